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
#include "cost/cost_model.h"
#include "gradsync/gradsync.h"
#include "transport/transport.h"

namespace gradsync {

struct Work::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  bool skipped = false;  // a compressed all-reduce under NonFinite::kSkip found NaN or Inf
  // The call's error. Kept as a value that every wait() throws a copy of, so each exception
  // object belongs to the thread that throws it: an exception_ptr made on the worker would be
  // freed by whichever thread drops it last, ordered only by libstdc++'s own count.
  std::optional<Error> error;
  std::exception_ptr other_error;              // anything but a gradsync::Error (bad_alloc...)
  std::vector<std::function<void()>> on_done;  // run once, after `done` is set
  void rethrow_if_failed() const {
    if (error) throw Error(*error);
    if (other_error) std::rethrow_exception(other_error);
  }
};

// An error every rank raises alike from data they all hold (a NaN that the ranks settled on
// together): the call fails, but the communicator stays usable, as no rank was left waiting.
// Any other error inside a call aborts the communicator on every rank.
class AgreedError : public Error {
 public:
  explicit AgreedError(const Error& e) : Error(e) {}
};

class CallSteps;

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

  // Queues one call: assigns the next sequence number and runs `body` on the worker (async)
  // or inline after every earlier call (blocking), in issue order either way. The body runs
  // the call's collectives as steps (see CallSteps). `timeout` 0: the context's. Issuing
  // thread only.
  Work submit_steps(collectives::CallSignature sig, std::function<void(CallSteps&)> body,
                    bool blocking, std::chrono::milliseconds timeout = {});
  // A call of one collective, `sig` itself.
  Work submit(collectives::CallSignature sig, std::function<void(collectives::Comm&)> body,
              bool blocking, std::chrono::milliseconds timeout = {});

  Algorithm pick_allreduce(std::size_t bytes, Algorithm requested) const;

  // After the context's own set-up calls (topology check, calibration), so that the user's
  // first call is #1 however many there were. Only with no call in flight. Tags stay
  // distinct from the set-up calls' all the same: those are of kind kInternal.
  void restart_sequence() { next_seq_ = 1; }

 private:
  struct Task {
    collectives::CallSignature sig;
    std::function<void(CallSteps&)> body;
    std::shared_ptr<Work::State> state;
    std::chrono::milliseconds timeout;
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

// The collectives of one queued call, run in order by the thread that executes it (the
// context's worker, or the caller of a blocking call). Each is a step of the call: its tag
// holds the call's sequence number and the step's number, so ranks match a composite call
// (a compressed all-reduce: an all-gather of NaN reports, then the codec's exchange) step by
// step, and a call never waits on the context's queue it is running on.
class CallSteps {
 public:
  CallSteps(Context::Impl& context, const collectives::CallSignature& call,
            transport::Clock::time_point deadline)
      : context_(context), call_(call), deadline_(deadline) {}

  const Context::Impl& context() const { return context_; }
  int rank() const { return context_.rank; }
  int size() const { return context_.size; }
  const collectives::CallSignature& call() const { return call_; }

  // One step: `sig` gets the call's sequence number, the next step number, and (if it has
  // none) the call's root, which for a compressed all-reduce is its codec's hash: ranks that
  // pass different codecs fail with kMismatch at the first message.
  void run(collectives::CallSignature sig, const std::function<void(collectives::Comm&)>& body);

  void allreduce(const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op,
                 Algorithm requested = Algorithm::kAuto);
  void allgather(const void* send, void* recv, std::size_t send_count, DataType dtype);
  void allgatherv(const void* send, void* recv, std::span<const std::size_t> counts,
                  DataType dtype);

  // The call's result for Work::skipped().
  void mark_skipped() { skipped_ = true; }
  bool skipped() const { return skipped_; }

 private:
  Context::Impl& context_;
  collectives::CallSignature call_;
  transport::Clock::time_point deadline_;
  std::uint16_t next_step_ = 0;  // wraps after 65536 steps: per pair, messages stay in order
  bool skipped_ = false;
};

// Runs an all-reduce of `chosen` (never kAuto) on `c`.
void run_allreduce(collectives::Comm& c, const Context::Impl& context, const void* send, void* recv,
                   std::size_t count, DataType dtype, ReduceOp op, Algorithm chosen);

namespace detail {
// Internal code's way to the implementation behind a public Context.
struct ContextAccess {
  static Context::Impl& impl(Context& ctx) { return *ctx.impl_; }
  static const Context::Impl& impl(const Context& ctx) { return *ctx.impl_; }
};
}  // namespace detail

// Wraps an existing transport (tests: inproc) into a context; calibrates the cost model
// unless `cost` is given. `host_of` labels each rank's host (empty: one host), unless
// options.topology groups the ranks explicitly; every rank must arrive at the same topology
// (kMismatch otherwise). Collective over all ranks of the transport.
std::unique_ptr<Context> make_context(std::unique_ptr<transport::Transport> transport,
                                      const Options& options,
                                      std::optional<cost::LinkParams> cost = std::nullopt,
                                      const std::vector<std::string>& host_of = {});

}  // namespace gradsync
