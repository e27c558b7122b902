// One rank's side of a shared-memory group: what the message path (ShmTransport, shm.cc) and
// the shared arena (ShmArena, shm_arena.h) both stand on. Every member's mapped segment, the
// link to each peer, the group's abort state, the sticky failure, sleeping on the doorbell and
// noticing departed peers.
//
// Threading contract: one thread at a time uses it (the transport's caller); abort() and the
// links' traffic counters may be used from any thread.
#pragma once

#include <immintrin.h>
#include <poll.h>
#include <sched.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/store.h"
#include "transport/shm.h"
#include "transport/shm_layout.h"
#include "transport/shm_segment.h"
#include "transport/transport.h"

// Hidden: internals of the library, never called from outside it, like everything in the
// shm_*.h headers. That also lets GCC inline calls between them under -fPIC, which it does not
// do for functions a shared library could interpose.
#pragma GCC visibility push(hidden)
namespace gradsync::transport::shm {

// ---- Waiting -----------------------------------------------------------------------------
//
// An idle waiter spins this long before sleeping on its futex: longer than the next slot takes
// to arrive at full bandwidth (docs/performance-notes.md), so the spin catches back-to-back
// slots without a system call, yet a rank whose peer is descheduled (4 ranks on 2 cores) gives
// its core back within 20 us.
constexpr std::chrono::microseconds kSpinBeforeSleep{20};
// A sleeping waiter wakes at least this often to look for dead peers, so a peer killed with
// SIGKILL (which cannot ring a doorbell) is noticed well within a second.
constexpr std::chrono::milliseconds kLivenessInterval{50};
// When the group has more ranks than this process has cores, the rank waited for is often
// descheduled, and every microsecond spun is taken from it. Waiters then yield the core
// between looks (sched_yield, as Open MPI does when oversubscribed) for these long before
// sleeping: a yield costs nothing when the core has nothing else to run, and futex wake-ups
// (twice per message when both sides sleep) are what dominate small messages
// (docs/performance-notes.md). ShmOptions::spin_us (GRADSYNC_SHM_SPIN_US) overrides both spins
// (and kSpinBeforeSleep).
constexpr std::chrono::microseconds kOversubscribedMessageSpin{100};
constexpr std::chrono::microseconds kOversubscribedArenaSpin{100};

// How an idle waiter spends the time before it sleeps. With a core to itself it pauses
// between looks and reads the clock every 32nd round (a clock read costs about a round);
// when ranks share cores it yields the core at every round instead.
class IdleSpin {
 public:
  IdleSpin(Clock::duration limit, bool yield) : limit_(limit), yield_(yield) {}
  // Relaxes once. True: look again right away; false: run the slower checks (abort,
  // spun_out) first.
  bool keep_spinning() {
    if (rounds_++ == 0) since_ = Clock::now();
    if (yield_) {
      ::sched_yield();
      return false;
    }
    _mm_pause();
    return rounds_ % 32 != 0;
  }
  bool spun_out() const { return Clock::now() - since_ >= limit_; }
  void restart() { rounds_ = 0; }

 private:
  Clock::duration limit_;
  bool yield_;
  std::uint32_t rounds_ = 0;
  Clock::time_point since_;
};

// ---- Links -------------------------------------------------------------------------------

// One posted isend or irecv. Owned jointly by its peer's queue (until complete) and by the
// Request handed to the caller, so a caller may drop a request and the op still progresses.
struct Operation {
  bool is_send = false;
  int peer = -1;
  Tag tag;
  std::size_t bytes = 0;
  std::size_t done_bytes = 0;  // copied into (send) or out of (receive) the ring so far
  bool complete = false;
  const unsigned char* send_data = nullptr;
  unsigned char* recv_data = nullptr;  // receives copy here, unless `consume` is set
  Consumer consume;
};
using OperationPtr = std::shared_ptr<Operation>;

// This rank's view of one peer: the two rings between us, the queues of posted operations,
// liveness and traffic. Only the owning transport's caller thread touches the non-atomic
// fields.
struct PeerLink {
  int rank = -1;
  SegmentHeader* segment = nullptr;  // the peer's inbox: its doorbell, flags and pid
  RingControl* out_ring = nullptr;   // this rank -> peer, in the peer's segment
  unsigned char* out_slots = nullptr;
  RingControl* in_ring = nullptr;  // peer -> this rank, in our own segment
  unsigned char* in_slots = nullptr;
  // Private copies of the ring counters: each side alone writes one counter, and re-reads the
  // other side's only when its cached copy says the ring is full (producer) or empty (consumer).
  std::uint64_t out_head = 0, out_tail_seen = 0;
  std::uint64_t in_tail = 0, in_head_seen = 0;
  std::deque<OperationPtr> sends, receives;  // FIFO: the ring is FIFO
  pid_t pid = 0;
  bool pid_checkable = false;  // false for threads of this process or another pid namespace
  int pidfd = -1;
  std::atomic<std::uint64_t> bytes_sent{0}, bytes_received{0};
  std::atomic<std::uint64_t> messages_sent{0}, messages_received{0};

  bool idle() const { return sends.empty() && receives.empty(); }
  ~PeerLink() {
    if (pidfd >= 0) ::close(pidfd);
  }
};

// ---- The group ---------------------------------------------------------------------------

class ShmGroup {
 public:
  // `group_ranks`: the global ranks of the group's members, ascending, `this_rank` among them.
  ShmGroup(int this_rank, int world_ranks, std::vector<int> group_ranks,
           TransportOptions transport_options);
  // Tells the peers this rank is gone: what it published is still delivered, nothing more.
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  // Collective setup: see make_shm_transport.
  void connect(Store& store, const std::string& key_prefix, std::chrono::milliseconds timeout,
               const ShmOptions& shm);

  // Any thread: records the first abort's reason for the whole group, then wakes every rank so
  // each notices at once.
  void abort(const std::string& reason);

  // ---- Sticky failure ----
  // Inline, like everything below: the wait loops call them on every round.

  // Every error except a timeout ends the transport: the rings may hold half a message, so
  // every pending and later operation reports the first error.
  [[noreturn]] void fail(std::exception_ptr error) {
    if (!failure_) failure_ = std::move(error);
    std::rethrow_exception(failure_);
  }
  void throw_if_failed() const {
    if (failure_) std::rethrow_exception(failure_);
  }

  // Fails with kAborted, naming the aborting rank and its reason, once any rank aborted.
  void check_abort(int peer) {
    check_abort(peer, [] { return false; });
  }

  // The same for a wait, unless `arrived()` says what it waits for came after all. A wait's
  // own look (a ring, a counter) and this check are two loads: a rank descheduled between them
  // can find the abort of a rank that went on after sending it its last message, sent while
  // it was away. `arrived()` looks once more, after the abort was seen: what came before the
  // abort is visible then, so only what never came fails the wait. Returns true where it came.
  template <class Arrived>
  bool check_abort(int peer, Arrived arrived) {
    GroupControl& group = *group_control;
    std::uint32_t state = group.abort_state.load(std::memory_order_acquire);
    if (state == kNotAborted) return false;
    if (arrived()) return true;
    fail_aborted(state, peer);
  }

  std::string describe(const Tag& tag) const {
    return options.format_tag ? options.format_tag(tag) : default_format_tag(tag);
  }

  // ---- Sleeping and liveness ----

  // One futex sleep, bounded by the deadline and the liveness interval. Announces the sleep
  // (for an arena wait also whose publish should end it), lets `wait_over` look once more (a
  // peer may have published just before the announcement; it throws to end the wait with an
  // error), then sleeps unless it returned true.
  template <class WaitOver>
  void sleep_on_doorbell(Clock::time_point deadline, int waits_for_member, WaitOver wait_over) {
    SegmentHeader& me = *own;
    std::uint32_t seen = me.doorbell.load(std::memory_order_acquire);
    me.sleeping_for_member.store(waits_for_member, std::memory_order_relaxed);
    // seq_cst, as the counters publishers store before they look at it: see wake_if_sleeping.
    me.owner_sleeping.store(1, std::memory_order_seq_cst);
    struct ClearSleeping {
      FutexWord& flag;
      ~ClearSleeping() { flag.store(0, std::memory_order_relaxed); }
    } clear_sleeping{me.owner_sleeping};

    if (wait_over()) return;
    auto now = Clock::now();
    futex_wait(&me.doorbell, seen, std::min(deadline, now + kLivenessInterval) - now);
  }

  // Why `link`'s peer will publish and send nothing more, or "" while it still may: its
  // closed flag (a plain load) always, its process (a system call) only if `check_process`.
  std::string departure(const PeerLink& link, bool check_process) const {
    if (link.segment->owner_closed.load(std::memory_order_acquire) != 0) {
      return "closed its transport";
    }
    if (check_process && !process_alive(link)) return "exited";
    return {};
  }

  bool process_alive(const PeerLink& link) const {
    if (!link.pid_checkable) return true;
    if (link.pidfd >= 0) {
      // A pidfd polls readable once the process has exited, zombie or reaped.
      pollfd p{link.pidfd, POLLIN, 0};
      return ::poll(&p, 1, 0) == 0;
    }
    return process_alive_by_proc(link.pid);
  }

  // ---- State ----
  // Fixed at construction.
  const int rank;
  const int world_size;
  const std::vector<int> ranks;  // global rank of each member; a member's number is its index
  const TransportOptions options;
  const Layout layout;
  // Set by connect, then only read (the links' own fields aside).
  int my_member = -1;                               // our position in `ranks` (arena member)
  std::vector<MappingPtr> mappings;                 // one per member, own included
  SegmentHeader* own = nullptr;                     // our inbox's header
  GroupControl* group_control = nullptr;            // in the group's first rank's segment
  std::vector<std::unique_ptr<PeerLink>> links;     // one per peer in the group
  std::vector<PeerLink*> link_by_rank;              // indexed by global rank; null if no link
  std::vector<PeerLink*> link_by_member;            // indexed by member; null for ourselves
  std::vector<SegmentHeader*> headers;              // every member's header, by member
  std::vector<unsigned char*> regions;              // every member's arena region, by member
  Clock::duration message_spin = kSpinBeforeSleep;  // a message wait's spin before sleeping
  Clock::duration arena_spin = kSpinBeforeSleep;    // an arena wait's spin before sleeping
  bool yield_when_idle = false;                     // local ranks outnumber usable cores
  // When message and arena waits next look at the peers' processes (epoch: on the first sleep).
  Clock::time_point next_process_check{};

 private:
  [[noreturn]] void fail_aborted(std::uint32_t state, int peer);

  std::exception_ptr failure_;  // the first fatal error, rethrown forever
};

}  // namespace gradsync::transport::shm
#pragma GCC visibility pop
