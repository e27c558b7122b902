// ProcessGroupGradsync: torch.distributed's process-group interface over a gradsync::Context,
// as ProcessGroupGloo is over Gloo. It translates tensors to buffers and torch's options to
// the public C++ API; every collective runs on the context's worker, and each returned Work
// (and its future, which DDP and every comm hook read) completes from there.
#pragma once

#include <torch/version.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "gradsync/compress.h"
#include "gradsync/gradsync.h"
#include "torch_tensors.h"

// torch 2 moved the collectives to c10d::Backend (ProcessGroup dispatches to it); 1.13 has
// them on ProcessGroup. The class is the same on both.
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#define GRADSYNC_C10D_BASE c10d::Backend
#else
#define GRADSYNC_C10D_BASE c10d::ProcessGroup
#endif

namespace gradsync::torch_backend {

// Threads that settle handed-out futures and run their callbacks. A callback may block on a
// later call of the group (torch's PowerSGD hook waits inside its callbacks), so a job never
// waits for a busy thread: the pool grows instead.
class CompletionPool {
 public:
  CompletionPool() = default;
  ~CompletionPool();  // runs every job posted, then joins
  CompletionPool(const CompletionPool&) = delete;
  CompletionPool& operator=(const CompletionPool&) = delete;
  void post(std::function<void()> job);

 private:
  void run();
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;  // guarded by mu_
  std::vector<std::thread> threads_;        // guarded by mu_
  std::size_t idle_ = 0;                    // guarded by mu_
  bool stopping_ = false;                   // guarded by mu_
};

class ProcessGroupGradsync : public GRADSYNC_C10D_BASE {
 public:
  // Meets the group's other ranks through `store` (the one torch hands every backend: no
  // second port). `timeout` bounds the rendezvous and each call.
  ProcessGroupGradsync(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout);
  ~ProcessGroupGradsync() override;

  const std::string getBackendName() const override { return "gradsync"; }
  Context& context() { return *ctx_; }

  // One finished call, for gradsync.torch.stats(): times on timeline::now_us()'s clock.
  struct CallRecord {
    std::string op;
    std::size_t bytes;         // of the tensors it wrote
    std::int64_t issued_us;    // handed to the backend
    std::int64_t started_us;   // began running on the worker
    std::int64_t done_us;      // finished
    std::uint64_t sent_bytes;  // this rank's wire bytes sent since the group began, then
  };
  // The calls finished since the last take (at most kMaxRecords: older ones are dropped).
  std::vector<CallRecord> take_records();
  // Collective over the group: rank 0 writes every rank's timeline (GRADSYNC_TIMELINE, or
  // `path`); returns the events written.
  std::size_t write_timeline(const std::string& path);

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<std::int64_t>& output_splits,
                                               std::vector<std::int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  // A DDP comm hook's bucket through `compressor` (averaged, float32): `names`, `counts` and
  // `rows` describe its parameters in bucket order (rows: a matrix's first dimension, for
  // PowerSGD; 0 for a vector). With `skip_non_finite`, NaN or Inf on any rank makes every
  // rank's bucket NaN (the step to skip, as a loss scaler sees it) instead of an error.
  c10::intrusive_ptr<c10d::Work> compressed_allreduce(
      std::shared_ptr<compress::BucketCompressor> compressor, at::Tensor& bucket,
      const std::vector<std::string>& names, const std::vector<std::int64_t>& counts,
      const std::vector<std::int64_t>& rows, bool skip_non_finite);

 private:
  // One torch call: `issue` queues its collectives on the context (under issue_mu_, so the
  // order is the same on every rank whichever thread calls), `finish` (on the worker, once
  // they are done) copies results to where torch wants them. The Work's future holds
  // `outputs`.
  // `shapes`: what the ranks' calls must agree on, named in a mismatch error.
  c10::intrusive_ptr<c10d::Work> launch(c10d::OpType type, std::vector<at::Tensor> outputs,
                                        const Shapes& shapes,
                                        const std::function<std::vector<Work>()>& issue,
                                        std::function<void()> finish = {});
  std::exception_ptr name_both_sides(std::exception_ptr error, std::uint64_t call,
                                     const Shapes& shapes);

  void record(c10d::OpType type, std::size_t bytes, std::int64_t issued_us);

  std::unique_ptr<CompletionPool> completions_;  // before ctx_: its calls post here
  std::unique_ptr<Context> ctx_;
  std::mutex issue_mu_;
  std::uint64_t launched_ = 0;  // calls issued, the same on every rank; guarded by issue_mu_
  // How long a rank that saw a mismatch waits for its peer's shapes in the store: the peer
  // sees the mismatch within microseconds of it, or never (then it saw the abort).
  static constexpr std::chrono::milliseconds kPeerReportWait{1000};
  c10::intrusive_ptr<c10d::Store> store_;
  static constexpr std::size_t kMaxRecords = 1 << 16;
  std::mutex records_mu_;
  std::vector<CallRecord> records_;  // guarded by records_mu_
  std::int64_t last_done_us_ = 0;    // guarded by records_mu_
};

}  // namespace gradsync::torch_backend
