// Sparsifying codecs: top-k (exact, or narrowed by a sampled threshold as in Deep Gradient
// Compression), threshold, and random-k (indices from a seed every rank shares).
#include <algorithm>
#include <charconv>
#include <cmath>

#include "compress/codecs.h"
#include "kernels/kernels.h"

namespace gradsync::compress {

namespace {

// Sparse payloads touch only their elements: decoding is zeroing and adding, and error
// feedback subtracts in place. Codecs give accumulate(payload, out, negate).
class Accumulating : public Codec, public SubtractsPayload {
 public:
  void decode(std::span<const std::uint8_t> payload, std::span<float> out) const override {
    std::fill(out.begin(), out.end(), 0.0f);
    accumulate(payload, out, false);
  }
  void decode_add(std::span<const std::uint8_t> payload, std::span<float> out) const override {
    accumulate(payload, out, false);
  }
  void subtract(std::span<const std::uint8_t> payload, std::span<float> out) const override {
    accumulate(payload, out, true);
  }

 protected:
  // out += (negate ? -1 : 1) * what the payload carries; throws kProtocol if malformed.
  virtual void accumulate(std::span<const std::uint8_t> payload, std::span<float> out,
                          bool negate) const = 0;
};

// (index, value) payload: u32 count, u32 pairs, the indices (strictly ascending, each below
// count), then the values.
class SparseDecoder : public Accumulating {
 private:
  void accumulate(std::span<const std::uint8_t> payload, std::span<float> out,
                  bool negate) const override {
    const std::string name = spec();
    if (payload.size() < 8) bad_payload(name, "shorter than its 8-byte header");
    const std::size_t n = get_u32(payload, 0), pairs = get_u32(payload, 4);
    if (n != out.size()) {
      bad_payload(
          name, "holds " + std::to_string(n) + " elements, expected " + std::to_string(out.size()));
    }
    if (pairs > n) bad_payload(name, std::to_string(pairs) + " pairs for " + std::to_string(n));
    expect_bytes(name, payload, 8 + 8 * pairs, n);
    const std::uint8_t* indices = payload.data() + 8;
    const std::uint8_t* values = indices + 4 * pairs;
    std::uint32_t previous = 0;
    for (std::size_t j = 0; j < pairs; ++j) {
      std::uint32_t i;
      float v;
      std::memcpy(&i, indices + 4 * j, 4);
      std::memcpy(&v, values + 4 * j, 4);
      if (i >= n || (j > 0 && i <= previous)) {
        bad_payload(name, "index " + std::to_string(i) + " at pair " + std::to_string(j) +
                              (i >= n ? " is out of range" : " is not ascending"));
      }
      previous = i;
      out[i] += negate ? -v : v;
    }
  }

 protected:
  static void write(std::size_t n, std::span<const std::uint32_t> indices,
                    std::span<const float> in, std::vector<std::uint8_t>& out) {
    out.resize(8 + 8 * indices.size());
    put_u32(out, 0, static_cast<std::uint32_t>(n));
    put_u32(out, 4, static_cast<std::uint32_t>(indices.size()));
    if (indices.empty()) return;
    std::memcpy(out.data() + 8, indices.data(), 4 * indices.size());
    auto* values = out.data() + 8 + 4 * indices.size();
    for (std::size_t j = 0; j < indices.size(); ++j) {
      std::memcpy(values + 4 * j, &in[indices[j]], 4);
    }
  }
};

std::size_t k_of(double ratio, std::size_t n) {
  if (n == 0) return 0;
  return std::clamp<std::size_t>(
      static_cast<std::size_t>(std::ceil(ratio * static_cast<double>(n))), 1, n);
}

// Top-k by magnitude, ties to the lower index. The result is exact either way; the sampled
// threshold only decides which elements are worth ranking. With warmup=S (Deep Gradient
// Compression's warm-up) the ratio starts at kWarmupStart and falls exponentially to its
// target over a tensor's first S steps, so the early, fast-changing gradients are not held
// back for hundreds of steps.
class TopKCodec final : public SparseDecoder, public SelectsIndices {
 public:
  TopKCodec(double ratio, bool exact, std::uint64_t warmup, bool exchange_union)
      : ratio_(ratio), exact_(exact), warmup_(warmup), union_(exchange_union) {}
  std::string spec() const override {
    return "topk:" + std::string(exact_ ? "exact=1," : "") + "ratio=" + format_number(ratio_) +
           (warmup_ > 0 ? ",warmup=" + std::to_string(warmup_) : "") + (union_ ? ",union=1" : "");
  }
  bool biased() const override { return true; }
  std::size_t encoded_bytes(std::size_t count) const override {
    return 8 + 8 * k_of(warmup_ > 0 ? std::max(ratio_, kWarmupStart) : ratio_, count);
  }
  bool size_varies() const override { return warmup_ > 0; }
  void encode(const Tensor& tensor, std::span<const float> in,
              std::vector<std::uint8_t>& out) override {
    select_indices(tensor, in, chosen_);
    write(in.size(), chosen_, in, out);
  }
  void select_indices(const Tensor& tensor, std::span<const float> in,
                      std::vector<std::uint32_t>& chosen) override {
    check_encodable("topk", tensor, in.size());
    refuse_non_finite(tensor, in, "topk");  // NaN would break the ranking
    const std::size_t n = in.size(), k = k_of(ratio_at(tensor), n);
    candidates_.clear();
    if (!exact_ && n >= kSampledFrom && k * 4 < n) sampled_candidates(in, k);
    if (candidates_.size() < k) {  // exact, small, or the sample guessed too high
      candidates_.resize(n);
      for (std::size_t i = 0; i < n; ++i) candidates_[i] = static_cast<std::uint32_t>(i);
    }
    select(in, k, chosen);
  }
  // The warm-up's step counts; none without warm-up.
  std::vector<std::uint8_t> save_state() const override {
    return warmup_ > 0 ? save_tensor_state(kMagic, steps_) : std::vector<std::uint8_t>{};
  }
  void load_state(std::span<const std::uint8_t> state) override {
    if (warmup_ == 0) return Codec::load_state(state);
    steps_ = load_tensor_state(kMagic, state);
  }

 private:
  // Below this the whole tensor is ranked: sampling would save little.
  static constexpr std::size_t kSampledFrom = 1 << 16;
  // Elements sampled to estimate the threshold (DGC samples 0.1-1%; a fixed count bounds the
  // cost and the estimate's spread alike).
  static constexpr std::size_t kSamples = 1 << 14;

  // The sample's magnitude at rank 1.5 k n/samples (a margin, so that usually at least k
  // elements pass), then every element at or above it, in index order.
  void sampled_candidates(std::span<const float> in, std::size_t k) {
    const std::size_t n = in.size(), m = std::min(n, kSamples);
    magnitudes_.resize(m);
    const double stride = static_cast<double>(n) / static_cast<double>(m);
    for (std::size_t j = 0; j < m; ++j) {
      magnitudes_[j] = std::fabs(in[static_cast<std::size_t>(static_cast<double>(j) * stride)]);
    }
    const auto want = static_cast<std::size_t>(
        std::ceil(1.5 * static_cast<double>(k) * static_cast<double>(m) / static_cast<double>(n)));
    if (want >= m) return;
    std::nth_element(magnitudes_.begin(), magnitudes_.begin() + static_cast<long>(want),
                     magnitudes_.end(), std::greater<float>());
    const float threshold = magnitudes_[want];
    for (std::size_t i = 0; i < n; ++i) {
      if (std::fabs(in[i]) >= threshold) candidates_.push_back(static_cast<std::uint32_t>(i));
    }
  }

  // The k largest magnitudes among the candidates (ascending indices), ties to the lower
  // index: everything above the k-th largest magnitude, then the first ties.
  void select(std::span<const float> in, std::size_t k, std::vector<std::uint32_t>& chosen) {
    chosen.clear();
    if (k == 0) return;
    magnitudes_.resize(candidates_.size());
    for (std::size_t j = 0; j < candidates_.size(); ++j) {
      magnitudes_[j] = std::fabs(in[candidates_[j]]);
    }
    std::nth_element(magnitudes_.begin(), magnitudes_.begin() + static_cast<long>(k - 1),
                     magnitudes_.end(), std::greater<float>());
    const float kth = magnitudes_[k - 1];
    std::size_t above = 0;
    for (std::uint32_t i : candidates_) above += std::fabs(in[i]) > kth;
    std::size_t ties = k - above;
    for (std::uint32_t i : candidates_) {
      const float a = std::fabs(in[i]);
      if (a > kth || (a == kth && ties > 0)) {
        if (a == kth) --ties;
        chosen.push_back(i);
      }
    }
  }

  // DGC's schedule starts at 25% (75% sparsity).
  static constexpr double kWarmupStart = 0.25;
  static constexpr char kMagic[4] = {'G', 'S', 'T', 'K'};

  double ratio_at(const Tensor& tensor) {
    if (warmup_ == 0 || ratio_ >= kWarmupStart) return ratio_;
    const std::uint64_t step = next_step(steps_, tensor.name);
    if (step >= warmup_) return ratio_;
    const double progress = static_cast<double>(step) / static_cast<double>(warmup_);
    return kWarmupStart * std::pow(ratio_ / kWarmupStart, progress);
  }

  double ratio_;
  bool exact_;
  std::uint64_t warmup_;
  bool union_;
  std::map<std::string, std::vector<float>> steps_;  // per tensor, with warm-up
  std::vector<std::uint32_t> candidates_, chosen_;
  std::vector<float> magnitudes_;
};

// Every element with |g| >= rel max|g|: as many pairs as the gradient has large elements.
class ThresholdCodec final : public SparseDecoder {
 public:
  explicit ThresholdCodec(double rel) : rel_(rel) {}
  std::string spec() const override { return "threshold:rel=" + format_number(rel_); }
  bool biased() const override { return true; }
  std::size_t encoded_bytes(std::size_t count) const override { return 8 + 8 * count; }
  bool size_varies() const override { return true; }
  void encode(const Tensor& tensor, std::span<const float> in,
              std::vector<std::uint8_t>& out) override {
    check_encodable("threshold", tensor, in.size());
    refuse_non_finite(tensor, in, "threshold");
    const float peak = kernels::max_abs(in.data(), in.size());
    const auto cut = static_cast<float>(rel_ * peak);
    chosen_.clear();
    if (peak > 0) {
      for (std::size_t i = 0; i < in.size(); ++i) {
        if (std::fabs(in[i]) >= cut) chosen_.push_back(static_cast<std::uint32_t>(i));
      }
    }
    write(in.size(), chosen_, in, out);
  }

 private:
  double rel_;
  std::vector<std::uint32_t> chosen_;
};

// Random-k: k values at indices drawn from (seed, tensor, step), one per stratum of n/k
// elements, so the draws spread over the tensor and every rank draws the same without
// exchanging them. Payload: u32 count, u32 k, u64 draw key, the k values (the only part that
// differs between ranks, so all-reduce sums just those).
class RandomKCodec final : public Accumulating {
 public:
  RandomKCodec(double ratio, std::uint64_t seed) : ratio_(ratio), seed_(seed) {}
  std::string spec() const override {
    return "randomk:ratio=" + format_number(ratio_) + ",seed=" + std::to_string(seed_);
  }
  bool biased() const override { return true; }
  std::size_t encoded_bytes(std::size_t count) const override {
    return kValuesAt + 4 * k_of(ratio_, count);
  }
  void encode(const Tensor& tensor, std::span<const float> in,
              std::vector<std::uint8_t>& out) override {
    check_encodable("randomk", tensor, in.size());
    const std::size_t n = in.size(), k = k_of(ratio_, n);
    std::uint64_t key = seed_ ^ name_hash(tensor.name);
    key ^= splitmix64(key) + next_step(steps_, tensor.name) * 0x9E3779B97F4A7C15ull;
    out.resize(encoded_bytes(n));
    put_u32(out, 0, static_cast<std::uint32_t>(n));
    put_u32(out, 4, static_cast<std::uint32_t>(k));
    std::memcpy(out.data() + 8, &key, 8);
    draw(key, n, k, indices_);
    for (std::size_t j = 0; j < k; ++j)
      std::memcpy(out.data() + kValuesAt + 4 * j, &in[indices_[j]], 4);
  }
  std::vector<std::uint8_t> save_state() const override {
    return save_tensor_state(kMagic, steps_);
  }
  void load_state(std::span<const std::uint8_t> state) override {
    steps_ = load_tensor_state(kMagic, state);
  }

  static constexpr std::size_t kValuesAt = 16;

 private:
  void accumulate(std::span<const std::uint8_t> payload, std::span<float> out,
                  bool negate) const override {
    if (payload.size() < kValuesAt) bad_payload("randomk", "shorter than its 16-byte header");
    const std::size_t n = get_u32(payload, 0), k = get_u32(payload, 4);
    if (n != out.size() || k != k_of(ratio_, n)) {
      bad_payload("randomk", "holds " + std::to_string(k) + " of " + std::to_string(n) +
                                 " elements, expected " + std::to_string(k_of(ratio_, out.size())) +
                                 " of " + std::to_string(out.size()));
    }
    expect_bytes("randomk", payload, encoded_bytes(n), n);
    std::uint64_t key;
    std::memcpy(&key, payload.data() + 8, 8);
    thread_local std::vector<std::uint32_t> indices;
    draw(key, n, k, indices);
    for (std::size_t j = 0; j < k; ++j) {
      float v;
      std::memcpy(&v, payload.data() + kValuesAt + 4 * j, 4);
      out[indices[j]] += negate ? -v : v;
    }
  }
  static void draw(std::uint64_t key, std::size_t n, std::size_t k,
                   std::vector<std::uint32_t>& indices) {
    indices.resize(k);
    for (std::size_t j = 0; j < k; ++j) {
      const std::size_t lo = j * n / k, hi = (j + 1) * n / k;  // j n < 2^64: n, k < 2^32
      indices[j] = static_cast<std::uint32_t>(lo + splitmix64(key) % (hi - lo));
    }
  }
  static constexpr char kMagic[4] = {'G', 'S', 'R', 'K'};
  double ratio_;
  std::uint64_t seed_;
  std::map<std::string, std::vector<float>> steps_;
  std::vector<std::uint32_t> indices_;
};

}  // namespace

std::size_t randomk_values_offset() {
  return RandomKCodec::kValuesAt;
}

std::unique_ptr<Codec> make_topk(const CodecSpec& s) {
  if (s.value("union") != 0 && s.get("ef", 1) == 0) {
    bad_spec(s.to_string(), "union=1 sends what error feedback holds at the union; it needs ef=1");
  }
  return std::make_unique<TopKCodec>(s.value("ratio"), s.value("exact") != 0,
                                     static_cast<std::uint64_t>(s.value("warmup")),
                                     s.value("union") != 0);
}

std::unique_ptr<Codec> make_randomk(const CodecSpec& s) {
  return std::make_unique<RandomKCodec>(s.value("ratio"),
                                        static_cast<std::uint64_t>(s.value("seed")));
}

std::unique_ptr<Codec> make_threshold(const CodecSpec& s) {
  return std::make_unique<ThresholdCodec>(s.value("rel"));
}

}  // namespace gradsync::compress
