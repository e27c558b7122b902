// ProcessGroupGradsync: the tensor side of every torch.distributed call (checks, dtypes,
// staging of non-contiguous tensors, results into torch's futures). What a collective does
// is the C++ library's.
#include "torch_backend.h"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <Python.h>
#include <sched.h>

#include <limits>
#include <numeric>
#include <optional>
#include <utility>

#include "gradsync/error.h"
#include "gradsync/timeline.h"
#include "torch_tensors.h"

namespace gradsync::torch_backend {
namespace {

// A c10d::Store as the rendezvous store gradsync::init() meets through.
class TorchStore final : public Store {
 public:
  explicit TorchStore(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const Bytes& value) override { store_->set(key, value); }
  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override {
    wait({key}, timeout);
    return store_->get(key);
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    try {
      store_->wait(keys, timeout);
    } catch (const std::exception& e) {
      std::string names;
      for (const auto& k : keys) names += (names.empty() ? "" : ", ") + k;
      throw Error(ErrorKind::kTimeout, "torch's store has no " + names + " after " +
                                           std::to_string(timeout.count()) +
                                           " ms (a rank of the group has not joined): " + e.what());
    }
  }
  std::int64_t add(const std::string& key, std::int64_t delta) override {
    return store_->add(key, delta);
  }
  bool check(const std::string& key) override { return store_->check({key}); }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

// A call's Work: completed by the context's worker once the call is done, unless its future
// was handed out (DDP, comm hooks): then callbacks may hang on it that wait for later calls
// of this group, which only that worker can run, so the CompletionPool settles it.
class GradsyncWork final : public c10d::Work {
 public:
  GradsyncWork(int rank, c10d::OpType type, std::vector<at::Tensor> outputs)
      : c10d::Work(rank, type),
        outputs_(std::move(outputs)),
        future_(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()))) {}

  // Settles the call at once if nobody holds its future (no callback can run), and returns
  // true; false if the future was handed out: then complete() must run elsewhere.
  bool complete_if_private(std::exception_ptr error) {
    std::lock_guard lock(handout_mu_);
    if (handed_out_) return false;
    complete(error);
    return true;
  }
  // The future first: whoever wait()s on the Work then finds the future settled too.
  void complete(std::exception_ptr error) {
    if (error) {
      future_->setError(error);
    } else {
      future_->markCompleted(c10::IValue(outputs_));
    }
    finish(error);
  }
  // The last of the call's collectives, once issued: wait() may run it on the waiting thread.
  void set_last_call(gradsync::Work call) { last_call_ = std::move(call); }
  // Without a timeout, a call still queued runs here (its callback finishes this Work); else
  // spin briefly, then block (src/core/handoff_spin.h says why): a small call is often done
  // within microseconds, before a sleeping waiter could even be woken.
  bool wait(std::chrono::milliseconds timeout) override {
    if (timeout.count() == 0) last_call_.run_if_next();  // torch's kNoTimeout: no limit
    const auto start = std::chrono::steady_clock::now();
    while (!isCompleted() && std::chrono::steady_clock::now() - start < kSpin) ::sched_yield();
    return c10d::Work::wait(timeout);
  }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    std::lock_guard lock(handout_mu_);
    handed_out_ = true;
    return future_;
  }

 private:
  // As the engine's kHandoffSpin (src/core/handoff_spin.h).
  static constexpr std::chrono::microseconds kSpin{50};
  std::vector<at::Tensor> outputs_;
  gradsync::Work last_call_;  // set by the issuing thread before the Work is handed out
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  std::mutex handout_mu_;
  bool handed_out_ = false;  // guarded by handout_mu_
};

}  // namespace

CompletionPool::~CompletionPool() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void CompletionPool::post(std::function<void()> job) {
  std::lock_guard lock(mu_);
  jobs_.push_back(std::move(job));
  // Every idle thread may already have a job waiting for it; a job beyond those gets a new
  // thread, so a completion never waits behind one whose callbacks block.
  if (jobs_.size() > idle_) {
    threads_.emplace_back([this] { run(); });
  } else {
    cv_.notify_one();
  }
}

void CompletionPool::run() {
  std::unique_lock lock(mu_);
  for (;;) {
    ++idle_;
    cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
    --idle_;
    if (jobs_.empty()) return;  // stopping, and nothing left to settle
    auto job = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    job();
    lock.lock();
  }
}

ProcessGroupGradsync::ProcessGroupGradsync(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                           int size, std::chrono::milliseconds timeout)
    : GRADSYNC_C10D_BASE(rank, size) {
  gradsync::Options options;
  options.rank = rank;
  options.size = size;
  options.store = std::make_shared<TorchStore>(store);
  options.timeout = timeout;
  store_ = store;
  completions_ = std::make_unique<CompletionPool>();
  ctx_ = gradsync::init(options);
}

ProcessGroupGradsync::~ProcessGroupGradsync() {
  // Finishing the queued calls may complete futures whose callbacks take the GIL (Python comm
  // hooks): a destructor run by Python's garbage collector must let them have it. The calls
  // finish before any member they record into goes.
  auto finish_calls = [this] {
    ctx_.reset();
    completions_.reset();
  };
  if (Py_IsInitialized() && PyGILState_Check()) {
    PyThreadState* state = PyEval_SaveThread();
    finish_calls();
    PyEval_RestoreThread(state);
  } else {
    finish_calls();
  }
}

std::vector<ProcessGroupGradsync::CallRecord> ProcessGroupGradsync::take_records() {
  std::lock_guard lock(records_mu_);
  return std::exchange(records_, {});
}

std::size_t ProcessGroupGradsync::write_timeline(const std::string& path) {
  std::lock_guard lock(issue_mu_);
  return timeline::write(*ctx_, path);
}

// On the worker, as a call completes: calls run there one after another, so one starts when
// it was issued or when the one before it finished, whichever is later.
void ProcessGroupGradsync::record(c10d::OpType type, std::size_t bytes, std::int64_t issued_us) {
  const std::int64_t done = timeline::now_us();
  std::lock_guard lock(records_mu_);
  const std::int64_t started = std::max(issued_us, last_done_us_);
  last_done_us_ = done;
  const std::string name = c10d::opTypeToString(type);
  if (timeline::enabled()) {
    timeline::record(name + " " + std::to_string(bytes >> 10) + " KiB", "comm", started, done);
  }
  // A job that never asks for stats() keeps only the latest calls: the older half goes.
  if (records_.size() >= kMaxRecords) {
    records_.erase(records_.begin(), records_.begin() + kMaxRecords / 2);
  }
  records_.push_back({name, bytes, issued_us, started, done, ctx_->total_traffic().bytes_sent});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::launch(
    c10d::OpType type, std::vector<at::Tensor> outputs, const Shapes& shapes,
    const std::function<std::vector<Work>()>& issue, std::function<void()> finish) {
  std::size_t bytes = 0;
  for (const auto& t : outputs) bytes += static_cast<std::size_t>(t.nbytes());
  const std::int64_t issued = timeline::now_us();
  auto work = c10::make_intrusive<GradsyncWork>(rank_, type, std::move(outputs));
  std::vector<Work> calls;
  std::uint64_t number = 0;
  {
    std::lock_guard lock(issue_mu_);
    number = launched_++;
    calls = issue();
  }
  if (calls.empty()) {  // nothing to move (an empty bucket)
    work->complete(nullptr);
    return work;
  }
  // The calls run in order on one worker: the last one done means all are. The first error
  // is the one to report (later calls fail only because the communicator was aborted).
  Work last = calls.back();
  work->set_last_call(last);
  last.on_done([this, type, bytes, issued, work, number, shapes, calls = std::move(calls),
                finish = std::move(finish)] {
    record(type, bytes, issued);
    std::exception_ptr error;
    for (const auto& c : calls) {
      if ((error = c.error())) break;
    }
    if (error) error = name_both_sides(error, number, shapes);
    if (!error && finish) {
      try {
        at::NoGradGuard no_grad;  // writing results back is not part of any graph
        finish();
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (!work->complete_if_private(error)) {
      completions_->post([work, error] { work->complete(error); });
    }
  });
  return work;
}

// The mismatch error says which call and peer disagree, and that the shapes do (the
// fingerprint): each rank that sees it or is aborted by it leaves its own shapes in torch's
// store, and a rank that saw it reads its peer's, so the message names both. Only a failed
// call touches the store.
std::exception_ptr ProcessGroupGradsync::name_both_sides(std::exception_ptr error,
                                                         std::uint64_t call, const Shapes& shapes) {
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    const bool saw_it = e.kind() == ErrorKind::kMismatch && e.peer() != Error::kNoPeer;
    if (!saw_it && e.kind() != ErrorKind::kAborted) return error;
    const std::string key = "gradsync/mismatch/" + std::to_string(call) + "/";
    const std::string mine = shapes.describe();
    if (mine.empty()) return error;
    std::string detail = e.detail() + "; this rank's tensors: " + mine;
    try {
      store_->set(key + std::to_string(rank_), std::vector<std::uint8_t>(mine.begin(), mine.end()));
      if (saw_it) {
        const std::string peer_key = key + std::to_string(e.peer());
        store_->wait({peer_key}, kPeerReportWait);
        const auto theirs = store_->get(peer_key);
        detail += ", rank " + std::to_string(e.peer()) +
                  "'s: " + std::string(theirs.begin(), theirs.end());
      }
    } catch (const std::exception&) {
      // The peer did not report in time, or the store is gone: name this side only.
    }
    return std::make_exception_ptr(Error(e.kind(), detail, e.rank(), e.peer(), e.op(), e.bytes()));
  } catch (...) {
    return error;
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::broadcast(std::vector<at::Tensor>& tensors,
                                                               const c10d::BroadcastOptions& opts) {
  const char* op = "broadcast";
  const DataType dtype = check_tensors(tensors, rank_, op);
  expect_one(tensors, rank_, op);
  auto staged = std::make_shared<Staged>(tensors[0]);
  const int root = static_cast<int>(opts.rootRank);
  const Shapes shapes(tensors);
  const auto options = call_options(opts.timeout, shapes);
  return launch(
      c10d::OpType::BROADCAST, tensors, shapes,
      [&]() -> std::vector<Work> {
        return {ctx_->broadcast_async(staged->data(), staged->count(), dtype, root, options)};
      },
      [staged] { staged->write_back(); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::allreduce(std::vector<at::Tensor>& tensors,
                                                               const c10d::AllreduceOptions& opts) {
  const char* op = "allreduce";
  const DataType dtype = check_tensors(tensors, rank_, op);
  expect_one(tensors, rank_, op);
  const ReduceOp rop = op_of(opts.reduceOp, rank_, op);
  auto staged = std::make_shared<Staged>(tensors[0]);
  const Shapes shapes(tensors);
  const auto options = call_options(opts.timeout, shapes);
  return launch(
      c10d::OpType::ALLREDUCE, tensors, shapes,
      [&]() -> std::vector<Work> {
        return {ctx_->allreduce_async(staged->data(), staged->data(), staged->count(), dtype, rop,
                                      options)};
      },
      [staged] { staged->write_back(); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  const char* op = "allreduce_coalesced";
  const DataType dtype = check_tensors(tensors, rank_, op);
  const ReduceOp rop = op_of(opts.reduceOp, rank_, op);
  auto flat = std::make_shared<at::Tensor>(flatten(tensors));
  const Shapes shapes(tensors);
  const auto options = call_options(opts.timeout, shapes);
  return launch(
      c10d::OpType::ALLREDUCE_COALESCED, tensors, shapes,
      [&]() -> std::vector<Work> {
        return {ctx_->allreduce_async(flat->data_ptr(), flat->data_ptr(),
                                      static_cast<std::size_t>(flat->numel()), dtype, rop,
                                      options)};
      },
      [flat, tensors] { unflatten(*flat, tensors); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::reduce(std::vector<at::Tensor>& tensors,
                                                            const c10d::ReduceOptions& opts) {
  const char* op = "reduce";
  const DataType dtype = check_tensors(tensors, rank_, op);
  expect_one(tensors, rank_, op);
  const ReduceOp rop = op_of(opts.reduceOp, rank_, op);
  auto staged = std::make_shared<Staged>(tensors[0]);
  const int root = static_cast<int>(opts.rootRank);
  const Shapes shapes(tensors);
  const auto options = call_options(opts.timeout, shapes);
  return launch(
      c10d::OpType::REDUCE, tensors, shapes,
      [&]() -> std::vector<Work> {
        // In place on the root, as torch's reduce is; the other ranks' tensors are inputs only.
        return {ctx_->reduce_async(staged->data(), rank_ == root ? staged->data() : nullptr,
                                   staged->count(), dtype, rop, root, options)};
      },
      [staged, root, rank = rank_] {
        if (rank == root) staged->write_back();
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* op = "allgather";
  const DataType dtype = check_tensors(inputs, rank_, op);
  expect_one(inputs, rank_, op);
  const auto& outs = rank_blocks(outputs, inputs[0], dtype, size_, rank_, op, "output");
  auto input = std::make_shared<at::Tensor>(inputs[0].contiguous());
  auto gathered = std::make_shared<at::Tensor>(
      at::empty({static_cast<std::int64_t>(size_) * input->numel()}, input->options()));
  const Shapes shapes(inputs);
  const auto options = call_options(opts.timeout, shapes);
  return launch(
      c10d::OpType::ALLGATHER, outs, shapes,
      [&]() -> std::vector<Work> {
        return {ctx_->allgather_async(input->data_ptr(), gathered->data_ptr(),
                                      static_cast<std::size_t>(input->numel()), dtype, options)};
      },
      [input, gathered, outs] { unflatten(*gathered, outs); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  const char* op = "_allgather_base";
  const DataType dtype = check_tensors({input, output}, rank_, op);
  if (output.numel() != input.numel() * size_) {
    refuse("output of shape " + shape_of(output) + " is not " + std::to_string(size_) +
               " inputs of shape " + shape_of(input),
           rank_, op);
  }
  auto in = std::make_shared<at::Tensor>(input.contiguous());
  auto staged = std::make_shared<Staged>(output);
  const Shapes shapes(std::vector<at::Tensor>{input});
  const auto options = call_options(opts.timeout, shapes);
  return launch(
      c10d::OpType::_ALLGATHER_BASE, {output}, shapes,
      [&]() -> std::vector<Work> {
        return {ctx_->allgather_async(in->data_ptr(), staged->data(),
                                      static_cast<std::size_t>(in->numel()), dtype, options)};
      },
      [in, staged] { staged->write_back(); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  const char* op = "allgather_coalesced";
  const DataType dtype = check_tensors(inputs, rank_, op);
  if (outputs.size() != static_cast<std::size_t>(size_)) {
    refuse("takes one output list per rank (" + std::to_string(size_) + "), got " +
               std::to_string(outputs.size()),
           rank_, op);
  }
  std::vector<at::Tensor> all_outputs;
  for (const auto& list : outputs) {
    if (list.size() != inputs.size()) {
      refuse("each output list must hold as many tensors as the input list", rank_, op);
    }
    all_outputs.insert(all_outputs.end(), list.begin(), list.end());
  }
  check_tensors(all_outputs, rank_, op);
  auto flat = std::make_shared<at::Tensor>(flatten(inputs));
  auto gathered = std::make_shared<at::Tensor>(
      at::empty({static_cast<std::int64_t>(size_) * flat->numel()}, flat->options()));
  const Shapes shapes(inputs);
  const auto options = call_options(opts.timeout, shapes);
  return launch(
      c10d::OpType::ALLGATHER_COALESCED, all_outputs, shapes,
      [&]() -> std::vector<Work> {
        return {ctx_->allgather_async(flat->data_ptr(), gathered->data_ptr(),
                                      static_cast<std::size_t>(flat->numel()), dtype, options)};
      },
      [flat, gathered, all_outputs] { unflatten(*gathered, all_outputs); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  const char* op = "reduce_scatter";
  const DataType dtype = check_tensors(outputs, rank_, op);
  expect_one(outputs, rank_, op);
  rank_blocks(inputs, outputs[0], dtype, size_, rank_, op, "input");
  auto flat = std::make_shared<at::Tensor>(flatten(inputs[0]));
  auto staged = std::make_shared<Staged>(outputs[0]);
  const ReduceOp rop = op_of(opts.reduceOp, rank_, op);
  const Shapes shapes(outputs);
  const auto options = call_options(opts.timeout, shapes);
  return launch(
      c10d::OpType::REDUCE_SCATTER, outputs, shapes,
      [&]() -> std::vector<Work> {
        return {ctx_->reduce_scatter_async(flat->data_ptr(), staged->data(), staged->count(), dtype,
                                           rop, options)};
      },
      [flat, staged] { staged->write_back(); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  const char* op = "_reduce_scatter_base";
  const DataType dtype = check_tensors({input, output}, rank_, op);
  if (input.numel() != output.numel() * size_) {
    refuse("input of shape " + shape_of(input) + " is not " + std::to_string(size_) +
               " outputs of shape " + shape_of(output),
           rank_, op);
  }
  auto in = std::make_shared<at::Tensor>(input.contiguous());
  auto staged = std::make_shared<Staged>(output);
  const ReduceOp rop = op_of(opts.reduceOp, rank_, op);
  const Shapes shapes(std::vector<at::Tensor>{output});
  const auto options = call_options(opts.timeout, shapes);
  return launch(
      c10d::OpType::_REDUCE_SCATTER_BASE, {output}, shapes,
      [&]() -> std::vector<Work> {
        return {ctx_->reduce_scatter_async(in->data_ptr(), staged->data(), staged->count(), dtype,
                                           rop, options)};
      },
      [in, staged] { staged->write_back(); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  const char* op = "gather";
  const DataType dtype = check_tensors(inputs, rank_, op);
  expect_one(inputs, rank_, op);
  const int root = static_cast<int>(opts.rootRank);
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    outs = rank_blocks(outputs, inputs[0], dtype, size_, rank_, op, "output");
  } else if (!outputs.empty() && !outputs[0].empty()) {
    refuse("only the root (rank " + std::to_string(root) + ") takes output tensors", rank_, op);
  }
  auto input = std::make_shared<at::Tensor>(inputs[0].contiguous());
  auto gathered = std::make_shared<at::Tensor>(
      rank_ == root
          ? at::empty({static_cast<std::int64_t>(size_) * input->numel()}, input->options())
          : at::Tensor());
  const Shapes shapes(inputs);
  const auto options = call_options(opts.timeout, shapes);
  return launch(
      c10d::OpType::GATHER, outs, shapes,
      [&]() -> std::vector<Work> {
        return {ctx_->gather_async(input->data_ptr(),
                                   gathered->defined() ? gathered->data_ptr() : nullptr,
                                   static_cast<std::size_t>(input->numel()), dtype, root, options)};
      },
      [input, gathered, outs] {
        if (gathered->defined()) unflatten(*gathered, outs);
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  const char* op = "scatter";
  const DataType dtype = check_tensors(outputs, rank_, op);
  expect_one(outputs, rank_, op);
  const int root = static_cast<int>(opts.rootRank);
  auto flat = std::make_shared<at::Tensor>();
  if (rank_ == root) {
    rank_blocks(inputs, outputs[0], dtype, size_, rank_, op, "input");
    *flat = flatten(inputs[0]);
  } else if (!inputs.empty() && !inputs[0].empty()) {
    refuse("only the root (rank " + std::to_string(root) + ") takes input tensors", rank_, op);
  }
  auto staged = std::make_shared<Staged>(outputs[0]);
  const Shapes shapes(outputs);
  const auto options = call_options(opts.timeout, shapes);
  return launch(
      c10d::OpType::SCATTER, outputs, shapes,
      [&]() -> std::vector<Work> {
        return {ctx_->scatter_async(flat->defined() ? flat->data_ptr() : nullptr, staged->data(),
                                    staged->count(), dtype, root, options)};
      },
      [flat, staged] { staged->write_back(); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<std::int64_t>& output_splits,
    std::vector<std::int64_t>& input_splits, const c10d::AllToAllOptions& opts) {
  const char* op = "alltoall_base";
  const DataType dtype = check_tensors({input, output}, rank_, op);
  auto send_counts = split_counts(input, input_splits, size_, rank_, "input");
  auto recv_counts = split_counts(output, output_splits, size_, rank_, "output");
  auto in = std::make_shared<at::Tensor>(input.contiguous());
  auto staged = std::make_shared<Staged>(output);
  const auto options = call_options(opts.timeout, Shapes{});
  return launch(
      c10d::OpType::ALLTOALL_BASE, {output}, Shapes{},
      [&]() -> std::vector<Work> {
        return {ctx_->alltoallv_async(in->data_ptr(), send_counts, staged->data(), recv_counts,
                                      dtype, options)};
      },
      [in, staged] { staged->write_back(); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::alltoall(std::vector<at::Tensor>& outputs,
                                                              std::vector<at::Tensor>& inputs,
                                                              const c10d::AllToAllOptions& opts) {
  const char* op = "alltoall";
  if (inputs.size() != static_cast<std::size_t>(size_) ||
      outputs.size() != static_cast<std::size_t>(size_)) {
    refuse("takes " + std::to_string(size_) + " input and output tensors", rank_, op);
  }
  const DataType dtype = check_tensors(inputs, rank_, op);
  if (check_tensors(outputs, rank_, op) != dtype)
    refuse("outputs and inputs differ in dtype", rank_, op);
  std::vector<std::size_t> send_counts, recv_counts;
  for (const auto& t : inputs) send_counts.push_back(static_cast<std::size_t>(t.numel()));
  for (const auto& t : outputs) recv_counts.push_back(static_cast<std::size_t>(t.numel()));
  auto flat_in = std::make_shared<at::Tensor>(flatten(inputs));
  std::int64_t total = 0;
  for (auto c : recv_counts) total += static_cast<std::int64_t>(c);
  auto flat_out = std::make_shared<at::Tensor>(at::empty({total}, flat_in->options()));
  const auto options = call_options(opts.timeout, Shapes{});
  return launch(
      c10d::OpType::ALLTOALL, outputs, Shapes{},
      [&]() -> std::vector<Work> {
        return {ctx_->alltoallv_async(flat_in->data_ptr(), send_counts, flat_out->data_ptr(),
                                      recv_counts, dtype, options)};
      },
      [flat_in, flat_out, outputs] { unflatten(*flat_out, outputs); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::send(std::vector<at::Tensor>& tensors, int dst,
                                                          int tag) {
  const char* op = "send";
  const DataType dtype = check_tensors(tensors, rank_, op);
  expect_one(tensors, rank_, op);
  auto in = std::make_shared<at::Tensor>(tensors[0].contiguous());
  const Shapes shapes(tensors);
  const auto options = call_options(c10d::kUnsetTimeout, shapes);
  return launch(
      c10d::OpType::SEND, tensors, shapes,
      [&]() -> std::vector<Work> {
        return {ctx_->send_async(in->data_ptr(), static_cast<std::size_t>(in->numel()), dtype, dst,
                                 tag, options)};
      },
      [in] {});
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::recv(std::vector<at::Tensor>& tensors, int src,
                                                          int tag) {
  const char* op = "recv";
  const DataType dtype = check_tensors(tensors, rank_, op);
  expect_one(tensors, rank_, op);
  auto staged = std::make_shared<Staged>(tensors[0]);
  const Shapes shapes(tensors);
  const auto options = call_options(c10d::kUnsetTimeout, shapes);
  return launch(
      c10d::OpType::RECV, tensors, shapes,
      [&]() -> std::vector<Work> {
        return {ctx_->recv_async(staged->data(), staged->count(), dtype, src, tag, options)};
      },
      [staged] { staged->write_back(); });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::recvAnysource(std::vector<at::Tensor>&, int) {
  refuse("recv from any source (src=None) is not supported: name the sending rank", rank_, "recv");
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::barrier(const c10d::BarrierOptions& opts) {
  const auto options = call_options(opts.timeout, Shapes{});
  return launch(c10d::OpType::BARRIER, {}, Shapes{},
                [&]() -> std::vector<Work> { return {ctx_->barrier_async(options)}; });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupGradsync::compressed_allreduce(
    std::shared_ptr<compress::BucketCompressor> compressor, at::Tensor& bucket,
    const std::vector<std::string>& names, const std::vector<std::int64_t>& counts,
    const std::vector<std::int64_t>& rows, bool skip_non_finite) {
  const char* op = "compressed allreduce";
  check_tensors({bucket}, rank_, op);
  if (bucket.scalar_type() != at::kFloat || !bucket.is_contiguous()) {
    refuse("gradsync's codecs take a contiguous float32 bucket; this one is " +
               std::string(c10::toString(bucket.scalar_type())),
           rank_, op);
  }
  if (names.size() != counts.size() || names.size() != rows.size()) {
    refuse("names, counts and rows must describe the same parameters", rank_, op);
  }
  std::vector<compress::TensorSlice> parts;
  std::size_t offset = 0;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const auto count = static_cast<std::size_t>(counts[i]);
    parts.push_back({compress::Tensor(names[i], static_cast<std::size_t>(rows[i])), offset, count});
    offset += count;
  }
  std::span<float> data(bucket.data_ptr<float>(), static_cast<std::size_t>(bucket.numel()));
  auto call = std::make_shared<Work>();
  const auto non_finite =
      skip_non_finite ? compress::NonFinite::kSkip : compress::NonFinite::kThrow;
  return launch(
      c10d::OpType::ALLREDUCE, {bucket}, Shapes{},
      [&]() -> std::vector<Work> {
        if (data.empty()) return {};
        *call = compressor->allreduce_async(*ctx_, data, parts, ReduceOp::kAvg, non_finite);
        return {*call};
      },
      [call, compressor, bucket] {
        if (call->skipped()) bucket.fill_(std::numeric_limits<float>::quiet_NaN());
      });
}

}  // namespace gradsync::torch_backend
