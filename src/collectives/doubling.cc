// Latency-optimal all-reduces. Recursive doubling: log2(N) full-size exchanges, best for
// small messages. Halving-doubling (Rabenseifner): recursive-halving reduce-scatter then
// recursive-doubling all-gather, log2(N) steps moving 2(N-1)/N of the data, for medium
// messages. A non-power-of-two N first folds the 2*rem lowest ranks pairwise (even into
// odd) so a power of two takes part, and hands the result back at the end.
#include <cstring>

#include "collectives/algorithms.h"
#include "collectives/element_stream.h"
#include "collectives/scratch.h"
#include "kernels/kernels.h"

namespace gradsync::collectives {

namespace {

// Who takes part in the power-of-two core of the algorithm, and under which number.
struct Fold {
  int p;      // largest power of two <= N
  int rem;    // N - p ranks fold into a partner
  int vrank;  // rank within the core, or -1 for a rank that only folds in and waits

  Fold(int rank, int n) {
    p = 1;
    while (p * 2 <= n) p *= 2;
    rem = n - p;
    if (rank < 2 * rem) {
      vrank = rank % 2 == 1 ? rank / 2 : -1;
    } else {
      vrank = rank - rem;
    }
  }
  int real_rank(int v) const { return v < rem ? 2 * v + 1 : v + rem; }
};

// Before the core: even ranks below 2*rem give their data to their odd neighbour.
void fold_in(Comm& c, const Fold& f, unsigned char* data, std::size_t count, DataType dtype,
             ReduceOp op, unsigned char* tmp) {
  const int r = c.rank();
  const std::size_t bytes = count * dtype_size(dtype);
  if (r >= 2 * f.rem) return;
  if (r % 2 == 0) {
    c.send(r + 1, data, bytes);
  } else {
    c.recv(r - 1, tmp, bytes);
    kernels::reduce_into(data, tmp, count, dtype, op);
  }
}

// After the core: odd ranks hand the result back to their even neighbour.
void fold_out(Comm& c, const Fold& f, unsigned char* data, std::size_t bytes) {
  const int r = c.rank();
  if (r >= 2 * f.rem) return;
  if (r % 2 == 0) {
    c.recv(r + 1, data, bytes);
  } else {
    c.send(r - 1, data, bytes);
  }
}

}  // namespace

void recursive_doubling_allreduce(Comm& c, const void* send, void* recv_v, std::size_t count,
                                  DataType dtype, ReduceOp op) {
  const std::size_t bytes = count * dtype_size(dtype);
  auto* recv = static_cast<unsigned char*>(recv_v);
  if (send != recv && bytes) std::memcpy(recv, send, bytes);
  Fold f(c.rank(), c.size());
  // A whole message, where a step cannot reduce as the data arrives.
  auto* tmp = scratch_of<unsigned char>(ScratchUse::kIncoming, bytes);
  fold_in(c, f, recv, count, dtype, op, tmp);
  if (f.vrank >= 0) {
    const std::size_t es = dtype_size(dtype);
    ElementStream reduce_arriving(es, [&](std::size_t e, const void* data, std::size_t k) {
      kernels::reduce_into(recv + e * es, data, k, dtype, op);
    });
    for (int mask = 1; mask < f.p; mask <<= 1) {
      int partner = f.real_rank(f.vrank ^ mask);
      // Once our half of the exchange has left `recv` (a small message is copied out before
      // isend returns), the partner's half is reduced into it straight out of the transport
      // buffer: no staging copy, no second pass. Both sides compute op(mine, theirs); the
      // kernels make that bitwise commutative, so every rank ends with the same bits.
      auto sent = c.isend(partner, recv, bytes);
      if (sent->test()) {
        c.wait(c.irecv_consume(partner, bytes, std::ref(reduce_arriving)));
      } else {
        auto received = c.irecv(partner, tmp, bytes);
        c.wait(received);
        c.wait(sent);
        kernels::reduce_into(recv, tmp, count, dtype, op);
      }
    }
  }
  fold_out(c, f, recv, bytes);
  if (op == ReduceOp::kAvg) kernels::scale_for_average(recv, count, dtype, c.size());
}

void halving_doubling_allreduce(Comm& c, const void* send, void* recv_v, std::size_t count,
                                DataType dtype, ReduceOp op) {
  const std::size_t es = dtype_size(dtype);
  auto* recv = static_cast<unsigned char*>(recv_v);
  if (send != recv && count) std::memcpy(recv, send, count * es);
  Fold f(c.rank(), c.size());
  auto* tmp = scratch_of<unsigned char>(ScratchUse::kIncoming, count * es);
  fold_in(c, f, recv, count, dtype, op, tmp);
  if (f.vrank >= 0) {
    const Partition blocks{count, static_cast<std::size_t>(f.p)};
    auto at = [&](std::size_t block) { return blocks.offset(block); };
    // Reduce-scatter by recursive halving: keep the half of the current block range that
    // contains our own block, send the other half to the partner across `mask`.
    std::size_t lo = 0, hi = static_cast<std::size_t>(f.p);
    for (int mask = f.p / 2; mask >= 1; mask >>= 1) {
      int partner = f.real_rank(f.vrank ^ mask);
      std::size_t mid = lo + (hi - lo) / 2;
      bool upper = (f.vrank & mask) != 0;
      std::size_t keep_lo = upper ? mid : lo, keep_hi = upper ? hi : mid;
      std::size_t give_lo = upper ? lo : mid, give_hi = upper ? mid : hi;
      std::size_t keep_n = at(keep_hi) - at(keep_lo), give_n = at(give_hi) - at(give_lo);
      c.sendrecv(partner, recv + at(give_lo) * es, give_n * es, partner, tmp, keep_n * es);
      kernels::reduce_into(recv + at(keep_lo) * es, tmp, keep_n, dtype, op);
      lo = keep_lo;
      hi = keep_hi;
    }
    if (op == ReduceOp::kAvg) {
      kernels::scale_for_average(recv + at(lo) * es, at(hi) - at(lo), dtype, c.size());
    }
    // All-gather by recursive doubling: swap our finished range for the partner's.
    for (int mask = 1; mask < f.p; mask <<= 1) {
      int partner = f.real_rank(f.vrank ^ mask);
      std::size_t width = hi - lo;
      bool upper = (f.vrank & mask) != 0;
      std::size_t other_lo = upper ? lo - width : hi;
      std::size_t other_hi = other_lo + width;
      c.sendrecv(partner, recv + at(lo) * es, (at(hi) - at(lo)) * es, partner,
                 recv + at(other_lo) * es, (at(other_hi) - at(other_lo)) * es);
      lo = std::min(lo, other_lo);
      hi = std::max(hi, other_hi);
    }
  }
  fold_out(c, f, recv, count * es);
}

}  // namespace gradsync::collectives
