// The shared arena of a ucx transport whose ranks all run on this machine (see SharedArena).
// Each rank's arena is memory UCX allocated and mapped (ucp_mem_map); the other ranks reach
// it through ucp_rkey_ptr, which UCX's shared-memory transports (posix, sysv, xpmem) offer: so
// the one-host collectives reduce straight out of UCX's shared memory, as they do out of the
// shm transport's segments, instead of passing every byte through UCX's message queues. Where
// UCX gives no such pointer to some peer (UCX_TLS without shared memory, several hosts), no
// rank has the arena and the collectives run over messages.
//
// Progress counters, doorbells and sleeps follow the shm transport's arena (shm_arena.cc):
// futex words in the shared pages, a spin, then sleeps bounded by the liveness interval,
// between which the transport looks for an abort, a lost peer or a stray message.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "transport/shared_arena.h"
#include "transport/shm_layout.h"
#include "transport/ucx_library.h"

#pragma GCC visibility push(hidden)
namespace gradsync::transport::ucx {

// The first page of every rank's arena memory; its region follows.
struct ArenaHeader {
  alignas(shm::kCacheLine) shm::FutexWord doorbell{0};  // bumped to wake the owner
  // Non-zero while the owner is (about to be) asleep; then sleeping_for_member names whose
  // publish should wake it (same cache line: one miss for both).
  alignas(shm::kCacheLine) shm::FutexWord owner_sleeping{0};
  std::atomic<std::int32_t> sleeping_for_member{shm::kNoMember};
  alignas(shm::kCacheLine) std::atomic<std::uint64_t> progress{0};
  // Set as the owner's transport ends: what it published is still there, nothing more comes.
  alignas(shm::kCacheLine) shm::FutexWord owner_closed{0};
};
constexpr std::size_t kArenaHeaderBytes = shm::kPageBytes;
static_assert(sizeof(ArenaHeader) <= kArenaHeaderBytes);
constexpr std::size_t kArenaBytes = kArenaHeaderBytes + shm::kArenaRegionBytes;

// This rank's arena memory, allocated by UCX and described for peers by a packed rkey.
class ArenaMemory {
 public:
  // Allocates kArenaBytes through `context` (created with UCP_FEATURE_RMA) and zeroes them.
  // ok() is false where UCX cannot (the arena is then simply not offered).
  ArenaMemory(const UcxLibrary& lib, ucp_context_h context);
  ~ArenaMemory();
  ArenaMemory(const ArenaMemory&) = delete;
  ArenaMemory& operator=(const ArenaMemory&) = delete;

  bool ok() const { return base_ != nullptr; }
  // SharedArena promises zeroed regions, and UCX may hand out recycled memory. Only this rank
  // writes its region, and peers read it only after it publishes, so zeroing it once the
  // arena is agreed races with nobody.
  void zero_region();
  unsigned char* base() const { return base_; }
  const std::vector<std::uint8_t>& packed_rkey() const { return packed_rkey_; }

 private:
  const UcxLibrary& lib_;
  ucp_context_h context_;
  ucp_mem_h memory_ = nullptr;
  unsigned char* base_ = nullptr;
  std::vector<std::uint8_t> packed_rkey_;
};

// A peer's arena memory, mapped into this process through its rkey. mapped() is null where
// UCX offers no direct pointer to it.
class PeerArena {
 public:
  PeerArena(const UcxLibrary& lib, ucp_ep_h endpoint, const std::uint8_t* packed_rkey,
            std::uint64_t remote_address);
  ~PeerArena();
  PeerArena(const PeerArena&) = delete;
  PeerArena& operator=(const PeerArena&) = delete;

  unsigned char* mapped() const { return mapped_; }

 private:
  const UcxLibrary& lib_;
  ucp_rkey_h rkey_ = nullptr;
  unsigned char* mapped_ = nullptr;
};

// What an arena wait needs from the transport that owns the arena.
class ArenaWaitChecks {
 public:
  // Called before each sleep of a wait for `member` to reach `value`: true if it has (looked
  // at again before any error, as it may publish just before it leaves); throws kAborted,
  // kMismatch (a message waits: its sender runs another collective) or kPeerLost, which end
  // the transport, or kTimeout past `deadline`, which does not; false: sleep on.
  // `check_process`: also ask the kernel whether the member's process still lives.
  virtual bool arena_wait_over(int member, std::uint64_t value, const Tag& call,
                               Clock::time_point deadline, bool check_process) = 0;

 protected:
  ~ArenaWaitChecks() = default;
};

class Arena final : public SharedArena {
 public:
  // `mappings[m]`: member m's kArenaBytes in this process (this rank's own included);
  // members are the world's ranks in order. `spin`, `yield`: how a waiter spends the time
  // before it sleeps (shm::IdleSpin).
  Arena(ArenaWaitChecks& checks, int member, std::vector<unsigned char*> mappings,
        Clock::duration spin, bool yield);

  int members() const override { return static_cast<int>(mappings_.size()); }
  int member_index() const override { return member_; }
  int member_rank(int member) const override { return static_cast<int>(checked(member)); }
  unsigned char* region(int member) override {
    return mappings_[checked(member)] + kArenaHeaderBytes;
  }
  std::size_t region_bytes() const override { return shm::kArenaRegionBytes; }
  std::uint64_t progress(int member) const override {
    if (member == member_) return published_;  // see shm::ShmArena::progress
    return header(static_cast<int>(checked(member))).progress.load(std::memory_order_acquire);
  }
  void publish(std::uint64_t value) override;
  void wait_for(int member, std::uint64_t value, const Tag& call,
                Clock::time_point deadline) override;

  // Wakes this rank's own sleeping wait, so that it looks at the transport again (an abort).
  void wake_own();
  // As the transport ends: marks this member closed and wakes every sleeping member.
  void close();
  // Whether `member`'s transport has ended.
  bool closed(int member) const {
    return header(member).owner_closed.load(std::memory_order_acquire) != 0;
  }

 private:
  std::size_t checked(int member) const;
  ArenaHeader& header(int member) const {
    return *reinterpret_cast<ArenaHeader*>(mappings_[static_cast<std::size_t>(member)]);
  }

  ArenaWaitChecks& checks_;
  int member_;
  std::vector<unsigned char*> mappings_;
  Clock::duration spin_;
  bool yield_;
  std::uint64_t published_ = 0;
};

}  // namespace gradsync::transport::ucx
#pragma GCC visibility pop
