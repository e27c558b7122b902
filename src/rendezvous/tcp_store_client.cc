// The TCP store's client: thread-safe, one connection, a hello that says who this rank is,
// and connect retry until its timeout.
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

class TcpStoreClient final : public Store {
 public:
  TcpStoreClient(std::string host, int port, std::string token,
                 std::chrono::milliseconds connect_timeout, const TcpStoreIdentity& identity)
      : host_(std::move(host)),
        port_(port),
        token_(std::move(token)),
        connect_timeout_(clamp_timeout(connect_timeout)),
        name_("tcp store " + net::join_host_port(host_, port_)),
        hello_(make_hello(identity)) {
    std::lock_guard lock(mu_);
    connect_locked();  // fail at creation, where the error is easiest to place
  }

  void set(const std::string& key, const Bytes& value) override {
    check_key(key);
    if (value.size() > sp::kMaxValueBytes) {
      throw Error(ErrorKind::kInvalidArgument,
                  "value of key '" + key + "' is over the " + std::to_string(sp::kMaxValueBytes) +
                      "-byte limit",
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
      throw Error(ErrorKind::kInvalidArgument,
                  "wait on more than " + std::to_string(sp::kMaxWaitKeys) + " keys",
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
      throw Error(ErrorKind::kInvalidArgument,
                  "key longer than " + std::to_string(sp::kMaxKeyBytes) + " bytes",
                  Error::kUnknownRank, Error::kNoPeer, name_, key.size());
    }
  }

  // Our proof of the token for the server's challenge (its nonce and its own proof, which
  // must hold first: a server without the token learns nothing it could use); nullopt if the
  // server's proof does not hold.
  std::optional<sp::Request> proof_for(const sp::Request& hello,
                                       const sp::Response& challenge) const {
    const std::string value(challenge.value.begin(), challenge.value.end());
    const std::string server_nonce = value.substr(0, net::kNonceBytes);
    const std::string binding = sp::proof_binding(hello_);
    if (value.size() != net::kNonceBytes + net::kProofBytes ||
        !net::proof_holds(value.substr(net::kNonceBytes), token_, sp::kServerRole, hello.key,
                          server_nonce, binding)) {
      return std::nullopt;
    }
    sp::Request proof;
    proof.type = sp::RequestType::kProof;
    proof.key = net::prove(token_, sp::kClientRole, hello.key, server_nonce, binding);
    return proof;
  }

  static sp::Hello make_hello(const TcpStoreIdentity& identity) {
    sp::Hello h;
    h.rank = identity.rank;
    h.world_size = identity.world_size;
    h.pid = static_cast<std::uint32_t>(::getpid());
    char name[256] = {};
    ::gethostname(name, sizeof name - 1);
    h.host = std::string(name).substr(0, sp::kMaxHostBytes);
    // Tells this client's reconnects apart from another process announcing the same rank.
    std::random_device rd;
    h.client_id = (static_cast<std::uint64_t>(rd()) << 32) ^ rd() ^ h.pid;
    return h;
  }

  // Connects and says hello. The server may drop a connection before reading its hello
  // when it is flooded with others: that connection is tried again until the timeout. A
  // hello it answers with a refusal fails at once, naming why. Caller holds mu_.
  void connect_locked() {
    const auto deadline = Clock::now() + connect_timeout_;
    auto backoff = std::chrono::milliseconds(5);
    for (;;) {
      fd_ = net::connect_tcp(host_, port_, deadline, "tcp store");
      reader_ = sp::MessageReader();
      sp::Request hello;
      hello.type = sp::RequestType::kHello;
      hello.key = net::fresh_nonce();
      hello.hello = hello_;
      sp::Response resp;
      try {
        resp = exchange_locked(hello, deadline + kReplyGrace);
        // Its challenge proves it holds the token; then our proof admits us (or is refused).
        if (resp.status == sp::Status::kOk) {
          auto proof = proof_for(hello, resp);
          if (!proof) {
            // An empty proof proves nothing but lets the server note who it refused, so the
            // other ranks' timeout can name this one.
            sp::Request nothing;
            nothing.type = sp::RequestType::kProof;
            exchange_locked(nothing, deadline + kReplyGrace);
            throw Error(ErrorKind::kProtocol,
                        "wrong token: the store at " + net::join_host_port(host_, port_) +
                            " did not prove the job token (another job's store, or a different "
                            "GRADSYNC_TOKEN)",
                        hello_.rank, Error::kNoPeer, name_);
          }
          resp = exchange_locked(*proof, deadline + kReplyGrace);
        }
      } catch (const Error& e) {
        fd_.reset();
        if (e.kind() != ErrorKind::kPeerLost) {
          throw Error(ErrorKind::kProtocol, "no valid answer to this client's hello: " + e.detail(),
                      hello_.rank, Error::kNoPeer, name_);
        }
        resp.status = sp::Status::kBusy;
        resp.message = e.detail();
      }
      switch (resp.status) {
        case sp::Status::kOk:
          return;
        case sp::Status::kJobFailed:
          job_failed(resp.message);
        case sp::Status::kBusy:
          break;
        case sp::Status::kError:
        case sp::Status::kTimeout:
          fd_.reset();
          throw Error(ErrorKind::kProtocol, "server refused the connection: " + resp.message,
                      hello_.rank, Error::kNoPeer, name_);
      }
      fd_.reset();
      const auto now = Clock::now();
      if (now >= deadline) {
        throw Error(ErrorKind::kTimeout,
                    "the server dropped every connection before authenticating it, the last "
                    "one: " +
                        resp.message,
                    hello_.rank, Error::kNoPeer, name_);
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    }
  }

  [[noreturn]] void job_failed(const std::string& why) {
    fd_.reset();
    // The ranks were started inconsistently: the caller's mistake, not a broken peer.
    throw Error(ErrorKind::kInvalidArgument, why, hello_.rank, Error::kNoPeer, name_);
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
        if (e.kind() == ErrorKind::kTimeout && !req.keys.empty())
          throw_store_timeout(name_, req.keys, timeout);
        if (e.kind() == ErrorKind::kTimeout && req.type == sp::RequestType::kGet) {
          throw_store_timeout(name_, {req.key}, timeout);
        }
        throw;
      }
      switch (resp.status) {
        case sp::Status::kOk:
          return resp;
        case sp::Status::kTimeout:
          throw_store_timeout(name_, resp.missing, timeout, resp.message);
        case sp::Status::kJobFailed:
          job_failed(resp.message);
        case sp::Status::kBusy:
        case sp::Status::kError:
          throw Error(ErrorKind::kProtocol,
                      std::string(sp::to_string(req.type)) + " '" + req.key +
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
      if (r == sp::MessageReader::Result::kTooLong)
        protocol("reply longer than the protocol allows");
      if (r == sp::MessageReader::Result::kMessage) {
        std::string why;
        auto resp = sp::parse_response(req.type, body, &why);
        if (!resp) protocol("malformed reply: " + why);
        return *resp;
      }
      auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
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
    throw Error(ErrorKind::kPeerLost, "connection lost: " + why, Error::kUnknownRank,
                Error::kNoPeer, name_);
  }
  [[noreturn]] void protocol(const std::string& why) const {
    throw Error(ErrorKind::kProtocol, why, Error::kUnknownRank, Error::kNoPeer, name_);
  }

  const std::string host_;
  const int port_;
  const std::string token_;
  const std::chrono::milliseconds connect_timeout_;
  const std::string name_;
  const sp::Hello hello_;
  std::mutex mu_;  // serialises requests: the protocol has one outstanding request per connection
  net::Fd fd_;     // guarded by mu_
  sp::MessageReader reader_;  // guarded by mu_
};

}  // namespace

std::shared_ptr<Store> make_tcp_store(const std::string& host, int port, const std::string& token,
                                      std::chrono::milliseconds connect_timeout,
                                      const TcpStoreIdentity& identity) {
  return std::make_shared<TcpStoreClient>(host, port, token, connect_timeout, identity);
}

std::shared_ptr<Store> make_tcp_store(const std::string& host, int port, const std::string& token,
                                      std::chrono::milliseconds connect_timeout) {
  return make_tcp_store(host, port, token, connect_timeout, TcpStoreIdentity{});
}

}  // namespace gradsync
