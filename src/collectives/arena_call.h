// What the collectives built on a SharedArena share: the layout of each member's region, where
// a call starts on the arena's counters, waiting for every member, and the signatures that tell
// a mismatched call from a slow one. The all-reduce (shared_memory.cc), the all-gather
// and reduce-scatter (shared_memory_blocks.cc) build on it.
//
// Region layout: a page for the header (keeps the slots page aligned), kSlots staging slots of
// the call's chunk size, and at the end the all-reduce's one-shot buffers (kOneShotReserve).
//
// Calls line up by the counters: a call starts once every member's counter reached the value
// this member's holds at its start (`base`), that is once every member finished the previous
// call, whichever collective it was. Then slots and header are free, and each collective only
// has to bring every member to the same final value (SharedArena's contract).
//
// One-shot calls, for messages so small that waiting for every member more than once costs more
// than the bytes: each rank copies its whole input into its one-shot buffer, publishes base + 1,
// waits for every member's base + 1 and reads theirs. Two buffers at the end of the region, used
// by turns (base % 2): a rank writes a buffer again only two calls later, when every member has
// begun the call in between, hence finished reading the buffer. Nothing else in the region is
// touched, so the chunked forms never wait for one-shot readers; each buffer starts with a line
// holding its call's tag.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "collectives/comm.h"
#include "collectives/scratch.h"
#include "gradsync/error.h"
#include "transport/shared_arena.h"

namespace gradsync::collectives::arena {

// Staging slots per rank. Four, not three: with three, the all-reduce's stage(t) would wait for
// every member to finish iteration t - 1 entirely, a barrier per chunk; the fourth slot gives
// each rank an iteration of slack.
constexpr std::size_t kSlots = 4;
constexpr std::size_t kHeaderBytes = 4096;
// Pieces that ranks write start on cache lines: no writer shares a line with another, and the
// vector kernels run on aligned data. Every dtype size divides it.
constexpr std::size_t kLineBytes = 64;
// Beyond two ranks, reductions run tile by tile through a private accumulator that stays in L1
// (32 KiB on the x86 cores the benchmarks run on) along with the tiles of all inputs.
constexpr std::size_t kTileBytes = 8 * 1024;
// Between two ranks, the peer's bytes of a reduction up to this size are first copied into
// private memory and reduced from there: one bulk copy pulls another core's lines faster than
// the reduction's own loads do. All-reduces of 4-128 KiB 10-25% faster (parts up to 64 KiB),
// reduce-scatters of 16-256 KiB 7-10% (parts up to 128 KiB); 1 MiB reduce-scatters, with
// parts of 256 KiB, 15% slower (docs/performance-notes.md, sessions 33 and 34).
constexpr std::size_t kPullBytes = 128 * 1024;
// The all-reduce's one-shot buffers at the end of each region: a line for the call's tag, then
// the data.
constexpr std::size_t kOneShotMaxBytes = 64 * 1024;
constexpr std::size_t kOneShotStride = kLineBytes + kOneShotMaxBytes;
constexpr std::size_t kOneShotReserve = 2 * kOneShotStride;

struct RegionHeader {
  transport::Tag signature;  // of the call this member's slots currently belong to
};

struct OneShotHeader {
  transport::Tag signature;
};

// Non-temporal copy: the destination is written straight to memory, without first being read
// into cache (a read-for-ownership is a third of a cached copy's memory traffic) and without
// evicting the staging slots that the next chunks reuse. Only for results that would not stay
// in cache anyway (AlgorithmConfig::shared_memory_streaming_bytes); the caller fences
// (_mm_sfence) before the result is read.
void copy_streaming(unsigned char* dst, const unsigned char* src, std::size_t bytes);

// A result's bytes into the caller's memory: past the cache where `streaming`, else memcpy.
inline void copy_result(unsigned char* to, const unsigned char* from, std::size_t bytes,
                        bool streaming) {
  if (streaming) {
    copy_streaming(to, from, bytes);
  } else {
    std::memcpy(to, from, bytes);
  }
}

// One call on the arena, as seen by one member.
class ArenaCall {
 protected:
  ArenaCall(Comm& c, transport::SharedArena& arena, const char* name, std::size_t bytes,
            std::size_t wanted_chunk_bytes)
      : c_(c),
        arena_(arena),
        name_(name),
        bytes_(bytes),
        n_(arena.members()),
        me_(arena.member_index()),
        chunk_bytes_(chunk_size(wanted_chunk_bytes, arena.region_bytes())) {
    if (n_ != c.size() || me_ != c.rank()) {
      throw Error(ErrorKind::kInvalidArgument,
                  "shared arena of " + std::to_string(n_) + " members (this rank member " +
                      std::to_string(me_) + ") does not span the world of " +
                      std::to_string(c.size()),
                  c.rank(), Error::kNoPeer, name_);
    }
  }

  // Waits until every member left the previous call (so this member's slots and header are
  // free), then marks the header with this call. Before the first publish: peers that see this
  // member's progress move can name the call (SharedArena::wait_for).
  void begin() {
    base_ = arena_.progress(me_);
    wait_all(base_);
    header(me_).signature = c_.tag();
  }

  void wait_all(std::uint64_t value) {
    for (int m = 0; m < n_; ++m) {
      if (m != me_) wait_for(m, value);
    }
  }
  void wait_for(int member, std::uint64_t value) {
    arena_.wait_for(member, value, c_.tag(), c_.deadline());
  }

  RegionHeader& header(int member) {
    return *reinterpret_cast<RegionHeader*>(arena_.region(member));
  }
  unsigned char* slot(int member, std::size_t k) {
    return arena_.region(member) + kHeaderBytes + (k % kSlots) * chunk_bytes_;
  }

  // This call's one-shot buffer of `member`: a line for its OneShotHeader, then the data.
  unsigned char* one_shot_buffer(int member) {
    return arena_.region(member) + arena_.region_bytes() - kOneShotReserve +
           (base_ % 2) * kOneShotStride;
  }
  unsigned char* one_shot_data(int member) { return one_shot_buffer(member) + kLineBytes; }
  // Before this member publishes base + 1.
  void mark_one_shot() { *reinterpret_cast<OneShotHeader*>(one_shot_buffer(me_)) = {c_.tag()}; }
  // Once `member` reached base + 1: throws kMismatch unless its buffer holds this call, naming
  // the member's latest call, whichever form it took (its region header), unless that is this
  // call: then the tag its buffer does hold. The header is read only for a mismatch: the member
  // has just written it, and reading it costs a miss.
  void check_one_shot(int member) {
    const auto& in_buffer = *reinterpret_cast<const OneShotHeader*>(one_shot_buffer(member));
    if (in_buffer.signature != c_.tag()) {
      const transport::Tag& latest = header(member).signature;
      check_signature(member, latest == c_.tag() ? in_buffer.signature : latest);
    }
  }

  // Call before reading any of `member`'s data: throws kMismatch if the tag `theirs` (by
  // default the member's header) is not this call's.
  void check_signature(int member, const transport::Tag& theirs) const {
    if (theirs == c_.tag()) return;
    mismatch(member, "expected " + describe_tag(c_.tag()) + " but rank " +
                         std::to_string(arena_.member_rank(member)) + " called " +
                         describe_tag(theirs));
  }
  void check_signature(int member) { check_signature(member, header(member).signature); }
  // Between two ranks, where `bytes` is at most kPullBytes: a private copy of the `bytes` at
  // shared(peer), to reduce from. Else null (reduce straight out of shared memory).
  template <typename Shared>
  const unsigned char* pulled(std::size_t bytes, const Shared& shared) const {
    if (n_ != 2 || bytes > kPullBytes || bytes == 0) return nullptr;
    auto* copy = scratch_of<unsigned char>(ScratchUse::kIncoming, bytes);
    std::memcpy(copy, shared(1 - me_), bytes);
    return copy;
  }

  [[noreturn]] void mismatch(int member, const std::string& what) const {
    throw Error(ErrorKind::kMismatch, what, c_.rank(), arena_.member_rank(member), name_, bytes_);
  }

  Comm& c_;
  transport::SharedArena& arena_;
  const char* const name_;   // for errors: "shm allreduce"
  const std::size_t bytes_;  // of the call, for errors
  const int n_;
  const int me_;
  const std::size_t chunk_bytes_;  // of each staging slot
  std::uint64_t base_ = 0;         // this member's counter when the call began

 private:
  static std::size_t chunk_size(std::size_t wanted, std::size_t region_bytes) {
    const std::size_t fits = (region_bytes - kHeaderBytes - kOneShotReserve) / kSlots;
    return std::max<std::size_t>(4096, std::min(wanted, fits) / 4096 * 4096);
  }
};

}  // namespace gradsync::collectives::arena
