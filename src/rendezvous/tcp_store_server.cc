// The TCP store's server: one epoll thread that parks blocking get/wait requests until their
// keys appear, admits a connection only after a bounded hello with the job's token, and checks
// what each rank says of itself against the others.
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <unordered_map>

#include "gradsync/error.h"
#include "gradsync/store.h"
#include "rendezvous/auth.h"
#include "rendezvous/socket.h"
#include "rendezvous/store_protocol.h"
#include "rendezvous/store_util.h"
#include "rendezvous/tcp_store.h"

namespace gradsync {

namespace {

namespace sp = store_protocol;
using Clock = std::chrono::steady_clock;

// Where the server notes ranks it refused for a wrong token. Such a connection cannot end the
// job (anyone who reaches the port could then end it), so the other ranks wait for it until
// their timeout; this note lets their timeout error say why the rank never came.
constexpr const char* kRefusedKey = "gradsync-store/refused";
// It travels in timeout replies, whose notes the protocol bounds.
constexpr std::size_t kMaxRefusedNoteBytes = std::min<std::size_t>(2048, sp::kMaxKeyBytes);

class TcpStoreServerImpl final : public TcpStoreServer {
 public:
  TcpStoreServerImpl(const std::string& bind_addr, int port, std::string token,
                     const TcpStoreServerOptions& options)
      : token_(std::move(token)), options_(options), world_(options.world_size) {
    options_.max_pending = std::max<std::size_t>(options_.max_pending, 2);
    listener_ = net::listen_tcp(bind_addr, port, /*nonblocking=*/true);
    port_ = net::local_port(listener_.get());
    epoll_ = net::Fd(::epoll_create1(EPOLL_CLOEXEC));
    wake_ = net::Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!epoll_.valid() || !wake_.valid()) {
      throw Error(ErrorKind::kSystem,
                  std::string("tcp store server setup: ") + std::strerror(errno));
    }
    add_fd(listener_.get(), kListenerId, EPOLLIN);
    add_fd(wake_.get(), kWakeId, EPOLLIN);
    thread_ = std::thread([this] { loop(); });
  }

  ~TcpStoreServerImpl() override {
    std::uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_.get(), &one, sizeof one);
    thread_.join();
  }

  int port() const override { return port_; }

 private:
  static constexpr std::uint64_t kListenerId = 0;
  static constexpr std::uint64_t kWakeId = 1;
  // Legitimate clients send one request at a time, so more than two maximal messages
  // buffered in either direction means a misbehaving peer.
  static constexpr std::size_t kMaxBuffered = 2 * (sp::kMaxMessageBytes + sp::kLengthPrefixBytes);
  // The most bytes an unauthenticated connection may have sent: one whole hello.
  static constexpr std::size_t kMaxHelloWire = sp::kMaxHelloBytes + sp::kLengthPrefixBytes;
  // Authenticated connections that are not ranks, where the world size is not known.
  static constexpr std::size_t kMaxAnonymous = 1024;

  struct Conn {
    net::Fd fd;
    sp::MessageReader reader{sp::kMaxHelloBytes};  // raised once authenticated
    sp::Bytes out;
    std::size_t out_pos = 0;
    bool authed = false;
    // Its hello and the two nonces, once it sent the hello and we our challenge.
    std::optional<sp::Request> hello;
    std::string server_nonce;
    bool anonymous = false;  // authenticated without announcing a rank
    bool out_armed = false;
    int rank = -1;             // the rank it announced
    std::uint64_t waiter = 0;  // id of the parked get/wait, 0 if none
    Clock::time_point hello_deadline;
  };
  struct Waiter {
    std::uint64_t conn = 0;
    sp::Request request;
    std::size_t missing = 0;  // distinct keys not yet present
    Clock::time_point deadline;
  };
  // A rank announced by a connection that is still open.
  struct Claim {
    std::uint64_t conn = 0;
    sp::Hello hello;
  };

  // All members below are touched by the server thread only (after construction).
  void add_fd(int fd, std::uint64_t id, std::uint32_t events) {
    epoll_event ev{};
    ev.events = events;
    ev.data.u64 = id;
    if (::epoll_ctl(epoll_.get(), EPOLL_CTL_ADD, fd, &ev) != 0) {
      throw Error(ErrorKind::kSystem, std::string("epoll_ctl: ") + std::strerror(errno));
    }
  }

  std::size_t authed_count() const { return conns_.size() - pending_.size(); }

  // Whether every rank has heard why the job failed, or will at its next request: each one
  // said hello (and got the answer, or has a connection open to get it), and none is still
  // connected.
  bool everyone_told() const {
    return authed_count() == 0 && (world_ <= 0 || seen_.size() >= static_cast<std::size_t>(world_));
  }

  void loop() {
    epoll_event events[64];
    // Once the job failed, the server outlives its owner a little so that ranks still
    // connected (or about to connect) learn why instead of finding nobody there.
    bool draining = false;
    Clock::time_point linger_until = Clock::time_point::max();
    for (;;) {
      int timeout_ms = next_timeout_ms(linger_until);
      int n = ::epoll_wait(epoll_.get(), events, 64, timeout_ms);
      if (n < 0 && errno != EINTR) return;  // epoll itself broke: nothing left to serve with
      bool accept_now = false;
      for (int i = 0; i < n; ++i) {
        std::uint64_t id = events[i].data.u64;
        if (id == kWakeId) {
          if (failure_.empty() || everyone_told()) return;
          std::uint64_t count = 0;
          [[maybe_unused]] ssize_t r = ::read(wake_.get(), &count, sizeof count);
          draining = true;
          linger_until = Clock::now() + options_.linger;
          continue;
        }
        if (id == kListenerId) {
          accept_now = true;
          continue;
        }
        auto it = conns_.find(id);
        if (it == conns_.end()) continue;  // closed earlier in this batch
        if (events[i].events & (EPOLLIN | EPOLLERR | EPOLLHUP)) on_readable(id, it->second);
        it = conns_.find(id);
        if (it != conns_.end() && (events[i].events & EPOLLOUT)) flush(id, it->second);
      }
      expire(Clock::now());
      drain_ready();
      // New connections only after the readable ones: a connection accepted in one round
      // has its hello read in the next before any accept can evict it.
      if (accept_now) accept_some();
      if (draining && (everyone_told() || Clock::now() >= linger_until)) return;
    }
  }

  int next_timeout_ms(Clock::time_point linger_until) const {
    Clock::time_point next = linger_until;
    if (!deadlines_.empty()) next = std::min(next, deadlines_.begin()->first);
    if (!hello_deadlines_.empty()) next = std::min(next, hello_deadlines_.begin()->first);
    if (next == Clock::time_point::max()) return -1;
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count();
    return static_cast<int>(std::clamp<long long>(ms + 1, 0, 60000));
  }

  // Accepts at most half the pending slots per round, so that a flood of connections
  // evicts only connections that have had a round to say hello in.
  void accept_some() {
    for (std::size_t i = 0; i < options_.max_pending / 2; ++i) {
      int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN, or a transient error (EMFILE...): retried on next event
      if (pending_.size() >= options_.max_pending) {
        reply_and_close(*pending_.begin(), sp::Status::kBusy,
                        "dropped before authenticating: more than " +
                            std::to_string(options_.max_pending) +
                            " connections were waiting to say hello");
      }
      net::set_nodelay(fd);
      std::uint64_t id = next_id_++;
      Conn& c = conns_[id];
      c.fd = net::Fd(fd);
      c.hello_deadline = Clock::now() + options_.hello_timeout;
      hello_deadlines_.emplace(c.hello_deadline, id);
      pending_.insert(id);
      add_fd(fd, id, EPOLLIN);
    }
  }

  void on_readable(std::uint64_t id, Conn& c) {
    if (!c.authed) {
      // Before authenticating, nothing beyond one hello is ever read, so an unauthenticated
      // peer cannot make the server hold more than a few KiB.
      std::uint8_t buf[kMaxHelloWire + 1];
      ssize_t n = ::recv(c.fd.get(), buf, kMaxHelloWire + 1 - c.reader.buffered(), 0);
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
      if (n <= 0) return close_conn(id);
      c.reader.append(buf, static_cast<std::size_t>(n));
      return process(id);
    }
    std::uint8_t buf[65536];
    // Bounded per event so one busy client cannot starve the others (level-triggered
    // epoll brings us back for the rest).
    for (int i = 0; i < 64; ++i) {
      ssize_t n = ::recv(c.fd.get(), buf, sizeof buf, 0);
      if (n > 0) {
        c.reader.append(buf, static_cast<std::size_t>(n));
        if (c.reader.buffered() > kMaxBuffered) return close_conn(id);
        if (static_cast<std::size_t>(n) < sizeof buf) break;
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (n < 0 && errno == EINTR) continue;
      return close_conn(id);  // EOF or reset: the client is gone
    }
    process(id);
  }

  // Handles the buffered requests of one connection until it blocks on a get/wait.
  void process(std::uint64_t id) {
    for (;;) {
      auto it = conns_.find(id);
      if (it == conns_.end()) return;
      Conn& c = it->second;
      if (c.waiter != 0) return;
      std::span<const std::uint8_t> body;
      auto r = c.reader.next(body);
      if (r == sp::MessageReader::Result::kNeedMore) {
        if (!c.authed && c.reader.buffered() > kMaxHelloWire) {
          return reply_and_close(id, sp::Status::kError, "sent more than a hello");
        }
        return;
      }
      if (r == sp::MessageReader::Result::kTooLong) {
        if (c.authed) return close_conn(id);
        return reply_and_close(id, sp::Status::kError,
                               "a hello is at most " + std::to_string(sp::kMaxHelloBytes) +
                                   " bytes; this connection announced more");
      }
      std::string why;
      auto req = sp::parse_request(body, &why);
      if (!c.authed) {
        if (!req) {
          return reply_and_close(id, sp::Status::kError,
                                 (c.hello ? "malformed proof: " : "malformed hello: ") + why);
        }
        if (!(c.hello ? admit(id, c, *req) : challenge(id, c, std::move(*req)))) return;
        continue;
      }
      // Garbage, or a second hello: never guess where the next message starts.
      if (!req || req->type == sp::RequestType::kProof || req->type == sp::RequestType::kHello) {
        return close_conn(id);
      }
      if (!failure_.empty()) {
        sp::Response resp;
        resp.status = sp::Status::kJobFailed;
        resp.message = failure_;
        respond(id, c, req->type, resp);
        continue;
      }
      handle(id, c, std::move(*req));
    }
  }

  // A proof of a wrong token from a hello that claims a rank not yet seen: noted under kRefusedKey
  // (one line per rank of the world at most, so a stranger cannot grow it).
  void note_refused(const sp::Request& req) {
    if (req.type != sp::RequestType::kHello || req.hello.rank < 0 || req.hello.rank >= world_ ||
        seen_.count(req.hello.rank) || !refused_.insert(req.hello.rank).second) {
      return;
    }
    const std::string line = "rank " + std::to_string(req.hello.rank) + " (pid " +
                             std::to_string(req.hello.pid) + " on host " + req.hello.host +
                             ") was refused: its GRADSYNC_TOKEN differs from this job's";
    sp::Bytes& note = data_[kRefusedKey];
    if (note.size() + line.size() + 2 > kMaxRefusedNoteBytes) return;
    if (!note.empty()) note.push_back(';');
    if (!note.empty()) note.push_back(' ');
    note.insert(note.end(), line.begin(), line.end());
  }

  // The first request of a connection, a hello with the client's nonce: answered with our
  // nonce and our proof of the job token. Nothing it claims is checked before its proof.
  bool challenge(std::uint64_t id, Conn& c, sp::Request req) {
    if (req.type != sp::RequestType::kHello) {
      reply_and_close(id, sp::Status::kError, "the first request must be a hello");
      return false;
    }
    if (req.key.size() != net::kNonceBytes) {
      reply_and_close(id, sp::Status::kError,
                      "a hello's nonce is not " + std::to_string(net::kNonceBytes) + " bytes");
      return false;
    }
    if (c.reader.buffered() != 0) {
      reply_and_close(id, sp::Status::kError, "sent requests before its hello was answered");
      return false;
    }
    sp::Response resp;
    try {
      c.server_nonce = net::fresh_nonce();
      const std::string proof = net::prove(token_, sp::kServerRole, req.key, c.server_nonce,
                                           sp::proof_binding(req.hello));
      resp.value.assign(c.server_nonce.begin(), c.server_nonce.end());
      resp.value.insert(resp.value.end(), proof.begin(), proof.end());
    } catch (const Error& e) {  // the server thread must not throw
      reply_and_close(id, sp::Status::kError, e.what());
      return false;
    }
    c.hello = std::move(req);
    respond(id, c, sp::RequestType::kHello, resp);
    return true;
  }

  // The second request: the client's proof of the token over both nonces. If it holds, checks
  // who the hello said it is against the ranks seen so far; true if it is now authenticated.
  bool admit(std::uint64_t id, Conn& c, const sp::Request& proof) {
    const sp::Request& req = *c.hello;
    bool holds = false;
    try {
      holds = proof.type == sp::RequestType::kProof &&
              net::proof_holds(proof.key, token_, sp::kClientRole, req.key, c.server_nonce,
                               sp::proof_binding(req.hello));
    } catch (const Error&) {
      holds = false;
    }
    if (!holds) {
      note_refused(req);
      reply_and_close(id, sp::Status::kError,
                      "wrong token: its proof does not hold (GRADSYNC_TOKEN must be the same "
                      "on every rank)");
      return false;
    }
    if (c.reader.buffered() != 0) {
      reply_and_close(id, sp::Status::kError, "sent requests before its proof was answered");
      return false;
    }
    const bool ranked = req.type == sp::RequestType::kHello && req.hello.rank >= 0;
    if (ranked && failure_.empty()) check_claim(req.hello);
    if (ranked && req.hello.rank < world_) seen_.insert(req.hello.rank);
    if (!failure_.empty()) {
      reply_and_close(id, sp::Status::kJobFailed, failure_);
      return false;
    }
    if (ranked) {
      auto old = claims_.find(req.hello.rank);
      // check_claim() let it through, so an old claim is this client's own connection from
      // before a reconnect: it is dead, whether or not its end has reached us yet.
      if (old != claims_.end() && old->second.conn != id) close_conn(old->second.conn);
      claims_[req.hello.rank] = Claim{id, req.hello};
      c.rank = req.hello.rank;
    } else {
      const std::size_t limit = options_.world_size > 0 ? options_.anonymous_slack : kMaxAnonymous;
      if (anonymous_ >= limit) {
        reply_and_close(id, sp::Status::kError,
                        "store full: " + std::to_string(limit) +
                            " connections that announce no rank are open already");
        return false;
      }
      ++anonymous_;
      c.anonymous = true;
    }
    c.authed = true;
    pending_.erase(id);
    erase_deadline(hello_deadlines_, c.hello_deadline, id);
    c.reader.set_max_body(sp::kMaxMessageBytes);
    respond(id, c, sp::RequestType::kProof, sp::Response{});
    return true;
  }

  static std::string who(const sp::Hello& h) {
    return "pid " + std::to_string(h.pid) + " on host " + (h.host.empty() ? "?" : h.host);
  }

  // Fails the job when a rank's hello contradicts what earlier ranks said.
  void check_claim(const sp::Hello& h) {
    const std::string rank = "rank " + std::to_string(h.rank);
    if (world_ <= 0) {
      world_ = h.world_size;
      world_source_ = h.rank;
    }
    if (h.world_size != world_) {
      return fail_job(rank + " (" + who(h) + ") was started with WORLD_SIZE=" +
                      std::to_string(h.world_size) + " but rank " + std::to_string(world_source_) +
                      " with WORLD_SIZE=" + std::to_string(world_) +
                      ": every rank must be started with the same WORLD_SIZE");
    }
    if (h.rank >= world_) {
      return fail_job(rank + " (" + who(h) +
                      ") is out of range for WORLD_SIZE=" + std::to_string(world_));
    }
    auto old = claims_.find(h.rank);
    if (old != claims_.end() && old->second.hello.client_id != h.client_id) {
      return fail_job("two processes claim " + rank + ": " + who(old->second.hello) + " and " +
                      who(h) + ": every rank must be started with its own RANK");
    }
  }

  // From now on every request is answered with `why`, the parked ones at once: their ranks
  // wait for keys that will never come.
  void fail_job(const std::string& why) {
    if (!failure_.empty()) return;
    failure_ = why;
    std::vector<std::uint64_t> ids;
    for (const auto& [wid, w] : waiters_) ids.push_back(wid);
    for (std::uint64_t wid : ids) {
      auto w = waiters_.find(wid);
      if (w != waiters_.end()) finish_waiter(w, sp::Status::kJobFailed);
    }
  }

  void handle(std::uint64_t id, Conn& c, sp::Request req) {
    sp::Response resp;
    switch (req.type) {
      case sp::RequestType::kSet:
        data_[req.key] = std::move(req.value);
        key_appeared(req.key);
        break;
      case sp::RequestType::kAdd: {
        auto& v = data_[req.key];
        try {
          // Wrapping arithmetic: an overflowing counter is the client's problem, not UB here.
          resp.number = static_cast<std::int64_t>(static_cast<std::uint64_t>(decode_int(v)) +
                                                  static_cast<std::uint64_t>(req.delta));
          v = encode_int(resp.number);
        } catch (const Error& e) {
          resp.status = sp::Status::kError;
          resp.message = e.detail();
        }
        key_appeared(req.key);
        break;
      }
      case sp::RequestType::kCheck:
        resp.exists = data_.count(req.key) != 0;
        break;
      case sp::RequestType::kGet:
      case sp::RequestType::kWait: {
        if (req.type == sp::RequestType::kGet) req.keys = {req.key};
        std::set<std::string> missing;
        for (const auto& k : req.keys) {
          if (!data_.count(k)) missing.insert(k);
        }
        if (missing.empty()) {
          if (req.type == sp::RequestType::kGet) resp.value = data_[req.key];
          break;
        }
        if (req.timeout_ms == 0) {
          resp.status = sp::Status::kTimeout;
          resp.missing.assign(missing.begin(), missing.end());
          break;
        }
        // Park it; the answer goes out from key_appeared() or expire().
        std::uint64_t wid = next_id_++;
        Waiter& w = waiters_[wid];
        w.conn = id;
        w.missing = missing.size();
        w.deadline =
            Clock::now() + clamp_timeout(std::chrono::milliseconds(std::min(
                               req.timeout_ms, static_cast<std::uint64_t>(kMaxTimeout.count()))));
        w.request = std::move(req);
        for (const auto& k : missing) key_waiters_[k].push_back(wid);
        deadlines_.emplace(w.deadline, wid);
        c.waiter = wid;
        return;
      }
      case sp::RequestType::kProof:
      case sp::RequestType::kHello:
        break;  // handled in challenge() and admit()
    }
    respond(id, c, req.type, resp);
  }

  void key_appeared(const std::string& key) {
    auto it = key_waiters_.find(key);
    if (it == key_waiters_.end()) return;
    std::vector<std::uint64_t> ids = std::move(it->second);
    key_waiters_.erase(it);
    for (std::uint64_t wid : ids) {
      auto w = waiters_.find(wid);
      if (w == waiters_.end()) continue;  // expired or its connection closed
      if (--w->second.missing == 0) finish_waiter(w, sp::Status::kOk);
    }
  }

  void finish_waiter(std::map<std::uint64_t, Waiter>::iterator w, sp::Status status) {
    Waiter waiter = std::move(w->second);
    std::uint64_t wid = w->first;
    waiters_.erase(w);
    erase_deadline(deadlines_, waiter.deadline, wid);
    auto c = conns_.find(waiter.conn);
    if (c == conns_.end()) return;
    c->second.waiter = 0;
    sp::Response resp;
    resp.status = status;
    const sp::Request& req = waiter.request;
    if (status == sp::Status::kJobFailed) {
      resp.message = failure_;
    } else if (status == sp::Status::kTimeout) {
      std::set<std::string> missing;
      for (const auto& k : req.keys) {
        if (!data_.count(k)) missing.insert(k);
      }
      resp.missing.assign(missing.begin(), missing.end());
      if (auto note = data_.find(kRefusedKey); note != data_.end()) {
        resp.message = to_string(note->second);
      }
    } else if (req.type == sp::RequestType::kGet) {
      resp.value = data_[req.key];
    }
    respond(waiter.conn, c->second, req.type, resp);
    // Requests it pipelined behind the get/wait run after this event batch, not here,
    // so a chain of wake-ups cannot recurse.
    ready_.push_back(waiter.conn);
  }

  void expire(Clock::time_point now) {
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      auto w = waiters_.find(deadlines_.begin()->second);
      if (w == waiters_.end()) {
        deadlines_.erase(deadlines_.begin());
        continue;
      }
      finish_waiter(w, sp::Status::kTimeout);
    }
    while (!hello_deadlines_.empty() && hello_deadlines_.begin()->first <= now) {
      std::uint64_t id = hello_deadlines_.begin()->second;
      hello_deadlines_.erase(hello_deadlines_.begin());
      // Busy, not refused: a real client that was only slow to say hello tries again.
      reply_and_close(id, sp::Status::kBusy,
                      "no hello within " + std::to_string(options_.hello_timeout.count()) +
                          " ms of connecting");
    }
  }

  void drain_ready() {
    while (!ready_.empty()) {
      std::uint64_t id = ready_.back();
      ready_.pop_back();
      process(id);
    }
  }

  void respond(std::uint64_t id, Conn& c, sp::RequestType type, const sp::Response& resp) {
    sp::Bytes msg = sp::encode_response(type, resp);
    if (c.out_pos == c.out.size()) {
      c.out.clear();
      c.out_pos = 0;
    }
    c.out.insert(c.out.end(), msg.begin(), msg.end());
    if (c.out.size() - c.out_pos > kMaxBuffered) return close_conn(id);
    flush(id, c);
  }

  void flush(std::uint64_t id, Conn& c) {
    while (c.out_pos < c.out.size()) {
      ssize_t n = ::send(c.fd.get(), c.out.data() + c.out_pos, c.out.size() - c.out_pos,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        c.out_pos += static_cast<std::size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      return close_conn(id);
    }
    bool want_out = c.out_pos < c.out.size();
    if (want_out != c.out_armed) {
      epoll_event ev{};
      ev.events = EPOLLIN | (want_out ? EPOLLOUT : 0u);
      ev.data.u64 = id;
      ::epoll_ctl(epoll_.get(), EPOLL_CTL_MOD, c.fd.get(), &ev);
      c.out_armed = want_out;
    }
  }

  void close_conn(std::uint64_t id) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    Conn& c = it->second;
    if (c.waiter != 0) {
      auto w = waiters_.find(c.waiter);
      if (w != waiters_.end()) {
        erase_deadline(deadlines_, w->second.deadline, c.waiter);
        waiters_.erase(w);
      }
    }
    if (!c.authed) {
      erase_deadline(hello_deadlines_, c.hello_deadline, id);
      pending_.erase(id);
    }
    if (c.anonymous) --anonymous_;
    auto claim = claims_.find(c.rank);
    if (claim != claims_.end() && claim->second.conn == id) claims_.erase(claim);
    conns_.erase(it);  // closing the fd also removes it from the epoll set
  }

  // Tells a connection that has not authenticated why it is dropped, then drops it. The
  // answer is small and nothing was sent on the connection before, so one non-blocking
  // send either takes it whole or the peer is gone anyway.
  void reply_and_close(std::uint64_t id, sp::Status status, const std::string& why) {
    auto it = conns_.find(id);
    if (it == conns_.end()) return;
    sp::Response resp;
    resp.status = status;
    resp.message = why;
    sp::Bytes msg = sp::encode_response(sp::RequestType::kHello, resp);
    [[maybe_unused]] ssize_t n =
        ::send(it->second.fd.get(), msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    close_conn(id);
  }

  static void erase_deadline(std::multimap<Clock::time_point, std::uint64_t>& m,
                             Clock::time_point when, std::uint64_t id) {
    auto [b, e] = m.equal_range(when);
    for (auto i = b; i != e; ++i) {
      if (i->second == id) {
        m.erase(i);
        return;
      }
    }
  }

  std::string token_;
  TcpStoreServerOptions options_;
  int world_ = 0;          // the world size every rank must announce; 0 until known
  int world_source_ = 0;   // the rank whose world size that is
  std::string failure_;    // why the job cannot go on; empty while it can
  std::set<int> refused_;  // ranks noted under kRefusedKey
  std::map<int, Claim> claims_;
  std::set<int> seen_;               // ranks below world_ that have said hello, whatever the answer
  std::set<std::uint64_t> pending_;  // unauthenticated connections, oldest (lowest id) first
  std::size_t anonymous_ = 0;
  net::Fd listener_, epoll_, wake_;
  int port_ = 0;
  std::thread thread_;
  std::uint64_t next_id_ = 2;  // 0 and 1 name the listener and the wake-up eventfd
  std::unordered_map<std::uint64_t, Conn> conns_;
  std::unordered_map<std::string, sp::Bytes> data_;
  std::map<std::uint64_t, Waiter> waiters_;
  std::unordered_map<std::string, std::vector<std::uint64_t>> key_waiters_;
  std::multimap<Clock::time_point, std::uint64_t> deadlines_;        // waiter deadlines
  std::multimap<Clock::time_point, std::uint64_t> hello_deadlines_;  // unauthenticated conns
  std::vector<std::uint64_t> ready_;
};

}  // namespace

std::unique_ptr<TcpStoreServer> make_tcp_store_server(const std::string& bind_addr, int port,
                                                      const std::string& token,
                                                      const TcpStoreServerOptions& options) {
  net::prepare_proofs();  // before the server's thread exists (see auth.h)
  return std::make_unique<TcpStoreServerImpl>(bind_addr, port, token, options);
}

std::unique_ptr<TcpStoreServer> make_tcp_store_server(const std::string& bind_addr, int port,
                                                      const std::string& token) {
  return make_tcp_store_server(bind_addr, port, token, TcpStoreServerOptions{});
}

}  // namespace gradsync
