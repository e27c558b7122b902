// splitmix64 (Steele, Lea and Flood, 2014) for the trainer's draws, the initial weights and
// the data order: tiny and fully specified, so every rank on every machine and standard
// library draws the same (std::shuffle's use of its engine and the std:: distributions are
// implementation-defined).
#pragma once

#include <cstdint>

namespace train {

class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, n) without modulo bias: reject the few values below 2^64 mod n.
  std::uint64_t below(std::uint64_t n) {
    const std::uint64_t threshold = (0 - n) % n;
    for (;;) {
      const std::uint64_t r = next();
      if (r >= threshold) return r % n;
    }
  }
  // Uniform in [-bound, bound): the top 24 bits, exactly what a float mantissa holds.
  float uniform(float bound) {
    const float u = static_cast<float>(next() >> 40) * (1.0f / 16777216.0f);
    return bound * (2.0f * u - 1.0f);
  }

 private:
  std::uint64_t state_;
};

}  // namespace train
