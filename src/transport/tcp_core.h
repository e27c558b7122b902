// The tcp transport's shared state: Core (one per transport), its peers and their queued
// operations. Core's members are defined by job in the tcp_*.cc files named below.
//
// Data path. A send is queued on its peer and written with sendmsg (header and payload in
// one iovec list, several queued messages per call); the calling thread writes at once
// when nothing is queued. A message whose receive is already posted is read straight into
// the user buffer; one that arrives first ("unexpected") lands in a recycled buffer and is
// copied out when its receive is posted (a consuming receive reads it in place), and a
// receive posted while such a message is still arriving takes it over mid-stream (copying
// only the prefix). Headers and small payloads go through a staging buffer so a burst of
// small messages costs one recv().
//
// Progress. A thread waiting on a request does the socket I/O itself (Core::drive_locked):
// it reads the socket of the receive it waits for and writes whatever the send sockets did
// not take, polling briefly and then sleeping in poll(). The kernel then wakes the thread
// that needs the bytes, not the loop thread that would hand them over: one wake-up per
// message instead of two. The loop thread does everything no caller waits for (setup,
// strays, sends and receives while nobody waits, sockets callers left idle).
//
// Locking. One mutex (Core::mu_) guards all state; syscalls run without it. A thread doing
// I/O on a peer sets that peer's `writing`/`reading` flag first: whoever sets the flag is
// the only one touching the buffers of the operations in flight (and the only one in a
// syscall on that direction of the socket), and must, after the syscall, settle any
// failure or abort that arrived meanwhile. That rule is what lets an abort or a dropped
// request never free a buffer the kernel is still copying into. Who is responsible for a
// direction beyond one syscall is the peer's `read_side` and `write_side`; the loop's epoll
// interest in the socket follows from those two.
#pragma once

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "rendezvous/auth.h"
#include "rendezvous/socket.h"
#include "transport/frame.h"
#include "transport/tcp.h"
#include "transport/tcp_buffer_pool.h"

// Hidden: internals of the library, never called from outside it. That also lets GCC inline
// calls between them under -fPIC, which it does not do for functions a shared library could
// interpose.
#pragma GCC visibility push(hidden)
namespace gradsync::transport::tcp {

// Headers and payload remainders below kDirectReadMin (tcp_read.cc) are read through a
// staging buffer of this size: one recv() then serves many small messages, at the price of
// one copy of at most kStageBytes per message.
constexpr std::size_t kStageBytes = 64 * 1024;

// epoll ids of the loop's descriptors.
constexpr std::uint64_t kWakeId = 0;
constexpr std::uint64_t kListenerId = 1;
constexpr std::uint64_t kPeerIdBase = 2;                          // + global rank
constexpr std::uint64_t kPendingIdBase = std::uint64_t{1} << 32;  // + pending serial

// The eventfd of this thread, on which it sleeps in drive_locked's poll() so that another
// thread settling the operation it waits for can wake it; -1 if it has none yet.
int current_thread_waker();

enum class OpStatus { kPending, kDone, kFailed };

// Who reads a peer's socket (see Core::drive_locked).
enum class ReadSide : std::uint8_t {
  kLoop,    // the loop thread, on EPOLLIN
  kDriven,  // a caller waiting in drive_locked; EPOLLIN off
  kParked,  // nobody until the next wait; EPOLLIN off; the loop takes it back when idle
};

// Who writes the frames queued on a peer (see Core::flush_locked).
enum class WriteSide : std::uint8_t {
  // The threads that send or wait: a send writes its frame at once, and callers waiting in
  // drive_locked write what a full socket left over. EPOLLOUT off.
  kCallers,
  // The loop thread, on EPOLLOUT: a full socket left frames over that no waiting caller
  // was going to write (their writer does not watch the socket, the last watcher left, or
  // an abort relayed from inside a read queued them). A send only queues its frame behind
  // them; callers that start waiting take the socket back (kCallers).
  kLoop,
};

// How far the hello exchange with a peer got. The lower rank dials the higher.
enum class Handshake : std::uint8_t {
  kNoConnection,  // nothing yet: we wait for it to dial us (or are about to dial it)
  kHelloSent,     // we dialed it and sent our hello (our nonce); its challenge has not come
  kProofSent,     // its challenge proved the token and we sent our proof; its hello has not
                  // come, which says it accepted ours
  kDone,          // proofs and hellos exchanged: data may flow
};

// What one read_once_locked call did.
enum class ReadStep {
  kMore,     // the read filled what it asked for: there may be more
  kDrained,  // the socket has nothing more for now
  kClosed,   // the connection failed (sticky error set)
};

struct Failure {
  ErrorKind kind;
  std::string detail;
};

struct SendOp {
  frame::Type type = frame::Type::kData;
  Tag tag;
  std::uint8_t header[frame::kHeaderBytes];
  const std::uint8_t* data = nullptr;
  std::size_t bytes = 0;    // payload bytes
  std::size_t written = 0;  // header + payload bytes handed to the kernel
  // Payload copy for control frames and for sends whose request was dropped before they
  // finished (the frame must still complete, or the stream would desynchronise).
  std::vector<std::uint8_t> owned;
  OpStatus status = OpStatus::kPending;
  Failure failure;
  int waker = -1;  // eventfd of the thread sleeping in poll() until this op settles
  std::size_t total() const { return frame::kHeaderBytes + bytes; }
};

struct RecvOp {
  Tag tag;
  std::uint8_t* data = nullptr;  // the user's buffer, or owned.get() for a consuming receive
  std::size_t bytes = 0;
  // A consuming receive (irecv_consume) has no user buffer: it takes over the buffer the
  // message is arriving in, so the consumer reads the bytes where recv() put them.
  bool consume = false;
  Buffer owned;
  std::size_t received = 0;
  OpStatus status = OpStatus::kPending;
  Failure failure;
  int waker = -1;          // eventfd of the thread sleeping in poll() until this op settles
  bool abandoned = false;  // its request was destroyed: the matching message is discarded
  bool claimed = false;    // it is the destination of the message now arriving
};

// The message being read from one peer.
struct Incoming {
  bool in_header = true;
  std::uint8_t hdr[frame::kHeaderBytes];
  std::size_t hdr_got = 0;
  frame::Header h;
  std::size_t got = 0;              // payload bytes read so far
  std::shared_ptr<RecvOp> claimed;  // destination: a posted receive's buffer
  Buffer buffer;                    // destination: our own (unexpected or control)
  bool drain = false;               // destination: nowhere
};

struct Unexpected {
  Tag tag;
  Buffer data;
  std::size_t bytes = 0;
};

struct Peer {
  int rank = -1;
  std::string address = "?";  // host:port it listens on (from the store or its hello)
  int fd = -1;                // closed only by ~Core, after the loop thread has stopped
  Handshake handshake = Handshake::kNoConnection;
  std::string nonce;               // ours, sent in our hello when we dialed it
  std::optional<Failure> failure;  // sticky: connection lost or protocol violation

  std::deque<std::shared_ptr<SendOp>> sendq;
  bool writing = false;  // a thread is in sendmsg() for this peer without the lock
  WriteSide write_side = WriteSide::kCallers;
  int out_watchers = 0;     // waiting callers that write this socket's backlog (loop keeps off)
  bool in_backlog = false;  // listed in Core::backlog_
  bool abort_settled = false;

  std::deque<std::shared_ptr<RecvOp>> posted;  // never non-empty together with `unexpected`
  std::deque<Unexpected> unexpected;
  Incoming in;
  bool reading = false;  // a thread is in recv() on this connection without the lock
  ReadSide read_side = ReadSide::kLoop;
  Clock::time_point parked_since;  // when read_side became kParked
  bool in_unloaded = false;        // listed in Core::unloaded_

  PeerTraffic traffic;  // payload bytes of data frames only; headers and control frames excluded
  std::optional<std::string> probe_answer;  // its answer to our latest probe (explain_stall)

  bool ready() const { return handshake == Handshake::kDone; }
};

// An accepted connection that has not yet presented a valid hello.
// The handshake's proofs of the token (rendezvous/auth.h): what each side signs, and the
// connection they bind it to (the dialer's rank, then the acceptor's).
inline constexpr std::string_view kDialerRole = "gradsync tcp dialer";
inline constexpr std::string_view kAcceptorRole = "gradsync tcp acceptor";
inline std::string binding(std::uint32_t dialer, int acceptor) {
  return std::to_string(dialer) + "->" + std::to_string(acceptor);
}

struct Pending {
  net::Fd fd;
  std::string from;
  // Its hello and the nonce of our challenge, once it sent the hello; its proof comes next.
  std::optional<frame::Hello> hello;
  std::string nonce;
  std::uint8_t hdr[frame::kHeaderBytes];
  std::size_t hdr_got = 0;
  frame::Header h;
  std::vector<std::uint8_t> payload;
  std::size_t got = 0;
  std::chrono::steady_clock::time_point deadline;
};

class Core {
 public:
  Core(int rank, int world_size, const std::vector<int>& group, TransportOptions options);
  ~Core();

  // --- setup (constructor thread; tcp_setup.cc) -----------------------------------------

  void start(const TcpOptions& tcp);
  const std::string& address() const { return address_; }
  void attach_dialed(int peer, net::Fd fd, const std::string& address);
  void wait_ready(std::chrono::steady_clock::time_point deadline,
                  std::chrono::milliseconds timeout);
  void shutdown();  // tcp_failure.cc

  // --- operations (caller threads) ------------------------------------------------------

  std::shared_ptr<SendOp> post_send(int peer, const Tag& tag, const void* data,
                                    std::size_t bytes);  // tcp_write.cc
  // `consume`: the receive owns its buffer (see RecvOp::consume); `data` is ignored.
  std::shared_ptr<RecvOp> post_recv(int peer, const Tag& tag, void* data, std::size_t bytes,
                                    bool consume = false);  // tcp_read.cc
  void abort(const std::string& reason);                    // tcp_failure.cc
  StallReport explain_stall(Clock::duration grace);         // tcp_failure.cc

  PeerTraffic traffic(int peer) const {
    std::lock_guard lk(mu_);
    if (peer < 0 || peer >= world_size_ || !peers_[static_cast<std::size_t>(peer)]) return {};
    return peers_[static_cast<std::size_t>(peer)]->traffic;
  }

  // --- request support (caller threads) -------------------------------------------------

  template <typename Op>
  bool test(Op& op, int peer, const char* what) {
    std::lock_guard lk(mu_);
    // Not done: whatever it waits for must progress without a waiting caller.
    if (op.status == OpStatus::kPending && !unloaded_.empty()) reclaim_locked(/*all=*/true);
    return check_locked(op, peer, what);
  }

  // Defined (for SendOp and RecvOp) in tcp_progress.cc.
  template <typename Op>
  void wait(Op& op, int peer, const char* what, std::chrono::steady_clock::time_point deadline);

  // The request was destroyed before completing: make sure nothing touches its buffer.
  void abandon(RecvOp& op, int peer);  // tcp_read.cc
  void abandon(SendOp& op, int peer);  // tcp_write.cc

 private:
  struct Drive;  // what one drive_locked call holds (tcp_progress.cc)

  // --- small helpers (caller holds mu_ unless noted) ------------------------------------

  void wake() {
    std::uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_.get(), &one, sizeof one);
  }

  const Failure* failure_for(const Peer& p) const {
    if (abort_) return &*abort_;
    if (p.failure) return &*p.failure;
    return nullptr;
  }

  Error error_of(const Failure& f, int peer, const char* what, std::size_t bytes) const {
    return Error(f.kind, f.detail, rank_, peer, what, bytes);
  }

  template <typename Op>
  bool check_locked(Op& op, int peer, const char* what) const {
    if (op.status == OpStatus::kDone) return true;
    if (op.status == OpStatus::kFailed) throw error_of(op.failure, peer, what, op.bytes);
    return false;
  }

  static std::size_t progress(const SendOp& op) {
    return op.written > frame::kHeaderBytes ? op.written - frame::kHeaderBytes : 0;
  }
  static std::size_t progress(const RecvOp& op) { return op.received; }

  // Raises the waker of whoever sleeps in drive_locked's poll() on behalf of `op`, unless
  // that is this very thread.
  template <typename Op>
  void wake_waiter_locked(Op& op) {
    if (op.waker >= 0 && op.waker != current_thread_waker()) {
      std::uint64_t one = 1;
      [[maybe_unused]] ssize_t n = ::write(op.waker, &one, sizeof one);
    }
  }

  // Waits for an I/O flag to clear. The loop notifies io_cv_ only while someone waits,
  // so the data path pays nothing for this rare case.
  template <typename Pred>
  void io_wait_locked(std::unique_lock<std::mutex>& lk, Pred pred) {
    ++io_waiters_;
    io_cv_.wait(lk, pred);
    --io_waiters_;
  }
  void io_done_locked() {
    if (io_waiters_ > 0) io_cv_.notify_all();
  }

  // For a request being dropped: waits until no thread is in the syscall on `peer` that
  // could still touch its buffer (`in_syscall`: &Peer::reading or &Peer::writing), and
  // returns the peer.
  Peer& wait_out_syscall_locked(std::unique_lock<std::mutex>& lk, int peer,
                                bool Peer::*in_syscall) {
    Peer& p = *peers_[static_cast<std::size_t>(peer)];
    io_wait_locked(lk, [&] { return !(p.*in_syscall); });
    return p;
  }

  template <typename Op>
  void complete_locked(Op& op) {
    op.status = OpStatus::kDone;
    wake_waiter_locked(op);
    cv_.notify_all();
  }
  template <typename Op>
  void fail_locked(Op& op, const Failure& f) {
    if (op.status != OpStatus::kPending) return;
    op.status = OpStatus::kFailed;
    op.failure = f;
    wake_waiter_locked(op);
    cv_.notify_all();
  }

  // Who reads or writes `p`; the loop's epoll interest in the socket follows (EPOLLIN while
  // read_side is kLoop, EPOLLOUT while write_side is kLoop), so a change of side that
  // leaves that interest as it is costs no epoll_ctl. A failed peer is no longer
  // registered, and its write side stays as it was.
  void set_read_side_locked(Peer& p, ReadSide side) {
    const bool loop_changes = (p.read_side == ReadSide::kLoop) != (side == ReadSide::kLoop);
    p.read_side = side;
    if (loop_changes && !p.failure) watch_events_locked(p);
  }
  void set_write_side_locked(Peer& p, WriteSide side) {
    if (p.write_side == side || p.failure) return;
    p.write_side = side;
    watch_events_locked(p);
  }

  // Below, the members declared `inline` are steps cut out of hot paths to be named: each is
  // defined in, and called only from, its own .cc file, where that lets the compiler fold it
  // back into its caller as it did when the transport was one file.

  // --- connection set-up (tcp_setup.cc) -------------------------------------------------

  void choose_spin_locked();
  std::vector<std::uint8_t> my_hello(const std::string& nonce) const;
  void epoll_add(int fd, std::uint64_t id, std::uint32_t events);
  bool try_epoll_add(int fd, std::uint64_t id, std::uint32_t events);
  void accept_pending();
  void evict_pending();
  void refuse(const Pending& pc, const std::string& why);
  void close_listener();
  void on_pending(std::uint64_t id);
  std::string promote(Pending& pc, const frame::Hello& h);
  bool send_challenge(Pending& pc, const frame::Hello& h);
  void refuse_overdue_pending();

  // --- failures and the errors operations report (tcp_failure.cc) -----------------------

  Peer& peer_checked(int peer, const char* what, std::size_t bytes);
  std::string describe(const Tag& tag) const;
  Failure mismatch(const Tag& want, std::size_t want_bytes, const Tag& got,
                   std::size_t got_bytes) const;
  void apply_abort_locked(bool send_frames);
  void fail_peer_locked(Peer& p, const Failure& f);
  std::string status_locked() const;
  std::uint64_t motion_locked(const Peer& p) const;
  void on_probe_locked(Peer& p, std::span<const std::uint8_t> payload);
  void on_probe_answer_locked(Peer& p, std::span<const std::uint8_t> payload);

  // --- progress: waiting callers and the loop thread (tcp_progress.cc) ------------------

  template <typename Op>
  inline void drive_locked(Op& op, Peer& target, std::unique_lock<std::mutex>& lk,
                           Clock::time_point deadline);
  inline bool await_other_reader_locked(RecvOp& op, Peer& target, std::unique_lock<std::mutex>& lk,
                                        Clock::time_point deadline);
  inline void take_read_side_locked(Drive& d, Peer& q, std::unique_lock<std::mutex>& lk);
  inline void take_parked_locked(Drive& d, std::unique_lock<std::mutex>& lk);
  inline bool read_target_locked(Drive& d, std::unique_lock<std::mutex>& lk);
  inline bool read_driven_locked(Drive& d, std::unique_lock<std::mutex>& lk);
  inline bool collect_poll_set_locked(Drive& d);
  inline void sleep_in_poll_locked(Drive& d, int& waiter, Clock::time_point deadline,
                                   Clock::time_point now, std::unique_lock<std::mutex>& lk);
  inline void read_ready_sockets_locked(Drive& d, std::unique_lock<std::mutex>& lk);
  inline void prefer_abort_cause_locked(Failure& failure, std::unique_lock<std::mutex>& lk,
                                        std::uint8_t* stage);
  inline void park_driven_locked(Drive& d);
  inline void unwatch_locked(Drive& d);
  void drain_locked(Peer& p, std::unique_lock<std::mutex>& lk);
  void sweep_locked(std::unique_lock<std::mutex>& lk, std::uint8_t* stage);
  void reclaim_locked(bool all);
  void watch_events_locked(Peer& p);
  void loop();
  void run_loop();
  inline int reclaim_and_pick_timeout();
  inline bool on_wake();
  void on_readable(Peer& p, std::uint32_t events);

  // --- the write side (tcp_write.cc) ----------------------------------------------------

  bool write_backlog_locked(std::unique_lock<std::mutex>& lk, std::vector<Peer*>& watched);
  void queue_control_locked(Peer& p, frame::Type type, std::vector<std::uint8_t> payload);
  std::size_t flush_locked(Peer& p, std::unique_lock<std::mutex>& lk, bool watching = false);
  inline void advance_sends_locked(Peer& p, std::size_t n);
  inline void finish_send_locked(Peer& p, std::shared_ptr<SendOp> op);
  void fail_sends_locked(Peer& p, const Failure& f);
  void settle_sends_after_abort_locked(Peer& p, bool send_frame);

  // --- the read side (tcp_read.cc) ------------------------------------------------------

  ReadStep read_once_locked(Peer& p, std::unique_lock<std::mutex>& lk, std::uint8_t* stage);
  ReadStep read_frames_locked(Peer& p, std::unique_lock<std::mutex>& lk, std::uint8_t* stage);
  void apply_peer_abort_locked(std::unique_lock<std::mutex>& lk, std::uint8_t* stage);
  inline void settle_claimed_locked(Peer& p);
  inline void consume_locked(Peer& p, const std::uint8_t* data, std::size_t n);
  void on_header_locked(Peer& p);
  void claim_locked(Peer& p);
  void finish_message_locked(Peer& p);
  bool accept_hello_locked(Peer& p, std::span<const std::uint8_t> payload);
  bool answer_challenge_locked(Peer& p, std::span<const std::uint8_t> payload);
  void on_abort_frame_locked(Peer& p, std::span<const std::uint8_t> payload);
  void fail_recvs_locked(Peer& p, const Failure& f);

  // --- state ----------------------------------------------------------------------------

  // The transport's life: what the loop does at its next wake-up.
  enum class Phase : std::uint8_t {
    kSetup,     // peers are connecting: the listener stays open
    kRunning,   // every peer connected: the loop closes the listener and strays
    kStopping,  // destruction: the loop thread exits
  };

  const int rank_;
  const int world_size_;
  const TransportOptions options_;
  std::string address_;  // written before the loop starts, then read-only
  TcpOptions tcp_;       // as start() was given it; then read-only

  // Declared before everything that holds its buffers (peers_, and the receive ops the
  // peers hold), so it is destroyed after them.
  BufferPool pool_;
  mutable std::mutex mu_;
  std::condition_variable cv_;     // an operation completed or failed; a peer became ready
  std::condition_variable io_cv_;  // a reading/writing flag cleared (abandon waits for it)
  int io_waiters_ = 0;
  std::vector<std::unique_ptr<Peer>> peers_;  // by global rank; null for self and non-members
  std::optional<Failure> abort_;              // sticky, transport-wide
  std::vector<std::uint8_t> abort_payload_;
  bool abort_send_frames_ = false;
  int abort_origin_ = -1;  // the peer whose abort frame we relay (it gets none back)
  // A peer's abort is recorded (abort_) but posted receives not yet failed: what already
  // arrived on the other sockets is read first (apply_peer_abort_locked, `sweeping`).
  bool peer_abort_unapplied_ = false;
  bool peer_abort_sweeping_ = false;
  Phase phase_ = Phase::kSetup;
  std::uint64_t probe_nonce_ = 0;  // number of our latest probe (explain_stall)
  std::optional<Tag> last_tag_;    // of the latest operation posted, for probe answers
  // The wait that timed out last (its request is dropped by then), for probe answers.
  struct TimedOut {
    Tag tag;
    int peer = -1;
    bool send = false;
  };
  std::optional<TimedOut> timed_out_;

  std::chrono::nanoseconds spin_{0};  // see choose_spin (tcp_tuning.h); set before any operation
  bool spin_yield_ = false;
  std::vector<Peer*> backlog_;   // peers with queued frames the socket did not take
  std::vector<Peer*> unloaded_;  // peers whose read_side is not kLoop
  bool loop_sleeps_ = false;     // the loop is in epoll_wait without a timeout

  // Loop thread only (after start()).
  net::Fd listener_, epoll_, wake_;
  std::map<std::uint64_t, Pending> pending_;
  std::uint64_t next_pending_ = 0;
  std::uint64_t refused_ = 0;  // connections refused as not a peer (see Core::refuse)
  std::vector<std::uint8_t> stage_;
  std::thread thread_;
};

}  // namespace gradsync::transport::tcp
#pragma GCC visibility pop
