// The ucx transport's internals, shared by its files: ucx.cc (messages, waits, failures, the
// arena's waits) and ucx_setup.cc (UCX's context and worker, cards, connections, hellos, the
// arena's mappings). See ucx.h for what it offers and ucx.cc for how it works.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "transport/tcp_tuning.h"
#include "transport/ucx.h"
#include "transport/ucx_arena.h"
#include "transport/ucx_library.h"

#pragma GCC visibility push(hidden)
namespace gradsync::transport::ucx {

// Tag layout: kind (2 bits) | sender rank (22 bits) | sequence number (40 bits).
enum class Kind : std::uint64_t { kData = 0, kAbort = 1, kHello = 2 };
constexpr int kKindShift = 62;
constexpr int kRankShift = 40;
constexpr std::uint64_t kSeqMask = (std::uint64_t{1} << kRankShift) - 1;
constexpr std::uint64_t kKindMask = std::uint64_t{3} << kKindShift;
constexpr std::uint64_t kFullMask = ~std::uint64_t{0};
constexpr int kMaxRanks = 1 << 22;

inline std::uint64_t ucx_tag(Kind kind, int sender, std::uint64_t seq) {
  return (static_cast<std::uint64_t>(kind) << kKindShift) |
         (static_cast<std::uint64_t>(sender) << kRankShift) | (seq & kSeqMask);
}
inline int sender_of(std::uint64_t tag) {
  return static_cast<int>((tag & ~kKindMask) >> kRankShift);
}

constexpr std::uint64_t kHeaderMagic = 0x6772616473796e63ull;  // "gradsync"
struct WireHeader {
  Tag tag;
  std::uint64_t bytes = 0;
  std::uint64_t magic = kHeaderMagic;
};
static_assert(sizeof(WireHeader) == 48);

constexpr std::size_t kAbortTextMax = 4096;

inline std::string ucx_error(const char* what, ucs_status_t status) {
  return std::string(what) + ": " + ucx_library().ucs_status_string(status);
}

// One posted send or receive. Owned jointly by its Request and, while UCX holds it, by the
// transport (`inflight_`), so a completion that arrives after the Request was dropped still
// lands in live memory.
struct Op {
  int peer = -1;
  bool send = false;
  bool data = true;       // a data message (hellos are not counted as traffic)
  bool finished = false;  // checked and counted
  Tag tag;
  std::size_t bytes = 0;
  WireHeader header;
  ucp_dt_iov_t iov[2] = {};
  void* request = nullptr;  // UCX's, until completion
  bool done = false;
  ucs_status_t status = UCS_OK;
  std::size_t received = 0;  // bytes UCX delivered (header included)
  std::string text;          // an abort notice's own copy of its reason
};
using OpPtr = std::shared_ptr<Op>;

class UcxTransport;

// What UCX's peer-failure callback needs to find its peer.
struct EndpointContext {
  UcxTransport* transport;
  int peer;
};

class UcxTransport final : public Transport, ucx::ArenaWaitChecks {
 public:
  UcxTransport(int rank, int world_size, const std::vector<int>& group, TransportOptions options,
               const UcxOptions& ucx);
  ~UcxTransport() override;

  int rank() const override { return rank_; }
  int size() const override { return world_size_; }
  const char* name() const override { return "ucx"; }
  RequestPtr isend(int peer, const Tag& tag, const void* data, std::size_t bytes) override;
  RequestPtr irecv(int peer, const Tag& tag, void* data, std::size_t bytes) override;
  void abort(const std::string& reason) override;
  PeerTraffic traffic(int peer) const override;
  SharedArena* shared_arena() override { return arena_.get(); }

  // Setup, in make_ucx_transport's order.
  // What peers need to reach this rank: its process, UCX worker address and, where it has
  // arena memory, that memory's address and packed rkey.
  Bytes card() const;
  void connect(int peer, const Bytes& card);
  void exchange_hellos(const std::vector<int>& peers, Clock::time_point deadline,
                       std::chrono::milliseconds timeout);
  // Maps every peer's arena memory (connect() kept their rkeys) and offers the arena if every
  // rank of the world could: the ranks tell each other in a second round of hellos, since the
  // collectives take the arena's algorithm only where every rank has it.
  void set_up_arena(const std::vector<int>& peers, Clock::time_point deadline,
                    std::chrono::milliseconds timeout);
  // How waiters poll, once connect() has seen which peers share this machine's cores.
  void choose_spin(int spin_us) {
    spin_ = tcp::choose_spin(static_cast<unsigned>(1 + watched_.size()), spin_us);
  }

  bool test(Op& op);
  void wait(Op& op, Clock::time_point deadline);
  // A request dropped before it completed: its receive buffer may be gone, so UCX must not
  // fill it.
  void abandon(Op& op);

 private:
  friend struct Callbacks;
  // One round of hellos: a message of one byte (`own`) to and from every peer (`theirs`).
  void hello_round(const std::vector<int>& peers, std::uint64_t round, std::uint8_t own,
                   std::vector<std::uint8_t>& theirs, Clock::time_point deadline,
                   std::chrono::milliseconds timeout);
  bool arena_wait_over(int member, std::uint64_t value, const Tag& call, Clock::time_point deadline,
                       bool check_process) override;
  // A data message that waits unmatched (none is expected while every rank runs an arena
  // collective): its sender, call and size, taken off UCX's queue.
  std::optional<std::string> stray_message_locked(int& sender);
  void check_peer(int peer, const char* what) const;
  OpPtr post(int peer, bool send, const Tag& tag, void* data, std::size_t bytes, Kind kind,
             std::uint64_t seq);
  // Completes `op` (true) or throws if it failed; false while pending. Needs mu_.
  bool finish_locked(Op& op);
  [[noreturn]] void throw_failure_locked(Op& op);
  // Aborts the transport with `error` (or, if it is aborted already, quiesces it) and throws it.
  [[noreturn]] void fail_locked(const Error& error);
  void abort_locked(const std::string& reason);
  // After an abort: closes every endpoint at once and ends every receive, then progresses
  // until UCX holds no request of this rank's, so that no buffer a caller releases after the
  // error is touched again. Bounded (200 ms): if UCX still holds a request then (shared memory
  // cannot cancel a rendezvous send), the transport is frozen_.
  void quiesce_locked();
  // Progresses until every request of `requests` and of inflight_ has completed (true), or
  // deadline (false).
  bool settle_locked(const std::vector<void*>& requests, Clock::time_point deadline);
  // ucp_worker_progress, unless the transport is frozen_.
  unsigned progress_locked() { return frozen_ ? 0 : lib_.ucp_worker_progress(worker_); }
  // Ends every receive UCX still holds (abandoned ones, the standing abort receive).
  void cancel_receives_locked();
  // Messages that arrived for no receive (an abort cut the job short): taken off UCX's
  // queue, which would otherwise warn about each one as the worker goes.
  void discard_unexpected_locked(Clock::time_point deadline);
  void post_abort_receive_locked();
  void on_abort_message_locked(std::uint64_t sender_tag, std::size_t length);
  void on_peer_failure_locked(int peer, ucs_status_t status);
  // Peers UCX cannot watch (its shared memory has no peer-failure handling): their
  // processes, through pidfds that also wake a sleeping waiter.
  void check_watched_locked();
  // Progresses until every op in `ops` is done or `deadline`; true if all are.
  bool drain_locked(const std::vector<OpPtr>& ops, Clock::time_point deadline);
  std::string describe(const Tag& tag) const {
    return options_.format_tag ? options_.format_tag(tag) : default_format_tag(tag);
  }

  const UcxLibrary& lib_;
  int rank_;
  int world_size_;
  TransportOptions options_;
  tcp::SpinPolicy spin_;  // set by choose_spin()
  std::vector<bool> member_;

  mutable std::mutex mu_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;  // -1: the worker cannot sleep on a fd; waiters back off instead
  Bytes address_;
  std::vector<ucp_ep_h> endpoints_;
  std::vector<std::unique_ptr<EndpointContext>> endpoint_contexts_;
  std::vector<std::uint64_t> send_seq_, recv_seq_;
  std::vector<PeerTraffic> traffic_;
  std::vector<std::optional<std::string>> lost_;  // why each lost peer was lost
  std::map<Op*, OpPtr> inflight_;
  struct Watched {
    int peer;
    pid_t pid;
    int pidfd;  // -1: checked through /proc
  };
  std::vector<Watched> watched_;
  std::optional<std::string> abort_;  // sticky
  std::vector<char> abort_text_;
  OpPtr abort_receive_;
  bool quiesced_ = false;
  // An abort left requests in UCX that it could not end (a rendezvous send to a live peer over
  // shared memory, which has no forced cancel): their buffers may be released by the caller,
  // so nothing progresses the worker again and UCX never reads or fills them.
  bool frozen_ = false;

  // Adds one to an eventfd, waking whoever polls it. A write to an eventfd below its limit
  // does not fail; every caller has a bounded sleep behind it in case it did.
  static void bump_eventfd(int fd) {
    const std::uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(fd, &one, sizeof one);
  }
  // Background progress: a rank that waits on another transport (the shm ring of a
  // hierarchical job) still answers UCX's rendezvous for its large sends, as the tcp
  // transport's epoll thread does. It sleeps on the worker's event fd, but only while no
  // caller drives the worker: see progress_loop().
  void progress_loop();
  // Whether callers drove the worker since the last look: one is in wait(), or some called
  // wait() or test() since. Read without mu_, which a spinning waiter holds.
  bool callers_drive();
  std::atomic<int> waiters_{0};           // callers in wait()
  std::atomic<std::uint64_t> drives_{0};  // wait() and test() calls so far
  std::uint64_t drives_seen_ = 0;         // by the progress thread's last look
  static constexpr int kParkLook = 10;    // milliseconds
  // Messages from this size on unpark the thread: a wake-up each, little against their time.
  static constexpr std::size_t kUnparkBytes = std::size_t{1} << 20;
  std::atomic<bool> parked_{false};
  int unpark_fd_ = -1;  // eventfd: written by post() to unpark
  std::thread progress_thread_;
  int stop_fd_ = -1;
  bool stopping_ = false;
  Op* sleeping_on_ = nullptr;  // the op of the waiter in poll(), if one sleeps
  int wake_fd_ = -1;           // eventfd: written when that op is done, lost or aborted
  // Wakes the sleeping waiter if its op is done or its peer lost, or `always` (abort).
  void wake_waiter_locked(bool always);

  // The shared arena (ucx_arena.h), where every rank of the world is on this machine.
  std::unique_ptr<ucx::ArenaMemory> arena_memory_;  // this rank's, until set_up_arena decides
  struct PeerRkey {
    std::vector<std::uint8_t> packed;
    std::uint64_t address = 0;
  };
  std::vector<std::optional<PeerRkey>> peer_rkeys_;  // from connect(), for set_up_arena
  std::vector<std::unique_ptr<ucx::PeerArena>> peer_arenas_;
  std::unique_ptr<ucx::Arena> arena_;
  std::vector<std::uint8_t> hello_byte_;     // what the hellos in flight send
  std::vector<std::uint8_t> stray_message_;  // see stray_message_locked
};

struct Callbacks {
  static void sent(void* request, ucs_status_t status, void* user_data) {
    complete(request, status, 0, user_data);
  }
  static void received(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                       void* user_data) {
    complete(request, status, info ? info->length : 0, user_data);
  }
  static void complete(void* request, ucs_status_t status, std::size_t length, void* user_data) {
    auto* op = static_cast<Op*>(user_data);
    op->done = true;
    op->status = status;
    op->received = length;
    op->request = nullptr;
    ucx_library().ucp_request_free(request);
  }
  static void peer_failed(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* ctx = static_cast<EndpointContext*>(arg);
    ctx->transport->on_peer_failure_locked(ctx->peer, status);  // runs inside progress
  }
};

}  // namespace gradsync::transport::ucx
#pragma GCC visibility pop
