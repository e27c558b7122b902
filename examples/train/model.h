// The trainer's models, written for the example: an MLP and a small CNN with per-layer
// forward and backward on OpenBLAS (one thread per rank), softmax cross-entropy, and
// backward reporting each parameter's gradient the moment it is final, so a Reducer can
// start reducing while backward continues.
#pragma once

#include <gradsync/types.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace gradsync {
class ShardedDataParallel;
}

namespace train {

struct Parameter {
  std::string name;  // "fc1.weight", "conv1.bias", ...
  std::size_t count = 0;
  std::size_t rows = 0;    // matrix rows for PowerSGD (weights: out features), 0 for vectors
  std::span<float> value;  // into Model::values()
  std::span<float> grad;   // into Model::grads()
};

// Mixed precision as autocast runs it on a CPU without 16-bit arithmetic: every layer
// computes from its weights and its input rounded to `compute` (float32 accumulation inside
// the products), and its output, its input gradient and its weight gradients are rounded to
// it. The master weights stay float32.
struct Precision {
  gradsync::DataType compute = gradsync::DataType::kFloat32;  // or kBFloat16, kFloat16
  float loss_scale = 1;  // backward starts from the loss times this (float16's loss scaling)
};

// Called with a parameter's index (into Model::parameters()) as soon as backward has written
// its final gradient for the batch.
using GradReady = std::function<void(std::size_t parameter)>;

class Model {
 public:
  virtual ~Model() = default;
  // Parameters in registration (forward) order.
  virtual std::vector<Parameter>& parameters() = 0;
  // Forward over `batch` images (batch x 784 floats, row-major, batch > 0; anything else throws
  // std::invalid_argument) -> logits (batch x 10), kept with every activation backward needs
  // (the images are copied: the caller's buffer may go as soon as this returns).
  virtual void forward(std::span<const float> images, std::size_t batch) = 0;
  // Mean softmax cross-entropy of the last forward against `labels`, and how many of the
  // batch the logits got right (`correct` may be null). Before any forward: std::logic_error.
  virtual float loss(std::span<const std::uint8_t> labels, std::size_t* correct) = 0;
  // Backward of the mean loss: OVERWRITES every gradient (or, with `accumulate`, adds into
  // it: gradient accumulation over micro-batches), last layer first, calling `ready` (may be empty)
  // per parameter as each is final: a layer's weight, then its bias, then the layer before. May be
  // called again on the same forward. Labels must number the batch and be 0..9 (else
  // std::invalid_argument, as for loss).
  virtual void backward(std::span<const std::uint8_t> labels, bool accumulate,
                        const GradReady& ready) = 0;
  // Every parameter's values, and gradients, back to back in parameters() order (the spans of
  // each Parameter point into these), for optimizers that update them all at once.
  virtual std::span<float> values() = 0;
  virtual std::span<float> grads() = 0;
  // "mlp 784-2048-2048-2048-2048-10, 14.2 M parameters (14217226)"
  virtual std::string describe() const = 0;
  // Hands the parameters to `sharded`, one unit per layer with parameters (its weight then its
  // bias, named after the layer) in forward order, and frees the model's own copies: from then
  // on forward and backward take each layer's values from it as the layer runs and hand it
  // their gradients (backward's `accumulate` and `ready` are then the engine's business), and
  // values() and grads() are empty. Once only.
  virtual void shard(gradsync::ShardedDataParallel& sharded) = 0;
  // From the next forward on (float32 until set).
  virtual void set_precision(const Precision& precision) = 0;
};

// "mlp": 784 -> hidden... -> 10 with ReLU (default hidden {2048, 2048, 2048, 2048}:
// 14,217,226 parameters, the DDP comparison's shape); "cnn" (no hidden sizes): conv 5x5
// 1->16 (padding 2), ReLU, max-pool 2 (14x14), conv 5x5 16->32, ReLU, max-pool 2 (7x7),
// flatten 32*7*7 = 1568 -> fc 128, ReLU, fc 128 -> 10 (215,370 parameters).
// Weights and biases drawn as PyTorch's defaults (uniform +-1/sqrt(fan_in), which Kaiming
// uniform with a = sqrt(5) reduces to) from a splitmix64 seeded by `seed`, so identical on
// every rank and machine. An unknown kind, or hidden sizes that do not fit it, throw
// std::invalid_argument. Sets OpenBLAS to one thread (one per rank) on the first call.
std::unique_ptr<Model> make_model(const std::string& kind, std::uint64_t seed,
                                  const std::vector<std::size_t>& hidden = {});

}  // namespace train
