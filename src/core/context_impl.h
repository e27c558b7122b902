// The state behind gradsync::Context: the transport, the call sequence, the cost model,
// the async worker, and the sticky failure that stops a broken communicator for good.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/signature.h"
#include "collectives/topology.h"
#include "gradsync/gradsync.h"
#include "cost/cost_model.h"
#include "transport/transport.h"

namespace gradsync {

struct Work::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
};

struct Context::Impl {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  std::chrono::milliseconds timeout{300000};
  Algorithm forced_algorithm = Algorithm::kAuto;
  cost::CostModel cost;
  collectives::AlgorithmConfig config;
  std::unique_ptr<transport::Transport> transport;
  std::vector<std::string> peer_transport;  // name per peer, for transport_name()
  collectives::Topology topology;           // hosts and ring order (init() fills it in)
  std::shared_ptr<Store> store;             // kept alive for the context's lifetime
  std::unique_ptr<TcpStoreServer> store_server;

  Impl() = default;
  ~Impl();

  // Runs one collective: assigns the next sequence number, runs `body` on the worker
  // (async) or inline after earlier async calls (blocking). Issuing thread only.
  Work submit(collectives::CallSignature sig, std::function<void(collectives::Comm&)> body,
              bool blocking);

  Algorithm pick_allreduce(std::size_t bytes, Algorithm requested) const;

  // After the context's own set-up calls (topology check, calibration), so that the user's
  // first call is #1 however many there were. Only with no call in flight. Tags stay
  // distinct from the set-up calls' all the same: those are of kind kInternal.
  void restart_sequence() { next_seq_ = 1; }

 private:
  struct Task {
    collectives::CallSignature sig;
    std::function<void(collectives::Comm&)> body;
    std::shared_ptr<Work::State> state;
  };
  void execute(Task& task);  // caller holds exec_mu_
  void worker_loop();
  void drain();  // waits until the async queue is empty and idle

  std::uint64_t next_seq_ = 1;
  std::mutex exec_mu_;                  // serialises use of the transport
  std::optional<std::string> failure_;  // guarded by exec_mu_; sticky
  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<Task> queue_;  // guarded by queue_mu_
  bool busy_ = false;       // worker is running a task; guarded by queue_mu_
  bool stopping_ = false;
  std::thread worker_;
};

// Wraps an existing transport (tests: inproc) into a context; calibrates the cost model
// unless `cost` is given. `host_of` labels each rank's host (empty: one host), unless
// options.topology groups the ranks explicitly; every rank must arrive at the same topology
// (kMismatch otherwise). Collective over all ranks of the transport.
std::unique_ptr<Context> make_context(std::unique_ptr<transport::Transport> transport,
                                      const Options& options,
                                      std::optional<cost::LinkParams> cost = std::nullopt,
                                      const std::vector<std::string>& host_of = {});

}  // namespace gradsync
