// TCP key-value store: a single-threaded epoll server that parks blocking get/wait
// requests until their keys appear, and a thread-safe client with connect retry.
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
#include <set>
#include <thread>
#include <unordered_map>

#include "gradsync/error.h"
#include "gradsync/store.h"
#include "rendezvous/socket.h"
#include "rendezvous/store_protocol.h"
#include "rendezvous/store_util.h"

namespace gradsync {

namespace {

namespace sp = store_protocol;
using Clock = std::chrono::steady_clock;

// Timeouts are clamped so `now + timeout` cannot overflow the clock's representation
// when a caller passes milliseconds::max() to mean "forever".
constexpr std::chrono::milliseconds kMaxTimeout = std::chrono::hours(24 * 365);
std::chrono::milliseconds clamp_timeout(std::chrono::milliseconds t) {
  return std::clamp(t, std::chrono::milliseconds(0), kMaxTimeout);
}

// ---------------------------------------------------------------------------------------
// Server

class TcpStoreServerImpl final : public TcpStoreServer {
 public:
  TcpStoreServerImpl(const std::string& bind_addr, int port, std::string token)
      : token_(std::move(token)) {
    listener_ = net::listen_tcp(bind_addr, port, /*nonblocking=*/true);
    port_ = net::local_port(listener_.get());
    epoll_ = net::Fd(::epoll_create1(EPOLL_CLOEXEC));
    wake_ = net::Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
    if (!epoll_.valid() || !wake_.valid()) {
      throw Error(ErrorKind::kSystem, std::string("tcp store server setup: ") + std::strerror(errno));
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
  // A client that has not authenticated within this time is dropped, so idle or hostile
  // connections cannot pin file descriptors forever.
  static constexpr auto kAuthTimeout = std::chrono::seconds(30);
  // Legitimate clients send one request at a time, so more than two maximal messages
  // buffered in either direction means a misbehaving peer.
  static constexpr std::size_t kMaxBuffered = 2 * (sp::kMaxMessageBytes + sp::kLengthPrefixBytes);
  static constexpr std::size_t kMaxConnections = 65536;

  struct Conn {
    net::Fd fd;
    sp::MessageReader reader;
    sp::Bytes out;
    std::size_t out_pos = 0;
    bool authed = false;
    bool out_armed = false;
    std::uint64_t waiter = 0;  // id of the parked get/wait, 0 if none
    Clock::time_point auth_deadline;
  };
  struct Waiter {
    std::uint64_t conn = 0;
    sp::Request request;
    std::size_t missing = 0;  // distinct keys not yet present
    Clock::time_point deadline;
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

  void loop() {
    epoll_event events[64];
    for (;;) {
      int timeout_ms = next_timeout_ms();
      int n = ::epoll_wait(epoll_.get(), events, 64, timeout_ms);
      if (n < 0 && errno != EINTR) return;  // epoll itself broke: nothing left to serve with
      for (int i = 0; i < n; ++i) {
        std::uint64_t id = events[i].data.u64;
        if (id == kWakeId) return;
        if (id == kListenerId) {
          accept_all();
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
    }
  }

  int next_timeout_ms() const {
    if (deadlines_.empty() && auth_deadlines_.empty()) return -1;
    Clock::time_point next = Clock::time_point::max();
    if (!deadlines_.empty()) next = deadlines_.begin()->first;
    if (!auth_deadlines_.empty()) next = std::min(next, auth_deadlines_.begin()->first);
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count();
    return static_cast<int>(std::clamp<long long>(ms + 1, 0, 60000));
  }

  void accept_all() {
    for (;;) {
      int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN, or a transient error (EMFILE...): retried on next event
      if (conns_.size() >= kMaxConnections) {
        ::close(fd);
        continue;
      }
      net::set_nodelay(fd);
      std::uint64_t id = next_id_++;
      Conn& c = conns_[id];
      c.fd = net::Fd(fd);
      c.auth_deadline = Clock::now() + kAuthTimeout;
      auth_deadlines_.emplace(c.auth_deadline, id);
      add_fd(fd, id, EPOLLIN);
    }
  }

  void on_readable(std::uint64_t id, Conn& c) {
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
      if (r == sp::MessageReader::Result::kNeedMore) return;
      if (r == sp::MessageReader::Result::kTooLong) return close_conn(id);
      auto req = sp::parse_request(body);
      if (!req) return close_conn(id);  // garbage: never guess where the next message starts
      if (req->type == sp::RequestType::kAuth || !c.authed) {
        if (req->type != sp::RequestType::kAuth || !net::tokens_equal(req->key, token_)) {
          return close_conn(id);
        }
        if (!c.authed) {
          c.authed = true;
          erase_deadline(auth_deadlines_, c.auth_deadline, id);
        }
        respond(id, c, req->type, sp::Response{});
        continue;
      }
      handle(id, c, std::move(*req));
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
      case sp::RequestType::kCheck: resp.exists = data_.count(req.key) != 0; break;
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
        w.deadline = Clock::now() + clamp_timeout(std::chrono::milliseconds(
                                        std::min(req.timeout_ms, static_cast<std::uint64_t>(kMaxTimeout.count()))));
        w.request = std::move(req);
        for (const auto& k : missing) key_waiters_[k].push_back(wid);
        deadlines_.emplace(w.deadline, wid);
        c.waiter = wid;
        return;
      }
      case sp::RequestType::kAuth: break;  // handled in process()
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
    if (status == sp::Status::kTimeout) {
      std::set<std::string> missing;
      for (const auto& k : req.keys) {
        if (!data_.count(k)) missing.insert(k);
      }
      resp.missing.assign(missing.begin(), missing.end());
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
    while (!auth_deadlines_.empty() && auth_deadlines_.begin()->first <= now) {
      std::uint64_t id = auth_deadlines_.begin()->second;
      auth_deadlines_.erase(auth_deadlines_.begin());
      close_conn(id);
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
    if (!c.authed) erase_deadline(auth_deadlines_, c.auth_deadline, id);
    conns_.erase(it);  // closing the fd also removes it from the epoll set
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
  net::Fd listener_, epoll_, wake_;
  int port_ = 0;
  std::thread thread_;
  std::uint64_t next_id_ = 2;  // 0 and 1 name the listener and the wake-up eventfd
  std::unordered_map<std::uint64_t, Conn> conns_;
  std::unordered_map<std::string, sp::Bytes> data_;
  std::map<std::uint64_t, Waiter> waiters_;
  std::unordered_map<std::string, std::vector<std::uint64_t>> key_waiters_;
  std::multimap<Clock::time_point, std::uint64_t> deadlines_;       // waiter deadlines
  std::multimap<Clock::time_point, std::uint64_t> auth_deadlines_;  // unauthenticated conns
  std::vector<std::uint64_t> ready_;
};

// ---------------------------------------------------------------------------------------
// Client

class TcpStoreClient final : public Store {
 public:
  TcpStoreClient(std::string host, int port, std::string token, std::chrono::milliseconds connect_timeout)
      : host_(std::move(host)),
        port_(port),
        token_(std::move(token)),
        connect_timeout_(clamp_timeout(connect_timeout)),
        name_("tcp store " + net::join_host_port(host_, port_)) {
    std::lock_guard lock(mu_);
    connect_locked();  // fail at creation, where the error is easiest to place
  }

  void set(const std::string& key, const Bytes& value) override {
    check_key(key);
    if (value.size() > sp::kMaxValueBytes) {
      throw Error(ErrorKind::kInvalidArgument, "value of key '" + key + "' is over the " +
                                                   std::to_string(sp::kMaxValueBytes) + "-byte limit",
                  Error::kUnknownRank, Error::kNoPeer, name_, value.size());
    }
    sp::Request r;
    r.type = sp::RequestType::kSet;
    r.key = key;
    r.value = value;
    call(r, std::chrono::milliseconds(0), /*idempotent=*/true);
  }

  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override {
    check_key(key);
    sp::Request r;
    r.type = sp::RequestType::kGet;
    r.key = key;
    return call(r, timeout, true).value;
  }

  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    if (keys.size() > sp::kMaxWaitKeys) {
      throw Error(ErrorKind::kInvalidArgument, "wait on more than " + std::to_string(sp::kMaxWaitKeys) + " keys",
                  Error::kUnknownRank, Error::kNoPeer, name_);
    }
    for (const auto& k : keys) check_key(k);
    sp::Request r;
    r.type = sp::RequestType::kWait;
    r.keys = keys;
    call(r, timeout, true);
  }

  std::int64_t add(const std::string& key, std::int64_t delta) override {
    check_key(key);
    sp::Request r;
    r.type = sp::RequestType::kAdd;
    r.key = key;
    r.delta = delta;
    // Not retried: if the connection broke after the server applied it, a retry would
    // add twice.
    return call(r, std::chrono::milliseconds(0), false).number;
  }

  bool check(const std::string& key) override {
    check_key(key);
    sp::Request r;
    r.type = sp::RequestType::kCheck;
    r.key = key;
    return call(r, std::chrono::milliseconds(0), true).exists;
  }

 private:
  // How long a reply may take beyond the request's own timeout before the server is
  // presumed hung; generous because a loaded server answering late is not an error.
  static constexpr auto kReplyGrace = std::chrono::seconds(60);

  void check_key(const std::string& key) const {
    if (key.size() > sp::kMaxKeyBytes) {
      throw Error(ErrorKind::kInvalidArgument, "key longer than " + std::to_string(sp::kMaxKeyBytes) + " bytes",
                  Error::kUnknownRank, Error::kNoPeer, name_, key.size());
    }
  }

  // Caller holds mu_.
  void connect_locked() {
    fd_ = net::connect_tcp(host_, port_, Clock::now() + connect_timeout_, "tcp store");
    reader_ = sp::MessageReader();
    sp::Request auth;
    auth.type = sp::RequestType::kAuth;
    auth.key = token_;
    try {
      exchange_locked(auth, Clock::now() + connect_timeout_ + kReplyGrace);
    } catch (const Error& e) {
      fd_.reset();
      throw Error(ErrorKind::kProtocol,
                  "server refused the connection (wrong token?): " + e.detail(),
                  Error::kUnknownRank, Error::kNoPeer, name_);
    }
  }

  sp::Response call(const sp::Request& r, std::chrono::milliseconds timeout, bool idempotent) {
    timeout = clamp_timeout(timeout);
    sp::Request req = r;
    req.timeout_ms = static_cast<std::uint64_t>(timeout.count());
    std::lock_guard lock(mu_);
    for (int attempt = 0;; ++attempt) {
      if (!fd_.valid()) connect_locked();
      sp::Response resp;
      try {
        resp = exchange_locked(req, Clock::now() + timeout + kReplyGrace);
      } catch (const Error& e) {
        fd_.reset();  // the stream may hold half a reply: never reuse it
        if (e.kind() == ErrorKind::kPeerLost && idempotent && attempt == 0) continue;
        if (e.kind() == ErrorKind::kTimeout && !req.keys.empty()) throw_store_timeout(name_, req.keys, timeout);
        if (e.kind() == ErrorKind::kTimeout && req.type == sp::RequestType::kGet) {
          throw_store_timeout(name_, {req.key}, timeout);
        }
        throw;
      }
      switch (resp.status) {
        case sp::Status::kOk: return resp;
        case sp::Status::kTimeout: throw_store_timeout(name_, resp.missing, timeout);
        case sp::Status::kError:
          throw Error(ErrorKind::kProtocol, std::string(sp::to_string(req.type)) + " '" + req.key +
                                                "' failed on the server: " + resp.message,
                      Error::kUnknownRank, Error::kNoPeer, name_);
      }
      return resp;
    }
  }

  // Sends one request and reads its reply. Throws kPeerLost when the connection breaks,
  // kTimeout when no reply arrives by `deadline`, kProtocol on a malformed reply.
  sp::Response exchange_locked(const sp::Request& req, Clock::time_point deadline) {
    sp::Bytes msg = sp::encode_request(req);
    if (!net::write_all(fd_.get(), msg.data(), msg.size())) lost(std::strerror(errno));
    std::uint8_t buf[65536];
    for (;;) {
      std::span<const std::uint8_t> body;
      auto r = reader_.next(body);
      if (r == sp::MessageReader::Result::kTooLong) protocol("reply longer than the protocol allows");
      if (r == sp::MessageReader::Result::kMessage) {
        std::string why;
        auto resp = sp::parse_response(req.type, body, &why);
        if (!resp) protocol("malformed reply: " + why);
        return *resp;
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) {
        throw Error(ErrorKind::kTimeout, "no reply to " + std::string(sp::to_string(req.type)),
                    Error::kUnknownRank, Error::kNoPeer, name_);
      }
      pollfd p{fd_.get(), POLLIN, 0};
      int rc = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 60000)));
      if (rc < 0 && errno != EINTR) lost(std::strerror(errno));
      if (rc <= 0) continue;
      ssize_t n = ::recv(fd_.get(), buf, sizeof buf, 0);
      if (n == 0) lost("server closed the connection");
      if (n < 0) {
        if (errno == EINTR || errno == EAGAIN) continue;
        lost(std::strerror(errno));
      }
      reader_.append(buf, static_cast<std::size_t>(n));
    }
  }

  [[noreturn]] void lost(const std::string& why) const {
    throw Error(ErrorKind::kPeerLost, "connection lost: " + why, Error::kUnknownRank, Error::kNoPeer, name_);
  }
  [[noreturn]] void protocol(const std::string& why) const {
    throw Error(ErrorKind::kProtocol, why, Error::kUnknownRank, Error::kNoPeer, name_);
  }

  const std::string host_;
  const int port_;
  const std::string token_;
  const std::chrono::milliseconds connect_timeout_;
  const std::string name_;
  std::mutex mu_;  // serialises requests: the protocol has one outstanding request per connection
  net::Fd fd_;     // guarded by mu_
  sp::MessageReader reader_;  // guarded by mu_
};

}  // namespace

std::unique_ptr<TcpStoreServer> make_tcp_store_server(const std::string& bind_addr, int port,
                                                      const std::string& token) {
  return std::make_unique<TcpStoreServerImpl>(bind_addr, port, token);
}

std::shared_ptr<Store> make_tcp_store(const std::string& host, int port, const std::string& token,
                                      std::chrono::milliseconds connect_timeout) {
  return std::make_shared<TcpStoreClient>(host, port, token, connect_timeout);
}

}  // namespace gradsync
