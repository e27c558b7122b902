// TCP transport: one connection per peer pair, non-blocking sockets progressed by the
// threads that wait on them and by one epoll thread per transport, token handshake, sticky
// per-peer errors and abort frames.
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
// Locking. One mutex (Core::mu) guards all state; syscalls run without it. A thread doing
// I/O on a peer sets that peer's `writing`/`reading` flag first: whoever sets the flag is
// the only one touching the buffers of the operations in flight (and the only one in a
// syscall on that direction of the socket), and must, after the syscall, settle any
// failure or abort that arrived meanwhile. That rule is what lets an abort or a dropped
// request never free a buffer the kernel is still copying into.
#include "transport/tcp.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>

#include "rendezvous/socket.h"
#include "transport/frame.h"

namespace gradsync::transport {

namespace {

// Headers and payload remainders below kDirectReadMin are read through a staging buffer
// of this size: one recv() then serves many small messages, at the price of one copy of
// at most kStageBytes per message.
constexpr std::size_t kStageBytes = 64 * 1024;
constexpr std::size_t kDirectReadMin = 16 * 1024;
// iovecs per sendmsg: enough to batch dozens of small messages per syscall; far below
// the kernel's IOV_MAX (1024).
constexpr int kMaxIov = 64;
// A real peer sends its hello right after connecting; anything silent this long is not one.
constexpr auto kHelloTimeout = std::chrono::seconds(10);
// Unidentified connections held at once; more are closed at accept so garbage cannot
// exhaust file descriptors.
constexpr std::size_t kMaxPendingConnections = 256;
// Reads per readiness event on one peer before serving the others (fairness).
constexpr int kReadsPerEvent = 32;
// A socket a caller read stays with callers this long after its last wait before the
// loop reads it again (see Core::drive_locked); also the loop's tick while any is parked.
constexpr auto kParkedReclaim = std::chrono::milliseconds(10);
// How long destruction waits for queued frames to drain (see Core::shutdown).
constexpr auto kShutdownLinger = std::chrono::seconds(1);

constexpr std::uint64_t kWakeId = 0;
constexpr std::uint64_t kListenerId = 1;
constexpr std::uint64_t kPeerIdBase = 2;                          // + global rank
constexpr std::uint64_t kPendingIdBase = std::uint64_t{1} << 32;  // + pending serial

// GRADSYNC_TCP_SOCKBUF_BYTES: SO_SNDBUF/SO_RCVBUF for every connection. 0 (default)
// leaves the kernel's autotuning on, which on Linux grows buffers past what a fixed
// setsockopt may (net.core.[rw]mem_max caps explicit sizes).
int socket_buffer_bytes() {
  static const int value = static_cast<int>(
      tuning_setting("GRADSYNC_TCP_SOCKBUF_BYTES", "0: kernel autotuning").value_or(0));
  return value;
}

// GRADSYNC_TCP_SPIN_US: how long a waiting caller keeps polling its sockets before it
// sleeps in poll(). Polling sees bytes without a wake-up, and a wake-up costs more than a
// small message (2-core VM, 4 KiB all-reduce: 2 ranks 29 us without polling, 11 us with
// it). When this host has a core for every local rank of the transport, it polls for
// kBusySpin; when ranks share cores, for kYieldSpin with sched_yield() between tries, so
// the ranks sharing the core run meanwhile (as Open MPI does when oversubscribed; 4 ranks
// on 2 cores: 69 -> 35 us). The variable overrides the duration; 0 turns polling off.
constexpr auto kBusySpin = std::chrono::microseconds(50);
constexpr auto kYieldSpin = std::chrono::microseconds(100);
long spin_us_setting() {
  static const long value =
      tuning_setting("GRADSYNC_TCP_SPIN_US", std::to_string(kBusySpin.count()) + ", or " +
                                                 std::to_string(kYieldSpin.count()) +
                                                 " yielding when ranks share cores")
          .value_or(-1);
  return value;
}

// GRADSYNC_TCP_LIVENESS_S: a peer whose host stops answering (link down, host powered off:
// no FIN or RST ever comes) is declared lost after about this many seconds, by the kernel:
// keepalive probes on an idle connection, TCP_USER_TIMEOUT on one with unacknowledged data.
// A peer that is only slow (computing, descheduled) still answers at the TCP level, so this
// does not fire for it. 0 turns it off (then only GRADSYNC_TIMEOUT ends such a wait).
int liveness_s() {
  static const int value =
      static_cast<int>(tuning_setting("GRADSYNC_TCP_LIVENESS_S", "15").value_or(15));
  return value;
}

void set_liveness(int fd) {
  const int limit = liveness_s();
  if (limit <= 0) return;
  int on = 1, idle = std::max(1, limit / 3), interval = 1, probes = std::max(1, limit - idle);
  unsigned user_timeout_ms = static_cast<unsigned>(limit) * 1000u;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof interval);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes);
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof user_timeout_ms);
}

void tune_socket(int fd) {
  net::set_nodelay(fd);
  set_liveness(fd);
  if (int b = socket_buffer_bytes(); b > 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &b, sizeof b);
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof b);
  }
}

// Buffers for messages that arrive before their receive is posted, and for consuming
// receives, are recycled. A fresh large allocation is fresh memory: one page fault and one
// zeroed page per 4 KiB when recv() first writes it, and an unmap when it is freed. In a
// 4-rank 64 MiB ring (every reduce-scatter piece lands in such a buffer) that tripled the
// page faults of the whole run and cost more CPU than the reductions.
class BufferPool {
 public:
  // Returns a buffer to its pool (or the heap) when the owning pointer dies.
  struct Release {
    BufferPool* pool = nullptr;  // null: plain delete[]
    std::size_t capacity = 0;
    void operator()(std::uint8_t* p) const noexcept {
      if (pool) {
        pool->put(p, capacity);
      } else {
        delete[] p;
      }
    }
  };
  using Buffer = std::unique_ptr<std::uint8_t[], Release>;

  // A buffer of at least `bytes` bytes, contents undefined; empty when out of memory.
  // Any thread.
  Buffer get(std::size_t bytes) {
    if (bytes < kMinPooledBytes) return Buffer(new (std::nothrow) std::uint8_t[bytes], Release{});
    {
      std::lock_guard lk(mu_);
      // Best fit among cached buffers, but never one much larger than asked for, so a
      // burst of small messages cannot pin the big buffers a large message needs.
      std::size_t best = free_.size();
      for (std::size_t i = 0; i < free_.size(); ++i) {
        std::size_t c = free_[i].capacity;
        if (c >= bytes && c <= bytes + bytes / 4 + kRoundBytes &&
            (best == free_.size() || c < free_[best].capacity)) {
          best = i;
        }
      }
      if (best != free_.size()) {
        Cached c = std::move(free_[best]);
        free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
        cached_bytes_ -= c.capacity;
        return Buffer(c.data.release(), Release{this, c.capacity});
      }
    }
    // Rounded up so the slightly different sizes of one collective's pieces share buffers.
    std::size_t capacity = (bytes + kRoundBytes - 1) / kRoundBytes * kRoundBytes;
    return Buffer(new (std::nothrow) std::uint8_t[capacity], Release{this, capacity});
  }

 private:
  // Below this, malloc serves from its own caches without touching fresh pages.
  static constexpr std::size_t kMinPooledBytes = 32 * 1024;
  static constexpr std::size_t kRoundBytes = 4096;
  // Cached memory per transport: a few dozen ring pieces in flight at the default 256 KiB
  // chunk, or one 32 MiB message; beyond that the oldest cached buffers are freed.
  static constexpr std::size_t kMaxCachedBytes = 32 * 1024 * 1024;

  struct Cached {
    std::unique_ptr<std::uint8_t[]> data;
    std::size_t capacity = 0;
  };

  void put(std::uint8_t* p, std::size_t capacity) noexcept {
    Cached released{std::unique_ptr<std::uint8_t[]>(p), capacity};
    if (capacity > kMaxCachedBytes) return;
    std::lock_guard lk(mu_);
    try {
      free_.push_back(std::move(released));
    } catch (...) {
      return;  // no memory for the list entry: the buffer is simply freed
    }
    cached_bytes_ += capacity;
    while (cached_bytes_ > kMaxCachedBytes) {  // oldest first
      cached_bytes_ -= free_.front().capacity;
      free_.erase(free_.begin());
    }
  }

  std::mutex mu_;             // leaf lock: taken under Core::mu_ or alone
  std::vector<Cached> free_;  // oldest first
  std::size_t cached_bytes_ = 0;
};
using Buffer = BufferPool::Buffer;

// Each thread that waits in Core::drive_locked sleeps in poll() on its own eventfd as well,
// so that another thread settling the operation it waits for can wake it.
struct ThreadWaker {
  int fd = -1;
  ~ThreadWaker() {
    if (fd >= 0) ::close(fd);
  }
};
thread_local ThreadWaker t_waker;
int thread_waker() {  // -1 if no eventfd could be made (drive_locked then polls in slices)
  if (t_waker.fd < 0) t_waker.fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  return t_waker.fd;
}
int current_thread_waker() {
  return t_waker.fd;
}
// True on a transport's loop thread (each serves one Core).
thread_local bool t_in_loop_thread = false;

enum class OpStatus { kPending, kDone, kFailed };

// Who reads a peer's socket (see Core::drive_locked).
enum class ReadSide : std::uint8_t {
  kLoop,    // the loop thread, on EPOLLIN
  kDriven,  // a caller waiting in drive_locked; EPOLLIN off
  kParked,  // nobody until the next wait; EPOLLIN off; the loop takes it back when idle
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
  std::string address = "?";       // host:port it listens on (from the store or its hello)
  int fd = -1;                     // closed only by ~Core, after the loop thread has stopped
  bool ready = false;              // handshake complete
  bool dialed = false;             // we connected to it (for setup error messages)
  std::optional<Failure> failure;  // sticky: connection lost or protocol violation

  std::deque<std::shared_ptr<SendOp>> sendq;
  bool writing = false;     // a thread is in sendmsg() for this peer without the lock
  bool out_armed = false;   // EPOLLOUT registered with the loop
  bool in_armed = true;     // EPOLLIN registered with the loop (off unless read_side is kLoop)
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
};

// An accepted connection that has not yet presented a valid hello.
struct Pending {
  net::Fd fd;
  std::string from;
  std::uint8_t hdr[frame::kHeaderBytes];
  std::size_t hdr_got = 0;
  frame::Header h;
  std::vector<std::uint8_t> payload;
  std::size_t got = 0;
  std::chrono::steady_clock::time_point deadline;
};

std::string peer_name_of(const sockaddr_storage& ss) {
  char host[64] = "?";
  int port = 0;
  if (ss.ss_family == AF_INET) {
    auto* a = reinterpret_cast<const sockaddr_in*>(&ss);
    ::inet_ntop(AF_INET, &a->sin_addr, host, sizeof host);
    port = ntohs(a->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    auto* a = reinterpret_cast<const sockaddr_in6*>(&ss);
    ::inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof host);
    port = ntohs(a->sin6_port);
  }
  return net::join_host_port(host, port);
}

class Core {
 public:
  Core(int rank, int world_size, const std::vector<int>& group, TransportOptions options)
      : rank_(rank),
        world_size_(world_size),
        options_(std::move(options)),
        peers_(static_cast<std::size_t>(world_size)),
        stage_(kStageBytes) {
    for (int r : group) {
      if (r == rank) continue;
      peers_[static_cast<std::size_t>(r)] = std::make_unique<Peer>();
      peers_[static_cast<std::size_t>(r)]->rank = r;
    }
  }

  ~Core() {
    for (auto& p : peers_) {
      if (p && p->fd >= 0) ::close(p->fd);
    }
  }

  // --- setup (constructor thread) -----------------------------------------------------

  void start(const TcpOptions& tcp) {
    listener_ = net::listen_tcp(tcp.bind_addr, 0, /*nonblocking=*/true);
    std::string host = tcp.advertise_addr.empty() ? net::default_advertise_address(tcp.bind_addr)
                                                  : tcp.advertise_addr;
    address_ = net::join_host_port(host, net::local_port(listener_.get()));
    epoll_ = net::Fd(::epoll_create1(EPOLL_CLOEXEC));
    wake_ = net::Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!epoll_.valid() || !wake_.valid()) sys_error("epoll/eventfd");
    epoll_add(wake_.get(), kWakeId, EPOLLIN);
    epoll_add(listener_.get(), kListenerId, EPOLLIN);
    thread_ = std::thread([this] { loop(); });
  }

  const std::string& address() const { return address_; }

  // Hands a connected socket to the loop and sends our hello; the peer is ready once its
  // hello comes back.
  void attach_dialed(int peer, net::Fd fd, const std::string& address) {
    net::set_nonblocking(fd.get());
    tune_socket(fd.get());
    std::unique_lock lk(mu_);
    Peer& p = *peers_[static_cast<std::size_t>(peer)];
    p.address = address;
    p.dialed = true;
    p.fd = fd.release();
    epoll_add(p.fd, kPeerIdBase + static_cast<std::uint64_t>(peer), EPOLLIN);
    queue_control_locked(p, frame::Type::kHello, my_hello());
    flush_locked(p, lk);
  }

  // Blocks until every peer completed the handshake; throws naming the peers that did not.
  void wait_ready(std::chrono::steady_clock::time_point deadline,
                  std::chrono::milliseconds timeout) {
    std::unique_lock lk(mu_);
    auto settled = [&] {
      for (auto& p : peers_) {
        if (p && !p->ready && !p->failure) return false;
      }
      return true;
    };
    bool ok = cv_.wait_until(lk, deadline, settled);
    for (auto& p : peers_) {
      // A peer that failed after its handshake may simply have finished and exited;
      // its messages stay deliverable, so only a failed handshake is a setup error.
      if (p && p->failure && !p->ready) {
        throw Error(p->failure->kind, p->failure->detail, rank_, p->rank, "tcp connect");
      }
    }
    if (!ok) {
      std::string missing;
      for (auto& p : peers_) {
        if (!p || p->ready) continue;
        missing += missing.empty() ? "" : "; ";
        missing += "rank " + std::to_string(p->rank) +
                   (p->dialed ? " at " + p->address + " connected but sent no handshake reply"
                              : " never connected to " + address_);
      }
      throw Error(
          ErrorKind::kTimeout,
          "transport setup took longer than " + std::to_string(timeout.count()) + " ms: " + missing,
          rank_, Error::kNoPeer, "tcp connect");
    }
    setup_over_ = true;  // the loop closes the listener and strays at its next wake-up
    choose_spin_locked();
    wake();
  }

  // Sets spin_ and spin_yield_ (see spin_us_setting). The ranks on this host are the peers
  // that advertise our host name.
  void choose_spin_locked() {
    auto host_of = [](const std::string& address) {
      try {
        return net::split_host_port(address).first;
      } catch (const Error&) {
        return std::string();
      }
    };
    const std::string mine = host_of(address_);
    unsigned local = 1;
    for (auto& p : peers_) {
      if (p && host_of(p->address) == mine) ++local;
    }
    spin_yield_ = local > usable_cores();
    long us = spin_us_setting();
    if (us >= 0) {
      spin_ = std::chrono::microseconds(us);
    } else {
      spin_ = spin_yield_ ? kYieldSpin : kBusySpin;
    }
  }

  // Stops the loop thread, then fails whatever is still pending. Idempotent.
  void shutdown() {
    {
      std::unique_lock lk(mu_);
      if (stopping_) return;
      // Frames still queued (an abort frame, sends whose requests were dropped) get a
      // bounded chance to leave, so peers learn "aborted" rather than "connection lost".
      auto queued = [&] {
        for (auto& p : peers_) {
          if (p && !p->failure && !p->sendq.empty()) return true;
        }
        return false;
      };
      auto linger_end = std::chrono::steady_clock::now() + kShutdownLinger;
      while (queued() && std::chrono::steady_clock::now() < linger_end) {
        cv_.wait_for(lk, std::chrono::milliseconds(5));  // polled: a rare, bounded path
      }
      stopping_ = true;
    }
    if (thread_.joinable()) {
      wake();
      thread_.join();
    }
    std::lock_guard lk(mu_);
    Failure f{ErrorKind::kAborted, "the tcp transport was destroyed"};
    for (auto& p : peers_) {
      if (!p) continue;
      fail_peer_locked(*p, f);
      if (p->fd >= 0) ::shutdown(p->fd, SHUT_RDWR);
    }
  }

  // --- operations (caller threads) ----------------------------------------------------

  std::shared_ptr<SendOp> post_send(int peer, const Tag& tag, const void* data, std::size_t bytes) {
    auto op = std::make_shared<SendOp>();
    op->tag = tag;
    op->data = static_cast<const std::uint8_t*>(data);
    op->bytes = bytes;
    frame::encode_header(frame::Header{frame::Type::kData, tag, bytes}, op->header);
    std::unique_lock lk(mu_);
    Peer& p = peer_checked(peer, "send", bytes);
    if (const Failure* f = failure_for(p)) throw error_of(*f, peer, "send", bytes);
    p.sendq.push_back(op);
    // Write from this thread when the loop is not already busy with this socket: saves
    // a thread hand-off for small messages, and large ones just fill the socket buffer.
    if (!p.out_armed) flush_locked(p, lk);
    return op;
  }

  // `consume`: the receive owns its buffer (see RecvOp::consume); `data` is ignored.
  std::shared_ptr<RecvOp> post_recv(int peer, const Tag& tag, void* data, std::size_t bytes,
                                    bool consume = false) {
    auto op = std::make_shared<RecvOp>();
    op->tag = tag;
    op->data = static_cast<std::uint8_t*>(data);
    op->bytes = bytes;
    op->consume = consume;
    std::unique_lock lk(mu_);
    Peer& p = peer_checked(peer, "recv", bytes);
    if (abort_) throw error_of(*abort_, peer, "recv", bytes);
    if (!p.unexpected.empty()) {
      Unexpected u = std::move(p.unexpected.front());
      p.unexpected.pop_front();
      lk.unlock();  // the message is ours now; copy it without blocking the loop
      if (u.tag != tag || u.bytes != bytes) {
        op->status = OpStatus::kFailed;
        op->failure = mismatch(tag, bytes, u.tag, u.bytes);
      } else if (consume) {
        op->owned = std::move(u.data);
        op->data = op->owned.get();
        op->received = bytes;
        op->status = OpStatus::kDone;
      } else {
        if (bytes) std::memcpy(data, u.data.get(), bytes);
        op->received = bytes;
        op->status = OpStatus::kDone;
      }
      return op;
    }
    if (p.failure) throw error_of(*p.failure, peer, "recv", bytes);
    p.posted.push_back(op);
    return op;
  }

  void abort(const std::string& reason) {
    std::unique_lock lk(mu_);
    if (abort_) return;
    abort_ = Failure{ErrorKind::kAborted, "rank " + std::to_string(rank_) + " aborted: " + reason};
    abort_payload_ = frame::encode_abort(frame::Abort{static_cast<std::uint32_t>(rank_), reason});
    apply_abort_locked(/*send_frames=*/true);
    for (auto& p : peers_) {
      if (p) flush_locked(*p, lk);  // best effort now; the loop finishes what does not fit
    }
  }

  PeerTraffic traffic(int peer) const {
    std::lock_guard lk(mu_);
    if (peer < 0 || peer >= world_size_ || !peers_[static_cast<std::size_t>(peer)]) return {};
    return peers_[static_cast<std::size_t>(peer)]->traffic;
  }

  // --- request support (caller threads) -----------------------------------------------

  template <typename Op>
  bool test(Op& op, int peer, const char* what) {
    std::lock_guard lk(mu_);
    // Not done: whatever it waits for must progress without a waiting caller.
    if (op.status == OpStatus::kPending && !unloaded_.empty()) reclaim_locked(/*all=*/true);
    return check_locked(op, peer, what);
  }

  template <typename Op>
  void wait(Op& op, int peer, const char* what, std::chrono::steady_clock::time_point deadline) {
    std::unique_lock lk(mu_);
    Peer& p = *peers_[static_cast<std::size_t>(peer)];
    if (op.status == OpStatus::kPending) drive_locked(op, p, lk, deadline);
    if (check_locked(op, peer, what)) return;
    std::size_t done = progress(op);
    throw Error(ErrorKind::kTimeout,
                std::string(what) + " of " + describe(op.tag) +
                    (std::strcmp(what, "send") == 0 ? " to" : " from") + " rank " +
                    std::to_string(peer) + " at " + p.address + " did not complete: " +
                    std::to_string(op.bytes - done) + " of " + std::to_string(op.bytes) +
                    " bytes still " + (std::strcmp(what, "send") == 0 ? "unsent" : "missing"),
                rank_, peer, what, op.bytes);
  }

  // The request was destroyed before completing: make sure nothing touches its buffer.
  void abandon(RecvOp& op, int peer) {
    std::unique_lock lk(mu_);
    Peer& p = *peers_[static_cast<std::size_t>(peer)];
    io_wait_locked(lk, [&] { return !p.reading; });
    if (op.status != OpStatus::kPending) return;
    op.abandoned = true;
    op.status = OpStatus::kFailed;
    if (op.claimed) {  // the message now arriving was headed for its buffer: discard the rest
      op.claimed = false;
      p.in.claimed.reset();
      p.in.drain = true;
    }
    // Otherwise it stays in `posted` to keep its place in the FIFO; its message is drained.
  }

  void abandon(SendOp& op, int peer) {
    std::unique_lock lk(mu_);
    Peer& p = *peers_[static_cast<std::size_t>(peer)];
    io_wait_locked(lk, [&] { return !p.writing; });
    if (op.status != OpStatus::kPending) return;
    // Still queued: finish it from a private copy, so the peer receives exactly the
    // stream it expects (dropping or truncating a frame would desynchronise it).
    op.owned.assign(op.data, op.data + op.bytes);
    op.data = op.owned.data();
    op.status = OpStatus::kFailed;
    op.failure = Failure{ErrorKind::kAborted, "request dropped before completion"};
  }

 private:
  // --- helpers (caller holds mu_ unless noted) -------------------------------------

  [[noreturn]] static void sys_error(const std::string& what) {
    throw Error(ErrorKind::kSystem, what + ": " + std::strerror(errno), Error::kUnknownRank,
                Error::kNoPeer, "tcp transport");
  }

  void epoll_add(int fd, std::uint64_t id, std::uint32_t events) {
    if (!try_epoll_add(fd, id, events)) sys_error("epoll_ctl");
  }
  // Loop-thread variant: an exception there would terminate the process.
  bool try_epoll_add(int fd, std::uint64_t id, std::uint32_t events) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = id;
    return ::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) == 0;
  }

  void wake() {
    std::uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_.get(), &one, sizeof one);
  }

  std::string describe(const Tag& tag) const {
    return options_.format_tag ? options_.format_tag(tag) : default_format_tag(tag);
  }

  std::vector<std::uint8_t> my_hello() const {
    return frame::encode_hello(frame::Hello{static_cast<std::uint32_t>(rank_),
                                            static_cast<std::uint32_t>(world_size_), options_.token,
                                            address_});
  }

  Peer& peer_checked(int peer, const char* what, std::size_t bytes) {
    if (peer < 0 || peer >= world_size_ || !peers_[static_cast<std::size_t>(peer)]) {
      throw Error(ErrorKind::kInvalidArgument,
                  peer == rank_
                      ? std::string("cannot ") + what + " to itself"
                      : "rank " + std::to_string(peer) + " is not a peer of this tcp transport",
                  rank_, peer, what, bytes);
    }
    return *peers_[static_cast<std::size_t>(peer)];
  }

  const Failure* failure_for(const Peer& p) const {
    if (abort_) return &*abort_;
    if (p.failure) return &*p.failure;
    return nullptr;
  }

  Error error_of(const Failure& f, int peer, const char* what, std::size_t bytes) const {
    return Error(f.kind, f.detail, rank_, peer, what, bytes);
  }

  Failure mismatch(const Tag& want, std::size_t want_bytes, const Tag& got,
                   std::size_t got_bytes) const {
    return Failure{ErrorKind::kMismatch, "expected " + describe(want) + " (" +
                                             std::to_string(want_bytes) + " bytes) but peer sent " +
                                             describe(got) + " (" + std::to_string(got_bytes) +
                                             " bytes)"};
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

  // Waits for `op` by doing the socket I/O it depends on on this thread, instead of
  // sleeping until the loop thread has done it: a receive reads its peer's socket, and
  // every wait writes the frames queued for any peer whose socket was full. That saves a
  // wake-up and a thread hand-off per message (and per socket-buffer refill of a large
  // send), the largest part of small-message latency on a loaded host. Polls without
  // sleeping for spin_ first.
  //
  // A socket this thread read stays with callers afterwards (kParked): bytes that arrive
  // before the next wait wait in the kernel for that wait to read them, rather than waking
  // the loop to buffer them, and no epoll_ctl is paid per wait. So that no rank ever waits
  // on a peer whose bytes nobody reads, every wait also reads every parked socket, test()
  // hands them back to the loop, and the loop takes back those parked longer than
  // kParkedReclaim (a rank busy elsewhere still makes progress).
  //
  // Caller holds mu_. Returns once `op` settled or `deadline` passed.
  template <typename Op>
  void drive_locked(Op& op, Peer& target, std::unique_lock<std::mutex>& lk,
                    Clock::time_point deadline) {
    if constexpr (std::is_same_v<Op, RecvOp>) {
      // Another thread reads `target` for its own receive: it completes ours on the way,
      // or hands the socket over when it is done.
      if (!cv_.wait_until(lk, deadline, [&] {
            return op.status != OpStatus::kPending || target.read_side != ReadSide::kDriven;
          })) {
        return;
      }
      if (op.status != OpStatus::kPending) return;
    }
    std::vector<Peer*> driven;  // read sides this thread reads
    auto take = [&](Peer& q) {
      const bool from_loop = q.read_side == ReadSide::kLoop;
      q.read_side = ReadSide::kDriven;
      driven.push_back(&q);
      if (from_loop) {
        set_events_locked(q, false, q.out_armed);
        if (!q.in_unloaded) {
          q.in_unloaded = true;
          unloaded_.push_back(&q);
        }
        io_wait_locked(lk, [&] { return !q.reading; });  // the loop may be in recv()
      }
    };
    bool reads_target = false;
    if constexpr (std::is_same_v<Op, RecvOp>) {
      if (!target.failure) {
        take(target);
        reads_target = true;
      }
    }
    for (std::size_t i = 0; i < unloaded_.size(); ++i) {  // take() may append; none erases
      Peer& q = *unloaded_[i];
      if (q.read_side == ReadSide::kParked && !q.failure) take(q);
    }

    std::vector<Peer*> watched;  // write sides this thread writes (see write_backlog_locked)
    std::vector<pollfd> fds;
    std::vector<Peer*> polled;  // polled[i] owns fds[i]
    std::uint8_t* stage = caller_stage();
    const int waker = thread_waker();
    const auto spin_end = spin_.count() > 0 ? Clock::now() + spin_ : Clock::time_point::min();
    while (op.status == OpStatus::kPending) {
      bool progress = false;
      if (reads_target) {
        ReadStep step = read_once_locked(target, lk, stage);
        if (step == ReadStep::kClosed) reads_target = false;  // `op` failed with the socket
        progress = step == ReadStep::kMore;
        if (op.status != OpStatus::kPending) break;
      } else {
        // A send has no socket of its own to read: read the parked ones as they come, as
        // the loop would, so frames keep their arrival order across sockets (an abort
        // that came before a peer's hang-up is seen before it).
        for (Peer* q : driven) {
          if (!q->failure && read_once_locked(*q, lk, stage) == ReadStep::kMore) progress = true;
        }
      }
      progress |= write_backlog_locked(lk, watched);
      if (op.status != OpStatus::kPending) break;
      if (progress) continue;
      auto now = Clock::now();
      if (now >= deadline) break;
      if (now < spin_end) {
        if (spin_yield_) {  // let the ranks that share this core run between tries
          lk.unlock();
          ::sched_yield();
          lk.lock();
        }
        continue;
      }

      fds.clear();
      polled.clear();
      for (Peer* q : driven) {
        if (q->failure) continue;
        fds.push_back({q->fd, POLLIN, 0});
        polled.push_back(q);
      }
      for (Peer* q : watched) {
        if (q->sendq.empty() || q->failure || q->writing) continue;
        auto it = std::find(polled.begin(), polled.end(), q);
        if (it != polled.end()) {
          fds[static_cast<std::size_t>(it - polled.begin())].events |= POLLOUT;
        } else {
          fds.push_back({q->fd, POLLOUT, 0});
          polled.push_back(q);
        }
      }
      if (fds.empty()) {
        // Nothing here for this thread to drive: another thread is writing the frame we
        // wait for, or the loop is. Whoever finishes it notifies cv_.
        cv_.wait_until(lk, deadline, [&] { return op.status != OpStatus::kPending; });
        continue;
      }
      // Sleep until a socket is ready, or another thread settles `op` (an abort, a failed
      // connection, a writer that flushed our frame with its own) and raises our waker.
      fds.push_back({waker, POLLIN, 0});  // a negative fd is ignored by poll()
      op.waker = waker;
      auto left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - now);
      if (waker < 0) left = std::min<std::chrono::nanoseconds>(left, std::chrono::milliseconds(1));
      timespec ts{static_cast<time_t>(left.count() / 1000000000),
                  static_cast<long>(left.count() % 1000000000)};
      lk.unlock();
      ::ppoll(fds.data(), fds.size(), &ts, nullptr);
      if (fds.back().revents & POLLIN) {
        std::uint64_t v;
        [[maybe_unused]] ssize_t n = ::read(waker, &v, sizeof v);
      }
      lk.lock();
      op.waker = -1;
      // Other parked sockets with bytes (or a hang-up): read them now. `target` is read at
      // the top of the loop; writable sockets are written there too.
      for (std::size_t i = 0; i + 1 < fds.size(); ++i) {
        Peer* q = polled[i];
        if ((reads_target && q == &target) || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR)))
          continue;
        if (q->read_side != ReadSide::kDriven || q->failure) continue;
        for (int k = 0; k < kReadsPerEvent; ++k) {
          if (read_once_locked(*q, lk, stage) != ReadStep::kMore) break;
        }
      }
    }
    if (op.status == OpStatus::kFailed && op.failure.kind == ErrorKind::kPeerLost && !abort_) {
      // A lost connection is often the consequence of an abort already waiting in another
      // socket (its sender's peer exited after it), and the abort names the root cause,
      // which is what every later operation reports too (see failure_for).
      sweep_locked(lk, stage);
      if (abort_) op.failure = *abort_;
    }
    if (!driven.empty()) {
      const auto now = Clock::now();
      for (Peer* q : driven) {
        q->read_side = ReadSide::kParked;
        q->parked_since = now;
      }
      cv_.notify_all();    // a thread waiting on another receive from `target` may read now
      if (loop_sleeps_) {  // it must tick to take parked sockets back (see reclaim_locked)
        loop_sleeps_ = false;
        wake();
      }
    }
    for (Peer* q : watched) {
      // The last caller to stop watching a socket with frames still queued hands it back.
      if (--q->out_watchers == 0 && !q->sendq.empty()) arm_out_locked(*q, true);
    }
  }

  // Reads what has arrived on `p`'s socket, unless another thread is reading it. Any
  // thread; caller holds mu_ (dropped around the syscalls).
  void drain_locked(Peer& p, std::unique_lock<std::mutex>& lk) {
    std::uint8_t* stage = t_in_loop_thread ? stage_.data() : caller_stage();
    while (read_once_locked(p, lk, stage) == ReadStep::kMore) {
    }
  }

  // Reads whatever has already arrived on every socket nobody is reading at this moment.
  // Caller holds mu_ (dropped around the syscalls). Rare: only after a connection loss.
  void sweep_locked(std::unique_lock<std::mutex>& lk, std::uint8_t* stage) {
    std::vector<pollfd> fds;
    std::vector<Peer*> ps;
    for (auto& q : peers_) {
      if (!q || q->failure || q->fd < 0 || q->reading || !q->ready) continue;
      fds.push_back({q->fd, POLLIN, 0});
      ps.push_back(q.get());
    }
    lk.unlock();
    ::poll(fds.data(), fds.size(), 0);
    lk.lock();
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      while (read_once_locked(*ps[i], lk, stage) == ReadStep::kMore) {
      }
    }
  }

  // Hands parked read sides back to the loop: all of them (`all`), or those parked for
  // kParkedReclaim. Caller holds mu_.
  void reclaim_locked(bool all) {
    const auto now = Clock::now();
    std::erase_if(unloaded_, [&](Peer* q) {
      if (q->read_side == ReadSide::kParked && !q->failure &&
          (all || now - q->parked_since >= kParkedReclaim)) {
        q->read_side = ReadSide::kLoop;
        set_events_locked(*q, true, q->out_armed);
      }
      bool keep = q->read_side != ReadSide::kLoop && !q->failure;
      if (!keep) q->in_unloaded = false;
      return !keep;
    });
  }

  // Writes the frames queued on every backlogged peer nobody is writing to now, and adds
  // each such peer to `watched`: this thread then polls its socket for space and the
  // loop stops watching it (out_watchers > 0). True if any bytes left. Caller holds mu_;
  // flush_locked drops it.
  bool write_backlog_locked(std::unique_lock<std::mutex>& lk, std::vector<Peer*>& watched) {
    if (backlog_.empty()) return false;
    std::erase_if(backlog_, [](Peer* q) {
      bool keep = !q->sendq.empty() && !q->failure;
      if (!keep) q->in_backlog = false;
      return !keep;
    });
    bool progress = false;
    std::vector<Peer*> now = backlog_;  // flush_locked drops the lock: backlog_ may change
    for (Peer* q : now) {
      if (q->sendq.empty() || q->failure) continue;
      if (std::find(watched.begin(), watched.end(), q) == watched.end()) {
        watched.push_back(q);
        ++q->out_watchers;
        arm_out_locked(*q, false);
      }
      if (!q->writing) progress |= flush_locked(*q, lk, /*watching=*/true) > 0;
    }
    return progress;
  }

  // Raises the waker of whoever sleeps in drive_locked's poll() on behalf of `op`, unless
  // that is this very thread.
  template <typename Op>
  void wake_waiter_locked(Op& op) {
    if (op.waker >= 0 && op.waker != current_thread_waker()) {
      std::uint64_t one = 1;
      [[maybe_unused]] ssize_t n = ::write(op.waker, &one, sizeof one);
    }
  }

  // A caller's staging buffer, like the loop's stage_: only used within one
  // read_once_locked, so one per thread serves every transport.
  static std::uint8_t* caller_stage() {
    thread_local std::unique_ptr<std::uint8_t[]> stage(new std::uint8_t[kStageBytes]);
    return stage.get();
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

  void queue_control_locked(Peer& p, frame::Type type, std::vector<std::uint8_t> payload) {
    auto op = std::make_shared<SendOp>();
    op->type = type;
    op->owned = std::move(payload);
    op->data = op->owned.data();
    op->bytes = op->owned.size();
    op->status = OpStatus::kFailed;  // no request waits on it; marks it as not user-owned
    frame::encode_header(frame::Header{type, Tag{}, op->bytes}, op->header);
    p.sendq.push_back(std::move(op));
  }

  // What the loop watches on `p`'s socket. A failed peer is no longer registered.
  void set_events_locked(Peer& p, bool in, bool out) {
    if ((p.in_armed == in && p.out_armed == out) || p.failure) return;
    epoll_event ev{};
    ev.events = (in ? EPOLLIN : 0u) | (out ? EPOLLOUT : 0u);
    // With nothing armed, epoll still reports a hang-up or error, level-triggered: report
    // it once, or the loop would spin while a caller reads the socket.
    if (!in && !out) ev.events = EPOLLET;
    ev.data.u64 = kPeerIdBase + static_cast<std::uint64_t>(p.rank);
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, p.fd, &ev);
    p.in_armed = in;
    p.out_armed = out;
  }
  void arm_out_locked(Peer& p, bool on) { set_events_locked(p, p.in_armed, on); }

  // Writes queued frames until the socket is full or the queue is empty, and returns the
  // bytes written. Any thread; may drop and retake the lock around sendmsg(). Frames left
  // over put `p` on backlog_ and, unless `watching` (a caller in drive_locked that polls
  // the socket itself), arm EPOLLOUT so the loop finishes them.
  std::size_t flush_locked(Peer& p, std::unique_lock<std::mutex>& lk, bool watching = false) {
    std::size_t total = 0;
    if (p.writing) {
      // Another thread is writing; it re-arms EPOLLOUT itself if the socket fills up (or
      // watches it from drive_locked). Disarming here stops a level-triggered EPOLLOUT
      // from spinning the loop meanwhile.
      arm_out_locked(p, false);
      return total;
    }
    while (!p.writing && p.fd >= 0 && !p.failure && !p.sendq.empty()) {
      iovec iov[kMaxIov];
      int count = 0;
      std::size_t want = 0;
      for (auto& op : p.sendq) {
        if (count + 2 > kMaxIov) break;
        std::size_t w = op->written;
        if (w < frame::kHeaderBytes) {
          iov[count++] = {op->header + w, frame::kHeaderBytes - w};
          want += frame::kHeaderBytes - w;
          w = frame::kHeaderBytes;
        }
        std::size_t off = w - frame::kHeaderBytes;
        if (off < op->bytes) {
          iov[count++] = {const_cast<std::uint8_t*>(op->data) + off, op->bytes - off};
          want += op->bytes - off;
        }
      }
      p.writing = true;
      int fd = p.fd;
      lk.unlock();
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = static_cast<std::size_t>(count);
      ssize_t n = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      int err = errno;
      lk.lock();
      p.writing = false;
      io_done_locked();
      // Account for what left first: frames fully written count as sent even if the peer
      // failed meanwhile. The rest we owned while writing, so we fail them here.
      if (n > 0) {
        advance_sends_locked(p, static_cast<std::size_t>(n));
        total += static_cast<std::size_t>(n);
      }
      if (p.failure) {
        fail_sends_locked(p, abort_ ? *abort_ : *p.failure);
        return total;
      }
      if (n < 0) {
        if (err == EINTR) continue;
        if (err == EAGAIN || err == EWOULDBLOCK) break;
        // The peer is gone. What it sent before it went (an abort naming the cause) may
        // still wait in our receive queue: read that first, so it is what gets reported.
        if (err == EPIPE || err == ECONNRESET) drain_locked(p, lk);
        fail_peer_locked(
            p, Failure{ErrorKind::kPeerLost, "sending to rank " + std::to_string(p.rank) + " at " +
                                                 p.address + " failed: " + std::strerror(err)});
        return total;
      }
      if (abort_ && !p.abort_settled) settle_sends_after_abort_locked(p, abort_send_frames_);
      if (static_cast<std::size_t>(n) < want) break;  // socket buffer full
    }
    if (p.sendq.empty()) {
      arm_out_locked(p, false);
    } else if (!p.writing && !p.failure) {  // socket full: wait for space
      if (!watching) arm_out_locked(p, true);
      if (!p.in_backlog) {
        p.in_backlog = true;
        backlog_.push_back(&p);
      }
    }
    return total;
  }

  void advance_sends_locked(Peer& p, std::size_t n) {
    while (n > 0 && !p.sendq.empty()) {
      SendOp& op = *p.sendq.front();
      std::size_t take = std::min(n, op.total() - op.written);
      op.written += take;
      n -= take;
      if (op.written < op.total()) break;
      finish_send_locked(p, p.sendq.front());
    }
  }

  void finish_send_locked(Peer& p, std::shared_ptr<SendOp> op) {
    p.sendq.pop_front();
    if (op->type == frame::Type::kData) {
      p.traffic.bytes_sent += op->bytes;
      p.traffic.messages_sent += 1;
    }
    if (op->status == OpStatus::kPending) complete_locked(*op);
  }

  void fail_sends_locked(Peer& p, const Failure& f) {
    for (auto& op : p.sendq) fail_locked(*op, f);
    p.sendq.clear();
  }

  // After an abort nothing new is sent except the abort frame itself. A frame already
  // partly written is finished from a private copy first: cutting it short would make the
  // peer parse payload bytes as the abort frame's header.
  void settle_sends_after_abort_locked(Peer& p, bool send_frame) {
    p.abort_settled = true;
    if (p.failure) return fail_sends_locked(p, *abort_);
    std::shared_ptr<SendOp> partial;
    if (!p.sendq.empty() && p.sendq.front()->written > 0) {
      partial = p.sendq.front();
      p.sendq.pop_front();
      if (partial->owned.empty() && partial->bytes > 0) {
        partial->owned.assign(partial->data, partial->data + partial->bytes);
        partial->data = partial->owned.data();
      }
      fail_locked(*partial, *abort_);
    }
    fail_sends_locked(p, *abort_);
    if (partial) p.sendq.push_back(std::move(partial));
    if (send_frame && p.rank != abort_origin_)
      queue_control_locked(p, frame::Type::kAbort, abort_payload_);
  }

  void fail_recvs_locked(Peer& p, const Failure& f) {
    for (auto& op : p.posted) fail_locked(*op, f);
    p.posted.clear();
    if (p.in.claimed && !p.reading) {  // if reading, the loop settles it after its recv()
      fail_locked(*p.in.claimed, f);
      p.in.claimed->claimed = false;
      p.in.claimed.reset();
      p.in.drain = true;
    }
  }

  // Local or remote abort: fail every operation on every peer; tell peers if local.
  // A peer that is mid-write settles its own queue when the write returns.
  void apply_abort_locked(bool send_frames) {
    abort_send_frames_ = send_frames;
    for (auto& pp : peers_) {
      if (!pp) continue;
      Peer& p = *pp;
      fail_recvs_locked(p, *abort_);
      p.unexpected.clear();
      if (!p.writing) settle_sends_after_abort_locked(p, send_frames);
    }
    cv_.notify_all();
  }

  // The connection to `p` is unusable: sticky error for every pending and later op.
  // Messages already fully received stay deliverable.
  void fail_peer_locked(Peer& p, const Failure& f) {
    if (p.failure) return;
    p.failure = f;
    if (p.fd >= 0) {
      ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, p.fd, nullptr);
      // Not closed here: the loop or a writer may still hold the number for a syscall in
      // flight, and a reused number would send our bytes to a stranger.
      ::shutdown(p.fd, SHUT_RDWR);
    }
    const Failure& reported = abort_ ? *abort_ : f;
    fail_recvs_locked(p, reported);
    if (!p.writing) fail_sends_locked(p, reported);
    cv_.notify_all();
  }

  // --- loop thread ----------------------------------------------------------------------

  void loop() {
    t_in_loop_thread = true;
    try {
      run_loop();
    } catch (const std::exception& e) {
      // Last resort (e.g. out of memory): fail every peer rather than terminate.
      std::unique_lock lk(mu_);
      Failure f{ErrorKind::kSystem, std::string("tcp transport loop failed: ") + e.what()};
      for (auto& p : peers_) {
        if (p) fail_peer_locked(*p, f);
      }
    }
  }

  void run_loop() {
    epoll_event events[64];
    for (;;) {
      int timeout = pending_.empty() ? -1 : 100;  // strays' hello deadlines need a tick
      {
        std::lock_guard lk(mu_);
        if (!unloaded_.empty()) {
          reclaim_locked(/*all=*/false);
          constexpr int kTick = static_cast<int>(kParkedReclaim.count());
          if (!unloaded_.empty()) timeout = timeout < 0 ? kTick : std::min(timeout, kTick);
        }
        loop_sleeps_ = timeout < 0;
      }
      int n = ::epoll_wait(epoll_.get(), events, 64, timeout);
      if (n < 0 && errno != EINTR) {
        std::unique_lock lk(mu_);
        Failure f{ErrorKind::kSystem, std::string("epoll_wait failed: ") + std::strerror(errno)};
        for (auto& p : peers_) {
          if (p) fail_peer_locked(*p, f);
        }
        return;
      }
      for (int i = 0; i < n; ++i) {
        std::uint64_t id = events[i].data.u64;
        if (id == kWakeId) {
          std::uint64_t v;
          [[maybe_unused]] ssize_t r = ::read(wake_.get(), &v, sizeof v);
          std::lock_guard lk(mu_);
          if (stopping_) return;
          if (setup_over_ && listener_.valid()) {
            listener_.reset();  // real peers are all here; close the door on strays
            pending_.clear();
          }
        } else if (id == kListenerId) {
          if (listener_.valid()) accept_pending();
        } else if (id >= kPendingIdBase) {
          on_pending(id);
        } else {
          Peer& p = *peers_[static_cast<std::size_t>(id - kPeerIdBase)];
          if (events[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) on_readable(p, events[i].events);
          if (events[i].events & EPOLLOUT) {
            std::unique_lock lk(mu_);
            flush_locked(p, lk);
          }
        }
      }
      if (!pending_.empty()) {
        auto now = std::chrono::steady_clock::now();
        for (auto it = pending_.begin(); it != pending_.end();) {
          if (now >= it->second.deadline) {
            refuse(it->second, "no hello within " + std::to_string(kHelloTimeout.count()) + " s");
            it = pending_.erase(it);
          } else {
            ++it;
          }
        }
      }
    }
  }

  void accept_pending() {
    for (;;) {
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      int fd = ::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&ss), &len,
                         SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;
      if (pending_.size() >= kMaxPendingConnections) {
        ::close(fd);
        continue;
      }
      std::uint64_t id = kPendingIdBase + next_pending_++;
      if (!try_epoll_add(fd, id, EPOLLIN)) {
        ::close(fd);
        continue;
      }
      Pending& pc = pending_[id];
      pc.fd = net::Fd(fd);
      pc.from = peer_name_of(ss);
      pc.deadline = std::chrono::steady_clock::now() + kHelloTimeout;
    }
  }

  void refuse(const Pending& pc, const std::string& why) {
    std::fprintf(stderr, "gradsync: rank %d: refused tcp connection from %s: %s\n", rank_,
                 pc.from.c_str(), why.c_str());
  }

  // Reads a stray's hello with exact-length reads, so no byte meant for the data path is
  // ever consumed here.
  void on_pending(std::uint64_t id) {
    auto it = pending_.find(id);
    if (it == pending_.end()) return;
    Pending& pc = it->second;
    auto drop = [&](const std::string& why) {
      refuse(pc, why);
      pending_.erase(it);
    };
    for (;;) {
      std::uint8_t* dest;
      std::size_t want;
      if (pc.hdr_got < frame::kHeaderBytes) {
        dest = pc.hdr + pc.hdr_got;
        want = frame::kHeaderBytes - pc.hdr_got;
      } else {
        dest = pc.payload.data() + pc.got;
        want = pc.payload.size() - pc.got;
      }
      ssize_t n = want ? ::recv(pc.fd.get(), dest, want, 0) : 0;
      if (want && n == 0) return drop("closed before completing its hello");
      if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        if (errno == EINTR) continue;
        return drop(std::strerror(errno));
      }
      if (pc.hdr_got < frame::kHeaderBytes) {
        pc.hdr_got += static_cast<std::size_t>(n);
        if (pc.hdr_got < frame::kHeaderBytes) continue;
        auto st = frame::parse_header(pc.hdr, frame::kDefaultMaxDataBytes, pc.h);
        if (st != frame::ParseStatus::kOk)
          return drop(std::string("bad frame: ") + frame::to_string(st));
        if (pc.h.type != frame::Type::kHello) return drop("first frame is not a hello");
        pc.payload.resize(pc.h.length);  // bounded by kMaxHelloBytes in parse_header
        continue;
      }
      pc.got += static_cast<std::size_t>(n);
      if (pc.got < pc.payload.size()) continue;
      auto hello = frame::parse_hello(pc.payload);
      if (!hello) return drop("malformed hello");
      std::string why = promote(pc, *hello);
      if (!why.empty()) return drop(why);
      pending_.erase(it);
      return;
    }
  }

  // Turns a stray that presented a valid hello into the connection of that peer. Returns
  // why it was refused, or "" on success.
  std::string promote(Pending& pc, const frame::Hello& h) {
    std::unique_lock lk(mu_);
    // Token first, so a stranger learns nothing about the job's ranks.
    if (!net::tokens_equal(h.token, options_.token)) return "wrong job token";
    if (h.world_size != static_cast<std::uint32_t>(world_size_)) {
      return "world size " + std::to_string(h.world_size) + " != " + std::to_string(world_size_);
    }
    if (h.rank >= static_cast<std::uint32_t>(world_size_) || !peers_[h.rank]) {
      return "rank " + std::to_string(h.rank) + " is not a peer of rank " + std::to_string(rank_);
    }
    if (static_cast<int>(h.rank) > rank_)
      return "rank " + std::to_string(h.rank) + " should be dialed, not dial";
    Peer& p = *peers_[h.rank];
    if (p.fd >= 0) return "rank " + std::to_string(h.rank) + " is already connected";
    tune_socket(pc.fd.get());
    // Re-register under the peer's id (the pending id dies with the Pending entry).
    ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, pc.fd.get(), nullptr);
    if (!try_epoll_add(pc.fd.get(), kPeerIdBase + h.rank, EPOLLIN)) return "epoll_ctl failed";
    p.fd = pc.fd.release();
    p.address = h.address;
    queue_control_locked(p, frame::Type::kHello, my_hello());
    p.ready = true;
    flush_locked(p, lk);
    cv_.notify_all();
    return {};
  }

  void on_readable(Peer& p, std::uint32_t events) {
    std::unique_lock lk(mu_);
    if (p.read_side == ReadSide::kParked && (events & (EPOLLERR | EPOLLHUP))) {
      p.read_side = ReadSide::kLoop;  // hung up while parked: read the end now
      set_events_locked(p, true, p.out_armed);
    }
    for (int iter = 0; iter < kReadsPerEvent; ++iter) {
      // A caller waiting on a receive from `p` reads it itself (see drive_locked).
      if (p.read_side != ReadSide::kLoop || p.reading) return;
      if (read_once_locked(p, lk, stage_.data()) != ReadStep::kMore) return;
    }
  }

  enum class ReadStep {
    kMore,     // the read filled what it asked for: there may be more
    kDrained,  // the socket has nothing more for now
    kClosed,   // the connection failed (sticky error set)
  };

  // One recv() from `p`, straight into the arriving message's destination when much of it
  // is left, else into `stage` (headers, small messages), then the processing of what
  // arrived. Only the thread that reads `p` calls this: the loop, or the caller that set
  // read_side kDriven. Caller holds mu_; it is dropped around the syscall, with p.reading set
  // so nobody frees or fails the destination meanwhile.
  ReadStep read_once_locked(Peer& p, std::unique_lock<std::mutex>& lk, std::uint8_t* stage) {
    for (;;) {
      if (p.failure || p.fd < 0) return ReadStep::kClosed;
      if (p.reading) return ReadStep::kDrained;  // another thread is reading it (a sweep)
      Incoming& in = p.in;
      if (!in.in_header) claim_locked(p);
      std::size_t remaining = in.in_header ? 0 : in.h.length - in.got;
      std::uint8_t* dest = nullptr;
      if (remaining >= kDirectReadMin && !in.drain) {
        dest = in.claimed ? in.claimed->data + in.got : in.buffer.get() + in.got;
      }
      const bool direct = dest != nullptr;
      const std::size_t len = direct ? remaining : kStageBytes;
      if (!direct) dest = stage;
      const int fd = p.fd;
      p.reading = true;
      lk.unlock();
      ssize_t n = ::recv(fd, dest, len, MSG_DONTWAIT);
      int err = errno;
      lk.lock();
      if (direct && n > 0) {  // bytes that arrived count, whatever happened meanwhile
        in.got += static_cast<std::size_t>(n);
        if (in.claimed) in.claimed->received = in.got;
        if (in.got == in.h.length) finish_message_locked(p);
      }
      p.reading = false;
      io_done_locked();
      // A failure or abort set by another thread during recv() (possibly why it returned
      // 0) skipped the receive we owned; settle it now.
      settle_claimed_locked(p);
      if (p.failure) return ReadStep::kClosed;
      if (n == 0) {
        if (!p.ready) {  // the acceptor refused our hello: the likely causes are configuration
          fail_peer_locked(p, Failure{ErrorKind::kProtocol,
                                      "rank " + std::to_string(p.rank) + " at " + p.address +
                                          " closed the connection during the handshake (different "
                                          "job token or world size? see its log)"});
          return ReadStep::kClosed;
        }
        fail_peer_locked(
            p, Failure{ErrorKind::kPeerLost, "connection to rank " + std::to_string(p.rank) +
                                                 " at " + p.address + " closed by the peer (EOF)"});
        return ReadStep::kClosed;
      }
      if (n < 0) {
        if (err == EAGAIN || err == EWOULDBLOCK) return ReadStep::kDrained;
        if (err == EINTR) continue;
        fail_peer_locked(p, Failure{ErrorKind::kPeerLost,
                                    "connection to rank " + std::to_string(p.rank) + " at " +
                                        p.address + " lost: " + std::strerror(err)});
        return ReadStep::kClosed;
      }
      auto got = static_cast<std::size_t>(n);
      if (!direct) consume_locked(p, stage, got);
      if (p.failure) return ReadStep::kClosed;
      return got < len ? ReadStep::kDrained : ReadStep::kMore;
    }
  }

  // After a recv() into a user buffer: a failure or abort that arrived meanwhile could not
  // fail the claimed receive (we owned it), so it is done here.
  void settle_claimed_locked(Peer& p) {
    const Failure* f = failure_for(p);
    if (!f || !p.in.claimed) return;
    fail_locked(*p.in.claimed, *f);
    p.in.claimed->claimed = false;
    p.in.claimed.reset();
    p.in.drain = true;
  }

  // Processes `n` bytes read into the staging buffer: headers, payload pieces, whole
  // small messages.
  void consume_locked(Peer& p, const std::uint8_t* data, std::size_t n) {
    Incoming& in = p.in;
    while (n > 0 && !p.failure) {
      if (in.in_header) {
        std::size_t take = std::min(n, frame::kHeaderBytes - in.hdr_got);
        std::memcpy(in.hdr + in.hdr_got, data, take);
        in.hdr_got += take;
        data += take;
        n -= take;
        if (in.hdr_got == frame::kHeaderBytes) on_header_locked(p);
        continue;
      }
      claim_locked(p);
      std::size_t take = std::min<std::size_t>(n, in.h.length - in.got);
      if (in.claimed) {
        std::memcpy(in.claimed->data + in.got, data, take);
        in.claimed->received = in.got + take;
      } else if (!in.drain) {
        std::memcpy(in.buffer.get() + in.got, data, take);
      }
      in.got += take;
      data += take;
      n -= take;
      if (in.got == in.h.length) finish_message_locked(p);
    }
  }

  void on_header_locked(Peer& p) {
    Incoming& in = p.in;
    auto st = frame::parse_header(in.hdr, frame::kDefaultMaxDataBytes, in.h);
    auto protocol = [&](const std::string& why) {
      fail_peer_locked(
          p, Failure{ErrorKind::kProtocol, "rank " + std::to_string(p.rank) + " at " + p.address +
                                               " broke the protocol: " + why});
    };
    if (st != frame::ParseStatus::kOk) return protocol(frame::to_string(st));
    in.in_header = false;
    in.got = 0;
    in.drain = false;
    in.claimed.reset();
    in.buffer.reset();
    switch (in.h.type) {
      case frame::Type::kHello:
        if (p.ready) return protocol("a second hello");
        break;
      case frame::Type::kAbort:
        break;
      case frame::Type::kData:
        if (!p.ready) return protocol("data before the handshake");
        if (abort_) {
          in.drain = true;  // aborted: nobody will ever receive it
        } else if (!p.posted.empty()) {
          claim_locked(p);
        }
        break;
    }
    if (!in.claimed && !in.drain && in.h.length > 0) {
      in.buffer = pool_.get(in.h.length);
      if (!in.buffer) {
        fail_peer_locked(
            p, Failure{ErrorKind::kSystem, "cannot buffer a " + std::to_string(in.h.length) +
                                               "-byte message from rank " + std::to_string(p.rank) +
                                               ": out of memory"});
        return;
      }
    }
    if (in.h.length == 0) finish_message_locked(p);
  }

  // Gives the data message now arriving to the oldest posted receive, if any. Called at
  // the header and again before each read, so a receive posted late takes over the rest
  // of the message directly (only the prefix already buffered is copied).
  void claim_locked(Peer& p) {
    Incoming& in = p.in;
    if (in.in_header || in.h.type != frame::Type::kData || in.claimed || in.drain) return;
    if (p.posted.empty() || !p.unexpected.empty()) return;
    std::shared_ptr<RecvOp> op = std::move(p.posted.front());
    p.posted.pop_front();
    if (op->abandoned || op->status != OpStatus::kPending) {
      in.drain = true;
    } else if (op->tag != in.h.tag || op->bytes != in.h.length) {
      fail_locked(*op, mismatch(op->tag, op->bytes, in.h.tag, in.h.length));
      in.drain = true;
    } else {
      if (op->consume) {
        // Take over the arriving message's buffer (or make one if nothing has arrived).
        if (!in.buffer && in.h.length > 0) in.buffer = pool_.get(in.h.length);
        if (!in.buffer && in.h.length > 0) {
          fail_locked(*op,
                      Failure{ErrorKind::kSystem, "cannot allocate " + std::to_string(in.h.length) +
                                                      " bytes for a consuming receive"});
          in.drain = true;
          return;
        }
        op->owned = std::move(in.buffer);
        op->data = op->owned.get();
      } else if (in.got > 0) {
        std::memcpy(op->data, in.buffer.get(), in.got);
      }
      op->received = in.got;
      op->claimed = true;
      in.claimed = std::move(op);
    }
    in.buffer.reset();
  }

  void finish_message_locked(Peer& p) {
    Incoming& in = p.in;
    std::span<const std::uint8_t> payload(in.buffer.get(), in.buffer ? in.h.length : 0);
    switch (in.h.type) {
      case frame::Type::kData:
        // A receive may have been posted while the last bytes were read without the lock.
        claim_locked(p);
        p.traffic.bytes_received += in.h.length;
        p.traffic.messages_received += 1;
        if (in.claimed) {
          in.claimed->claimed = false;
          in.claimed->received = in.h.length;
          complete_locked(*in.claimed);
        } else if (!in.drain) {
          p.unexpected.push_back(Unexpected{in.h.tag, std::move(in.buffer), in.h.length});
        }
        break;
      case frame::Type::kHello: {
        auto h = frame::parse_hello(payload);
        std::string why;
        if (!h) {
          why = "malformed hello";
        } else if (!net::tokens_equal(h->token, options_.token)) {
          why = "wrong job token in its hello";
        } else if (h->rank != static_cast<std::uint32_t>(p.rank)) {
          why = "answered as rank " + std::to_string(h->rank);
        } else if (h->world_size != static_cast<std::uint32_t>(world_size_)) {
          why =
              "world size " + std::to_string(h->world_size) + " != " + std::to_string(world_size_);
        }
        if (!why.empty()) {
          fail_peer_locked(
              p, Failure{ErrorKind::kProtocol, "handshake with rank " + std::to_string(p.rank) +
                                                   " at " + p.address + " failed: " + why});
          return;
        }
        p.ready = true;
        cv_.notify_all();
        break;
      }
      case frame::Type::kAbort: {
        auto a = frame::parse_abort(payload);
        std::string reason = a ? a->reason : "(malformed abort frame)";
        if (!abort_) {
          abort_ = Failure{ErrorKind::kAborted,
                           "rank " + std::to_string(p.rank) + " aborted: " + reason};
          // Passed on to every other peer. The aborter's own frame to some rank may wait
          // behind data in a full socket; a rank that exits after this abort would then
          // show that rank a lost connection (EOF) before the cause arrives. Relayed, the
          // cause travels ahead of the exit on the same stream.
          abort_payload_ =
              frame::encode_abort(frame::Abort{static_cast<std::uint32_t>(rank_), abort_->detail});
          abort_origin_ = p.rank;
          apply_abort_locked(/*send_frames=*/true);
          for (auto& q : peers_) {  // the loop writes them (we may be deep in a read here)
            if (q && !q->failure && !q->sendq.empty()) arm_out_locked(*q, true);
          }
        }
        break;
      }
    }
    in.in_header = true;
    in.hdr_got = 0;
    in.got = 0;
    in.drain = false;
    in.claimed.reset();
    in.buffer.reset();
  }

  const int rank_;
  const int world_size_;
  const TransportOptions options_;
  std::string address_;  // written before the loop starts, then read-only

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
  bool stopping_ = false;
  bool setup_over_ = false;

  std::chrono::nanoseconds spin_{0};  // see spin_us_setting; set before any operation
  bool spin_yield_ = false;
  std::vector<Peer*> backlog_;   // peers with queued frames the socket did not take
  std::vector<Peer*> unloaded_;  // peers whose read_side is not kLoop
  bool loop_sleeps_ = false;     // the loop is in epoll_wait without a timeout

  // Loop thread only (after start()).
  net::Fd listener_, epoll_, wake_;
  std::map<std::uint64_t, Pending> pending_;
  std::uint64_t next_pending_ = 0;
  std::vector<std::uint8_t> stage_;
  std::thread thread_;
};

class TcpSendRequest final : public Request {
 public:
  TcpSendRequest(std::shared_ptr<Core> core, std::shared_ptr<SendOp> op, int peer)
      : core_(std::move(core)), op_(std::move(op)), peer_(peer) {}
  ~TcpSendRequest() override {
    if (!finished_) core_->abandon(*op_, peer_);
  }
  bool test() override { return finished_ = finished_ || core_->test(*op_, peer_, "send"); }
  void wait(Clock::time_point deadline) override {
    if (finished_) return;
    core_->wait(*op_, peer_, "send", deadline);
    finished_ = true;
  }

 private:
  std::shared_ptr<Core> core_;
  std::shared_ptr<SendOp> op_;
  int peer_;
  bool finished_ = false;  // owned by the waiting thread; the op's status is the truth
};

class TcpRecvRequest final : public Request {
 public:
  TcpRecvRequest(std::shared_ptr<Core> core, std::shared_ptr<RecvOp> op, int peer)
      : core_(std::move(core)), op_(std::move(op)), peer_(peer) {}
  ~TcpRecvRequest() override {
    if (!finished_) core_->abandon(*op_, peer_);
  }
  bool test() override { return finished_ = finished_ || core_->test(*op_, peer_, "recv"); }
  void wait(Clock::time_point deadline) override {
    if (finished_) return;
    core_->wait(*op_, peer_, "recv", deadline);
    finished_ = true;
  }

 private:
  std::shared_ptr<Core> core_;
  std::shared_ptr<RecvOp> op_;
  int peer_;
  bool finished_ = false;
};

// A consuming receive: once the message is complete, the waiting thread hands the whole
// message to the consumer straight from the buffer it was received into.
class TcpConsumeRequest final : public Request {
 public:
  TcpConsumeRequest(std::shared_ptr<Core> core, std::shared_ptr<RecvOp> op, int peer,
                    Consumer consume)
      : core_(std::move(core)), op_(std::move(op)), peer_(peer), consume_(std::move(consume)) {}
  ~TcpConsumeRequest() override {
    if (!finished_) core_->abandon(*op_, peer_);
  }
  bool test() override {
    if (!finished_ && core_->test(*op_, peer_, "recv")) finish();
    return finished_;
  }
  void wait(Clock::time_point deadline) override {
    if (finished_) return;
    core_->wait(*op_, peer_, "recv", deadline);
    finish();
  }

 private:
  void finish() {
    finished_ = true;  // the op is done: no other thread touches op_->owned any more
    if (op_->bytes > 0) consume_(op_->owned.get(), 0, op_->bytes);
    op_->owned.reset();
  }
  std::shared_ptr<Core> core_;
  std::shared_ptr<RecvOp> op_;
  int peer_;
  Consumer consume_;
  bool finished_ = false;
};

class TcpTransport final : public Transport {
 public:
  TcpTransport(int rank, int world_size, const std::vector<int>& group,
               const TransportOptions& options)
      : rank_(rank),
        world_size_(world_size),
        core_(std::make_shared<Core>(rank, world_size, group, options)) {}
  ~TcpTransport() override { core_->shutdown(); }

  Core& core() { return *core_; }

  int rank() const override { return rank_; }
  int size() const override { return world_size_; }
  const char* name() const override { return "tcp"; }

  RequestPtr isend(int peer, const Tag& tag, const void* data, std::size_t bytes) override {
    auto op = core_->post_send(peer, tag, data, bytes);
    return std::make_unique<TcpSendRequest>(core_, std::move(op), peer);
  }
  RequestPtr irecv(int peer, const Tag& tag, void* data, std::size_t bytes) override {
    auto op = core_->post_recv(peer, tag, data, bytes);
    return std::make_unique<TcpRecvRequest>(core_, std::move(op), peer);
  }
  RequestPtr irecv_consume(int peer, const Tag& tag, std::size_t bytes, Consumer consume) override {
    auto op = core_->post_recv(peer, tag, nullptr, bytes, /*consume=*/true);
    return std::make_unique<TcpConsumeRequest>(core_, std::move(op), peer, std::move(consume));
  }
  void abort(const std::string& reason) override { core_->abort(reason); }
  PeerTraffic traffic(int peer) const override { return core_->traffic(peer); }

 private:
  int rank_;
  int world_size_;
  std::shared_ptr<Core> core_;
};

}  // namespace

std::unique_ptr<Transport> make_tcp_transport(Store& store, const std::string& key_prefix, int rank,
                                              int world_size, const std::vector<int>& group,
                                              const TransportOptions& options,
                                              const TcpOptions& tcp,
                                              std::chrono::milliseconds timeout) {
  if (world_size <= 0 || rank < 0 || rank >= world_size ||
      !std::is_sorted(group.begin(), group.end()) ||
      std::adjacent_find(group.begin(), group.end()) != group.end() ||
      !std::binary_search(group.begin(), group.end(), rank) ||
      (!group.empty() && (group.front() < 0 || group.back() >= world_size))) {
    throw Error(ErrorKind::kInvalidArgument,
                "group must be sorted distinct ranks in [0, world_size) that include this rank",
                rank, Error::kNoPeer, "make_tcp_transport");
  }
  auto deadline = std::chrono::steady_clock::now() + timeout;
  auto t = std::make_unique<TcpTransport>(rank, world_size, group, options);
  Core& core = t->core();
  core.start(tcp);
  auto key = [&](int r) { return key_prefix + "/tcp/" + std::to_string(r); };
  store.set(key(rank), Bytes(core.address().begin(), core.address().end()));
  // Lower rank dials higher: each pair gets exactly one connection, and no two ranks
  // race to dial each other.
  for (int peer : group) {
    if (peer <= rank) continue;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    Bytes v;
    try {
      v = store.get(key(peer), std::max(left, std::chrono::milliseconds(0)));
    } catch (const Error& e) {
      throw Error(
          e.kind(),
          "rank " + std::to_string(peer) + " did not publish its tcp address: " + e.detail(), rank,
          peer, "tcp connect");
    }
    std::string address(v.begin(), v.end());
    auto [host, port] = net::split_host_port(address);
    net::Fd fd;
    try {
      fd = net::connect_tcp(host, port, deadline, "rank " + std::to_string(peer));
    } catch (const Error& e) {
      throw Error(e.kind(), e.detail(), rank, peer, "tcp connect");
    }
    core.attach_dialed(peer, std::move(fd), address);
  }
  core.wait_ready(deadline, timeout);
  return t;
}

}  // namespace gradsync::transport
