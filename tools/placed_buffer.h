// Benchmark buffers that start a chosen number of bytes past a page boundary. Where malloc puts
// a buffer changes the speed of some copies by up to 2x (docs/performance-notes.md, session 33),
// so gradsync-bench and the peer benchmarks place theirs alike rather than where the heap's
// history happens to leave them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace gradsync::tools {

template <typename T>
class PlacedBuffer {
 public:
  static constexpr std::size_t kPageBytes = 4096;

  PlacedBuffer() = default;
  explicit PlacedBuffer(std::size_t count, std::size_t offset_bytes = 0) {
    assign(count, offset_bytes);
  }
  // `count` value-initialised elements from `offset_bytes` (a multiple of sizeof(T)) past a page.
  void assign(std::size_t count, std::size_t offset_bytes = 0) {
    storage_.assign(count + (offset_bytes + kPageBytes) / sizeof(T), T{});
    const auto address = reinterpret_cast<std::uintptr_t>(storage_.data());
    const std::size_t to_page = (kPageBytes - address % kPageBytes) % kPageBytes;
    data_ = storage_.data() + (to_page + offset_bytes) / sizeof(T);
    size_ = count;
  }
  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return size_; }
  T& operator[](std::size_t i) { return data_[i]; }

 private:
  std::vector<T> storage_;
  T* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace gradsync::tools
