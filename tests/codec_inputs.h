// Test inputs and a look into codecs' saved state, for the codec tests and the compressed
// all-reduce tests.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gradsync/bytes.h"

namespace gradsync::testing {

// Gradient-like data: mostly small, a few large, both signs, some exact zeros.
inline std::vector<float> gradient(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  std::vector<float> g(n);
  for (std::size_t i = 0; i < n; ++i) {
    g[i] = i % 97 == 0 ? 0.0f : normal(rng) * (i % 31 == 0 ? 100.0f : 1.0f);
  }
  return g;
}

// Entry `key` of a codec's saved state (format in src/compress/codecs.h: magic, u32 entries,
// per entry u32 name bytes, name, u64 floats, floats; error feedback's residuals follow
// "GSEW", u64 bytes and its inner codec's state, u64 bytes); empty if absent.
inline std::vector<float> state_entry(const std::vector<std::uint8_t>& state,
                                      const std::string& key) {
  if (state.size() < 8) return {};  // a codec without state
  const std::string kind(state.begin(), state.begin() + 4);
  const bool feedback = kind == "GSEW";  // per tensor: name, residual, momentum
  ByteReader r(state, kind, feedback ? 2 : 1, "test");
  if (feedback) r.bytes();  // the inner codec's
  const auto entries = r.get<std::uint32_t>();
  for (std::uint32_t e = 0; e < entries; ++e) {
    const std::string name = r.string();
    std::vector<float> v = r.floats();
    if (feedback) r.floats();
    if (name == key) return v;
  }
  return {};
}

}  // namespace gradsync::testing
