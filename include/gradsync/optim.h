// Optimizers over flat float32 parameters, and dynamic loss scaling for float16 training.
// ZeRO sharding of their state across data-parallel ranks is ShardedDataParallel's
// (sharded.h), which steps one of these over this rank's shards.
//
// Example:
//   auto adamw = gradsync::optim::make_adamw(weights.size(), {.lr = 1e-3f});
//   adamw->step(weights, grad);  // grad averaged over the ranks (a Reducer's)
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "gradsync/gradsync.h"

namespace gradsync::optim {

// PyTorch's SGD: g += weight_decay p; with momentum, b = momentum b + g (b = g at the first
// step) and g = nesterov ? g + momentum b : b; then p -= lr g.
struct SgdOptions {
  float lr = 0.01f;
  float momentum = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
};

// AdamW (Loshchilov and Hutter): decoupled weight decay p -= lr wd p, then Adam's update with
// bias-corrected moments.
struct AdamWOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
};

// LARS (You, Gitman and Ginsburg, 2017), for large batches with SGD: each tensor's step is
// scaled by its trust ratio trust ||w|| / (||g|| + weight_decay ||w||) (1 where either norm
// is 0); then g += weight_decay w, b = momentum b + lr ratio g, w -= b.
struct LarsOptions {
  float lr = 0.1f;
  float momentum = 0.9f;
  float weight_decay = 0.0f;
  float trust = 0.001f;
  // Per tensor, or empty for none: true for a tensor stepped with neither weight decay nor
  // trust ratio (ratio 1), as the LAMB paper's BERT setup and NVIDIA's LAMB step biases,
  // whose small norms would otherwise hold back their steps.
  std::vector<bool> excluded = {};
};

// LAMB (You et al., 2019), for large batches with Adam: Adam's bias-corrected update plus
// decoupled weight decay, u = m / (sqrt(v) + eps) + weight_decay w, scaled for each tensor by
// ||w|| / ||u|| (1 where either norm is 0): w -= lr ratio u.
struct LambOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-6f;
  float weight_decay = 0.01f;
  // As LarsOptions::excluded: an excluded tensor takes Adam's step, u without weight decay
  // and ratio 1.
  std::vector<bool> excluded = {};
};

// Updates a fixed range of `count` parameters from their gradients; keeps its state (momentum,
// moments) for exactly that range.
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // Its steps need each tensor whole (LARS, LAMB: norms per tensor), so it cannot step a
  // ZeRO shard, which cuts tensors anywhere.
  virtual bool needs_whole_tensors() const { return false; }
  // params.size() == grads.size() == the count it was made for.
  virtual void step(std::span<float> params, std::span<const float> grads) = 0;
  // One step, taken piece by piece: piece k is [bounds[k], bounds[k + 1]) of the range
  // (bounds rise from 0 to the count), and after(k) runs as soon as piece k has its new
  // values, while later pieces are still to step (ZeRO starts the gather of a unit's shard
  // there). SGD and AdamW step each piece in turn; an optimizer whose update needs more than
  // its own elements (LARS, LAMB), or one that does not say otherwise, steps the whole range
  // and then runs every after(k). Refuses bounds that do not cover the range
  // (kInvalidArgument).
  virtual void step_pieces(std::span<float> params, std::span<const float> grads,
                           std::span<const std::size_t> bounds,
                           const std::function<void(std::size_t piece)>& after);
  // The learning rate of the steps from now on (a schedule sets it before each step; it is
  // not part of the saved state, being a function of the step).
  virtual void set_lr(float lr) = 0;
  virtual std::size_t state_bytes() const = 0;
  // The state as bytes for a checkpoint; load_state refuses bytes it did not write
  // (Error kProtocol).
  virtual std::vector<std::uint8_t> save_state() const = 0;
  virtual void load_state(std::span<const std::uint8_t> state) = 0;

  // The state as planes of per-element floats, each as long as the parameters (SGD's
  // momentum; AdamW's m, then v), and the steps taken: what ZeRO moves when a checkpoint is
  // re-sharded at another number of ranks (ShardedDataParallel::load_state_of_ranks). An
  // optimizer whose state has another form returns nullopt, and refuses load_planes (Error
  // kInvalidArgument); so does one given planes of another count or length.
  struct Planes {
    std::uint64_t steps = 0;
    std::vector<std::vector<float>> planes;
  };
  virtual std::optional<Planes> planes() const { return std::nullopt; }
  virtual void load_planes(const Planes& planes);
};

std::unique_ptr<Optimizer> make_sgd(std::size_t count, SgdOptions options = {});
std::unique_ptr<Optimizer> make_adamw(std::size_t count, AdamWOptions options = {});
// Over tensors of these sizes, back to back: count is their sum. An `excluded` that is neither
// empty nor one flag per tensor is refused (Error kInvalidArgument).
std::unique_ptr<Optimizer> make_lars(std::vector<std::size_t> tensors, LarsOptions options = {});
std::unique_ptr<Optimizer> make_lamb(std::vector<std::size_t> tensors, LambOptions options = {});

// Dynamic loss scaling for float16 training, by the rule of torch.cuda.amp.GradScaler: backward
// runs on the loss times scale(), so that small gradients survive float16; unscale() divides
// them back before the step. A NaN or Inf on any rank means the scale overflowed: the step is
// skipped on every rank and the scale halves; after `growth_interval` good steps in a row it
// doubles.
//
// Example:
//   gradsync::optim::LossScaler scaler;
//   // ... backward from the loss times scaler.scale(), the gradients averaged over ranks ...
//   if (scaler.unscale(*ctx, grad)) {  // false: skipped on every rank
//     // ... optimizer step ...
//   }
struct LossScalerOptions {
  float init_scale = 65536.0f;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int growth_interval = 2000;
};

class LossScaler {
 public:
  explicit LossScaler(LossScalerOptions options = {});
  float scale() const { return scale_; }
  // Divides `grads` (this rank's: all of them, or its shard) by the scale and says whether
  // every rank's are finite, collective over `ctx` (one 4-byte all-reduce), and updates the
  // scale. False: skip this step (the gradients are then not to be used).
  bool unscale(Context& ctx, std::span<float> grads);
  std::uint64_t skipped_steps() const { return skipped_; }
  // The scale, the good steps in a row and the skipped count, for a checkpoint; load_state
  // refuses bytes it did not write (Error kProtocol).
  std::vector<std::uint8_t> save_state() const;
  void load_state(std::span<const std::uint8_t> state);

 private:
  LossScalerOptions options_;
  float scale_;
  std::int64_t good_steps_ = 0;
  std::uint64_t skipped_ = 0;
};

}  // namespace gradsync::optim
