// The state behind gradsync::Context: the transport, the call sequence, the cost model,
// the async worker, and the sticky failure that stops a broken communicator for good.
#pragma once

#include <atomic>
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

// A copy of `e` that shares nothing with it. A plain copy shares the message buffer, which
// libstdc++ counts with atomics ThreadSanitizer cannot see: the worker freeing a call's error
// after the caller's copy was read and dropped would look like a race.
inline Error unshared_copy(const Error& e) {
  return Error(e.kind(), e.detail(), e.rank(), e.peer(), e.op(), e.bytes());
}

struct Work::State {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  bool skipped = false;  // a compressed all-reduce under NonFinite::kSkip found NaN or Inf
  // The call's error. Kept as a value that every wait() throws an unshared copy of, so each
  // exception object belongs to the thread that throws it: an exception_ptr made on the worker
  // would be freed by whichever thread drops it last, ordered only by libstdc++'s own count.
  // (The worker often drops the state last: it completes blocking sends and recvs.)
  std::optional<Error> error;
  std::exception_ptr other_error;              // anything but a gradsync::Error (bad_alloc...)
  std::vector<std::function<void()>> on_done;  // run once, after `done` is set
  // The context whose async queue holds the call until it completes: Work::wait may run it
  // there (Context::Impl::run_if_next). Null for calls that never queue.
  Context::Impl* queued_in = nullptr;
  // A thread waits for the call (Work::wait found the worker busy): once the call is in
  // flight, the worker tests its calls in flight longer before it sleeps (PollBackoff).
  std::atomic<bool> awaited{false};
  void rethrow_if_failed() const {
    if (error) throw unshared_copy(*error);
    if (other_error) std::rethrow_exception(other_error);
  }
};

// Settles a call: records its outcome and wakes whoever waits on its Work. Every call, queued
// or blocking, collective or point-to-point, completes here and nowhere else.
void complete_work(Work::State& state, std::optional<Error> error,
                   std::exception_ptr other_error = nullptr, bool skipped = false);

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
  // A call of one collective, `sig` itself, with the caller's timeout and fingerprint.
  Work submit(collectives::CallSignature sig, std::function<void(collectives::Comm&)> body,
              bool blocking, const CallOptions& options = {});
  // A point-to-point call: which way, with whom, and its buffer (read for a send).
  struct P2p {
    bool is_send = false;
    int peer = -1;
    void* data = nullptr;
    std::size_t bytes = 0;
  };
  // Queues a send to or a receive from a peer (see context_p2p.cc), handed to the transport
  // tagged `sig`. `sig` gets the pair's next message number, not a call number, as only the
  // two ranks issue it. The worker posts it in issue order, but does not wait for it before
  // posting the point-to-point calls queued behind it. `blocking`: its issuer waits for it
  // next, so where the worker is idle and nothing is queued it runs on the issuing thread at
  // once (as run_if_next would, without showing it to the worker first).
  Work submit_p2p(collectives::CallSignature sig, P2p p2p, bool blocking,
                  std::chrono::milliseconds timeout);

  Algorithm pick_allreduce(std::size_t bytes, Algorithm requested) const;

  // Runs the queued call of `state` on the calling thread, as the worker would, if it is next
  // in the queue and the worker is idle (a point-to-point call: if it is the only one queued);
  // true if it did. A thread about to wait for a call spares the hand-off to the worker and
  // back: two wake-ups, each a wait for a core where ranks outnumber cores. Calls still run one
  // at a time and in issue order.
  // Where it cannot because the worker is busy, it marks the call awaited and wakes the worker
  // from a sleep between tests.
  bool run_if_next(Work::State* state);
  // Whether run_if_next may: only where this host has a core per rank. With more ranks than
  // cores the worker, woken for every call, competes with the waiter for a core and waiting
  // calls measured slower than hand-offs (docs/performance-notes.md).
  bool waiters_run_calls = false;

  // After the context's own set-up calls (topology check, calibration), so that the user's
  // first call is #1 however many there were. Only with no call in flight. Tags stay
  // distinct from the set-up calls' all the same: those are of kind kInternal.
  void restart_sequence() { next_seq_ = 1; }

 private:
  struct Task {
    collectives::CallSignature sig;
    std::function<void(CallSteps&)> body;
    std::shared_ptr<Work::State> state;
    std::chrono::milliseconds timeout{0};
    // A point-to-point call instead of `body`: posts its one transport request, tagged `sig`.
    std::optional<P2p> p2p{};
  };
  // A point-to-point call whose request is posted and not yet complete (worker thread only).
  struct InFlight {
    transport::RequestPtr request;
    std::shared_ptr<Work::State> state;
    transport::Clock::time_point deadline;
    std::chrono::milliseconds limit;
    P2p p2p;
    collectives::CallSignature sig;
  };
  // "send to rank 3: p2p #2 (...)", for its errors: built only for one.
  static std::string describe(const InFlight& call);
  // Whether a thread waits for one of the calls in flight (worker thread only).
  bool flight_awaited() const;
  // Runs `task` on this thread, which has set running_here_, and clears it.
  void run_here(Task& task);
  void execute(Task& task);  // caller holds exec_mu_
  void enqueue(Task task);   // for the worker; issuing thread
  void worker_loop();
  void drain();  // waits until the async queue is empty and idle
  // The error a failure inside a call becomes, naming the call `what`: a timeout first finds
  // the rank the job waits for; then the communicator fails for good and every peer is told.
  // Caller holds exec_mu_.
  Error fail_call(const Error& e, const std::string& what, std::chrono::milliseconds limit);
  // Point-to-point calls (context_p2p.cc); caller holds exec_mu_. Posts the task's request;
  // nullopt where that failed (its Work is settled then).
  std::optional<InFlight> post_p2p(Task& task);
  // The worker's: posts the task and keeps it in flight.
  void start_p2p(Task& task);
  // `block`: waits for every call in flight (no call that could be posted now is queued);
  // else one test of each. True if any completed or moved bytes.
  bool progress_p2p(bool block);
  // Tests one call, or waits for it (`block`, or past its deadline); settles its Work and
  // returns true once it completed.
  bool settle_p2p(InFlight& call, bool block);
  void finish_p2p(InFlight& call, std::optional<Error> error, std::exception_ptr other = nullptr);

  std::uint64_t next_seq_ = 1;
  std::vector<std::uint64_t> sent_to_, received_from_;  // messages per peer; issuing thread
  std::mutex exec_mu_;                                  // serialises use of the transport
  std::optional<std::string> failure_;                  // guarded by exec_mu_; sticky
  std::deque<InFlight> in_flight_;                      // worker thread only
  std::uint64_t in_flight_bytes_moved_ = 0;  // the traffic of their peers at the last test
  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<Task> queue_;  // guarded by queue_mu_
  // Calls ever enqueued: a worker spinning for the next call watches it without the lock.
  std::atomic<std::uint64_t> enqueued_{0};
  // Worker is running a task or has point-to-point calls in flight; guarded by queue_mu_.
  bool busy_ = false;
  int draining_ = 0;           // threads in drain(), guarded by queue_mu_
  bool running_here_ = false;  // a waiting thread runs a call (run_if_next); queue_mu_
  bool awaited_news_ = false;  // a call in flight became awaited; queue_mu_
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
  void reduce_scatter(const void* send, void* recv, std::size_t recv_count, DataType dtype,
                      ReduceOp op);
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

// Argument checks of the public calls: each throws kInvalidArgument naming the call `op`.
// `what()` makes the message, only for a check that fails: every call runs these checks, and
// building their messages up front took a few allocations each, longer than the rest of a
// small call's path on this side of the transport.
template <class What>
void require(bool ok, const What& what, int rank, const char* op, std::size_t bytes = 0) {
  if (!ok) [[unlikely]] {
    throw Error(ErrorKind::kInvalidArgument, what(), rank, Error::kNoPeer, op, bytes);
  }
}
void check_buffer(const void* p, std::size_t count, const char* name, int rank, const char* op);
void check_dtype_op(DataType dtype, ReduceOp op, int rank, const char* name);

// The algorithm of the all-gathers and reduce-scatters (the signature names it), and the
// calls, on `c`.
Algorithm block_algorithm(const Context::Impl& context);
void run_allgatherv(collectives::Comm& c, const Context::Impl& context, const void* send,
                    void* recv, std::span<const std::size_t> counts, DataType dtype);
void run_reduce_scatter(collectives::Comm& c, const Context::Impl& context, const void* send,
                        void* recv, std::size_t recv_count, DataType dtype, ReduceOp op);

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
