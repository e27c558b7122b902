// Data-parallel gradient reduction for a training loop, as PyTorch DDP's reducer and Horovod
// do it: parameters are grouped into buckets in the order backward produces their
// gradients, each bucket is all-reduced (through a codec) on the context's worker as soon as
// its last gradient is final, and the step waits only for what is still in flight.
//
// Example:
//   gradsync::Reducer reducer(*ctx, {.codec = "fp16"});
//   for (auto& p : parameters) {
//     p.id = reducer.add_parameter(p.name, p.grad.size(), p.grad, p.rows);
//   }
//   for (int step = 0; step < steps; ++step) {
//     forward();
//     for (auto& p : parameters | std::views::reverse) {  // backward: the last layer first
//       backward(p);               // writes p.grad
//       reducer.mark_ready(p.id);  // p's bucket all-reduces once all its gradients are ready
//     }
//     reducer.finish();  // waits for the buckets: every p.grad holds the average over ranks
//   }
//
// With a codec that holds gradient back (error feedback: topk, int8, sign, powersgd), run
// forward and backward at value - lr * reducer.held_back(id) and step from the values as
// they were: step-ahead error feedback, see held_back (gradsync-train does it).
//
// Threading: add_parameter, mark_ready and finish come from one thread (the one running
// backward), the thread that issues the context's calls. Each bucket is one async call on the
// context, queued when its last gradient is ready, which is not at the same moment on every
// rank: between the first mark_ready of a step and finish(), issue no other collective on the
// context, or ranks would queue them in different orders.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gradsync/compress.h"
#include "gradsync/gradsync.h"

namespace gradsync {

struct ReducerOptions {
  // Bytes per bucket (PyTorch DDP's bucket_cap_mb: 25 MiB), and of the first bucket, which
  // launches as soon as backward's first gradients are ready (DDP: 1 MiB).
  std::size_t bucket_bytes = std::size_t{25} << 20;
  std::size_t first_bucket_bytes = std::size_t{1} << 20;
  // Reduce buckets while backward runs (false: all of them in finish(), for comparison).
  bool overlap = true;
  // Parameters that never become ready in a step are reduced as zeros instead of being an
  // error (models with branches a batch may not take).
  bool find_unused_parameters = false;
  // Communicate every k-th step only; the k-1 steps between accumulate gradients locally.
  int accumulate_steps = 1;
  // Codec spec of compress::make_codec ("none", "fp16", "topk:ratio=0.01", ...). none,
  // fp16, bf16 and top-k reduce each bucket in one call (top-k ranks the whole bucket, so the
  // bucket sizes bound how widely it ranks; its error feedback stays per parameter); the
  // others reduce parameter by parameter.
  std::string codec = "none";
  // A NaN or Inf in a gradient: kThrow fails the step on every rank naming the tensor;
  // kPropagate lets it through to every rank, for float16 training whose loss scaler skips
  // such a step (optim::LossScaler).
  compress::NonFinite non_finite = compress::NonFinite::kThrow;
  // Rebuild the buckets once, after the first step, in the order gradients became ready on
  // rank 0 (every rank adopts it, so all launch the same buckets in the same order).
  bool rebuild_buckets = true;
};

// What one step's reduction cost, as the reducer saw it.
struct StepStats {
  bool communicated = false;        // false on an accumulation step
  double compute_s = 0;             // first mark_ready .. finish() called (backward's part)
  double communication_s = 0;       // time the bucket all-reduces ran
  double exposed_s = 0;             // time finish() waited for them
  double overlap_fraction = 0;      // 1 - exposed / communication (0 if nothing ran)
  std::uint64_t bytes_sent = 0;     // by this rank, per the transport counters
  std::uint64_t raw_bytes = 0;      // the float32 gradients reduced (before compression)
  std::size_t allreduce_calls = 0;  // collective calls the buckets took
  std::size_t buckets = 0;
  // Sharded data parallelism (sharded.h): the part of communication_s spent all-gathering
  // parameters, and the part of exposed_s spent waiting for a gather while it ran (a wait
  // for the calls queued before it counts as theirs).
  double gather_s = 0;
  double exposed_gather_s = 0;
};

class Reducer {
 public:
  Reducer(Context& ctx, ReducerOptions options = {});
  ~Reducer();
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  // Registers a float32 parameter gradient of `count` elements, returns its id (0, 1, ...).
  // `name` keys codec state (error-feedback residuals...); `rows` is its matrix shape for
  // PowerSGD (0: a vector). If `grad` is given, the gradient lives there and is copied into
  // its bucket when ready and back after the reduction; if it is empty, the gradient lives in
  // bucket memory: write it through gradient(id), no copies at all. Every rank registers the
  // same parameters in the same order, before the first step.
  int add_parameter(std::string name, std::size_t count, std::span<float> grad = {},
                    std::size_t rows = 0);
  // Where parameter `id`'s gradient is to be written (and read after finish()): `grad` if it
  // was given, else its place in bucket memory, which moves when the buckets are rebuilt
  // (after the first step): ask again each step.
  std::span<float> gradient(int id);

  // Gradient `id` is final for this step (any order, from the thread running backward).
  void mark_ready(int id);
  // Waits for every bucket, leaves the average over ranks in every gradient, and reports.
  // A parameter never marked ready is an error naming it (on every rank), unless
  // find_unused_parameters is set. On an accumulation step it communicates nothing.
  StepStats finish();

  // While a NoSync lives, finish() communicates nothing (gradients accumulate locally), as
  // DDP's no_sync(). The step after it reduces what accumulated.
  class NoSync {
   public:
    explicit NoSync(Reducer& r) : r_(r) { ++r_.no_sync_depth_; }
    ~NoSync() { --r_.no_sync_depth_; }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    Reducer& r_;
  };
  NoSync no_sync() { return NoSync(*this); }

  // What a checkpoint needs to continue bit for bit: the codec's state (residuals, PowerSGD's
  // Q, draw counters) and the bucket layout, whose sizes pick the algorithms and so the
  // order of every sum. load_state refuses bytes it did not write (Error kProtocol) and
  // must come before the first step.
  std::vector<std::uint8_t> save_state() const;
  void load_state(std::span<const std::uint8_t> state);

  // What this rank's codec holds back of parameter `id`'s gradient: the error-feedback
  // residual, gradient computed here but not yet sent (empty when the codec keeps none).
  // Step-ahead error feedback (Xu et al. 2021) evaluates the next gradient at
  // value - lr * held_back, where the model is headed, rather than at the value the residual
  // has not reached yet. Only between steps (after finish(), before the next mark_ready);
  // the view is valid until then.
  std::span<const float> held_back(int id) const;

  // The buckets as parameter ids in launch order (for tests and the timeline).
  std::vector<std::vector<int>> buckets() const;
  std::string codec_spec() const;

 private:
  // Whether this step all-reduces (not inside no_sync, and the last of accumulate_steps).
  bool communicates() const;
  struct State;
  std::unique_ptr<State> s_;
  int no_sync_depth_ = 0;
};

}  // namespace gradsync
