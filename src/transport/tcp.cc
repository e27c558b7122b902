// The tcp transport as callers see it: TcpTransport, its requests, and make_tcp_transport,
// which connects every peer. The work is done by tcp::Core (tcp_core.h).
#include "transport/tcp.h"

#include <algorithm>

#include "transport/tcp_core.h"

namespace gradsync::transport {

namespace {

using tcp::Core;
using tcp::RecvOp;
using tcp::SendOp;

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
  StallReport explain_stall(Clock::duration grace) override { return core_->explain_stall(grace); }

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
  check_group(rank, world_size, group, "make_tcp_transport");
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
