// Recycled buffers for the tcp transport's messages that arrive before their receive is
// posted, and for consuming receives.
#include "transport/tcp_buffer_pool.h"

#include <new>
#include <utility>

namespace gradsync::transport::tcp {

BufferPool::Buffer BufferPool::get(std::size_t bytes) {
  if (bytes < kMinPooledBytes) return Buffer(new (std::nothrow) std::uint8_t[bytes], Release{});
  {
    std::lock_guard lk(mu_);
    // Best fit among cached buffers, but never one much larger than asked for, so a
    // burst of small messages cannot pin the big buffers a large message needs.
    std::size_t best = free_.size();
    for (std::size_t i = 0; i < free_.size(); ++i) {
      std::size_t c = free_[i].capacity;
      if (c >= bytes && c <= bytes + bytes / 4 + kRoundBytes &&
          (best == free_.size() || c < free_[best].capacity)) {
        best = i;
      }
    }
    if (best != free_.size()) {
      Cached c = std::move(free_[best]);
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
      cached_bytes_ -= c.capacity;
      return Buffer(c.data.release(), Release{this, c.capacity});
    }
  }
  // Rounded up so the slightly different sizes of one collective's pieces share buffers.
  std::size_t capacity = (bytes + kRoundBytes - 1) / kRoundBytes * kRoundBytes;
  return Buffer(new (std::nothrow) std::uint8_t[capacity], Release{this, capacity});
}

void BufferPool::put(std::uint8_t* p, std::size_t capacity) noexcept {
  Cached released{std::unique_ptr<std::uint8_t[]>(p), capacity};
  if (capacity > kMaxCachedBytes) return;
  std::lock_guard lk(mu_);
  try {
    free_.push_back(std::move(released));
  } catch (...) {
    return;  // no memory for the list entry: the buffer is simply freed
  }
  cached_bytes_ += capacity;
  while (cached_bytes_ > kMaxCachedBytes) {  // oldest first
    cached_bytes_ -= free_.front().capacity;
    free_.erase(free_.begin());
  }
}

}  // namespace gradsync::transport::tcp
