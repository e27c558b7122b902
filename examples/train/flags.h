// gradsync-train's command line: every flag with its default, the checks that refuse a bad
// value or a conflicting pair before any rank starts, and the usage text.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "train/fashion_mnist.h"

namespace train {

struct Config {
  std::string model = "mlp";
  std::vector<std::size_t> hidden;
  int epochs = 1;
  std::size_t batch = 64;
  double lr = -1;                        // below 0: the optimizer's default, set by parse_flags
  std::string lr_schedule = "constant";  // or "cosine", "poly"
  double poly_power = 0;                 // poly's exponent; 0: not given (1 with poly)
  double weight_decay = -1;              // below 0: the optimizer's default, set by parse_flags
  // LARS and LAMB step biases (1-D tensors) with neither weight decay nor trust ratio.
  bool exclude_biases = false;
  double beta2 = -1;  // Adam's (adamw, lamb); below 0: 0.999
  // --lr scaled by the global batch (batch x ranks x accumulate) over base_batch: "none",
  // "linear" (Goyal et al., for SGD) or "sqrt" (Hoffer et al., for Adam and LAMB).
  std::string lr_scaling = "none";
  std::size_t base_batch = 256;
  double warmup_epochs = 0;  // the rate rises linearly from 0 over these first epochs
  std::string optimizer = "sgd";
  std::uint64_t seed = 1;
  std::string codec = "none";
  double bucket_mb = 25, first_bucket_mb = 1;
  bool overlap = true;
  bool step_ahead = true;
  int accumulate = 1;
  int zero = 0;
  int prefetch = 1;  // ZeRO 3: units gathered ahead (ShardedOptions::prefetch_depth)
  // Mixed precision: "none", "bf16" or "fp16" (with dynamic loss scaling); the gradients
  // travel in it (it becomes the codec, or ZeRO 2 and 3's wire).
  std::string amp = "none";
  long max_steps = -1;
  std::string data = kFashionMnistDir;
  std::string json;
  bool quiet = false;
  std::string checkpoint;
  long checkpoint_every = 0;  // 0: end of each epoch
  bool resume = false;
  bool overwrite = false;  // a new run may replace the checkpoints in --checkpoint DIR
};

// The flags of argv[1..]. --help prints the usage to stdout and exits 0; a flag refused prints
// why and the usage to stderr and exits 2.
Config parse_flags(int argc, char** argv);

// A codec with momentum correction (DGC) applies SGD's momentum before the wire: what arrives
// is already the update, so the optimizer must not apply momentum again.
bool codec_has_momentum(const std::string& spec);

// --weight-decay's default for this --optimizer: AdamW's and LAMB's 0.01, else none.
double default_weight_decay(const std::string& optimizer);

}  // namespace train
