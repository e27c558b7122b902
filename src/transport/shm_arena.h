// The shared arena of a shared-memory group (see SharedArena): every member's region and
// progress counter live in the members' segments, next to the message rings, and share their
// doorbells, abort state and liveness checks (ShmGroup). Owned by the shm transport, which
// hands it out through shared_arena().
#pragma once

#include <cstddef>
#include <cstdint>

#include "transport/shared_arena.h"
#include "transport/shm_group.h"

// Hidden, as all shm internals are (see shm_group.h).
#pragma GCC visibility push(hidden)
namespace gradsync::transport::shm {

class ShmArena final : public SharedArena {
 public:
  // `group` must outlive the arena and be connected before the arena is used.
  explicit ShmArena(ShmGroup& group) : group_(group) {}

  int members() const override { return static_cast<int>(group_.ranks.size()); }
  int member_index() const override { return group_.my_member; }
  int member_rank(int member) const override { return group_.ranks[checked_member(member)]; }
  unsigned char* region(int member) override { return group_.regions[checked_member(member)]; }
  std::size_t region_bytes() const override { return group_.layout.arena_bytes; }
  std::uint64_t progress(int member) const override {
    // Its own counter from the copy it keeps: peers poll the shared line, so loading it back
    // would miss the cache in every call.
    if (member == group_.my_member) return published_;
    return group_.headers[checked_member(member)]->arena_progress.load(std::memory_order_acquire);
  }

  void publish(std::uint64_t value) override;
  void wait_for(int member, std::uint64_t value, const Tag& call,
                Clock::time_point deadline) override;

 private:
  std::size_t checked_member(int member) const;
  // wait_for's last look before sleeping: true once `member` reached `value`.
  bool wait_over(const PeerLink& link, int member, std::uint64_t value, const Tag& call,
                 Clock::time_point deadline);

  ShmGroup& group_;
  std::uint64_t published_ = 0;  // our arena counter, as last published
  Tag call_;                     // as last written to our header's arena_call
};

}  // namespace gradsync::transport::shm
#pragma GCC visibility pop
