// Sharded data parallelism: ZeRO stages 1, 2 and 3 (Rajbhandari et al., 2020; stage 3 is
// PyTorch FSDP's FULL_SHARD, stage 2 its SHARD_GRAD_OP), with the communication overlapped
// with forward and backward.
//
// The model is cut into units (a layer's weight and bias), each sharded evenly across the
// ranks. Stage 3 keeps only this rank's shard of each unit between uses: a unit is
// all-gathered just before its forward and again before its backward (the last units stay
// whole from one to the other), the next unit's gather is queued while this one computes, and
// the whole copy is freed after use. Stages 1 and 2 keep
// the parameters whole and all-gather them after the step, each unit waited for only when its
// next forward needs it. In all three, a unit's gradient is reduce-scattered as soon as
// backward has it, while backward goes on, and the optimizer steps only this rank's shard: a
// step sends what a DDP all-reduce sends (stages 1 and 2) or up to half as much again
// (stage 3, less the second gathers of the units kept from forward to backward).
// Stage 2 reduce-scatters every micro-batch and keeps only its shard of the gradient; stage 1
// keeps the whole gradient through gradient accumulation and communicates once a step.
//
// Example:
//   gradsync::ShardedDataParallel sharded(*ctx, {.stage = 3});
//   for (auto& layer : layers) layer.unit = sharded.add_unit(layer.name, layer.initial_values);
//   sharded.set_optimizer([](std::size_t n) { return gradsync::optim::make_adamw(n); });
//   for (int step = 0; step < steps; ++step) {
//     for (auto& layer : layers) {  // forward
//       layer.forward(sharded.acquire(layer.unit, gradsync::Pass::kForward));
//       sharded.release(layer.unit, gradsync::Pass::kForward);
//     }
//     for (auto& layer : layers | std::views::reverse) {  // backward
//       const auto values = sharded.acquire(layer.unit, gradsync::Pass::kBackward);
//       layer.backward(values, sharded.gradient(layer.unit));  // writes the whole gradient
//       sharded.mark_ready(layer.unit);  // its reduce-scatter starts
//       sharded.release(layer.unit, gradsync::Pass::kBackward);
//     }
//     sharded.finish();  // waits for the reduce-scatters
//     sharded.step();    // this rank's shard; stages 1 and 2 then all-gather the parameters
//   }
//
// Calls: every acquire, mark_ready, finish and step is collective in effect (it may queue a
// call on the context), so every rank makes them in the same order, from the one thread that
// issues the context's calls. A rank that acquires another unit than its peers fails with
// kMismatch, never combines the wrong data. Between calls of this class the context may be
// used for other collectives: they queue behind the prefetches in the same order on every
// rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gradsync/gradsync.h"
#include "gradsync/optim.h"
#include "gradsync/reducer.h"

namespace gradsync {

struct ShardedOptions {
  // 3: parameters, gradients and optimizer state sharded; 2: gradients and optimizer state
  // sharded, parameters whole between steps; 1: optimizer state sharded, parameters whole,
  // gradients whole while micro-batches accumulate.
  int stage = 3;
  // Stage 1: each step has a multiple of this many micro-batches (finish() calls); the
  // gradients of each group's micro-batches but the last add up on each rank, and the last's
  // backward reduce-scatters their sum, so a step communicates once whatever the
  // accumulation (the DDP Reducer's accumulate_steps).
  // Stages 2 and 3 keep only their shard of the gradient, so they reduce-scatter every
  // micro-batch and take only 1.
  int accumulate_steps = 1;
  // The parameters' and gradients' dtype on the wire: kFloat32, or kBFloat16 / kFloat16 for
  // half the bytes (gathered parameters rounded to it; gradients reduce-scattered with a
  // float32 addition at every hop, pre-divided by the ranks so that fp16 cannot overflow).
  // The shards and the optimizer stay float32 (the master weights).
  DataType wire = DataType::kFloat32;
  // kInt8: the gradients instead reduce-scattered as int8 with a float32 scale per block of
  // 256 (the parameters gathered in `wire`), with error feedback: each rank quantises its
  // whole gradient once, keeps what rounding dropped and adds it to its next gradient (one
  // float per parameter a rank, counted in Memory::error_feedback_bytes), and sums the ranks'
  // pieces of its shard in float32. kFloat32, the default: the gradients travel in `wire`.
  DataType gradient_wire = DataType::kFloat32;
  // Stage 3: how many of the units used next have their gathers queued while this one
  // computes, or while step() steps the shards (0: each gathered only when acquired). Units
  // are used in forward order, then in backward order. At the turn, the last
  // prefetch_depth + 1 units stay whole from their forward to their backward: forward would
  // queue their second gathers itself, which could hide only behind the (often small) units
  // after them, and the copies kept take the place of the prefetched ones. One is FSDP's
  // forward_prefetch and BACKWARD_PRE; each more holds one more whole unit and one more gradient in
  // flight at once, for a worker that would otherwise idle while a unit computes longer than the
  // next one's gather.
  int prefetch_depth = 1;
};

// Which pass a unit's parameters are acquired for (it decides which unit is prefetched).
enum class Pass : std::uint8_t { kForward, kBackward };

class ShardedDataParallel {
 public:
  // Makes the optimizer of `count` parameters.
  using OptimizerFactory = std::function<std::unique_ptr<optim::Optimizer>(std::size_t count)>;

  ShardedDataParallel(Context& ctx, ShardedOptions options = {});
  ~ShardedDataParallel();
  ShardedDataParallel(const ShardedDataParallel&) = delete;
  ShardedDataParallel& operator=(const ShardedDataParallel&) = delete;

  // Registers a unit with its initial values, identical on every rank; this rank keeps its
  // shard of them (the caller may free them). Returns its id: 0, 1, ... in forward order.
  // Every rank registers the same units in the same order, before set_optimizer.
  int add_unit(std::string name, std::span<const float> initial);
  // The optimizer of this rank's shards (every unit's shard back to back, padded to a
  // multiple of the ranks with zeros). One that needs whole tensors (LARS, LAMB) is refused
  // (kInvalidArgument): a shard cuts its tensors anywhere.
  void set_optimizer(const OptimizerFactory& make);
  void set_lr(float lr);

  // The unit's whole parameters for this pass: waits for its gather (queued now unless
  // prefetched), and queues those of the units used next (ShardedOptions::prefetch_depth).
  // Valid until release(unit, pass).
  std::span<const float> acquire(int unit, Pass pass);
  // Stage 3 frees the unit's whole copy, unless it is one of the last prefetch_depth + 1
  // units after their forward (kept for their backward). Stages 1 and 2 keep it.
  void release(int unit, Pass pass);
  // Where backward writes the unit's whole gradient (overwriting it), until mark_ready.
  std::span<float> gradient(int unit);
  // The unit's gradient is final: its reduce-scatter is queued (stage 1, before the last
  // micro-batch of a step: it is added to the unit's accumulated gradient instead).
  void mark_ready(int unit);
  // Waits for every reduce-scatter of this backward and adds the results into this rank's
  // shard of the gradient (micro-batches accumulate until step()). Reports what this
  // backward cost: communication_s the reduce-scatters and gathers ran since the last
  // finish(), exposed_s the time acquire and finish waited for them; communicated is false
  // for a stage 1 micro-batch that sent nothing.
  StepStats finish();
  // Steps this rank's shard with the mean gradient over the ranks and the micro-batches
  // finished since the last step, unit by unit in forward order (Optimizer::step_pieces),
  // queuing a unit's gather as soon as its shard has stepped: stages 1 and 2 every unit's,
  // stage 3 those its first acquire would queue (the first prefetch_depth + 1 units; none at
  // depth 0), having dropped every whole copy still held, now out of date. With a loss scaler
  // (float16 training) the gradients are unscaled first, and where any rank's hold NaN or Inf
  // the step is skipped on every rank: false, the gradients dropped, the parameters as they
  // were.
  bool step(optim::LossScaler* scaler = nullptr);

  // Every unit's whole parameters back to back, in unit order, as the float32 master copies
  // hold them whatever the wire (for checkpoints and evaluation elsewhere): collective. After
  // set_optimizer, as load_values, save_state and load_state.
  std::vector<float> gather_values();
  // Takes this rank's shard of `values` (gather_values' layout), identical on every rank.
  void load_values(std::span<const float> values);
  // The optimizer's state of this rank's shard, and with int8 gradients what their rounding
  // held back; load_state refuses bytes it did not write (kProtocol).
  std::vector<std::uint8_t> save_state() const;
  void load_state(std::span<const std::uint8_t> state);
  // Re-sharding, for a job that goes on at another number of ranks (an elastic job that lost
  // one): `states` are save_state() of every rank of a run with the same units, in rank order;
  // this rank takes its part of their optimizer state at this run's number of ranks, and of
  // its own old rank's int8 error feedback where it had one (the others' is dropped, as a lost
  // rank's codec residuals are). Local: every rank needs every state, no collective runs.
  // Needs an optimizer whose state is per-element planes (SGD, AdamW: Optimizer::planes),
  // else kInvalidArgument; states of other units are refused (kProtocol).
  void load_state_of_ranks(std::span<const std::vector<std::uint8_t>> states);

  struct Memory {
    // This rank's float32 shard (the master copy), and with stages 1 and 2 the whole copy of
    // every unit, each padded to a multiple of the ranks.
    std::size_t parameter_bytes = 0;
    // This rank's shard of the reduced gradient, and with stage 1 accumulating micro-batches
    // the whole gradient they add up in.
    std::size_t gradient_bytes = 0;
    std::size_t optimizer_state_bytes = 0;  // this rank's
    std::size_t working_bytes = 0;          // the most held at once for gathers and gradients
    std::size_t error_feedback_bytes = 0;   // int8 gradients: what rounding held back
  };
  Memory memory() const;
  std::size_t units() const;
  std::size_t unit_size(int unit) const;  // its parameters, unpadded

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace gradsync
