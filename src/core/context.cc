// gradsync::Context: argument checks, call signatures, algorithm choice, blocking and
// async execution in issue order, and the sticky failure that aborts a broken communicator.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>

#include "core/context_impl.h"
#include "core/env.h"
#include "core/handoff_spin.h"
#include "kernels/kernels.h"
#include "transport/shared_arena.h"

namespace gradsync {

using collectives::CallSignature;
using collectives::CollectiveKind;
using collectives::Comm;

// ---- Work ----

bool Work::run_if_next() {
  if (!state_) return false;
  Context::Impl* queued_in = nullptr;
  {
    std::lock_guard lock(state_->mu);
    if (state_->done) return false;
    queued_in = state_->queued_in;
  }
  return queued_in && queued_in->run_if_next(state_.get());
}

void Work::wait() {
  if (!state_) return;
  run_if_next();
  detail::spin_until([&] { return test(); });
  std::unique_lock lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  state_->rethrow_if_failed();
}

bool Work::wait(std::chrono::milliseconds timeout) {
  if (!state_) return true;
  // Never runs the call here: that would wait as long as the call takes, not `timeout`.
  detail::spin_until([&] { return test(); });
  std::unique_lock lock(state_->mu);
  if (!state_->cv.wait_for(lock, timeout, [&] { return state_->done; })) return false;
  state_->rethrow_if_failed();
  return true;
}

bool Work::test() const {
  if (!state_) return true;
  std::lock_guard lock(state_->mu);
  return state_->done;
}

std::exception_ptr Work::error() const {
  if (!state_) return nullptr;
  std::lock_guard lock(state_->mu);
  if (!state_->done) return nullptr;
  if (state_->error) return std::make_exception_ptr(unshared_copy(*state_->error));
  return state_->other_error;
}

bool Work::skipped() {
  wait();
  if (!state_) return false;
  std::lock_guard lock(state_->mu);
  return state_->skipped;
}

void Work::on_done(std::function<void()> callback) {
  if (state_) {
    std::lock_guard lock(state_->mu);
    if (!state_->done) {
      state_->on_done.push_back(std::move(callback));
      return;
    }
  }
  callback();
}

// ---- Impl ----

Context::Impl::~Impl() {
  {
    std::lock_guard lock(queue_mu_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

Algorithm Context::Impl::pick_allreduce(std::size_t bytes, Algorithm requested) const {
  if (requested != Algorithm::kAuto) return requested;
  if (forced_algorithm != Algorithm::kAuto) return forced_algorithm;
  return cost.choose_allreduce(size, bytes, transport->shared_arena() != nullptr, topology.hosts());
}

Error Context::Impl::fail_call(const Error& e, const std::string& what,
                               std::chrono::milliseconds limit) {
  // A timeout names the peer this rank waited for, which may itself wait for another:
  // first find out which rank is stopped or hung and what the others wait on (a
  // stopped rank is then the error's peer). Grace: a quarter of the timeout, up to 2 s.
  std::string detail = e.detail();
  int peer = e.peer();
  if (e.kind() == ErrorKind::kTimeout) {
    const auto grace = std::min<std::chrono::milliseconds>(limit / 4, std::chrono::seconds(2));
    transport::StallReport stall;
    try {
      stall = transport->explain_stall(grace);
    } catch (const std::exception&) {
      // Only a diagnosis: the timeout itself is what must be raised.
    }
    if (!stall.detail.empty()) detail += "; " + stall.detail;
    if (stall.silent.size() == 1) peer = stall.silent.front();
  }
  // Name this call, then make the failure sticky and tell every peer, so no rank keeps
  // waiting on a communicator that can no longer complete.
  Error error(e.kind(), detail, rank, peer, what, e.bytes());
  failure_ = error.what();
  transport->abort(error.what());
  return error;
}

void Context::Impl::execute(Task& task) {
  bool skipped = false;
  std::optional<Error> error;
  std::exception_ptr other_error;
  if (failure_) {
    error = Error(ErrorKind::kAborted, "communicator failed earlier: " + *failure_, rank,
                  Error::kNoPeer, collectives::describe(task.sig));
  } else {
    const auto limit = task.timeout.count() > 0 ? task.timeout : timeout;
    CallSteps steps(*this, task.sig, transport::Clock::now() + limit);
    try {
      task.body(steps);
      skipped = steps.skipped();
    } catch (const AgreedError& e) {
      error = e;  // every rank raised it alike: nobody waits, the communicator goes on
    } catch (const Error& e) {
      error = fail_call(e, collectives::describe(task.sig), limit);
    } catch (...) {
      other_error = std::current_exception();
    }
  }
  complete_work(*task.state, std::move(error), std::move(other_error), skipped);
}

void complete_work(Work::State& state, std::optional<Error> error, std::exception_ptr other_error,
                   bool skipped) {
  std::vector<std::function<void()>> callbacks;
  {
    std::lock_guard lock(state.mu);
    state.skipped = skipped;
    state.error = std::move(error);
    state.other_error = std::move(other_error);
    state.done = true;
    state.queued_in = nullptr;
    callbacks.swap(state.on_done);
  }
  state.cv.notify_all();
  for (auto& callback : callbacks) callback();
}

Work Context::Impl::submit_steps(CallSignature sig, std::function<void(CallSteps&)> body,
                                 bool blocking, std::chrono::milliseconds call_timeout) {
  sig.seq = next_seq_++;
  auto state = std::make_shared<Work::State>();
  Task task;
  task.sig = sig;
  task.body = std::move(body);
  task.state = state;
  task.timeout = call_timeout;
  if (blocking) {
    drain();
    std::lock_guard exec(exec_mu_);
    execute(task);
  } else {
    enqueue(std::move(task));
  }
  return Work(state);
}

Work Context::Impl::submit(CallSignature sig, std::function<void(Comm&)> body, bool blocking,
                           const CallOptions& options) {
  sig.fingerprint = options.fingerprint;
  return submit_steps(
      sig, [sig, body = std::move(body)](CallSteps& steps) { steps.run(sig, body); }, blocking,
      options.timeout);
}

// ---- CallSteps ----

void CallSteps::run(CallSignature sig, const std::function<void(Comm&)>& body) {
  sig.seq = call_.seq;
  sig.step = next_step_++;
  if (sig.root == -1) sig.root = call_.root;
  Comm comm(*context_.transport, sig, deadline_, &context_.topology);
  body(comm);
}

void CallSteps::allreduce(const void* send, void* recv, std::size_t count, DataType dtype,
                          ReduceOp op, Algorithm requested) {
  const Algorithm chosen = context_.pick_allreduce(count * dtype_size(dtype), requested);
  const Context::Impl& context = context_;
  run({0, CollectiveKind::kAllreduce, dtype, op, chosen, -1, count},
      [&](Comm& c) { run_allreduce(c, context, send, recv, count, dtype, op, chosen); });
}

void CallSteps::allgather(const void* send, void* recv, std::size_t send_count, DataType dtype) {
  const std::vector<std::size_t> counts(static_cast<std::size_t>(size()), send_count);
  const Context::Impl& context = context_;
  run({0, CollectiveKind::kAllgather, dtype, ReduceOp::kSum, block_algorithm(context), -1,
       send_count * counts.size()},
      [&](Comm& c) { run_allgatherv(c, context, send, recv, counts, dtype); });
}

void CallSteps::reduce_scatter(const void* send, void* recv, std::size_t recv_count, DataType dtype,
                               ReduceOp op) {
  const Context::Impl& context = context_;
  run({0, CollectiveKind::kReduceScatter, dtype, op, block_algorithm(context), -1,
       recv_count * static_cast<std::size_t>(size())},
      [&](Comm& c) { run_reduce_scatter(c, context, send, recv, recv_count, dtype, op); });
}

void CallSteps::allgatherv(const void* send, void* recv, std::span<const std::size_t> counts,
                           DataType dtype) {
  const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
  const Context::Impl& context = context_;
  run({0, CollectiveKind::kAllgatherv, dtype, ReduceOp::kSum, block_algorithm(context),
       collectives::counts_digest(counts), total},
      [&](Comm& c) { run_allgatherv(c, context, send, recv, counts, dtype); });
}

// Where the ranks share memory, each byte of an all-gather or a reduce-scatter crosses it once,
// with no chain of hops; every rank sees the same, as the arena spans the whole world or no
// rank has one.
Algorithm block_algorithm(const Context::Impl& context) {
  return context.transport->shared_arena() ? Algorithm::kSharedMemory : Algorithm::kRing;
}

void run_allgatherv(Comm& c, const Context::Impl& context, const void* send, void* recv,
                    std::span<const std::size_t> counts, DataType dtype) {
  if (transport::SharedArena* arena = context.transport->shared_arena()) {
    collectives::shm_direct_allgatherv(c, *arena, send, recv, counts, dtype, context.config);
  } else {
    collectives::hierarchical_allgatherv(c, send, recv, counts, dtype, context.config);
  }
}

void run_reduce_scatter(Comm& c, const Context::Impl& context, const void* send, void* recv,
                        std::size_t recv_count, DataType dtype, ReduceOp op) {
  if (transport::SharedArena* arena = context.transport->shared_arena()) {
    collectives::shm_direct_reduce_scatter(c, *arena, send, recv, recv_count, dtype, op,
                                           context.config);
  } else {
    const std::vector<std::size_t> counts(static_cast<std::size_t>(c.size()), recv_count);
    collectives::hierarchical_reduce_scatter(c, send, recv, counts, dtype, op, context.config);
  }
}

void run_allreduce(Comm& c, const Context::Impl& context, const void* send, void* recv,
                   std::size_t count, DataType dtype, ReduceOp op, Algorithm chosen) {
  const auto& cfg = context.config;
  switch (chosen) {
    case Algorithm::kSharedMemory:
      // Where the ranks share no memory (several hosts, inproc) it is the ring; every rank
      // sees the same, as the arena spans the whole world or no rank has one.
      if (transport::SharedArena* arena = context.transport->shared_arena()) {
        collectives::shm_direct_allreduce(c, *arena, send, recv, count, dtype, op, cfg);
      } else {
        collectives::ring_allreduce(c, send, recv, count, dtype, op, cfg);
      }
      break;
    case Algorithm::kRecursiveDoubling:
      collectives::recursive_doubling_allreduce(c, send, recv, count, dtype, op);
      break;
    case Algorithm::kHalvingDoubling:
      collectives::halving_doubling_allreduce(c, send, recv, count, dtype, op);
      break;
    case Algorithm::kParameterServer:
      collectives::parameter_server_allreduce(c, send, recv, count, dtype, op);
      break;
    case Algorithm::kHierarchical:
      collectives::hierarchical_allreduce(c, send, recv, count, dtype, op, cfg);
      break;
    default:
      collectives::ring_allreduce(c, send, recv, count, dtype, op, cfg);
  }
}

// ---- Context ----

void check_buffer(const void* p, std::size_t count, const char* name, int rank, const char* op) {
  require(
      p != nullptr || count == 0, [&] { return std::string(name) + " buffer is null"; }, rank, op);
}

void check_dtype_op(DataType dtype, ReduceOp op, int rank, const char* name) {
  require(
      dtype_size(dtype) != 0,
      [&] { return "unknown dtype " + std::to_string(static_cast<int>(dtype)); }, rank, name);
  require(
      static_cast<int>(op) <= static_cast<int>(ReduceOp::kBxor),
      [&] { return "unknown reduce op " + std::to_string(static_cast<int>(op)); }, rank, name);
  // Refused here, on the calling thread, before any rank sends: a bitwise op on float bits
  // would be meaningless, and every rank makes the same call, so every rank refuses it.
  require(
      dtype_op_valid(dtype, op),
      [&] {
        return std::string("reduce op ") + to_string(op) +
               " is bitwise: it takes an integer or bool dtype, not " + to_string(dtype);
      },
      rank, name);
}

namespace {

Work allreduce_impl(Context::Impl& impl, const void* send, void* recv, std::size_t count,
                    DataType dtype, ReduceOp op, const CallOptions& options, bool blocking) {
  const char* name = "allreduce";
  check_dtype_op(dtype, op, impl.rank, name);
  check_buffer(send, count, "send", impl.rank, name);
  check_buffer(recv, count, "recv", impl.rank, name);
  const Algorithm chosen = impl.pick_allreduce(count * dtype_size(dtype), options.algorithm);
  CallSignature sig{0, CollectiveKind::kAllreduce, dtype, op, chosen, -1, count};
  const Context::Impl& context = impl;
  return impl.submit(
      sig,
      [=, &context](Comm& c) { run_allreduce(c, context, send, recv, count, dtype, op, chosen); },
      blocking, options);
}

Work reduce_scatter_impl(Context::Impl& impl, const void* send, void* recv, std::size_t recv_count,
                         DataType dtype, ReduceOp op, const CallOptions& options, bool blocking) {
  const char* name = "reduce_scatter";
  check_dtype_op(dtype, op, impl.rank, name);
  const std::size_t n = static_cast<std::size_t>(impl.size);
  check_buffer(send, recv_count * n, "send", impl.rank, name);
  check_buffer(recv, recv_count, "recv", impl.rank, name);
  CallSignature sig{
      0, CollectiveKind::kReduceScatter, dtype, op, block_algorithm(impl), -1, recv_count * n};
  const Context::Impl& context = impl;
  return impl.submit(
      sig,
      [=, &context](Comm& c) { run_reduce_scatter(c, context, send, recv, recv_count, dtype, op); },
      blocking, options);
}

Work allgatherv_impl(Context::Impl& impl, const void* send, void* recv,
                     std::vector<std::size_t> counts, DataType dtype, CollectiveKind kind,
                     const CallOptions& options, bool blocking) {
  const char* name = collectives::to_string(kind);
  check_dtype_op(dtype, ReduceOp::kSum, impl.rank, name);
  require(
      counts.size() == static_cast<std::size_t>(impl.size),
      [&] {
        return "recv_counts has " + std::to_string(counts.size()) + " entries for " +
               std::to_string(impl.size) + " ranks";
      },
      impl.rank, name);
  const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
  check_buffer(send, counts[static_cast<std::size_t>(impl.rank)], "send", impl.rank, name);
  check_buffer(recv, total, "recv", impl.rank, name);
  // An all-gather's counts are equal, given by the total; an all-gatherv's only by the digest.
  const std::int32_t root =
      kind == CollectiveKind::kAllgatherv ? collectives::counts_digest(counts) : -1;
  CallSignature sig{0, kind, dtype, ReduceOp::kSum, block_algorithm(impl), root, total};
  const Context::Impl& context = impl;
  return impl.submit(
      sig, [=, &context](Comm& c) { run_allgatherv(c, context, send, recv, counts, dtype); },
      blocking, options);
}

Work broadcast_impl(Context::Impl& impl, void* data, std::size_t count, DataType dtype, int root,
                    const CallOptions& options, bool blocking) {
  const char* name = "broadcast";
  check_dtype_op(dtype, ReduceOp::kSum, impl.rank, name);
  require(
      root >= 0 && root < impl.size,
      [&] { return "root " + std::to_string(root) + " is not a rank"; }, impl.rank, name);
  check_buffer(data, count, "data", impl.rank, name);
  CallSignature sig{0,    CollectiveKind::kBroadcast, dtype, ReduceOp::kSum, Algorithm::kAuto, root,
                    count};
  const auto cfg = impl.config;
  return impl.submit(
      sig, [=](Comm& c) { collectives::broadcast(c, data, count, dtype, root, cfg); }, blocking,
      options);
}

Work reduce_impl(Context::Impl& impl, const void* send, void* recv, std::size_t count,
                 DataType dtype, ReduceOp op, int root, const CallOptions& options, bool blocking) {
  const char* name = "reduce";
  check_dtype_op(dtype, op, impl.rank, name);
  require(
      root >= 0 && root < impl.size,
      [&] { return "root " + std::to_string(root) + " is not a rank"; }, impl.rank, name);
  check_buffer(send, count, "send", impl.rank, name);
  if (impl.rank == root) check_buffer(recv, count, "recv", impl.rank, name);
  CallSignature sig{0, CollectiveKind::kReduce, dtype, op, Algorithm::kAuto, root, count};
  return impl.submit(
      sig, [=](Comm& c) { collectives::reduce(c, send, recv, count, dtype, op, root); }, blocking,
      options);
}

Work barrier_impl(Context::Impl& impl, const CallOptions& options, bool blocking) {
  CallSignature sig{
      0, CollectiveKind::kBarrier, DataType::kUInt8, ReduceOp::kSum, Algorithm::kAuto, -1, 0};
  return impl.submit(
      sig, [](Comm& c) { collectives::barrier(c); }, blocking, options);
}

std::vector<std::size_t> equal_counts(int ranks, std::size_t count) {
  return std::vector<std::size_t>(static_cast<std::size_t>(ranks), count);
}

}  // namespace

Context::Context(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Context::~Context() = default;

int Context::rank() const {
  return impl_->rank;
}
int Context::size() const {
  return impl_->size;
}
int Context::local_rank() const {
  return impl_->local_rank;
}
int Context::local_size() const {
  return impl_->local_size;
}
std::string Context::transport_name(int peer) const {
  if (peer == impl_->rank) return "self";
  if (peer < 0 || peer >= impl_->size) {
    throw Error(ErrorKind::kInvalidArgument, "no such peer", impl_->rank, peer, "transport_name");
  }
  return impl_->peer_transport[static_cast<std::size_t>(peer)];
}

Algorithm Context::choose_allreduce_algorithm(std::size_t bytes) const {
  return impl_->pick_allreduce(bytes, Algorithm::kAuto);
}

std::string Context::cost_model() const {
  return impl_->cost.to_string();
}

std::string Context::topology() const {
  return impl_->topology.describe();
}

int Context::hosts() const {
  return impl_->topology.hosts();
}

int Context::host_of(int rank) const {
  if (rank < 0 || rank >= impl_->size) {
    throw Error(ErrorKind::kInvalidArgument, "no such rank", impl_->rank, rank, "host_of");
  }
  return impl_->topology.host_of(rank);
}

PeerTraffic Context::traffic(int peer) const {
  return impl_->transport->traffic(peer);
}

PeerTraffic Context::total_traffic() const {
  PeerTraffic sum;
  for (int p = 0; p < impl_->size; ++p) {
    if (p == impl_->rank) continue;
    PeerTraffic t = traffic(p);
    sum.bytes_sent += t.bytes_sent;
    sum.bytes_received += t.bytes_received;
    sum.messages_sent += t.messages_sent;
    sum.messages_received += t.messages_received;
  }
  return sum;
}

void Context::allreduce(const void* send, void* recv, std::size_t count, DataType dtype,
                        ReduceOp op, const CallOptions& options) {
  allreduce_impl(*impl_, send, recv, count, dtype, op, options, true).wait();
}
Work Context::allreduce_async(const void* send, void* recv, std::size_t count, DataType dtype,
                              ReduceOp op, const CallOptions& options) {
  return allreduce_impl(*impl_, send, recv, count, dtype, op, options, false);
}

void Context::reduce_scatter(const void* send, void* recv, std::size_t recv_count, DataType dtype,
                             ReduceOp op, const CallOptions& options) {
  reduce_scatter_impl(*impl_, send, recv, recv_count, dtype, op, options, true).wait();
}
Work Context::reduce_scatter_async(const void* send, void* recv, std::size_t recv_count,
                                   DataType dtype, ReduceOp op, const CallOptions& options) {
  return reduce_scatter_impl(*impl_, send, recv, recv_count, dtype, op, options, false);
}

void Context::allgather(const void* send, void* recv, std::size_t send_count, DataType dtype,
                        const CallOptions& options) {
  allgatherv_impl(*impl_, send, recv, equal_counts(impl_->size, send_count), dtype,
                  CollectiveKind::kAllgather, options, true)
      .wait();
}
Work Context::allgather_async(const void* send, void* recv, std::size_t send_count, DataType dtype,
                              const CallOptions& options) {
  return allgatherv_impl(*impl_, send, recv, equal_counts(impl_->size, send_count), dtype,
                         CollectiveKind::kAllgather, options, false);
}

void Context::allgatherv(const void* send, void* recv, std::span<const std::size_t> recv_counts,
                         DataType dtype, const CallOptions& options) {
  allgatherv_impl(*impl_, send, recv, {recv_counts.begin(), recv_counts.end()}, dtype,
                  CollectiveKind::kAllgatherv, options, true)
      .wait();
}
Work Context::allgatherv_async(const void* send, void* recv,
                               std::span<const std::size_t> recv_counts, DataType dtype,
                               const CallOptions& options) {
  return allgatherv_impl(*impl_, send, recv, {recv_counts.begin(), recv_counts.end()}, dtype,
                         CollectiveKind::kAllgatherv, options, false);
}

void Context::broadcast(void* data, std::size_t count, DataType dtype, int root,
                        const CallOptions& options) {
  broadcast_impl(*impl_, data, count, dtype, root, options, true).wait();
}
Work Context::broadcast_async(void* data, std::size_t count, DataType dtype, int root,
                              const CallOptions& options) {
  return broadcast_impl(*impl_, data, count, dtype, root, options, false);
}

void Context::reduce(const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op,
                     int root, const CallOptions& options) {
  reduce_impl(*impl_, send, recv, count, dtype, op, root, options, true).wait();
}
Work Context::reduce_async(const void* send, void* recv, std::size_t count, DataType dtype,
                           ReduceOp op, int root, const CallOptions& options) {
  return reduce_impl(*impl_, send, recv, count, dtype, op, root, options, false);
}

void Context::barrier(const CallOptions& options) {
  barrier_impl(*impl_, options, true).wait();
}
Work Context::barrier_async(const CallOptions& options) {
  return barrier_impl(*impl_, options, false);
}

}  // namespace gradsync
