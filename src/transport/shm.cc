// Shared-memory transport for ranks on one host, whether threads or processes: per ordered
// pair of ranks a single-producer single-consumer ring of fixed-size slots in POSIX shared
// memory. Callers drive progress; idle waits spin briefly, then sleep on a process-shared futex.
//
// Memory layout. Every rank owns one segment, its "inbox": a header (doorbell, sleeping flag,
// pid, closed flag; in the segment of the group's first rank also the group's abort state)
// followed by one ring per peer that sends to it. A ring is a control block (producer head and
// consumer tail counters on separate cache lines, one descriptor per slot) and the slots.
// A message of B bytes occupies max(1, ceil(B / slot_bytes)) consecutive slots; every slot's
// descriptor repeats the message's tag and length and gives the piece's offset, so the
// receiver checks tag and length on the first piece and a zero-length message is one empty slot.
// After the rings comes the member's shared-arena region (see SharedArena): raw memory for
// collectives that reduce straight out of each other's buffers, guarded by a progress counter
// in the header. The arena and the rings share the doorbell, abort and liveness machinery.
//
// Progress: every wait()/test() moves all pending operations of the transport (sends into
// free slots, posted receives out of full ones), so ranks that send to each other before they
// wait cannot deadlock. A send completes once all of it is in the ring, so a message larger
// than the ring completes only as the receiver drains it (after posting its receive).
// Failure: every error except a timeout is sticky (see fail()); a dead peer is noticed through
// its pid, a peer that destroyed its transport through its closed flag.
//
// Threading contract: one thread at a time posts, waits and tests (callers serialize);
// abort() and traffic() may be called from any thread. Requests must not outlive the transport.
#include "transport/shm.h"

#include <fcntl.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <fstream>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "rendezvous/store_util.h"
#include "transport/shared_arena.h"

namespace gradsync::transport {

namespace {

using namespace std::chrono_literals;

// ---- Tuning ------------------------------------------------------------------------------
//
// Ring geometry for small groups: 16 slots of 128 KiB. Measured with 2 processes streaming
// 256 MiB (and 1 MiB messages) on a 2-core EPYC VM: 8 x 256 KiB, 16 x 128 KiB and 32 x 64 KiB
// all reach the memory-bandwidth limit (~8.5 GB/s copying out, ~17 GB/s consuming in place),
// so the choice rests on two other effects. Smaller slots fill the pipeline sooner (the
// consumer starts after one slot: ~9 us here instead of ~17 us for 256 KiB), which adds up over
// the 2(N-1) steps of a ring all-reduce; and a slot takes less than kSpinBeforeSleep to copy, so
// a consumer waiting for the next slot catches it while spinning instead of paying a futex
// wake-up per slot. Many slots let the producer run ahead through scheduling jitter. The whole
// ring (2 MiB) stays cache-resident (1 MiB L2 per core, 32 MiB L3), so the consumer reads
// what the producer just wrote from cache, not DRAM.
constexpr std::uint32_t kSlotCount = 16;
constexpr std::size_t kMaxSlotBytes = 128 * 1024;
// Large groups get smaller slots so one rank's inbox stays within kInboxBudgetBytes (shared
// memory grows with ranks^2 otherwise). The floor keeps bookkeeping cheap, and because slot
// sizes are powers of two >= 16 KiB, pieces handed to a consumer never split an element.
constexpr std::size_t kMinSlotBytes = 16 * 1024;
constexpr std::size_t kInboxBudgetBytes = std::size_t{32} << 20;
// An idle waiter spins this long before sleeping on its futex: at full bandwidth a slot
// arrives every ~8-15 us, so the spin catches back-to-back slots without a system call, yet a
// rank whose peer is descheduled (4 ranks on 2 cores) gives its core back within 20 us.
constexpr auto kSpinBeforeSleep = 20us;
// A sleeping waiter wakes at least this often to look for dead peers, so a peer killed with
// SIGKILL (which cannot ring a doorbell) is noticed well within a second.
constexpr auto kLivenessInterval = 50ms;
// When the group has more ranks than this process has cores, the rank waited for is often
// descheduled, and every microsecond spun is taken from it. Waiters then yield the core
// between looks (sched_yield, as Open MPI does when oversubscribed) for these long before
// sleeping: a yield costs nothing when the core has nothing else to run, and a futex
// wake-up (5-10 us, twice per message when both sides sleep) is what dominates small
// messages. GRADSYNC_SHM_SPIN_US overrides both spins (and kSpinBeforeSleep).
constexpr auto kOversubscribedMessageSpin = 100us;
constexpr auto kOversubscribedArenaSpin = 100us;
// Each member's arena region. The shared-memory all-reduce stages a few chunks of a few hundred
// KiB per member there (collectives/shared_memory.cc); 4 MiB leaves it room to try larger
// chunks without making /dev/shm use grow much next to the inbox rings (up to 32 MiB a rank).
constexpr std::size_t kArenaRegionBytes = std::size_t{4} << 20;

// GRADSYNC_SHM_SPIN_US: microseconds an idle waiter looks for progress before it sleeps on
// its futex; -1 when unset (the defaults above apply).
long spin_us_setting() {
  static const long value = tuning_setting("GRADSYNC_SHM_SPIN_US",
                                           std::to_string(kSpinBeforeSleep.count()) + ", or " +
                                               std::to_string(kOversubscribedMessageSpin.count()) +
                                               " yielding when ranks share cores")
                                .value_or(-1);
  return value;
}

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

// ---- Shared-memory layout ----------------------------------------------------------------

constexpr std::size_t kCacheLine = 64;
constexpr std::size_t kPageBytes = 4096;
constexpr std::uint64_t kSegmentMagic = 0x31636e7973647267;  // "grdsync1" little-endian
constexpr std::uint32_t kLayoutVersion = 2;                  // 2: arena region and counter
constexpr std::int32_t kNoMember = -1;
constexpr std::size_t kAbortReasonBytes = 1024;

// Futex words must be plain 32-bit integers in memory.
using FutexWord = std::atomic<std::uint32_t>;
static_assert(sizeof(FutexWord) == 4 && FutexWord::is_always_lock_free);
static_assert(std::atomic<std::uint64_t>::is_always_lock_free,
              "ring counters are shared between processes and must not use a lock");

// Describes the piece of a message held by one slot. Written by the producer before it
// publishes the slot, read by the consumer after it sees the publication.
struct alignas(kCacheLine) SlotDescriptor {
  Tag tag;                      // tag of the whole message
  std::uint64_t message_bytes;  // length of the whole message
  std::uint64_t offset;         // where this piece starts in the message
  std::uint64_t length;         // bytes of payload in this slot
};

struct RingControl {
  // Slots ever published by the producer / released by the consumer (64 bits never wrap).
  // Accessed seq_cst, not just release/acquire, for the sleep/wake handshake (wake_if_sleeping).
  alignas(kCacheLine) std::atomic<std::uint64_t> head{0};
  alignas(kCacheLine) std::atomic<std::uint64_t> tail{0};
  SlotDescriptor slots[kSlotCount];
};

enum AbortState : std::uint32_t { kNotAborted = 0, kAbortBeingWritten = 1, kAbortPublished = 2 };

struct GroupControl {
  alignas(kCacheLine) FutexWord abort_state{kNotAborted};
  std::int32_t abort_rank = -1;
  char abort_reason[kAbortReasonBytes] = {};
};

struct SegmentHeader {
  // Written once by the owner before the segment's name is published.
  std::uint64_t magic = 0;
  std::uint32_t layout_version = 0;
  std::uint32_t group_size = 0;
  std::uint64_t slot_bytes = 0;
  std::uint64_t arena_bytes = 0;
  std::uint64_t segment_bytes = 0;
  std::int32_t owner_rank = -1;
  std::int32_t owner_pid = 0;
  std::uint64_t owner_pid_namespace = 0;
  // Bumped by whoever wants the owner to re-check its rings (new data, freed space, abort).
  alignas(kCacheLine) FutexWord doorbell{0};
  // Non-zero while the owner is (about to be) asleep on the doorbell: only then do others
  // pay for a FUTEX_WAKE system call.
  alignas(kCacheLine) FutexWord owner_sleeping{0};
  // While the owner sleeps in SharedArena::wait_for: the member whose progress it waits for,
  // so only that member's publishes ring the doorbell (kNoMember for message waits). Read by
  // publishers after they see owner_sleeping set (same cache line: one miss for both).
  std::atomic<std::int32_t> sleeping_for_member{kNoMember};
  // The owner's arena progress counter (SharedArena::publish). seq_cst like the ring
  // counters, for the same sleep/wake handshake (wake_if_sleeping).
  alignas(kCacheLine) std::atomic<std::uint64_t> arena_progress{0};
  // The call the owner last waited in (SharedArena::wait_for's `call`): written before the
  // owner publishes in that call, so whoever sees the progress can name the call.
  std::atomic<std::uint64_t> arena_call[4] = {};
  // Set when the owner destroys its transport: what it published is still delivered, but
  // nothing more will come.
  alignas(kCacheLine) FutexWord owner_closed{0};
  GroupControl group;  // used only in the segment of the group's first rank
};

constexpr std::size_t round_up(std::size_t n, std::size_t to) {
  return (n + to - 1) / to * to;
}

// Sizes and offsets of one segment; identical for every rank of a group.
struct Layout {
  explicit Layout(int members) {
    std::size_t senders = static_cast<std::size_t>(std::max(members - 1, 1));
    slot_bytes = kMaxSlotBytes;
    while (slot_bytes > kMinSlotBytes && senders * kSlotCount * slot_bytes > kInboxBudgetBytes) {
      slot_bytes /= 2;
    }
    header_bytes = round_up(sizeof(SegmentHeader), kPageBytes);
    control_bytes = round_up(sizeof(RingControl), kPageBytes);
    ring_bytes = control_bytes + kSlotCount * slot_bytes;
    arena_offset = header_bytes + static_cast<std::size_t>(members - 1) * ring_bytes;
    arena_bytes = kArenaRegionBytes;
    segment_bytes = arena_offset + arena_bytes;
  }
  // The ring in the segment of group member `receiver` that carries messages from `sender`.
  std::size_t ring_offset(int sender, int receiver) const {
    int index = sender < receiver ? sender : sender - 1;
    return header_bytes + static_cast<std::size_t>(index) * ring_bytes;
  }

  std::size_t slot_bytes;
  std::size_t header_bytes;
  std::size_t control_bytes;
  std::size_t ring_bytes;
  std::size_t arena_offset;  // page aligned: every part before it is a whole number of pages
  std::size_t arena_bytes;
  std::size_t segment_bytes;
};

// ---- System helpers ----------------------------------------------------------------------

void futex_wait(FutexWord* word, std::uint32_t expected, Clock::duration timeout) {
  auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
  if (ns <= 0) return;
  timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
  // Not FUTEX_PRIVATE_FLAG: the word lives in memory shared with other processes. EAGAIN
  // (the word changed), EINTR and ETIMEDOUT all just mean "look again".
  ::syscall(SYS_futex, static_cast<void*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(FutexWord* word) {
  ::syscall(SYS_futex, static_cast<void*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void ring_doorbell(SegmentHeader& owner) {
  owner.doorbell.fetch_add(1, std::memory_order_release);
  futex_wake_all(&owner.doorbell);
}

// Called right after publishing a slot or freeing one (a seq_cst counter store). A waiter
// stores its sleeping flag (seq_cst) and then re-reads the counters (seq_cst): in the single
// total order of seq_cst operations either it sees our counter or we see its flag, so a wake-up
// is never lost. (seq_cst accesses rather than fences: same cost on x86, and TSan models them.)
void wake_if_sleeping(SegmentHeader& owner) {
  if (owner.owner_sleeping.load(std::memory_order_seq_cst) != 0) ring_doorbell(owner);
}

std::uint64_t pid_namespace_id() {
  struct stat st;
  return ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<std::uint64_t>(st.st_ino) : 0;
}

int open_pidfd(pid_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
#else
  (void)pid;
  errno = ENOSYS;
  return -1;
#endif
}

// Fallback when pidfds are unavailable. A zombie (state Z) or dying (X) process counts as
// dead: it can never write to the ring again, but kill(pid, 0) would still succeed.
bool process_alive_by_proc(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat_line;
  if (!std::getline(in, stat_line)) return false;
  std::size_t close_paren = stat_line.rfind(')');  // the command name may contain spaces
  if (close_paren == std::string::npos || close_paren + 2 >= stat_line.size()) return true;
  char state = stat_line[close_paren + 2];
  return state != 'Z' && state != 'X';
}

// A whole shared-memory segment mapped into this process; unmapped when the last transport
// using it goes (the memory itself lives on while any process still maps it).
class Mapping {
 public:
  Mapping(void* address, std::size_t bytes) : address_(address), bytes_(bytes) {}
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() { ::munmap(address_, bytes_); }
  unsigned char* bytes() const { return static_cast<unsigned char*>(address_); }
  SegmentHeader& header() const { return *static_cast<SegmentHeader*>(address_); }

 private:
  void* address_;
  std::size_t bytes_;
};
using MappingPtr = std::shared_ptr<const Mapping>;

// Segments this process has mapped, by inode. Ranks that are threads of one process share one
// mapping per segment: less address space and page-table work, and ThreadSanitizer sees both
// sides of every ring at the same address, so it can check the ring protocol.
class MappingRegistry {
 public:
  static MappingRegistry& instance() {
    static auto* registry = new MappingRegistry;  // never destroyed: outlives static transports
    return *registry;
  }
  // The live mapping of the object `st` describes, or a new one made by `map`.
  template <class MapFn>
  MappingPtr find_or_map(const struct stat& st, MapFn map) {
    std::lock_guard lock(mu_);
    std::erase_if(mappings_, [](const auto& entry) { return entry.second.expired(); });
    // An inode cannot be reused while a mapping keeps its object alive, so a live entry is
    // always the same segment.
    auto key = std::make_pair(st.st_dev, st.st_ino);
    if (auto it = mappings_.find(key); it != mappings_.end()) {
      if (auto existing = it->second.lock()) return existing;
    }
    MappingPtr created = map();
    mappings_[key] = created;
    return created;
  }

 private:
  std::mutex mu_;
  std::map<std::pair<dev_t, ino_t>, std::weak_ptr<const Mapping>> mappings_;
};

// Segment names waiting to be unlinked. Setup unlinks them all once every rank has mapped
// every segment, and on every error path, so /dev/shm is clean however setup ends.
class SegmentUnlinker {
 public:
  ~SegmentUnlinker() { unlink_all(); }
  void add(const std::string& name) { names_.push_back(name); }
  void unlink_all() {
    for (const auto& n : names_) ::shm_unlink(n.c_str());  // ENOENT: another rank was first
    names_.clear();
  }

 private:
  std::vector<std::string> names_;
};

// "/gradsync-<token[0:8]>-<key prefix>-p<pid>-r<rank>-<n>": the token prefix lets the
// launcher remove a job's strays (gradsync-run cleans /dev/shm/gradsync-<token[0:8]>*),
// the key prefix and pid say which context and process; the counter keeps transports of
// one process apart.
std::string make_segment_name(const std::string& token, const std::string& key_prefix, int rank) {
  static std::atomic<unsigned> counter{0};
  std::string safe;
  for (char c : token.substr(0, 8) + "-" + key_prefix.substr(0, 128)) {
    bool keep = std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
    safe += keep ? c : '_';
  }
  return "/gradsync-" + safe + "-p" + std::to_string(::getpid()) + "-r" + std::to_string(rank) +
         "-" + std::to_string(counter++);
}

// ---- The transport -----------------------------------------------------------------------

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

class ShmTransport;

class ShmRequest final : public Request {
 public:
  ShmRequest(ShmTransport& transport, OperationPtr op)
      : transport_(transport), op_(std::move(op)) {}
  bool test() override;
  void wait(Clock::time_point deadline) override;

 private:
  ShmTransport& transport_;
  OperationPtr op_;
};

// The transport is also the group's shared arena: both live in the same segments and share
// the doorbells, the abort state and the liveness checks.
class ShmTransport final : public Transport, public SharedArena {
 public:
  ShmTransport(int rank, int world_size, std::vector<int> group, TransportOptions options)
      : rank_(rank),
        world_size_(world_size),
        group_(std::move(group)),
        options_(std::move(options)),
        layout_(static_cast<int>(group_.size())),
        link_by_rank_(static_cast<std::size_t>(world_size), nullptr) {}

  ~ShmTransport() override {
    if (!own_) return;  // setup failed before our segment existed
    own_->owner_closed.store(1, std::memory_order_release);
    for (auto& link : links_) ring_doorbell(*link->segment);
  }

  // Collective setup; see make_shm_transport.
  void connect(Store& store, const std::string& key_prefix, std::chrono::milliseconds timeout);

  int rank() const override { return rank_; }
  int size() const override { return world_size_; }
  const char* name() const override { return "shm"; }
  SharedArena* shared_arena() override { return this; }

  RequestPtr isend(int peer, const Tag& tag, const void* data, std::size_t bytes) override {
    PeerLink& link = link_for(peer, "isend", bytes);
    if (bytes != 0 && data == nullptr) {
      throw Error(ErrorKind::kInvalidArgument, "null send buffer", rank_, peer, "shm send", bytes);
    }
    throw_if_failed();
    check_abort(peer);
    auto op = std::make_shared<Operation>();
    op->is_send = true;
    op->peer = peer;
    op->tag = tag;
    op->bytes = bytes;
    op->send_data = static_cast<const unsigned char*>(data);
    link.sends.push_back(op);
    // Eager: a message that fits in the ring's free slots is sent before isend returns.
    progress_guarded([&] { return progress_sends(link); });
    return std::make_unique<ShmRequest>(*this, std::move(op));
  }

  RequestPtr irecv(int peer, const Tag& tag, void* data, std::size_t bytes) override {
    if (bytes != 0 && data == nullptr) {
      throw Error(ErrorKind::kInvalidArgument, "null receive buffer", rank_, peer, "shm recv",
                  bytes);
    }
    auto op = post_receive(peer, tag, bytes);
    op->recv_data = static_cast<unsigned char*>(data);
    return std::make_unique<ShmRequest>(*this, std::move(op));
  }

  // Native zero-copy receive: `consume` reads each piece straight out of the ring slot, which
  // is released only after it returns. It runs inside whichever wait()/test() of this
  // transport makes the progress (always the single caller thread).
  RequestPtr irecv_consume(int peer, const Tag& tag, std::size_t bytes, Consumer consume) override {
    if (!consume) {
      throw Error(ErrorKind::kInvalidArgument, "empty consumer", rank_, peer, "shm recv", bytes);
    }
    auto op = post_receive(peer, tag, bytes);
    op->consume = std::move(consume);
    return std::make_unique<ShmRequest>(*this, std::move(op));
  }

  // Any thread: touches only shared atomics, then wakes every rank so each notices at once.
  void abort(const std::string& reason) override {
    GroupControl& group = *group_control_;
    std::uint32_t expected = kNotAborted;
    if (group.abort_state.compare_exchange_strong(expected, kAbortBeingWritten,
                                                  std::memory_order_acq_rel)) {
      group.abort_rank = rank_;
      std::size_t n = std::min(reason.size(), kAbortReasonBytes - 1);
      std::memcpy(group.abort_reason, reason.data(), n);
      group.abort_reason[n] = '\0';
      group.abort_state.store(kAbortPublished, std::memory_order_release);
    }
    ring_doorbell(*own_);
    for (auto& link : links_) ring_doorbell(*link->segment);
  }

  // Any thread.
  PeerTraffic traffic(int peer) const override {
    if (peer == rank_) return {};
    const PeerLink* link =
        peer >= 0 && peer < world_size_ ? link_by_rank_[static_cast<std::size_t>(peer)] : nullptr;
    if (!link) {
      throw Error(ErrorKind::kInvalidArgument, "peer is not in this shm group", rank_, peer,
                  "shm traffic");
    }
    return PeerTraffic{link->bytes_sent.load(std::memory_order_relaxed),
                       link->bytes_received.load(std::memory_order_relaxed),
                       link->messages_sent.load(std::memory_order_relaxed),
                       link->messages_received.load(std::memory_order_relaxed)};
  }

  // ---- SharedArena ----

  int members() const override { return static_cast<int>(group_.size()); }
  int member_index() const override { return my_index_; }
  int member_rank(int member) const override { return group_[checked_member(member)]; }
  unsigned char* region(int member) override { return regions_[checked_member(member)]; }
  std::size_t region_bytes() const override { return layout_.arena_bytes; }
  std::uint64_t progress(int member) const override {
    return headers_[checked_member(member)]->arena_progress.load(std::memory_order_acquire);
  }

  void publish(std::uint64_t value) override {
    if (value < published_) {
      throw Error(ErrorKind::kInvalidArgument,
                  "arena progress may not go back from " + std::to_string(published_) + " to " +
                      std::to_string(value),
                  rank_, Error::kNoPeer, "shm arena publish");
    }
    published_ = value;
    own_->arena_progress.store(value, std::memory_order_seq_cst);  // see sleep_on_doorbell
    for (std::size_t m = 0; m < headers_.size(); ++m) {
      SegmentHeader& member = *headers_[m];
      if (static_cast<int>(m) != my_index_ &&
          member.owner_sleeping.load(std::memory_order_seq_cst) != 0 &&
          member.sleeping_for_member.load(std::memory_order_relaxed) == my_index_) {
        ring_doorbell(member);
      }
    }
  }

  void wait_for(int member, std::uint64_t value, const Tag& call,
                Clock::time_point deadline) override {
    if (!(call == arena_call_)) {
      arena_call_ = call;
      for (int w = 0; w < 4; ++w) {
        own_->arena_call[w].store(call.words[w], std::memory_order_relaxed);
      }
    }
    const auto& counter = headers_[checked_member(member)]->arena_progress;
    if (counter.load(std::memory_order_acquire) >= value) return;
    throw_if_failed();
    PeerLink* link = link_by_member_[static_cast<std::size_t>(member)];
    if (!link) {
      throw Error(ErrorKind::kInvalidArgument, "waits for its own arena progress", rank_, rank_,
                  "shm arena wait");
    }
    IdleSpin spin(arena_spin_, yield_when_idle_);
    for (;;) {
      if (counter.load(std::memory_order_acquire) >= value) return;
      if (spin.keep_spinning()) continue;
      check_abort(link->rank);
      if (!spin.spun_out()) continue;
      sleep_on_doorbell(deadline, member,
                        [&] { return arena_wait_over(*link, member, value, call, deadline); });
      spin.restart();
    }
  }

  bool test(Operation& op) {
    if (op.complete) return true;
    throw_if_failed();
    progress_all();
    if (op.complete) return true;
    check_abort(op.peer);
    check_peers_alive(Clock::now());
    return false;
  }

  void wait(Operation& op, Clock::time_point deadline) {
    if (op.complete) return;
    throw_if_failed();
    IdleSpin spin(message_spin_, yield_when_idle_);
    for (;;) {
      bool moved = progress_all();
      if (op.complete) return;
      check_abort(op.peer);
      if (moved) {
        spin.restart();
        // Traffic with other peers must not hide a deadline or a dead peer.
        auto now = Clock::now();
        if (now >= deadline) throw_timeout(op);
        if (now >= next_process_check_) check_peers_alive(now);
        continue;
      }
      if (spin.keep_spinning() || !spin.spun_out()) continue;
      sleep_on_doorbell(deadline, kNoMember, [&] { return message_wait_over(op, deadline); });
      spin.restart();
    }
  }

 private:
  OperationPtr post_receive(int peer, const Tag& tag, std::size_t bytes) {
    PeerLink& link = link_for(peer, "irecv", bytes);
    throw_if_failed();
    check_abort(peer);
    auto op = std::make_shared<Operation>();
    op->peer = peer;
    op->tag = tag;
    op->bytes = bytes;
    link.receives.push_back(op);
    return op;
  }

  std::size_t checked_member(int member) const {
    if (member < 0 || member >= members()) {
      throw Error(ErrorKind::kInvalidArgument,
                  "arena member " + std::to_string(member) + " outside group of " +
                      std::to_string(members()),
                  rank_, Error::kNoPeer, "shm arena");
    }
    return static_cast<std::size_t>(member);
  }

  PeerLink& link_for(int peer, const char* what, std::size_t bytes) const {
    if (peer == rank_) {
      throw Error(ErrorKind::kInvalidArgument, std::string(what) + " to self is not supported",
                  rank_, peer, "shm transport", bytes);
    }
    PeerLink* link =
        peer >= 0 && peer < world_size_ ? link_by_rank_[static_cast<std::size_t>(peer)] : nullptr;
    if (!link) {
      throw Error(ErrorKind::kInvalidArgument,
                  std::string(what) + ": peer is not in this shm group", rank_, peer,
                  "shm transport", bytes);
    }
    return *link;
  }

  std::string describe(const Tag& tag) const {
    return options_.format_tag ? options_.format_tag(tag) : default_format_tag(tag);
  }

  // ---- Sticky failure ----

  // Every error except a timeout ends the transport: the rings may hold half a message, so
  // every pending and later operation reports the first error.
  [[noreturn]] void fail(std::exception_ptr error) {
    if (!failure_) failure_ = std::move(error);
    std::rethrow_exception(failure_);
  }
  void throw_if_failed() const {
    if (failure_) std::rethrow_exception(failure_);
  }

  void check_abort(int peer) {
    GroupControl& group = *group_control_;
    std::uint32_t state = group.abort_state.load(std::memory_order_acquire);
    if (state == kNotAborted) return;
    // The aborting rank fills in the reason between its two stores; give it a moment (it may
    // also have died in between, hence the bound).
    for (int i = 0; i < 10000 && state == kAbortBeingWritten; ++i) {
      std::this_thread::sleep_for(1us);
      state = group.abort_state.load(std::memory_order_acquire);
    }
    bool published = state == kAbortPublished;
    std::string who = published ? "rank " + std::to_string(group.abort_rank) : "a rank";
    std::string reason =
        published
            ? std::string(group.abort_reason, ::strnlen(group.abort_reason, kAbortReasonBytes))
            : "(reason not recorded: the aborting rank died while writing it)";
    fail(std::make_exception_ptr(Error(ErrorKind::kAborted,
                                       "group aborted by " + who + ": " + reason, rank_, peer,
                                       "shm transport")));
  }

  [[noreturn]] void throw_timeout(const Operation& op) const {
    std::size_t missing = op.bytes - op.done_bytes;
    std::string amount =
        op.done_bytes == 0 ? "all " + std::to_string(op.bytes) + " bytes"
                           : std::to_string(missing) + " of " + std::to_string(op.bytes) + " bytes";
    std::string detail = describe(op.tag) + ": " + amount + " still missing" +
                         (op.is_send ? " (the peer's ring is full: is it receiving?)" : "");
    throw Error(ErrorKind::kTimeout, detail, rank_, op.peer, op.is_send ? "shm send" : "shm recv",
                op.bytes);
  }

  // ---- Progress ----

  // Runs one progress step; any error it raises fails the transport. A consumer that calls
  // back into the transport gets no nested progress (the queues are mid-update); it may post
  // operations, but must not wait on them.
  template <class Step>
  bool progress_guarded(Step step) {
    if (progressing_) return false;
    progressing_ = true;
    try {
      bool moved = step();
      progressing_ = false;
      return moved;
    } catch (...) {
      progressing_ = false;
      fail(std::current_exception());
    }
  }

  // Moves what can move on every link; true if anything did. Each direction of each link moves
  // at most one ring's worth of slots per pass, so a long send to one peer cannot starve the
  // receive from another (a ring all-reduce sends and receives at once, and its predecessor
  // stalls while we do not drain).
  bool progress_all() {
    return progress_guarded([&] {
      bool moved = false;
      for (auto& link : links_) {
        if (!link->sends.empty()) moved |= progress_sends(*link);
        if (!link->receives.empty()) moved |= progress_receives(*link);
      }
      return moved;
    });
  }

  bool progress_sends(PeerLink& link) {
    bool moved = false;
    const std::size_t slot_bytes = layout_.slot_bytes;
    for (std::uint32_t budget = kSlotCount; budget > 0 && !link.sends.empty(); --budget) {
      if (link.out_head - link.out_tail_seen == kSlotCount) {
        link.out_tail_seen = link.out_ring->tail.load(std::memory_order_seq_cst);
        if (link.out_head - link.out_tail_seen == kSlotCount) break;  // ring full
      }
      Operation& op = *link.sends.front();
      std::size_t slot = link.out_head % kSlotCount;
      std::size_t length = std::min(op.bytes - op.done_bytes, slot_bytes);
      SlotDescriptor& d = link.out_ring->slots[slot];
      d.tag = op.tag;
      d.message_bytes = op.bytes;
      d.offset = op.done_bytes;
      d.length = length;
      if (length)
        std::memcpy(link.out_slots + slot * slot_bytes, op.send_data + op.done_bytes, length);
      link.out_ring->head.store(++link.out_head, std::memory_order_seq_cst);
      wake_if_sleeping(*link.segment);
      moved = true;
      op.done_bytes += length;
      link.bytes_sent.fetch_add(length, std::memory_order_relaxed);
      if (op.done_bytes == op.bytes) {
        op.complete = true;
        link.messages_sent.fetch_add(1, std::memory_order_relaxed);
        link.sends.pop_front();
      }
    }
    return moved;
  }

  bool progress_receives(PeerLink& link) {
    bool moved = false;
    const std::size_t slot_bytes = layout_.slot_bytes;
    for (std::uint32_t budget = kSlotCount; budget > 0 && !link.receives.empty(); --budget) {
      if (link.in_head_seen == link.in_tail) {
        link.in_head_seen = link.in_ring->head.load(std::memory_order_seq_cst);
        if (link.in_head_seen == link.in_tail) break;  // ring empty
      }
      Operation& op = *link.receives.front();
      std::size_t slot = link.in_tail % kSlotCount;
      const SlotDescriptor d = link.in_ring->slots[slot];  // copy: read the shared one once
      if (op.done_bytes == 0 && !(d.tag == op.tag && d.message_bytes == op.bytes)) {
        throw Error(ErrorKind::kMismatch,
                    "expected " + describe(op.tag) + " (" + std::to_string(op.bytes) +
                        " bytes) but peer sent " + describe(d.tag) + " (" +
                        std::to_string(d.message_bytes) + " bytes)",
                    rank_, link.rank, "shm recv", op.bytes);
      }
      if (d.offset != op.done_bytes || d.length > op.bytes - op.done_bytes ||
          d.length > slot_bytes || (d.length == 0 && op.bytes != 0)) {
        throw Error(ErrorKind::kProtocol,
                    "corrupt ring slot: piece at offset " + std::to_string(d.offset) + " of " +
                        std::to_string(d.length) + " bytes, expected offset " +
                        std::to_string(op.done_bytes),
                    rank_, link.rank, "shm recv", op.bytes);
      }
      const unsigned char* piece = link.in_slots + slot * slot_bytes;
      if (d.length) {
        if (op.consume) {
          op.consume(piece, d.offset, d.length);
        } else {
          std::memcpy(op.recv_data + d.offset, piece, d.length);
        }
      }
      link.in_ring->tail.store(++link.in_tail, std::memory_order_seq_cst);
      wake_if_sleeping(*link.segment);
      moved = true;
      op.done_bytes += d.length;
      link.bytes_received.fetch_add(d.length, std::memory_order_relaxed);
      if (op.done_bytes == op.bytes) {
        op.complete = true;
        link.messages_received.fetch_add(1, std::memory_order_relaxed);
        link.receives.pop_front();
      }
    }
    return moved;
  }

  // ---- Sleeping and liveness ----

  // One futex sleep, bounded by the deadline and the liveness interval. Announces the sleep
  // (for an arena wait also whose publish should end it), lets `wait_over` look once more (a
  // peer may have published just before the announcement; it throws to end the wait with an
  // error), then sleeps unless it returned true.
  template <class WaitOver>
  void sleep_on_doorbell(Clock::time_point deadline, int waits_for_member, WaitOver wait_over) {
    SegmentHeader& me = *own_;
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

  // wait()'s last look before sleeping: true if `op` completed or anything moved.
  bool message_wait_over(Operation& op, Clock::time_point deadline) {
    if (progress_all() || op.complete) return true;
    check_abort(op.peer);
    auto now = Clock::now();
    check_peers_alive(now);
    if (op.complete) return true;  // the liveness check delivers what a departed peer left behind
    check_peers_in_arena();
    if (op.complete) return true;
    if (now >= deadline) throw_timeout(op);
    return false;
  }

  // SharedArena::wait_for's last look before sleeping: true once `member` reached `value`.
  bool arena_wait_over(const PeerLink& link, int member, std::uint64_t value, const Tag& call,
                       Clock::time_point deadline) {
    const auto& counter = headers_[static_cast<std::size_t>(member)]->arena_progress;
    auto reached = [&] { return counter.load(std::memory_order_seq_cst) >= value; };
    if (reached()) return true;
    check_abort(link.rank);
    // While every member runs the same arena collective, no messages flow: the collective
    // sends none, and every earlier collective consumed all of its own. So a message in our
    // inbox means its sender runs a message-based collective instead. Unless it finished this
    // one first: a member leaves an arena collective only after seeing every value any member
    // waits for in it, and publishes before it sends, so once its message shows, so does the
    // value we wait for.
    for (auto& sender : links_) {
      if (sender->in_ring->head.load(std::memory_order_seq_cst) == sender->in_tail) continue;
      if (reached()) return true;
      const SlotDescriptor d = sender->in_ring->slots[sender->in_tail % kSlotCount];
      fail(std::make_exception_ptr(
          Error(ErrorKind::kMismatch,
                "rank " + std::to_string(sender->rank) + " sent " + describe(d.tag) + " (" +
                    std::to_string(d.message_bytes) +
                    " bytes) over the message path while this rank waits in shared memory for " +
                    describe(call),
                rank_, sender->rank, "shm arena wait")));
    }
    auto now = Clock::now();
    bool check_process = now >= next_process_check_;
    if (check_process) next_process_check_ = now + kLivenessInterval;
    std::string gone = departure(link, check_process);
    if (!gone.empty()) {
      if (reached()) return true;  // it published what we wait for before it left
      fail(std::make_exception_ptr(
          Error(ErrorKind::kPeerLost,
                "peer process " + std::to_string(link.pid) + " (rank " + std::to_string(link.rank) +
                    ") " + gone + " with its shared-memory progress at " +
                    std::to_string(counter.load(std::memory_order_relaxed)) + ", short of the " +
                    std::to_string(value) + " this rank waits for in " + describe(call),
                rank_, link.rank, "shm arena wait")));
    }
    if (now >= deadline) {
      throw Error(ErrorKind::kTimeout,
                  describe(call) + ": rank " + std::to_string(link.rank) +
                      "'s shared-memory progress is still " +
                      std::to_string(counter.load(std::memory_order_relaxed)) +
                      ", this rank waits for " + std::to_string(value),
                  rank_, link.rank, "shm arena wait");
    }
    return false;
  }

  // The mirror image of the stray-message check in arena_wait_over: a peer whose arena counter
  // is past ours has entered an arena collective this rank is not in (every member ends each
  // one at the same count), so what we wait for from it will never come. It published after
  // sending all it sent before, so a last pass delivers that first.
  void check_peers_in_arena() {
    const std::uint64_t mine = own_->arena_progress.load(std::memory_order_relaxed);
    for (auto& link : links_) {
      if (link->idle()) continue;
      const std::uint64_t theirs = link->segment->arena_progress.load(std::memory_order_seq_cst);
      if (theirs <= mine) continue;
      progress_all();
      if (link->idle()) continue;
      const Operation& op = link->receives.empty() ? *link->sends.front() : *link->receives.front();
      Tag their_call;
      for (int w = 0; w < 4; ++w) {
        their_call.words[w] = link->segment->arena_call[w].load(std::memory_order_relaxed);
      }
      fail(std::make_exception_ptr(
          Error(ErrorKind::kMismatch,
                "rank " + std::to_string(link->rank) + " runs " + describe(their_call) +
                    " in shared memory (its arena progress " + std::to_string(theirs) +
                    " is past this rank's " + std::to_string(mine) + ") while this rank " +
                    (op.is_send ? "sends it " : "waits for ") + describe(op.tag) + " (" +
                    std::to_string(op.bytes) + " bytes)",
                rank_, link->rank, op.is_send ? "shm send" : "shm recv", op.bytes)));
    }
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

  // Fails with kPeerLost if a peer we still wait on has closed its transport or died. Closed
  // flags are plain loads, checked every time; process ids every kLivenessInterval.
  void check_peers_alive(Clock::time_point now) {
    bool check_processes = now >= next_process_check_;
    if (check_processes) next_process_check_ = now + kLivenessInterval;
    for (auto& link : links_) {
      if (link->idle()) continue;
      std::string what = departure(*link, check_processes);
      if (what.empty()) continue;
      // A departed peer writes nothing more, so one more pass delivers all it left behind.
      progress_all();
      if (link->idle()) continue;
      const Operation& op = link->receives.empty() ? *link->sends.front() : *link->receives.front();
      std::string detail = "peer process " + std::to_string(link->pid) + " (rank " +
                           std::to_string(link->rank) + ") " + what + " with " +
                           std::to_string(op.bytes - op.done_bytes) + " of " +
                           std::to_string(op.bytes) + " bytes of " + describe(op.tag) +
                           (op.is_send ? " not yet taken by it" : " not yet received");
      fail(std::make_exception_ptr(Error(ErrorKind::kPeerLost, detail, rank_, link->rank,
                                         op.is_send ? "shm send" : "shm recv", op.bytes)));
    }
  }

  const int rank_;
  const int world_size_;
  const std::vector<int> group_;
  const TransportOptions options_;
  const Layout layout_;
  int my_index_ = -1;                                // our position in group_ (arena member)
  std::vector<MappingPtr> mappings_;                 // one per group member, own included
  SegmentHeader* own_ = nullptr;                     // our inbox's header
  GroupControl* group_control_ = nullptr;            // in the group's first rank's segment
  std::vector<std::unique_ptr<PeerLink>> links_;     // one per peer in the group
  std::vector<PeerLink*> link_by_rank_;              // indexed by global rank; null if no link
  std::vector<PeerLink*> link_by_member_;            // indexed by member; null for ourselves
  std::vector<SegmentHeader*> headers_;              // every member's header, by member
  std::vector<unsigned char*> regions_;              // every member's arena region, by member
  std::uint64_t published_ = 0;                      // our arena counter, as last published
  Tag arena_call_;                                   // as last written to own_->arena_call
  Clock::duration message_spin_ = kSpinBeforeSleep;  // wait's spin before sleeping
  Clock::duration arena_spin_ = kSpinBeforeSleep;    // wait_for's spin before sleeping
  bool yield_when_idle_ = false;                     // local ranks outnumber usable cores
  std::exception_ptr failure_;                       // the first fatal error, rethrown forever
  bool progressing_ = false;                         // inside progress_guarded
  Clock::time_point next_process_check_{};           // epoch: check on the first sleep
};

bool ShmRequest::test() {
  return transport_.test(*op_);
}
void ShmRequest::wait(Clock::time_point deadline) {
  transport_.wait(*op_, deadline);
}

// ---- Setup -------------------------------------------------------------------------------

[[noreturn]] void throw_setup_errno(const std::string& what, const std::string& name, int err,
                                    int rank) {
  throw Error(ErrorKind::kSystem, what + " " + name + ": " + std::strerror(err), rank,
              Error::kNoPeer, "shm transport setup");
}

struct FdCloser {
  int fd;
  ~FdCloser() { ::close(fd); }
};

MappingPtr map_segment(int fd, std::size_t bytes, const std::string& name, int rank) {
  struct stat st;
  if (::fstat(fd, &st) != 0) throw_setup_errno("cannot stat", name, errno, rank);
  return MappingRegistry::instance().find_or_map(st, [&] {
    // MAP_POPULATE pre-faults the page tables so the first transfer does not pay for it.
    void* address =
        ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (address == MAP_FAILED) throw_setup_errno("cannot map", name, errno, rank);
    return std::make_shared<const Mapping>(address, bytes);
  });
}

MappingPtr create_segment(const std::string& name, const Layout& layout, int rank,
                          SegmentUnlinker& unlinker) {
  int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw_setup_errno("cannot create shared memory", name, errno, rank);
  unlinker.add(name);
  FdCloser closer{fd};
  if (::ftruncate(fd, static_cast<off_t>(layout.segment_bytes)) != 0) {
    throw_setup_errno("cannot size shared memory", name, errno, rank);
  }
  // Reserve the pages now: a full /dev/shm then fails here with a message instead of killing
  // the process with SIGBUS on first touch in the middle of a transfer.
  if (int err = ::posix_fallocate(fd, 0, static_cast<off_t>(layout.segment_bytes)); err != 0) {
    throw_setup_errno("cannot reserve " + std::to_string(layout.segment_bytes) +
                          " bytes of shared memory (is /dev/shm too small?) for",
                      name, err, rank);
  }
  return map_segment(fd, layout.segment_bytes, name, rank);
}

MappingPtr open_segment(const std::string& name, const Layout& layout, int rank, int owner_rank) {
  int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    throw_setup_errno("cannot open shared memory of rank " + std::to_string(owner_rank), name,
                      errno, rank);
  }
  FdCloser closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) throw_setup_errno("cannot stat", name, errno, rank);
  if (static_cast<std::size_t>(st.st_size) != layout.segment_bytes) {
    throw Error(ErrorKind::kProtocol,
                "segment " + name + " of rank " + std::to_string(owner_rank) + " has " +
                    std::to_string(st.st_size) + " bytes, expected " +
                    std::to_string(layout.segment_bytes) + " (different gradsync builds?)",
                rank, owner_rank, "shm transport setup");
  }
  return map_segment(fd, layout.segment_bytes, name, rank);
}

void ShmTransport::connect(Store& store, const std::string& key_prefix,
                           std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  auto remaining = [&] {
    return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                    0ms);
  };
  const int group_size = static_cast<int>(group_.size());
  const int my_index = my_index_ =
      static_cast<int>(std::find(group_.begin(), group_.end(), rank_) - group_.begin());
  const std::uint64_t my_pid_namespace = pid_namespace_id();
  auto segment_key = [&](int r) { return key_prefix + "/shm/segment/" + std::to_string(r); };

  SegmentUnlinker unlinker;

  // 1. Create and initialise our inbox, then publish its name.
  std::string own_name = make_segment_name(options_.token, key_prefix, rank_);
  mappings_.resize(static_cast<std::size_t>(group_size));
  const Mapping& own = *(mappings_[static_cast<std::size_t>(my_index)] =
                             create_segment(own_name, layout_, rank_, unlinker));
  own_ = new (own.bytes()) SegmentHeader();
  own_->magic = kSegmentMagic;
  own_->layout_version = kLayoutVersion;
  own_->group_size = static_cast<std::uint32_t>(group_size);
  own_->slot_bytes = layout_.slot_bytes;
  own_->arena_bytes = layout_.arena_bytes;
  own_->segment_bytes = layout_.segment_bytes;
  own_->owner_rank = rank_;
  own_->owner_pid = static_cast<std::int32_t>(::getpid());
  own_->owner_pid_namespace = my_pid_namespace;
  for (int sender = 0; sender < group_size; ++sender) {
    if (sender != my_index) new (own.bytes() + layout_.ring_offset(sender, my_index)) RingControl();
  }
  store.set(segment_key(rank_), to_bytes(own_name));

  // 2. Map every peer's inbox and check it was built by a compatible transport.
  for (int index = 0; index < group_size; ++index) {
    if (index == my_index) continue;
    int peer = group_[static_cast<std::size_t>(index)];
    std::string name;
    try {
      name = to_string(store.get(segment_key(peer), remaining()));
    } catch (const Error& e) {
      throw Error(e.kind(),
                  "rank " + std::to_string(peer) + " did not publish its segment: " + e.detail(),
                  rank_, peer, "shm transport setup");
    }
    unlinker.add(name);
    const Mapping& m =
        *(mappings_[static_cast<std::size_t>(index)] = open_segment(name, layout_, rank_, peer));
    const SegmentHeader& h = m.header();
    if (h.magic != kSegmentMagic || h.layout_version != kLayoutVersion ||
        h.group_size != static_cast<std::uint32_t>(group_size) ||
        h.slot_bytes != layout_.slot_bytes || h.arena_bytes != layout_.arena_bytes ||
        h.owner_rank != peer) {
      throw Error(ErrorKind::kProtocol,
                  "segment " + name + " does not hold rank " + std::to_string(peer) +
                      "'s inbox for this group (different gradsync builds or key prefixes?)",
                  rank_, peer, "shm transport setup");
    }
  }

  // 3. Barrier: once every rank has mapped every segment, the names are no longer needed.
  store.set(key_prefix + "/shm/mapped/" + std::to_string(rank_), to_bytes("1"));
  std::vector<std::string> mapped_keys;
  for (int r : group_) mapped_keys.push_back(key_prefix + "/shm/mapped/" + std::to_string(r));
  try {
    store.wait(mapped_keys, remaining());
  } catch (const Error& e) {
    throw Error(e.kind(), "not every rank mapped the group's segments: " + e.detail(), rank_,
                Error::kNoPeer, "shm transport setup");
  }
  unlinker.unlink_all();

  // 4. Wire up the arena and the links.
  if (static_cast<unsigned>(group_size) > usable_cores()) {
    yield_when_idle_ = true;
    message_spin_ = kOversubscribedMessageSpin;
    arena_spin_ = kOversubscribedArenaSpin;
  }
  if (long us = spin_us_setting(); us >= 0) {
    message_spin_ = arena_spin_ = std::chrono::microseconds(us);
  }
  group_control_ = &mappings_[0]->header().group;
  link_by_member_.assign(static_cast<std::size_t>(group_size), nullptr);
  for (const MappingPtr& m : mappings_) {
    headers_.push_back(&m->header());
    regions_.push_back(m->bytes() + layout_.arena_offset);
  }
  for (int index = 0; index < group_size; ++index) {
    if (index == my_index) continue;
    auto link = std::make_unique<PeerLink>();
    const Mapping& peer_segment = *mappings_[static_cast<std::size_t>(index)];
    link->rank = group_[static_cast<std::size_t>(index)];
    link->segment = &peer_segment.header();
    unsigned char* out = peer_segment.bytes() + layout_.ring_offset(my_index, index);
    link->out_ring = reinterpret_cast<RingControl*>(out);
    link->out_slots = out + layout_.control_bytes;
    unsigned char* in = own.bytes() + layout_.ring_offset(index, my_index);
    link->in_ring = reinterpret_cast<RingControl*>(in);
    link->in_slots = in + layout_.control_bytes;
    link->pid = static_cast<pid_t>(link->segment->owner_pid);
    bool same_namespace = link->segment->owner_pid_namespace == my_pid_namespace;
    link->pid_checkable = same_namespace && link->pid != ::getpid();
    if (link->pid_checkable) {
      link->pidfd = open_pidfd(link->pid);
      if (link->pidfd < 0 && errno == ESRCH) {
        throw Error(ErrorKind::kPeerLost,
                    "peer process " + std::to_string(link->pid) + " exited during setup", rank_,
                    link->rank, "shm transport setup");
      }
    }
    link_by_rank_[static_cast<std::size_t>(link->rank)] = link.get();
    link_by_member_[static_cast<std::size_t>(index)] = link.get();
    links_.push_back(std::move(link));
  }
}

}  // namespace

std::unique_ptr<Transport> make_shm_transport(Store& store, const std::string& key_prefix, int rank,
                                              int world_size, const std::vector<int>& group,
                                              const TransportOptions& options,
                                              std::chrono::milliseconds timeout) {
  auto invalid = [&](const std::string& why) {
    return Error(ErrorKind::kInvalidArgument, why, rank, Error::kNoPeer, "shm transport setup");
  };
  if (world_size <= 0 || rank < 0 || rank >= world_size) {
    throw invalid("rank " + std::to_string(rank) + " outside world of " +
                  std::to_string(world_size));
  }
  if (group.empty() || !std::is_sorted(group.begin(), group.end()) ||
      std::adjacent_find(group.begin(), group.end()) != group.end() || group.front() < 0 ||
      group.back() >= world_size) {
    throw invalid("group must be sorted distinct ranks in [0, " + std::to_string(world_size) + ")");
  }
  if (!std::binary_search(group.begin(), group.end(), rank)) {
    throw invalid("group does not contain this rank");
  }
  auto transport = std::make_unique<ShmTransport>(rank, world_size, group, options);
  transport->connect(store, key_prefix, timeout);
  return transport;
}

}  // namespace gradsync::transport
