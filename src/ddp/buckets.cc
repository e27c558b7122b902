#include "ddp/buckets.h"

namespace gradsync::ddp {

std::vector<std::vector<std::size_t>> assign_buckets(std::span<const std::size_t> counts,
                                                     std::size_t first_bucket_bytes,
                                                     std::size_t bucket_bytes) {
  std::vector<std::vector<std::size_t>> buckets;
  std::size_t floats = 0;  // in the last bucket
  std::size_t cap = first_bucket_bytes;
  bool closed = false;  // the last bucket holds a large tensor
  for (std::size_t i = 0; i < counts.size(); ++i) {
    const bool large = 2 * counts[i] * sizeof(float) >= bucket_bytes;
    if (buckets.empty() || closed || large || (floats + counts[i]) * sizeof(float) > cap) {
      if (!buckets.empty()) cap = bucket_bytes;
      buckets.emplace_back();
      floats = 0;
    }
    buckets.back().push_back(i);
    floats += counts[i];
    closed = large;
  }
  return buckets;
}

}  // namespace gradsync::ddp
