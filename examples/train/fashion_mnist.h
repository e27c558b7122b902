// Fashion-MNIST from the IDX files Debian's dataset-fashion-mnist installs (gzip-compressed,
// /usr/share/datasets/fashion-mnist), and the per-rank, per-epoch shuffled batches of a
// data-parallel run (PyTorch's DistributedSampler semantics).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace train {

inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

// The pixels stay bytes, as in the files (a quarter of the memory of floats, and nothing to
// convert at load); a batch converts its images as it is assembled.
struct Dataset {
  std::size_t count = 0;  // images
  std::size_t rows = 28, cols = 28;
  std::vector<std::uint8_t> pixels;  // count x rows*cols, 0..255
  std::vector<std::uint8_t> labels;  // count, each 0..9
  std::size_t pixels_per_image() const { return rows * cols; }
  // Writes image i into dst[0 .. rows*cols), each pixel scaled to [0, 1] (exactly x / 255).
  void image_into(std::size_t i, float* dst) const;
};

// Loads the training (60,000) or test (10,000) split from `dir`
// ({train,t10k}-{images-idx3,labels-idx1}-ubyte.gz). A missing, truncated or corrupt file,
// one that is no regular file (a FIFO, a device) or larger than any such file, an empty set,
// or images and labels that disagree, throws std::runtime_error naming the path and what is
// wrong.
Dataset load_fashion_mnist(const std::string& dir, bool train);

// Which samples rank `rank` of `world` sees in each epoch: the indices 0..count-1 shuffled
// with a seed derived from (seed, epoch), the same permutation on every rank; rank r takes
// every world-th index starting at r, after dropping the count % world last ones so every
// rank has the same number of samples (and so the same number of steps). Batches are
// consecutive runs of `batch` of those; the last partial batch is dropped, so every rank
// runs exactly steps_per_epoch() steps. The permutation is a Fisher-Yates shuffle driven by
// splitmix64 (fully specified here, unlike std::shuffle and the std distributions), so it is
// the same on every machine and standard library. batch() keeps the last epoch's indices
// per thread, so stepping through an epoch shuffles once, not once per step.
class ShardedSampler {
 public:
  ShardedSampler(std::size_t count, int rank, int world, std::size_t batch, std::uint64_t seed);
  std::size_t steps_per_epoch() const;
  std::size_t samples_per_rank() const;
  // The sample indices of step `step` (0..steps_per_epoch()-1) of `epoch` on this rank.
  std::vector<std::size_t> batch(std::size_t epoch, std::size_t step) const;
  // All of this rank's indices in `epoch`, in order.
  std::vector<std::size_t> epoch_indices(std::size_t epoch) const;

 private:
  std::size_t count_, batch_;
  int rank_, world_;
  std::uint64_t seed_;
};

}  // namespace train
