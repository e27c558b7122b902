// Publishing and waiting for arena progress across a shared-memory group; see shm_arena.h.
#include "transport/shm_arena.h"

#include <exception>
#include <string>

namespace gradsync::transport::shm {

std::size_t ShmArena::checked_member(int member) const {
  if (member < 0 || member >= members()) {
    throw Error(
        ErrorKind::kInvalidArgument,
        "arena member " + std::to_string(member) + " outside group of " + std::to_string(members()),
        group_.rank, Error::kNoPeer, "shm arena");
  }
  return static_cast<std::size_t>(member);
}

void ShmArena::publish(std::uint64_t value) {
  if (value < published_) {
    throw Error(ErrorKind::kInvalidArgument,
                "arena progress may not go back from " + std::to_string(published_) + " to " +
                    std::to_string(value),
                group_.rank, Error::kNoPeer, "shm arena publish");
  }
  published_ = value;
  group_.own->arena_progress.store(value, std::memory_order_seq_cst);  // see sleep_on_doorbell
  for (std::size_t m = 0; m < group_.headers.size(); ++m) {
    SegmentHeader& member = *group_.headers[m];
    if (static_cast<int>(m) != group_.my_member &&
        member.owner_sleeping.load(std::memory_order_seq_cst) != 0 &&
        member.sleeping_for_member.load(std::memory_order_relaxed) == group_.my_member) {
      ring_doorbell(member);
    }
  }
}

void ShmArena::wait_for(int member, std::uint64_t value, const Tag& call,
                        Clock::time_point deadline) {
  if (!(call == call_)) {
    call_ = call;
    for (int w = 0; w < 4; ++w) {
      group_.own->arena_call[w].store(call.words[w], std::memory_order_relaxed);
    }
  }
  const auto& counter = group_.headers[checked_member(member)]->arena_progress;
  if (counter.load(std::memory_order_acquire) >= value) return;
  group_.throw_if_failed();
  PeerLink* link = group_.link_by_member[static_cast<std::size_t>(member)];
  if (!link) {
    throw Error(ErrorKind::kInvalidArgument, "waits for its own arena progress", group_.rank,
                group_.rank, "shm arena wait");
  }
  IdleSpin spin(group_.arena_spin, group_.yield_when_idle);
  for (;;) {
    if (counter.load(std::memory_order_acquire) >= value) return;
    if (spin.keep_spinning()) continue;
    if (group_.check_abort(link->rank,
                           [&] { return counter.load(std::memory_order_acquire) >= value; })) {
      return;
    }
    if (!spin.spun_out()) continue;
    group_.sleep_on_doorbell(deadline, member,
                             [&] { return wait_over(*link, member, value, call, deadline); });
    spin.restart();
  }
}

bool ShmArena::wait_over(const PeerLink& link, int member, std::uint64_t value, const Tag& call,
                         Clock::time_point deadline) {
  const auto& counter = group_.headers[static_cast<std::size_t>(member)]->arena_progress;
  auto reached = [&] { return counter.load(std::memory_order_seq_cst) >= value; };
  if (reached()) return true;
  if (group_.check_abort(link.rank, reached)) return true;
  // While every member runs the same arena collective, no messages flow: the collective
  // sends none, and every earlier collective consumed all of its own. So a message in our
  // inbox means its sender runs a message-based collective instead. Unless it finished this
  // one first: a member leaves an arena collective only after seeing every value any member
  // waits for in it, and publishes before it sends, so once its message shows, so does the
  // value we wait for.
  for (auto& sender : group_.links) {
    if (sender->in_ring->head.load(std::memory_order_seq_cst) == sender->in_tail) continue;
    if (reached()) return true;
    const SlotDescriptor d = sender->in_ring->slots[sender->in_tail % kSlotCount];
    group_.fail(std::make_exception_ptr(
        Error(ErrorKind::kMismatch,
              "rank " + std::to_string(sender->rank) + " sent " + group_.describe(d.tag) + " (" +
                  std::to_string(d.message_bytes) +
                  " bytes) over the message path while this rank waits in shared memory for " +
                  group_.describe(call),
              group_.rank, sender->rank, "shm arena wait")));
  }
  auto now = Clock::now();
  bool check_process = now >= group_.next_process_check;
  if (check_process) group_.next_process_check = now + kLivenessInterval;
  std::string gone = group_.departure(link, check_process);
  if (!gone.empty()) {
    if (reached()) return true;  // it published what we wait for before it left
    group_.fail(std::make_exception_ptr(
        Error(ErrorKind::kPeerLost,
              "peer process " + std::to_string(link.pid) + " (rank " + std::to_string(link.rank) +
                  ") " + gone + " with its shared-memory progress at " +
                  std::to_string(counter.load(std::memory_order_relaxed)) + ", short of the " +
                  std::to_string(value) + " this rank waits for in " + group_.describe(call),
              group_.rank, link.rank, "shm arena wait")));
  }
  if (now >= deadline) {
    throw Error(ErrorKind::kTimeout,
                group_.describe(call) + ": rank " + std::to_string(link.rank) +
                    "'s shared-memory progress is still " +
                    std::to_string(counter.load(std::memory_order_relaxed)) +
                    ", this rank waits for " + std::to_string(value),
                group_.rank, link.rank, "shm arena wait");
  }
  return false;
}

}  // namespace gradsync::transport::shm
