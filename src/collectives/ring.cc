// Ring reduce-scatter, all-gather and all-reduce. Each rank's data is cut into N
// segments and each segment into K pieces; every piece is reduced as soon as it arrives
// (straight out of the transport's buffer when it supports that) and forwarded at once,
// so sending, receiving and reducing overlap. Each rank sends 2(N-1)/N of the payload.
#include <algorithm>
#include <cstring>
#include <deque>
#include <numeric>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/element_stream.h"
#include "collectives/scratch.h"
#include "kernels/kernels.h"

namespace gradsync::collectives {

namespace {

std::size_t mod(long long a, long long n) {
  return static_cast<std::size_t>(((a % n) + n) % n);
}

// Byte layout of N segments inside a full-size buffer, each split into K pieces. Segments are
// indexed by ring position: segment i is the block of `counts` owned by the rank at ring
// position i (block i itself when the ring is in rank order).
struct RingLayout {
  std::vector<std::size_t> seg_offset;  // in elements
  std::vector<std::size_t> seg_count;
  std::size_t pieces = 1;
  std::size_t elem = 1;

  RingLayout(const Comm& c, std::span<const std::size_t> counts, std::size_t elem_size,
             std::size_t chunk_bytes)
      : elem(elem_size) {
    std::vector<std::size_t> block_offset;
    std::size_t off = 0, largest = 0;
    for (std::size_t count : counts) {
      block_offset.push_back(off);
      off += count;
      largest = std::max(largest, count);
    }
    for (std::size_t i = 0; i < counts.size(); ++i) {
      const auto block = static_cast<std::size_t>(c.ring_rank(static_cast<long long>(i)));
      seg_offset.push_back(block_offset[block]);
      seg_count.push_back(counts[block]);
    }
    std::size_t chunk_elems = std::max<std::size_t>(1, chunk_bytes / elem);
    pieces = std::max<std::size_t>(1, (largest + chunk_elems - 1) / chunk_elems);
  }
  // Element offset (in the full buffer) and count of piece j of segment i.
  std::size_t piece_offset(std::size_t i, std::size_t j) const {
    return seg_offset[i] + Partition{seg_count[i], pieces}.offset(j);
  }
  std::size_t piece_count(std::size_t i, std::size_t j) const {
    return Partition{seg_count[i], pieces}.size(j);
  }
};

// The reduce-scatter phase. Step s sends segment (r - s + shift) and receives segment
// (r - s - 1 + shift), reducing it with this rank's contribution from `send`. Partial
// results go to `work` (full layout); the segment this rank ends up owning,
// (r + shift + 1) mod N, is written to `owned_dst` instead, and finished for kAvg. After
// reducing each final piece, `on_owned_piece(j)` runs (all-reduce starts all-gather there).
template <typename OnOwned>
void reduce_scatter_phase(Comm& c, const unsigned char* send, unsigned char* work,
                          unsigned char* owned_dst, const RingLayout& L, DataType dtype,
                          ReduceOp op, long long shift, std::vector<transport::RequestPtr>& sends,
                          OnOwned on_owned_piece) {
  const long long n = c.size(), r = c.ring_position();
  const int right = c.ring_rank(r + 1), left = c.ring_rank(r - 1);
  const std::size_t K = L.pieces, es = L.elem;
  const bool average = op == ReduceOp::kAvg;

  // Step 0 sends this rank's own contribution straight from `send`.
  std::size_t first = mod(r + shift, n);
  for (std::size_t j = 0; j < K; ++j) {
    sends.push_back(
        c.isend(right, send + L.piece_offset(first, j) * es, L.piece_count(first, j) * es));
  }
  for (long long s = 0; s < n - 1; ++s) {
    const std::size_t seg = mod(r - s - 1 + shift, n);
    const bool last = s == n - 2;
    for (std::size_t j = 0; j < K; ++j) {
      const std::size_t off = L.piece_offset(seg, j), cnt = L.piece_count(seg, j);
      unsigned char* dst = last ? owned_dst + (off - L.seg_offset[seg]) * es : work + off * es;
      const unsigned char* mine = send + off * es;
      ElementStream stream(es, [&](std::size_t e, const void* data, std::size_t k) {
        kernels::reduce(dst + e * es, mine + e * es, data, k, dtype, op);
      });
      c.wait(c.irecv_consume(left, cnt * es, std::ref(stream)));
      if (last) {
        if (average) kernels::scale_for_average(dst, cnt, dtype, static_cast<int>(n));
        on_owned_piece(j);
      } else {
        sends.push_back(c.isend(right, dst, cnt * es));
      }
    }
  }
}

// The all-gather phase: step t sends segment (owned - t) and receives segment
// (owned - t - 1) into `recv`, forwarding each received piece at the next step. Step 0's
// pieces were sent by the caller. Receives are posted a few pieces ahead so a transport
// can land data straight in `recv` instead of buffering it. `before_overwrite(t, j)` runs
// before a piece of `recv` is handed to a receive (all-reduce waits there for the send
// that last read it).
template <typename BeforeOverwrite>
void allgather_phase(Comm& c, unsigned char* recv, const RingLayout& L, std::size_t owned,
                     std::vector<transport::RequestPtr>& sends, BeforeOverwrite before_overwrite) {
  // Enough pieces in flight to cover a transport round trip, few enough that posted but
  // unfilled receives pin little memory.
  constexpr std::size_t kLookahead = 4;
  const long long n = c.size(), r = c.ring_position();
  const int right = c.ring_rank(r + 1), left = c.ring_rank(r - 1);
  const std::size_t K = L.pieces, es = L.elem;
  const std::size_t total = static_cast<std::size_t>(n - 1) * K;
  struct Posted {
    std::size_t step;
    unsigned char* dst;
    std::size_t bytes;
    transport::RequestPtr request;
  };
  std::deque<Posted> posted;
  std::size_t next = 0;
  for (std::size_t done = 0; done < total; ++done) {
    for (; next < total && next < done + kLookahead; ++next) {
      const std::size_t t = next / K, j = next % K;
      const std::size_t seg = mod(static_cast<long long>(owned) - static_cast<long long>(t) - 1, n);
      unsigned char* dst = recv + L.piece_offset(seg, j) * es;
      const std::size_t bytes = L.piece_count(seg, j) * es;
      before_overwrite(t, j);
      posted.push_back({t, dst, bytes, c.irecv(left, dst, bytes)});
    }
    Posted p = std::move(posted.front());
    posted.pop_front();
    c.wait(p.request);
    if (static_cast<long long>(p.step) < n - 2) sends.push_back(c.isend(right, p.dst, p.bytes));
  }
}

}  // namespace

void ring_allreduce(Comm& c, const void* send_v, void* recv_v, std::size_t count, DataType dtype,
                    ReduceOp op, const AlgorithmConfig& cfg) {
  const std::size_t n = static_cast<std::size_t>(c.size());
  const std::size_t es = dtype_size(dtype);
  auto* recv = static_cast<unsigned char*>(recv_v);
  const auto* send = static_cast<const unsigned char*>(send_v);
  if (n == 1) {
    if (send != recv && count) std::memcpy(recv, send, count * es);
    return;
  }
  std::vector<std::size_t> counts(n);
  for (std::size_t i = 0; i < n; ++i) counts[i] = Partition{count, n}.size(i);
  RingLayout L(c, counts, es, cfg.chunk_bytes);
  const int right = c.ring_rank(c.ring_position() + 1);
  const std::size_t owned = (static_cast<std::size_t>(c.ring_position()) + 1) % n;

  // sends[0 .. K) are step 0 of reduce-scatter; sends[s*K + j] is piece j of step s.
  std::vector<transport::RequestPtr> sends;
  sends.reserve(2 * (n - 1) * L.pieces);
  reduce_scatter_phase(
      c, send, recv, recv + L.seg_offset[owned] * es, L, dtype, op, 0, sends, [&](std::size_t j) {
        sends.push_back(
            c.isend(right, recv + L.piece_offset(owned, j) * es, L.piece_count(owned, j) * es));
      });
  // All-gather step t overwrites segment (r - t), which reduce-scatter step t sent from
  // (from `send` at step 0, in place or not, else from `recv`): wait for that send first.
  allgather_phase(c, recv, L, owned, sends,
                  [&](std::size_t t, std::size_t j) { c.wait(sends[t * L.pieces + j]); });
  c.wait_all(sends);
}

void ring_reduce_scatter(Comm& c, const void* send_v, void* recv_v,
                         std::span<const std::size_t> block_counts, DataType dtype, ReduceOp op,
                         const AlgorithmConfig& cfg) {
  const std::size_t n = static_cast<std::size_t>(c.size());
  const std::size_t es = dtype_size(dtype);
  const auto* send = static_cast<const unsigned char*>(send_v);
  auto* recv = static_cast<unsigned char*>(recv_v);
  RingLayout L(c, block_counts, es, cfg.chunk_bytes);
  if (n == 1) {
    if (send != recv && block_counts[0]) std::memcpy(recv, send, block_counts[0] * es);
    return;
  }
  const std::size_t total =
      std::accumulate(block_counts.begin(), block_counts.end(), std::size_t{0});
  // Partial sums of the blocks in transit, in the full layout (every byte used is written
  // before it is read); two ranks, whose one step reduces straight into `recv`, need none.
  unsigned char* work =
      n > 2 ? scratch_of<unsigned char>(ScratchUse::kPartialSums, total * es) : nullptr;
  std::vector<transport::RequestPtr> sends;
  // shift = -1 makes the rank at ring position p end up owning segment p: its own block.
  reduce_scatter_phase(c, send, work, recv, L, dtype, op, -1, sends, [](std::size_t) {});
  c.wait_all(sends);
}

void ring_allgatherv(Comm& c, const void* send_v, void* recv_v,
                     std::span<const std::size_t> block_counts, DataType dtype,
                     const AlgorithmConfig& cfg) {
  const std::size_t n = static_cast<std::size_t>(c.size());
  const std::size_t es = dtype_size(dtype);
  const auto r = static_cast<std::size_t>(c.ring_position());
  auto* recv = static_cast<unsigned char*>(recv_v);
  RingLayout L(c, block_counts, es, cfg.chunk_bytes);
  unsigned char* mine = recv + L.seg_offset[r] * es;
  if (send_v != mine && L.seg_count[r]) std::memcpy(mine, send_v, L.seg_count[r] * es);
  if (n == 1) return;
  const int right = c.ring_rank(static_cast<long long>(r) + 1);
  std::vector<transport::RequestPtr> sends;
  for (std::size_t j = 0; j < L.pieces; ++j) {
    sends.push_back(c.isend(right, recv + L.piece_offset(r, j) * es, L.piece_count(r, j) * es));
  }
  allgather_phase(c, recv, L, r, sends, [](std::size_t, std::size_t) {});
  c.wait_all(sends);
}

}  // namespace gradsync::collectives
