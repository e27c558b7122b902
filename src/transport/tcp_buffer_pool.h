// Recycled buffers for the tcp transport's messages that arrive before their receive is
// posted, and for consuming receives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

// Hidden, as all tcp internals are (see tcp_core.h).
#pragma GCC visibility push(hidden)
namespace gradsync::transport::tcp {

// A fresh large allocation is fresh memory: one page fault and one zeroed page per 4 KiB
// when recv() first writes it, and an unmap when it is freed. In a 4-rank 64 MiB ring
// (every reduce-scatter piece lands in such a buffer) that tripled the page faults of the
// whole run and cost more CPU than the reductions.
class BufferPool {
 public:
  // Returns a buffer to its pool (or the heap) when the owning pointer dies.
  struct Release {
    BufferPool* pool = nullptr;  // null: plain delete[]
    std::size_t capacity = 0;
    void operator()(std::uint8_t* p) const noexcept {
      if (pool) {
        pool->put(p, capacity);
      } else {
        delete[] p;
      }
    }
  };
  using Buffer = std::unique_ptr<std::uint8_t[], Release>;

  // A buffer of at least `bytes` bytes, contents undefined; empty when out of memory.
  // Any thread.
  Buffer get(std::size_t bytes);

  // Cached memory per transport: a few dozen ring pieces in flight at the default 256 KiB
  // chunk, or one 32 MiB message; beyond that the oldest cached buffers are freed.
  static constexpr std::size_t kMaxCachedBytes = 32 * 1024 * 1024;

 private:
  // Below this, malloc serves from its own caches without touching fresh pages.
  static constexpr std::size_t kMinPooledBytes = 32 * 1024;
  static constexpr std::size_t kRoundBytes = 4096;
  struct Cached {
    std::unique_ptr<std::uint8_t[]> data;
    std::size_t capacity = 0;
  };

  void put(std::uint8_t* p, std::size_t capacity) noexcept;

  std::mutex mu_;             // leaf lock: taken under Core::mu_ or alone
  std::vector<Cached> free_;  // oldest first
  std::size_t cached_bytes_ = 0;
};
using Buffer = BufferPool::Buffer;

}  // namespace gradsync::transport::tcp
#pragma GCC visibility pop
