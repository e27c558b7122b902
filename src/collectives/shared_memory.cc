// All-reduce for ranks that share memory (SharedArena): each rank stages its input chunk by
// chunk in its arena region, reduces one sub-block of every chunk straight out of all ranks'
// staging buffers, and copies each finished chunk out of the reducers' buffers. User memory is
// read once and written once; the staged bytes are read back while still in cache.
//
// Protocol. Chunk k of the message is cut into one sub-block per member; member j reduces
// sub-block j. A call's chunks go through three steps, each ending in a publish of this rank's
// arena counter (values relative to the counter at the call's start, `base`):
//   stage(k):  copy input chunk k, but for own sub-block, into own
//              slot k % kSlots                                    -> staged(k)  = base + 3k + 1
//   reduce(k): own sub-block of chunk k over every member's slot
//              (own input read from `send`), in member order,
//              into own slot and `recv` (kAvg finished; float16/
//              bfloat16 in the slot when a codec rounds the sums
//              to a 16-bit wire)                                  -> reduced(k) = base + 3k + 5
//   copy(k):   every other member's sub-block of chunk k into
//              `recv`                                             -> copied(k)  = base + 3k + 9
// Iteration t runs stage(t), reduce(t - 1), copy(t - 2), so while the slowest rank catches up
// the others already work on the next chunk. reduce(k) waits for every member's staged(k),
// copy(k) for every reduced(k), and stage(k) for every copied(k - kSlots) before it overwrites
// the slot. Values encode (iteration, step), so "member m is at least this far" is one compare.
// A call starts once every member finished the previous one (counter >= base), so slots and
// headers are free and the counters of every call line up however the call sizes vary. Its
// last step, copy(K-1), waits for every member's reduced(K-1), the highest value any member
// waits for in the call: the contract SharedArena states for mismatch detection.
//
// Mismatch safety: before its first publish a rank writes its call's tag into its region
// header; a rank compares every member's tag before it reads any of that member's data.
//
// One-shot form (arena_call.h), for messages up to AlgorithmConfig::shared_memory_one_shot_limit,
// where the three waits for every member cost more than the bytes: each rank reduces the whole
// message itself, out of every member's one-shot buffer, in member order (so every rank
// computes the same bits).
#include <emmintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/arena_call.h"
#include "collectives/scratch.h"
#include "kernels/kernels.h"
#include "transport/shared_arena.h"

namespace gradsync::collectives {

namespace {

using arena::kLineBytes;
using arena::kSlots;
using arena::kTileBytes;

class SharedMemoryAllreduce : arena::ArenaCall {
 public:
  SharedMemoryAllreduce(Comm& c, transport::SharedArena& arena, const void* send, void* recv,
                        std::size_t count, DataType dtype, ReduceOp op, const AlgorithmConfig& cfg,
                        const ShmFloatExtras& extras)
      : ArenaCall(c, arena, "shm allreduce", count * dtype_size(dtype),
                  cfg.shared_memory_chunk_bytes),
        send_(static_cast<const unsigned char*>(send)),
        recv_(static_cast<unsigned char*>(recv)),
        dtype_(dtype),
        op_(op),
        es_(dtype_size(dtype)),
        chunks_(std::max<std::size_t>(1, (bytes_ + chunk_bytes_ - 1) / chunk_bytes_)),
        streaming_(bytes_ * static_cast<std::size_t>(n_) >= cfg.shared_memory_streaming_bytes),
        round_through_(dtype == DataType::kFloat32 ? extras.round_through : DataType::kFloat32),
        non_finite_(dtype == DataType::kFloat32 ? extras.non_finite : nullptr),
        float_sum_(dtype == DataType::kFloat32 && (op == ReduceOp::kSum || op == ReduceOp::kAvg)),
        sums_in_recv_(!streaming_ && round_through_ == DataType::kFloat32 &&
                      (send != recv || non_finite_ == nullptr)),
        one_shot_(bytes_ <=
                  std::min(cfg.shared_memory_one_shot_limit(n_), arena::kOneShotMaxBytes)) {}

  void run() {
    if (one_shot_) {
      run_one_shot();
      return;
    }
    begin();
    for (std::size_t t = 0; t < chunks_ + 2; ++t) {
      if (t < chunks_) {
        if (t >= kSlots) wait_all(copied(t - kSlots));
        stage(t);
        arena_.publish(staged(t));
      }
      if (t >= 1 && t - 1 < chunks_) {
        const std::size_t k = t - 1;
        wait_all(staged(k));
        if (k == 0) check_signatures();
        reduce(k);
        arena_.publish(reduced(k));
      }
      if (t >= 2) {
        const std::size_t k = t - 2;
        wait_all(reduced(k));
        copy_out(k);
        arena_.publish(copied(k));
      }
    }
    // Non-temporal stores are weakly ordered: make them visible before the caller (or a thread
    // it signals) reads the result.
    if (streaming_) _mm_sfence();
  }

 private:
  // See the one-shot form at the top of the file.
  void run_one_shot() {
    // Every member left the previous call: at once after a one-shot one (this rank saw as much
    // in it). The tag in the region header too, for a member in the other form to name this
    // call.
    begin();
    mark_one_shot();
    if (bytes_) transport::copy_to_shared(one_shot_data(me_), send_, bytes_);
    arena_.publish(base_ + 1);
    wait_all(base_ + 1);
    for (int m = 0; m < n_; ++m) {
      if (m != me_) check_one_shot(m);
    }
    const unsigned char* peer_input = pulled(bytes_, [&](int peer) { return one_shot_data(peer); });
    reduce_tiles(0, bytes_, nullptr, [&](int m, std::size_t offset) {
      if (m == me_) return send_ + offset;
      return (peer_input ? peer_input : one_shot_data(m)) + offset;
    });
  }

  std::uint64_t staged(std::size_t k) const { return base_ + 3 * k + 1; }
  std::uint64_t reduced(std::size_t k) const { return base_ + 3 * (k + 1) + 2; }
  std::uint64_t copied(std::size_t k) const { return base_ + 3 * (k + 2) + 3; }

  std::size_t chunk_offset(std::size_t k) const { return k * chunk_bytes_; }
  std::size_t chunk_length(std::size_t k) const {
    return std::min(chunk_bytes_, bytes_ - std::min(bytes_, chunk_offset(k)));
  }
  // Byte range [first, second) of member j's sub-block within chunk k.
  std::pair<std::size_t, std::size_t> sub_block(std::size_t k, int j) const {
    const std::size_t length = chunk_length(k);
    const Partition lines{(length + kLineBytes - 1) / kLineBytes, static_cast<std::size_t>(n_)};
    const auto index = static_cast<std::size_t>(j);
    const std::size_t first = std::min(length, lines.offset(index) * kLineBytes);
    const std::size_t last =
        std::min(length, (lines.offset(index) + lines.size(index)) * kLineBytes);
    return {first, last};
  }

  void check_signatures() {
    for (int m = 0; m < n_; ++m) {
      if (m != me_) check_signature(m);
    }
  }

  // Only the sub-blocks other members reduce: this rank reads its own straight from `send`.
  void stage(std::size_t k) {
    const auto [first, last] = sub_block(k, me_);
    const unsigned char* in = send_ + chunk_offset(k);
    unsigned char* out = slot(me_, k);
    if (first > 0) transport::copy_to_shared(out, in, first);
    if (const std::size_t length = chunk_length(k); last < length) {
      transport::copy_to_shared(out + last, in + last, length - last);
    }
  }

  // Reduces this rank's sub-block of chunk k in member order 0, 1, ..., n-1 (the same order on
  // every rank and run, so results are bitwise reproducible), tile by tile, and copies the
  // finished sums into its own slot, where the other members copy them from. Not straight into
  // the slot: a store to a line another core has read first fetches it from that core (read
  // for ownership), while memcpy's string copy claims whole lines without reading them; the
  // reduce step took twice as long where cores are far apart (docs/performance-notes.md).
  // The sums go straight into `recv` (this rank's own memory, and the own sub-block's
  // copy-out comes for free) and reach the slot in one copy of the whole sub-block once all are
  // summed: copied tile by tile, each 8 KiB copy between two tiles' sums, the reduce step took
  // 1.2-1.3x as long between 2 ranks (docs/performance-notes.md, session 33). Where that will
  // not do (see sums_in_recv_), the sums go into a private tile copied to both.
  void reduce(std::size_t k) {
    // Plain variables, not a structured binding: the lambda below captures `first`, and
    // Debian 12's clang 14 refuses to capture bindings (C++20 allows it; clang 16 does).
    const auto block = sub_block(k, me_);
    const std::size_t first = block.first;
    const std::size_t length = block.second - first;
    const unsigned char* own_input = send_ + chunk_offset(k) + first;
    const unsigned char* peer_input =
        pulled(length, [&](int peer) { return slot(peer, k) + first; });
    reduce_tiles(chunk_offset(k) + first, length, slot(me_, k) + first,
                 [&](int m, std::size_t offset) {
                   if (m == me_) return own_input + offset;
                   return (peer_input ? peer_input : slot(m, k) + first) + offset;
                 });
  }

  // Reduces `length` bytes of the message from byte `at` on, member m's input at input(m,
  // offset), as reduce() describes, into `recv` and (unless null) `shared`.
  template <typename Input>
  void reduce_tiles(std::size_t at, std::size_t length, unsigned char* shared, const Input& input) {
    unsigned char* out = recv_ + at;
    alignas(64) unsigned char accumulator[kTileBytes];
    alignas(64) unsigned char tile[kTileBytes];
    for (std::size_t offset = 0; offset < length; offset += kTileBytes) {
      const std::size_t count = std::min(kTileBytes, length - offset) / es_;
      // Every member's input but the last goes into `partial` (the first two straight, when
      // there are only two); the last step adds the last input and finishes.
      const unsigned char* partial = input(0, offset);
      if (n_ > 2) {
        kernels::reduce(accumulator, input(0, offset), input(1, offset), count, dtype_, op_);
        for (int m = 2; m < n_ - 1; ++m) {
          kernels::reduce_into(accumulator, input(m, offset), count, dtype_, op_);
        }
        partial = accumulator;
      }
      // `recv` may be `send`: written only now, after every read of this tile's inputs (the
      // kernels allow their output to alias an input).
      unsigned char* sums = sums_in_recv_ ? out + offset : tile;
      if (float_sum_) {
        finish_float_sum(sums, partial, input(n_ - 1, offset), count, at + offset, offset, input);
      } else {
        kernels::reduce(sums, partial, input(n_ - 1, offset), count, dtype_, op_);
        if (op_ == ReduceOp::kAvg) kernels::scale_for_average(sums, count, dtype_, n_);
      }
      if (sums_in_recv_) continue;  // copied to `shared` whole, after the loop
      if (narrow_results()) {
        if (shared) std::memcpy(shared + offset / 2, tile, count * 2);
        widen(reinterpret_cast<const std::uint16_t*>(tile), out + offset, count);
      } else {
        if (shared) std::memcpy(shared + offset, tile, count * es_);
        copy(out + offset, tile, count * es_);
      }
    }
    if (sums_in_recv_ && shared && length) transport::copy_to_shared(shared, out, length);
  }

  // A float32 sum or average: the last addition, the division and the NaN/Inf search are one
  // pass (kernels::sum_finish). With a 16-bit wire type the finished sums are stored as such,
  // so every member's copy-out reads half the bytes and widens them on the way out.
  template <typename Input>
  void finish_float_sum(unsigned char* sums, const unsigned char* partial,
                        const unsigned char* last_input, std::size_t count, std::size_t at,
                        std::size_t offset, const Input& input) {
    const std::size_t bad = kernels::sum_finish(
        sums, round_through_, reinterpret_cast<const float*>(partial),
        reinterpret_cast<const float*>(last_input), count, op_ == ReduceOp::kAvg ? n_ : 1);
    // After rounding: a sum past the 16-bit range is lost as surely as a NaN input.
    if (non_finite_ && bad != count) find_non_finite(at, bad, count, input, offset);
  }
  bool narrow_results() const { return round_through_ != DataType::kFloat32; }

  // A tile (starting at byte `at` of the message) summed to NaN or Inf at element `bad`: which
  // members' inputs hold one, or else an overflow.
  template <typename Input>
  void find_non_finite(std::size_t at, std::size_t bad, std::size_t count, const Input& input,
                       std::size_t offset) {
    auto note = [&](std::size_t entry, std::size_t element, bool nan) {
      const auto e = static_cast<std::int64_t>(2 * (at / sizeof(float) + element) + nan);
      if (non_finite_[entry] < 0 || e < non_finite_[entry]) non_finite_[entry] = e;
    };
    bool any = false;
    for (int m = 0; m < n_; ++m) {
      const auto* in = reinterpret_cast<const float*>(input(m, offset));
      const std::size_t i = kernels::first_non_finite(in, count);
      if (i != count) {
        note(static_cast<std::size_t>(m), i, std::isnan(in[i]));
        any = true;
      }
    }
    if (!any) note(static_cast<std::size_t>(n_), bad, false);
  }

  // Every other member's sub-block of chunk k (reduce wrote this rank's own).
  void copy_out(std::size_t k) {
    if (chunk_length(k) == 0) return;  // an empty call: `recv` may be null
    unsigned char* out = recv_ + chunk_offset(k);
    for (int j = 0; j < n_; ++j) {
      if (j == me_) continue;
      const auto [first, last] = sub_block(k, j);
      if (narrow_results()) {
        widen(reinterpret_cast<const std::uint16_t*>(slot(j, k) + first), out + first,
              (last - first) / sizeof(float));
      } else {
        copy(out + first, slot(j, k) + first, last - first);
      }
    }
  }

  // Into `recv`: past the cache with non-temporal stores where the message is that large.
  void copy(unsigned char* to, const unsigned char* from, std::size_t bytes) const {
    arena::copy_result(to, from, bytes, streaming_);
  }
  void widen(const std::uint16_t* sums, unsigned char* to, std::size_t count) const {
    auto* values = reinterpret_cast<float*>(to);
    if (streaming_) {
      kernels::float_from_16bit_streaming(sums, values, count, round_through_);
    } else {
      kernels::float_from_16bit(sums, values, count, round_through_);
    }
  }

  const unsigned char* send_;
  unsigned char* recv_;
  const DataType dtype_;
  const ReduceOp op_;
  const std::size_t es_;
  const std::size_t chunks_;  // at least one, so an empty call still checks signatures
  const bool streaming_;
  const DataType round_through_;    // kFloat32: no rounding
  std::int64_t* const non_finite_;  // see ShmFloatExtras
  const bool float_sum_;            // reduced through finish_float_sum
  // Whether reduce() writes its sums straight into `recv` and copies them to the slot from
  // there: one copy fewer than through the private tile (1 MiB between 2 ranks: about 10%).
  // Not where `recv` takes non-temporal stores (streaming_), nor where the slot holds 16-bit
  // sums, nor in place where a non-finite sum must be traced back to the inputs it
  // overwrote.
  const bool sums_in_recv_;
  const bool one_shot_;  // see the one-shot form at the top of the file
};

}  // namespace

namespace arena {

void copy_streaming(unsigned char* dst, const unsigned char* src, std::size_t bytes) {
  std::size_t head = (0 - reinterpret_cast<std::uintptr_t>(dst)) & 15;  // to a 16-byte boundary
  head = std::min(head, bytes);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  bytes -= head;
  const std::size_t body = bytes & ~std::size_t{63};
  for (std::size_t i = 0; i < body; i += 64) {
    const auto* s = reinterpret_cast<const __m128i*>(src + i);
    auto* d = reinterpret_cast<__m128i*>(dst + i);
    __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1);
    __m128i c = _mm_loadu_si128(s + 2), e = _mm_loadu_si128(s + 3);
    _mm_stream_si128(d, a);
    _mm_stream_si128(d + 1, b);
    _mm_stream_si128(d + 2, c);
    _mm_stream_si128(d + 3, e);
  }
  std::memcpy(dst + body, src + body, bytes - body);
}

}  // namespace arena

void shm_direct_allreduce(Comm& c, transport::SharedArena& arena, const void* send, void* recv,
                          std::size_t count, DataType dtype, ReduceOp op,
                          const AlgorithmConfig& cfg, const ShmFloatExtras& extras) {
  if (c.size() == 1) {
    if (send != recv && count) std::memcpy(recv, send, count * dtype_size(dtype));
    if (dtype != DataType::kFloat32) return;
    const DataType round_through = extras.round_through;
    if (round_through != DataType::kFloat32 && count) {
      auto* values = static_cast<float*>(recv);
      std::vector<std::uint16_t> narrow(count);
      kernels::float_to_16bit(values, narrow.data(), count, round_through);
      kernels::float_from_16bit(narrow.data(), values, count, round_through);
    }
    if (extras.non_finite && count) {
      const auto* values = static_cast<const float*>(recv);
      const std::size_t bad = kernels::first_non_finite(values, count);
      if (bad != count) {
        extras.non_finite[0] = static_cast<std::int64_t>(2 * bad + std::isnan(values[bad]));
      }
    }
    return;
  }
  SharedMemoryAllreduce(c, arena, send, recv, count, dtype, op, cfg, extras).run();
}

}  // namespace gradsync::collectives
