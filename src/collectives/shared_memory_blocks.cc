// The collectives whose results are blocks, for ranks that share memory (SharedArena): the
// all-gather and the reduce-scatter. Both stage pieces in the arena's slots and have each rank
// read what it needs straight out of the others' slots, two steps per piece.
//
// All-gather: each rank stages its block piece by piece in its arena region, and copies every
// other member's piece of the same turn straight out of theirs. Every byte is written to shared
// memory once and read once by each other member: N block copies per rank, where a ring over a
// transport makes 2(N - 1) (into the transport's buffers and out again at every hop), and no
// rank waits for a chain of hops.
//
// Protocol. Blocks are cut into pieces of the slot size (the last shorter; blocks may differ in
// size, and a member whose block has ended stages nothing). Piece k of every block goes through
// two steps, each ending in a publish of this rank's arena counter (values relative to the
// counter at the call's start, `base`):
//   stage(k): own piece k into own slot k % kSlots (and `recv`) -> staged(k) = base + 2k + 1
//   copy(k):  every other member's piece k into `recv`, each as
//             soon as that member staged it                    -> consumed(k) = base + 2(k + 1) + 2
// Iteration t runs stage(t), then copy(t - 1), so a rank that is ahead stages its next piece
// while the others catch up; values encode (iteration, step), so "member m is at least this
// far" is one compare. stage(k) waits for every member's consumed(k - kSlots) before it
// overwrites the slot. Every member runs the same number of pieces (that of the largest block),
// so every member ends the call at the same value; its last wait, for every member's
// staged(K - 1), is for the highest value any member waits for in it (SharedArena's contract).
//
// Mismatch safety: before its first publish a rank writes its call's tag into its region header
// (arena_call.h); a rank compares it before it reads any of that member's data. An all-gatherv's
// tag holds a digest of the block sizes (collectives::counts_digest), so ranks that disagree on
// them fail like any other mismatched call.
//
// Blocks of up to kOneShotMaxBytes take the one-shot form (arena_call.h): one wait for every
// member instead of two, the same copies.
//
// Reduce-scatter: rank j ends with the reduction of block j of every rank's input (blocks of
// equal size). Chunk k holds piece k of every block, the slot cut into one line-aligned part
// per member, and goes through
//   stage(k):  piece k of every other member's block into own slot  -> staged(k) = base + 2k + 1
//   reduce(k): piece k of own block: own input (read from `send`)
//              reduced with every other member's part of its slot,
//              each as soon as that member staged it, into `recv`   -> consumed(k) =
//                                                                        base + 2(k + 1) + 2
// with the same iterations, waits and final value as the all-gather. Block j is reduced in the
// order j, j + 1, ..., j - 1 (mod N) whenever the members arrive, so results are bitwise
// reproducible, and a rank reduces while the members after it still stage (where ranks
// outnumber cores, while they wait for one): 4 ranks on 2 cores ran 0.7-1.0x the ring's speed
// when every rank first waited for all (docs/performance-notes.md, session 34). Against a
// ring over a transport: the same bytes written and read, but no chain of N - 1 hops, each
// waiting for the previous one's rank to be scheduled.
#include <emmintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/arena_call.h"
#include "kernels/kernels.h"

namespace gradsync::collectives {

namespace {

using arena::kLineBytes;
using arena::kSlots;

// The pipeline both collectives share: iteration t stages piece t, then consumes piece t - 1
// (copies it out, or reduces it), each step ending in a publish; staging piece k waits for
// every member to have consumed piece k - kSlots, whose slot it overwrites.
class TwoStepCall : protected arena::ArenaCall {
 protected:
  using ArenaCall::ArenaCall;

  template <class Stage, class Consume>
  void run_pieces(std::size_t pieces, const Stage& stage, const Consume& consume) {
    for (std::size_t t = 0; t <= pieces; ++t) {
      if (t < pieces) {
        if (t >= kSlots) wait_all(consumed(t - kSlots));
        stage(t);
        arena_.publish(staged(t));
      }
      if (t >= 1) {
        consume(t - 1);
        arena_.publish(consumed(t - 1));
      }
    }
  }

  std::uint64_t staged(std::size_t k) const { return base_ + 2 * k + 1; }
  std::uint64_t consumed(std::size_t k) const { return base_ + 2 * (k + 1) + 2; }
};

class SharedMemoryAllgather : TwoStepCall {
 public:
  SharedMemoryAllgather(Comm& c, transport::SharedArena& arena, const void* send, void* recv,
                        std::span<const std::size_t> block_counts, DataType dtype,
                        const AlgorithmConfig& cfg)
      : TwoStepCall(c, arena, "shm allgather", total_bytes(block_counts, dtype),
                    cfg.shared_memory_chunk_bytes),
        send_(static_cast<const unsigned char*>(send)),
        recv_(static_cast<unsigned char*>(recv)),
        one_shot_(std::all_of(block_counts.begin(), block_counts.end(),
                              [&](std::size_t count) {
                                return count * dtype_size(dtype) <= arena::kOneShotMaxBytes;
                              })),
        streaming_(bytes_ >= cfg.shared_memory_streaming_bytes && !one_shot_) {
    const std::size_t es = dtype_size(dtype);
    std::size_t offset = 0, largest = 0;
    for (std::size_t count : block_counts) {
      blocks_.push_back({offset, count * es});
      offset += count * es;
      largest = std::max(largest, count * es);
    }
    pieces_ = std::max<std::size_t>(1, (largest + chunk_bytes_ - 1) / chunk_bytes_);
  }

  void run() {
    if (one_shot_) {
      run_one_shot();
      return;
    }
    begin();
    run_pieces(
        pieces_, [&](std::size_t k) { stage(k); }, [&](std::size_t k) { copy_out(k); });
    // Non-temporal stores are weakly ordered: make them visible before the caller (or a thread
    // it signals) reads the result.
    if (streaming_) _mm_sfence();
  }

 private:
  struct Block {
    std::size_t offset;  // in `recv`, bytes
    std::size_t bytes;
  };

  void run_one_shot() {
    begin();
    mark_one_shot();
    const Block own = blocks_[static_cast<std::size_t>(me_)];
    if (own.bytes) {
      transport::copy_to_shared(one_shot_data(me_), send_, own.bytes);
      if (recv_ + own.offset != send_) std::memcpy(recv_ + own.offset, send_, own.bytes);
    }
    arena_.publish(base_ + 1);
    for (int step = 1; step < n_; ++step) {
      const int m = (me_ + step) % n_;
      wait_for(m, base_ + 1);
      check_one_shot(m);
      const Block theirs = blocks_[static_cast<std::size_t>(m)];
      if (theirs.bytes) std::memcpy(recv_ + theirs.offset, one_shot_data(m), theirs.bytes);
    }
  }

  static std::size_t total_bytes(std::span<const std::size_t> counts, DataType dtype) {
    std::size_t total = 0;
    for (std::size_t count : counts) total += count;
    return total * dtype_size(dtype);
  }
  // Byte range of piece k within member m's block: {offset in the block, length}.
  std::pair<std::size_t, std::size_t> piece(int member, std::size_t k) const {
    const std::size_t block = blocks_[static_cast<std::size_t>(member)].bytes;
    const std::size_t first = std::min(block, k * chunk_bytes_);
    return {first, std::min(chunk_bytes_, block - first)};
  }

  void stage(std::size_t k) {
    const auto [first, length] = piece(me_, k);
    if (length == 0) return;
    const unsigned char* in = send_ + first;
    transport::copy_to_shared(slot(me_, k), in, length);
    unsigned char* out = recv_ + blocks_[static_cast<std::size_t>(me_)].offset + first;
    if (out != in) copy(out, in, length);  // else in place: the block already sits in `recv`
  }

  // Members in turn from the next one on, so the ranks do not all read the same member's slot
  // at once, and each piece as soon as its member staged it.
  void copy_out(std::size_t k) {
    for (int step = 1; step < n_; ++step) {
      const int m = (me_ + step) % n_;
      wait_for(m, staged(k));
      if (k == 0) check_signature(m);
      const auto [first, length] = piece(m, k);
      if (length)
        copy(recv_ + blocks_[static_cast<std::size_t>(m)].offset + first, slot(m, k), length);
    }
  }

  void copy(unsigned char* to, const unsigned char* from, std::size_t bytes) const {
    arena::copy_result(to, from, bytes, streaming_);
  }

  const unsigned char* send_;
  unsigned char* recv_;
  const bool one_shot_;  // every block fits a one-shot buffer
  // Results at least AlgorithmConfig::shared_memory_streaming_bytes go to `recv` past the cache.
  const bool streaming_;
  std::vector<Block> blocks_;  // per member
  std::size_t pieces_ = 1;     // every member's, at least one (an empty call checks signatures)
};

class SharedMemoryReduceScatter : TwoStepCall {
 public:
  SharedMemoryReduceScatter(Comm& c, transport::SharedArena& arena, const void* send, void* recv,
                            std::size_t block_count, DataType dtype, ReduceOp op,
                            const AlgorithmConfig& cfg)
      : TwoStepCall(c, arena, "shm reduce_scatter",
                    block_count * dtype_size(dtype) * static_cast<std::size_t>(c.size()),
                    cfg.shared_memory_chunk_bytes),
        send_(static_cast<const unsigned char*>(send)),
        recv_(static_cast<unsigned char*>(recv)),
        dtype_(dtype),
        op_(op),
        es_(dtype_size(dtype)),
        block_bytes_(block_count * es_),
        piece_bytes_(std::max(
            kLineBytes, chunk_bytes_ / static_cast<std::size_t>(n_) / kLineBytes * kLineBytes)),
        pieces_(std::max<std::size_t>(1, (block_bytes_ + piece_bytes_ - 1) / piece_bytes_)) {}

  void run() {
    begin();
    run_pieces(
        pieces_, [&](std::size_t k) { stage(k); }, [&](std::size_t k) { reduce(k); });
  }

 private:
  // Piece k of every block: {offset in the block, length}.
  std::pair<std::size_t, std::size_t> piece(std::size_t k) const {
    const std::size_t first = std::min(block_bytes_, k * piece_bytes_);
    return {first, std::min(piece_bytes_, block_bytes_ - first)};
  }
  // Where member `reader`'s part of a slot starts.
  std::size_t part(int reader) const { return static_cast<std::size_t>(reader) * piece_bytes_; }
  const unsigned char* input_block(int member) const {
    return send_ + static_cast<std::size_t>(member) * block_bytes_;
  }

  // Only the pieces other members reduce: this rank reads its own straight from `send`.
  void stage(std::size_t k) {
    const auto [first, length] = piece(k);
    if (length == 0) return;
    for (int j = 0; j < n_; ++j) {
      if (j != me_)
        transport::copy_to_shared(slot(me_, k) + part(j), input_block(j) + first, length);
    }
  }

  // Own input first, then the members in turn from the next one on (see the top of the file).
  // Whole parts at once, not tiles through L1 as the all-reduce: a part is at most a slot over
  // N (256 KiB between 2 ranks), in L2 across the passes.
  void reduce(std::size_t k) {
    const auto [first, length] = piece(k);
    const std::size_t count = length / es_;
    // `recv` may be this rank's block of `send`: the first step reads it and writes it alike.
    unsigned char* out = recv_ + first;
    const unsigned char* own = input_block(me_) + first;
    for (int step = 1; step < n_; ++step) {
      const int m = (me_ + step) % n_;
      wait_for(m, staged(k));
      if (k == 0) check_signature(m);
      if (count == 0) continue;
      const unsigned char* shared = slot(m, k) + part(me_);
      const unsigned char* pulled_copy = pulled(length, [&](int) { return shared; });
      const unsigned char* theirs = pulled_copy ? pulled_copy : shared;
      if (step == 1) {
        kernels::reduce(out, own, theirs, count, dtype_, op_);
      } else {
        kernels::reduce_into(out, theirs, count, dtype_, op_);
      }
    }
    if (op_ == ReduceOp::kAvg && count) kernels::scale_for_average(out, count, dtype_, n_);
  }

  const unsigned char* send_;
  unsigned char* recv_;
  const DataType dtype_;
  const ReduceOp op_;
  const std::size_t es_;
  const std::size_t block_bytes_;
  const std::size_t piece_bytes_;  // of each block per chunk: a slot holds one per member
  const std::size_t pieces_;       // at least one (an empty call checks signatures)
};

}  // namespace

void shm_direct_reduce_scatter(Comm& c, transport::SharedArena& arena, const void* send, void* recv,
                               std::size_t block_count, DataType dtype, ReduceOp op,
                               const AlgorithmConfig& cfg) {
  if (c.size() == 1) {
    if (send != recv && block_count) std::memcpy(recv, send, block_count * dtype_size(dtype));
    return;
  }
  SharedMemoryReduceScatter(c, arena, send, recv, block_count, dtype, op, cfg).run();
}

void shm_direct_allgatherv(Comm& c, transport::SharedArena& arena, const void* send, void* recv,
                           std::span<const std::size_t> block_counts, DataType dtype,
                           const AlgorithmConfig& cfg) {
  if (c.size() == 1) {
    const std::size_t bytes = block_counts.empty() ? 0 : block_counts[0] * dtype_size(dtype);
    if (send != recv && bytes) std::memcpy(recv, send, bytes);
    return;
  }
  SharedMemoryAllgather(c, arena, send, recv, block_counts, dtype, cfg).run();
}

}  // namespace gradsync::collectives
