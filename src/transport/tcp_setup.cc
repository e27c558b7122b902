// Connection set-up of the tcp transport: listening, dialing, the hello exchange, and
// accepting connections until they prove to be a peer (or a stray to refuse).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdio>

#include "transport/tcp_core.h"
#include "transport/tcp_tuning.h"

namespace gradsync::transport::tcp {

namespace {

// A real peer sends its hello in one write right after connecting, so its hello is
// usually there by the time we accept; anything silent this long is not a peer.
constexpr auto kHelloTimeout = std::chrono::seconds(5);
// Unidentified connections held at once, so junk cannot exhaust file descriptors. When full,
// a new connection evicts the oldest that is still silent (else the oldest): a flood of
// junk only ever costs junk its place, never the connection of a peer dialing after it.
constexpr std::size_t kMaxPendingConnections = 256;
// Refusals logged one by one; past that, only counted (a flood must not flood stderr too),
// and the count is logged once the listener closes.
constexpr std::uint64_t kRefusalsLogged = 5;

[[noreturn]] void sys_error(const std::string& what) {
  throw Error(ErrorKind::kSystem, what + ": " + std::strerror(errno), Error::kUnknownRank,
              Error::kNoPeer, "tcp transport");
}

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

}  // namespace

Core::Core(int rank, int world_size, const std::vector<int>& group, TransportOptions options)
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

Core::~Core() {
  for (auto& p : peers_) {
    if (p && p->fd >= 0) ::close(p->fd);
  }
}

void Core::start(const TcpOptions& tcp) {
  tcp_ = tcp;
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

// Hands a connected socket to the loop and sends our hello; the peer is ready once it has
// answered with its challenge, we with our proof, and it with its hello.
void Core::attach_dialed(int peer, net::Fd fd, const std::string& address) {
  net::set_nonblocking(fd.get());
  tune_socket(fd.get(), tcp_);
  std::unique_lock lk(mu_);
  Peer& p = *peers_[static_cast<std::size_t>(peer)];
  p.address = address;
  p.handshake = Handshake::kHelloSent;
  p.nonce = net::fresh_nonce();
  p.fd = fd.release();
  epoll_add(p.fd, kPeerIdBase + static_cast<std::uint64_t>(peer), EPOLLIN);
  queue_control_locked(p, frame::Type::kHello, my_hello(p.nonce));
  flush_locked(p, lk);
}

// Blocks until every peer completed the handshake; throws naming the peers that did not.
void Core::wait_ready(std::chrono::steady_clock::time_point deadline,
                      std::chrono::milliseconds timeout) {
  std::unique_lock lk(mu_);
  auto settled = [&] {
    for (auto& p : peers_) {
      if (p && !p->ready() && !p->failure) return false;
    }
    return true;
  };
  bool ok = cv_.wait_until(lk, deadline, settled);
  for (auto& p : peers_) {
    // A peer that failed after its handshake may simply have finished and exited;
    // its messages stay deliverable, so only a failed handshake is a setup error.
    if (p && p->failure && !p->ready()) {
      throw Error(p->failure->kind, p->failure->detail, rank_, p->rank, "tcp connect");
    }
  }
  if (!ok) {
    std::string missing;
    for (auto& p : peers_) {
      if (!p || p->ready()) continue;
      missing += missing.empty() ? "" : "; ";
      missing += "rank " + std::to_string(p->rank) +
                 (p->handshake == Handshake::kHelloSent
                      ? " at " + p->address + " connected but sent no handshake reply"
                  : p->handshake == Handshake::kProofSent
                      ? " at " + p->address + " did not answer our proof of the token"
                      : " never connected to " + address_);
    }
    throw Error(
        ErrorKind::kTimeout,
        "transport setup took longer than " + std::to_string(timeout.count()) + " ms: " + missing,
        rank_, Error::kNoPeer, "tcp connect");
  }
  phase_ = Phase::kRunning;  // the loop closes the listener and strays at its next wake-up
  choose_spin_locked();
  wake();
}

// Sets spin_ and spin_yield_ (see choose_spin). The ranks on this host are the peers that
// advertise our host name.
void Core::choose_spin_locked() {
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
  const SpinPolicy policy = choose_spin(local, tcp_.spin_us);
  spin_yield_ = policy.yield;
  spin_ = policy.duration;
}

std::vector<std::uint8_t> Core::my_hello(const std::string& nonce) const {
  return frame::encode_hello(frame::Hello{
      static_cast<std::uint32_t>(rank_), static_cast<std::uint32_t>(world_size_), nonce, address_});
}

void Core::epoll_add(int fd, std::uint64_t id, std::uint32_t events) {
  if (!try_epoll_add(fd, id, events)) sys_error("epoll_ctl");
}

// Loop-thread variant: an exception there would terminate the process.
bool Core::try_epoll_add(int fd, std::uint64_t id, std::uint32_t events) {
  epoll_event ev{};
  ev.events = events;
  ev.data.u64 = id;
  return ::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) == 0;
}

// --- loop thread ----------------------------------------------------------------------

void Core::accept_pending() {
  for (;;) {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    int fd = ::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&ss), &len,
                       SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    if (pending_.size() >= kMaxPendingConnections) evict_pending();
    std::uint64_t id = kPendingIdBase + next_pending_++;
    if (!try_epoll_add(fd, id, EPOLLIN)) {
      ::close(fd);
      continue;
    }
    Pending& pc = pending_[id];
    pc.fd = net::Fd(fd);
    pc.from = peer_name_of(ss);
    pc.deadline = std::chrono::steady_clock::now() + kHelloTimeout;
    on_pending(id);  // a peer's hello is likely there already: it then never holds a slot
  }
}

// Frees one slot of pending_: the oldest connection that has sent nothing, else the oldest.
// Whatever it sent is read first, so a hello that already arrived is never thrown away.
void Core::evict_pending() {
  auto victim = pending_.end();
  for (auto it = pending_.begin(); it != pending_.end(); ++it) {
    if (it->second.hdr_got == 0) {
      victim = it;
      break;
    }
  }
  if (victim == pending_.end()) victim = pending_.begin();
  const std::uint64_t id = victim->first;
  on_pending(id);
  auto it = pending_.find(id);
  if (it == pending_.end()) return;  // it completed its hello (or was refused) just now
  refuse(it->second, "evicted without a complete hello: " + std::to_string(kMaxPendingConnections) +
                         " unidentified connections were waiting");
  pending_.erase(it);
}

void Core::refuse(const Pending& pc, const std::string& why) {
  if (++refused_ <= kRefusalsLogged) {
    std::fprintf(stderr, "gradsync: rank %d: refused tcp connection from %s: %s\n", rank_,
                 pc.from.c_str(), why.c_str());
  }
}

// The listener closes: the connections still unidentified are refused, and the count of
// refusals that were not logged one by one is logged.
void Core::close_listener() {
  for (auto& [id, pc] : pending_) refuse(pc, "still without a hello when every peer was in");
  pending_.clear();
  listener_.reset();
  if (refused_ > kRefusalsLogged) {
    std::fprintf(stderr,
                 "gradsync: rank %d: refused %llu tcp connections in all that were not peers of "
                 "this job (only the first %llu logged)\n",
                 rank_, static_cast<unsigned long long>(refused_),
                 static_cast<unsigned long long>(kRefusalsLogged));
  }
}

// Reads a stray's hello, answers it with our challenge, then reads its proof of the token,
// with exact-length reads, so no byte meant for the data path is ever consumed here.
void Core::on_pending(std::uint64_t id) {
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
    if (want && n == 0) {
      return drop(pc.hello ? "closed without proving the token (the wrong GRADSYNC_TOKEN?)"
                           : "closed before completing its hello");
    }
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
      const frame::Type expected = pc.hello ? frame::Type::kProof : frame::Type::kHello;
      if (pc.h.type != expected) {
        return drop(pc.hello ? "the frame after its hello is not a proof"
                             : "first frame is not a hello");
      }
      pc.payload.resize(pc.h.length);  // bounded by kMaxHelloBytes in parse_header
      continue;
    }
    pc.got += static_cast<std::size_t>(n);
    if (pc.got < pc.payload.size()) continue;
    if (!pc.hello) {
      auto hello = frame::parse_hello(pc.payload);
      if (!hello) return drop("malformed hello");
      if (!send_challenge(pc, *hello)) return drop("could not send it our challenge");
      pc.hello = std::move(hello);
      pc.hdr_got = 0;
      pc.got = 0;
      pc.payload.clear();
      continue;
    }
    // Proof first, so a stranger learns nothing about the job's ranks.
    auto proof = frame::parse_proof(pc.payload);
    bool holds = false;
    try {
      holds = proof && net::proof_holds(*proof, options_.token, kDialerRole, pc.hello->nonce,
                                        pc.nonce, binding(pc.hello->rank, rank_));
    } catch (const Error& e) {
      return drop(e.what());
    }
    if (!holds) return drop("wrong job token: its proof of the token does not hold");
    std::string why = promote(pc, *pc.hello);
    if (!why.empty()) return drop(why);
    pending_.erase(it);
    return;
  }
}

// Our challenge to a stray that sent a hello: our nonce, and our proof of the token over its
// nonce and ours. Written straight to its socket: nothing else is queued there yet, and a
// fresh socket's buffer takes these bytes whole.
// Loop thread: false rather than an exception, which would end the process.
bool Core::send_challenge(Pending& pc, const frame::Hello& h) {
  std::vector<std::uint8_t> bytes;
  try {
    pc.nonce = net::fresh_nonce();
    const auto payload = frame::encode_challenge(frame::Challenge{
        pc.nonce,
        net::prove(options_.token, kAcceptorRole, h.nonce, pc.nonce, binding(h.rank, rank_))});
    bytes = frame::encode_frame(frame::Type::kChallenge, Tag{}, payload);
  } catch (const Error&) {
    return false;
  }
  const ssize_t n = ::send(pc.fd.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL);
  return n == static_cast<ssize_t>(bytes.size());
}

// Turns a stray that proved the token into the connection of the peer its hello names. Returns
// why it was refused, or "" on success.
std::string Core::promote(Pending& pc, const frame::Hello& h) {
  std::unique_lock lk(mu_);
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
  tune_socket(pc.fd.get(), tcp_);
  // Re-register under the peer's id (the pending id dies with the Pending entry).
  ::epoll_ctl(epoll_.get(), EPOLL_CTL_DEL, pc.fd.get(), nullptr);
  if (!try_epoll_add(pc.fd.get(), kPeerIdBase + h.rank, EPOLLIN)) return "epoll_ctl failed";
  p.fd = pc.fd.release();
  p.address = h.address;
  // Our hello tells the dialer its proof held: it may send data from then on.
  queue_control_locked(p, frame::Type::kHello, my_hello(pc.nonce));
  p.handshake = Handshake::kDone;
  flush_locked(p, lk);
  cv_.notify_all();
  return {};
}

// Refuses the strays whose hello did not come within kHelloTimeout.
void Core::refuse_overdue_pending() {
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

}  // namespace gradsync::transport::tcp
