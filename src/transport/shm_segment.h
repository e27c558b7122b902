// The operating-system side of the shm transport: creating, opening and mapping segments, the
// futex doorbell, and telling whether a peer's process still lives. Knows the segment layout
// (shm_layout.h) but nothing of messages or the arena.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstddef>
#include <ctime>
#include <memory>
#include <string>
#include <vector>

#include "transport/shm_layout.h"

// Hidden, as all shm internals are (see shm_group.h).
#pragma GCC visibility push(hidden)
namespace gradsync::transport::shm {

// ---- Futex doorbell ----------------------------------------------------------------------
// Inline: these run on every slot published or freed and around every sleep.

inline void futex_wait(FutexWord* word, std::uint32_t expected, Clock::duration timeout) {
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
  if (ns <= 0) return;
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  // Not FUTEX_PRIVATE_FLAG: the word lives in memory shared with other processes. EAGAIN
  // (the word changed), EINTR and ETIMEDOUT all just mean "look again".
  ::syscall(SYS_futex, static_cast<void*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

inline void futex_wake_all(FutexWord* word) {
  ::syscall(SYS_futex, static_cast<void*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Bumps a doorbell and wakes whoever sleeps on it (the ucx transport's arena rings its own,
// which live in UCX-mapped pages rather than in segment headers).
inline void ring_doorbell(FutexWord& doorbell) {
  doorbell.fetch_add(1, std::memory_order_release);
  futex_wake_all(&doorbell);
}

inline void ring_doorbell(SegmentHeader& owner) {
  ring_doorbell(owner.doorbell);
}

// Called right after publishing a slot or freeing one (a seq_cst counter store). A waiter
// stores its sleeping flag (seq_cst) and then re-reads the counters (seq_cst): in the single
// total order of seq_cst operations either it sees our counter or we see its flag, so a wake-up
// is never lost. (seq_cst accesses rather than fences: same cost on x86, and TSan models them.)
inline void wake_if_sleeping(SegmentHeader& owner) {
  if (owner.owner_sleeping.load(std::memory_order_seq_cst) != 0) ring_doorbell(owner);
}

// ---- Processes ---------------------------------------------------------------------------

// Identifies this process's pid namespace: a pid means the same process only within one.
std::uint64_t pid_namespace_id();

// A pidfd for `pid` (pollable, readable once the process exits), or -1 with errno set
// (ENOSYS where the kernel or libc lacks pidfd_open).
int open_pidfd(pid_t pid);

// Fallback when pidfds are unavailable. A zombie (state Z) or dying (X) process counts as
// dead: it can never write to the ring again, but kill(pid, 0) would still succeed.
bool process_alive_by_proc(pid_t pid);
// The state letter of /proc/<pid>/stat ('R', 'S', 'T' stopped, 't' traced, 'Z'...); 0 if
// there is no such process.
char process_state(pid_t pid);

// ---- Segments ----------------------------------------------------------------------------

// A whole shared-memory segment mapped into this process; unmapped when the last transport
// using it goes (the memory itself lives on while any process still maps it).
class Mapping {
 public:
  Mapping(void* address, std::size_t bytes) : address_(address), bytes_(bytes) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping();
  unsigned char* bytes() const { return static_cast<unsigned char*>(address_); }
  SegmentHeader& header() const { return *static_cast<SegmentHeader*>(address_); }

 private:
  void* address_;
  std::size_t bytes_;
};
using MappingPtr = std::shared_ptr<const Mapping>;

// Segment names waiting to be unlinked. Setup unlinks them all once every rank has mapped
// every segment, and on every error path, so /dev/shm is clean however setup ends. Until
// then a SIGTERM, SIGINT or SIGHUP unlinks them too: the first add() installs a handler for
// each of those not ignored, which unlinks every name still waiting and then does what the
// signal did before (by default, ends the process with that signal, so its exit status is
// the usual one).
class SegmentUnlinker {
 public:
  SegmentUnlinker() = default;
  SegmentUnlinker(const SegmentUnlinker&) = delete;
  SegmentUnlinker& operator=(const SegmentUnlinker&) = delete;
  ~SegmentUnlinker() { unlink_all(); }
  void add(const std::string& name);
  // Takes back the last name added, without unlinking it (a segment it turned out not to own).
  void forget_last();
  void unlink_all();

 private:
  struct Name {
    std::string name;
    int slot;  // in the table the signal handler reads; -1 when it was full
  };
  std::vector<Name> names_;
};

// A name for this process's segment of `rank` (gradsync::shm_segment_name, numbered so that
// the transports of one process never collide).
std::string make_segment_name(const std::string& token, const std::string& key_prefix, int rank);

// Creates the segment `name` (exclusively, so a stale one is never reused), sizes it for
// `layout`, reserves its pages and maps it. Registers it with `unlinker` before creating it,
// so neither a failure nor a terminating signal at any point leaves it behind. Throws kSystem
// naming `name`; `rank` is this rank.
MappingPtr create_segment(const std::string& name, const Layout& layout, int rank,
                          SegmentUnlinker& unlinker);

// Opens and maps the segment `name` that `owner_rank` created; kProtocol if its size is not
// what `layout` says (a different build or group).
MappingPtr open_segment(const std::string& name, const Layout& layout, int rank, int owner_rank);

}  // namespace gradsync::transport::shm
#pragma GCC visibility pop
