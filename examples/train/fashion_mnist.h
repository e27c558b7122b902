// Fashion-MNIST from the IDX files Debian's dataset-fashion-mnist installs (gzip-compressed,
// /usr/share/datasets/fashion-mnist), and the per-rank, per-epoch shuffled batches of a
// data-parallel run (PyTorch's DistributedSampler semantics).
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

namespace train {

inline constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";

// The allocator of the loader's buffers (the whole compressed file, 47 MB of pixels): new
// elements are left uninitialised, since read() and inflate() write them before anything reads
// them, and blocks of 4 MiB and more are asked for in huge pages. Zeroing the buffers first,
// and taking a page fault for each of their 4 KiB pages, cost two thirds of a trainer's
// start-up on this project's VMs (docs/performance-notes.md).
template <class T>
struct UninitializedAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = UninitializedAllocator<U>;
  };
  static constexpr std::size_t kHugePage = std::size_t{2} << 20;
  static constexpr std::size_t kHugeFrom = std::size_t{4} << 20;

  UninitializedAllocator() = default;
  template <class U>
  UninitializedAllocator(const UninitializedAllocator<U>&) noexcept {}

  T* allocate(std::size_t n) {
    if (n * sizeof(T) < kHugeFrom) return std::allocator<T>::allocate(n);
    const std::size_t bytes = (n * sizeof(T) + kHugePage - 1) / kHugePage * kHugePage;
    void* p = std::aligned_alloc(kHugePage, bytes);
    if (!p) throw std::bad_alloc();
    ::madvise(p, bytes, MADV_HUGEPAGE);  // advice: without transparent huge pages, 4 KiB pages
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t n) {
    if (n * sizeof(T) < kHugeFrom) return std::allocator<T>::deallocate(p, n);
    std::free(p);
  }
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
using LoadedBytes = std::vector<std::uint8_t, UninitializedAllocator<std::uint8_t>>;

// The pixels stay bytes, as in the files (a quarter of the memory of floats, and nothing to
// convert at load); a batch converts its images as it is assembled.
struct Dataset {
  std::size_t count = 0;  // images
  std::size_t rows = 28, cols = 28;
  LoadedBytes pixels;                // count x rows*cols, 0..255
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
