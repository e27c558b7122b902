// Codecs against numbers: round-trip bounds per codec, error feedback conserving mass over many
// steps, state saved and restored by tensor name, and malformed specs and payloads refused
// with a clear error instead of read out of bounds. The codecs inside all-reduces are
// compressed_allreduce_test.cc's.
#include "gradsync/compress.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "codec_inputs.h"
#include "gradsync/error.h"
#include "harness.h"
#include "kernels/kernels.h"

namespace gradsync {
namespace {

using compress::CodecSpec;
using compress::make_codec;
using testing::contains;
using testing::expect_error;
using testing::gradient;
using testing::state_entry;

std::vector<float> round_trip(compress::Codec& codec, const std::vector<float>& in,
                              std::size_t* bytes = nullptr) {
  std::vector<std::uint8_t> payload;
  codec.encode("t", in, payload);
  if (bytes) *bytes = payload.size();
  std::vector<float> out(in.size());
  codec.decode(payload, out);
  return out;
}

TEST(CodecSpec, ParsesCanonicalizesAndNamesWhatIsWrong) {
  EXPECT_EQ(CodecSpec::parse("int8:ef=0,block=64").to_string(), "int8:block=64,ef=0");
  EXPECT_EQ(CodecSpec::parse("fp16").to_string(), "fp16");
  EXPECT_EQ(make_codec("int8")->spec(), "int8:block=256,ef=1");  // biased: feedback by default
  EXPECT_EQ(make_codec("int8:ef=0")->spec(), "int8:block=256");
  EXPECT_EQ(make_codec("fp16")->spec(), "fp16");  // unbiased: none by default
  EXPECT_EQ(make_codec("bf16:ef=1")->spec(), "bf16:ef=1");
  EXPECT_EQ(make_codec("topk:momentum=0.9,ratio=0.01")->spec(),
            "topk:ratio=0.01,ef=1,momentum=0.9");
  EXPECT_EQ(make_codec("fp16:momentum=0.5")->spec(), "fp16:ef=1,momentum=0.5");  // implies ef
  struct Bad {
    const char* spec;
    const char* says;
  };
  for (const Bad& b :
       {Bad{"", "no codec name"}, Bad{"zstd", "unknown codec 'zstd'"},
        Bad{"int8:", "nothing after ':'"}, Bad{"int8:block", "not key=value"},
        Bad{"fp16:block=4", "takes no 'block'"}, Bad{"int8:block=x", "not a number"},
        Bad{"int8:block=0", "block is a whole number"},
        Bad{"int8:block=2.5", "block is a whole number"},
        Bad{"int8:ef=2", "ef is a whole number 0..1"}, Bad{"int8:ef=1,ef=0", "given twice"},
        Bad{"sign:momentum=1", "momentum"}, Bad{"none:momentum=0.9", "takes no 'momentum'"},
        Bad{"powersgd:momentum=0.9", "takes no 'momentum'"},
        Bad{"topk:ratio=0.1,ef=0,momentum=0.9", "it needs ef=1"}}) {
    Error e = expect_error(ErrorKind::kInvalidArgument, [&] { make_codec(b.spec); });
    EXPECT_TRUE(contains(e.what(), b.says)) << b.spec << ": " << e.what();
    EXPECT_TRUE(contains(e.what(), "'" + std::string(b.spec) + "'")) << e.what();
  }
}

TEST(Codecs, NoneIsExact) {
  auto codec = make_codec("none");
  const auto g = gradient(1031, 1);
  std::size_t bytes = 0;
  EXPECT_EQ(round_trip(*codec, g, &bytes), g);
  EXPECT_EQ(bytes, g.size() * 4);
}

// fp16 and bf16: one rounding to nearest, so within half a unit in the last place of the
// format (relative 2^-11 for fp16 normals, 2^-8 for bf16), and exactly the scalar kernel's
// bits; half the bytes.
TEST(Codecs, HalfPrecisionWithinOneRoundingAndHalfTheBytes) {
  const auto g = gradient(100003, 2);
  for (const char* spec : {"fp16", "bf16"}) {
    const bool bf16 = std::string(spec) == "bf16";
    auto codec = make_codec(spec);
    std::size_t bytes = 0;
    const auto out = round_trip(*codec, g, &bytes);
    EXPECT_EQ(bytes, g.size() * 2) << spec;
    const double unit = bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    for (std::size_t i = 0; i < g.size(); ++i) {
      const float want = bf16 ? kernels::bfloat16_to_float(kernels::float_to_bfloat16(g[i]))
                              : kernels::half_to_float(kernels::float_to_half(g[i]));
      ASSERT_EQ(std::memcmp(&out[i], &want, 4), 0) << spec << " element " << i;
      // fp16 normals start at 2^-14: below, the absolute step 2^-25 bounds the error.
      const double bound = std::max(unit * std::fabs(g[i]), bf16 ? 0.0 : std::ldexp(1.0, -25));
      ASSERT_LE(std::fabs(out[i] - g[i]), bound) << spec << " element " << i << " " << g[i];
    }
  }
}

// int8: every element within half a quantisation step of its block (max|x| / 127 / 2); the
// largest element of each block exact; payload = header + one scale per block + a byte each.
TEST(Codecs, Int8WithinHalfAStepPerBlock) {
  for (std::size_t block : {std::size_t{1}, std::size_t{7}, std::size_t{256}}) {
    auto codec = make_codec("int8:ef=0,block=" + std::to_string(block));
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{255}, std::size_t{10007}}) {
      const auto g = gradient(n, 3);
      std::size_t bytes = 0;
      const auto out = round_trip(*codec, g, &bytes);
      const std::size_t blocks = (n + block - 1) / block;
      EXPECT_EQ(bytes, 8 + 4 * blocks + n);
      EXPECT_EQ(codec->encoded_bytes(n), bytes);
      for (std::size_t b = 0; b < blocks; ++b) {
        float peak = 0;
        for (std::size_t i = b * block; i < std::min(n, (b + 1) * block); ++i) {
          peak = std::max(peak, std::fabs(g[i]));
        }
        const float step = peak / 127.0f;
        for (std::size_t i = b * block; i < std::min(n, (b + 1) * block); ++i) {
          ASSERT_LE(std::fabs(out[i] - g[i]), step / 2 * (1 + 1e-5f))
              << "block " << block << " i " << i;
          if (std::fabs(g[i]) == peak) {
            ASSERT_NEAR(out[i], g[i], peak * 1e-6f);
          }
        }
      }
    }
  }
}

// Error feedback: after T steps, what the wire carried plus the residual equals the sum of
// the inputs (within float rounding), and the residual stays bounded by one step's error.
TEST(ErrorFeedback, ConservesMassOverManySteps) {
  auto codec = make_codec("int8:block=64");  // ef on by default
  const std::size_t n = 4099;
  std::vector<double> sent(n, 0), fed(n, 0);
  std::vector<std::uint8_t> payload;
  std::vector<float> decoded(n);
  for (unsigned step = 0; step < 200; ++step) {
    const auto g = gradient(n, 100 + step);
    codec->encode("layer1.weight", g, payload);
    codec->decode(payload, decoded);
    for (std::size_t i = 0; i < n; ++i) {
      sent[i] += decoded[i];
      fed[i] += g[i];
    }
  }
  // The residual is what is still owed: one more step with a zero gradient carries part of it.
  auto state = codec->save_state();
  auto probe = make_codec("int8:block=64");
  probe->load_state(state);
  std::vector<float> zero(n, 0.0f);
  probe->encode("layer1.weight", zero, payload);  // owed = residual + 0
  std::vector<float> carried(n);
  probe->decode(payload, carried);
  double worst = 0, scale = 0;
  for (std::size_t i = 0; i < n; ++i) {
    // sent + residual == fed: the residual is fed - sent, and the probe's encoding of it
    // carries it to within half an int8 step of its block.
    const double residual = fed[i] - sent[i];
    worst = std::max(worst, std::fabs(carried[i] - residual));
    scale = std::max(scale, std::fabs(fed[i]));
  }
  EXPECT_LT(worst, scale / 127.0) << "residual does not match fed - sent";
  // Without feedback, 200 steps of rounding add up; with it, the total is right to one step.
  auto plain = make_codec("int8:block=64,ef=0");
  std::vector<double> plain_sent(n, 0);
  for (unsigned step = 0; step < 200; ++step) {
    const auto g = gradient(n, 100 + step);
    plain->encode("layer1.weight", g, payload);
    plain->decode(payload, decoded);
    for (std::size_t i = 0; i < n; ++i) plain_sent[i] += decoded[i];
  }
  double err_ef = 0, err_plain = 0;
  for (std::size_t i = 0; i < n; ++i) {
    err_ef += std::fabs(sent[i] - fed[i]);
    err_plain += std::fabs(plain_sent[i] - fed[i]);
  }
  EXPECT_LT(err_ef * 5, err_plain) << "feedback should beat plain rounding by far";
}

// State is per tensor name and survives save/restore; a name reused with another size is an
// error naming it; garbage state is refused.
TEST(ErrorFeedback, StateIsKeyedByTensorNameAndRestored) {
  auto a = make_codec("int8:block=16");
  std::vector<std::uint8_t> pa, pb;
  const auto g1 = gradient(100, 7), g2 = gradient(33, 8);
  a->encode("w1", g1, pa);
  a->encode("w2", g2, pa);
  auto b = make_codec("int8:block=16");
  b->load_state(a->save_state());
  // Same next step on both: identical payloads (the residuals came along).
  const auto next = gradient(100, 9);
  a->encode("w1", next, pa);
  b->encode("w1", next, pb);
  EXPECT_EQ(pa, pb);
  EXPECT_EQ(a->save_state(), b->save_state());

  Error e = expect_error(ErrorKind::kInvalidArgument, [&] { a->encode("w2", g1, pa); });
  EXPECT_TRUE(contains(e.what(), "tensor 'w2' has 100 elements")) << e.what();

  auto state = a->save_state();
  for (std::size_t cut : {std::size_t{0}, std::size_t{3}, std::size_t{9}, state.size() - 1}) {
    std::vector<std::uint8_t> truncated(state.begin(), state.begin() + static_cast<long>(cut));
    expect_error(ErrorKind::kProtocol, [&] { b->load_state(truncated); });
  }
  auto wrong = state;
  wrong[0] = 'X';
  expect_error(ErrorKind::kProtocol, [&] { b->load_state(wrong); });
  auto trailing = state;
  trailing.push_back(0);
  expect_error(ErrorKind::kProtocol, [&] { b->load_state(trailing); });
}

// Malformed payloads: wrong length, wrong count or block in the header, a NaN or negative
// scale; each refused with what is wrong. NaN/Inf gradients cannot be carried by int8: named.
TEST(Codecs, MalformedPayloadsAreRefused) {
  const auto g = gradient(1000, 4);
  std::vector<float> out(1000);
  for (const char* spec : {"none", "fp16", "bf16", "int8:ef=0"}) {
    auto codec = make_codec(spec);
    std::vector<std::uint8_t> payload;
    codec->encode("t", g, payload);
    auto shorter = payload;
    shorter.pop_back();
    Error e = expect_error(ErrorKind::kProtocol, [&] { codec->decode(shorter, out); });
    EXPECT_TRUE(contains(e.what(), "payload")) << e.what();
    std::vector<float> fewer(999);
    expect_error(ErrorKind::kProtocol, [&] { codec->decode(payload, fewer); });
  }
  auto int8 = make_codec("int8:ef=0,block=100");
  std::vector<std::uint8_t> payload;
  int8->encode("t", g, payload);
  auto nan_scale = payload;
  const float nan = std::numeric_limits<float>::quiet_NaN(), negative = -1.0f;
  std::memcpy(nan_scale.data() + 8 + 4 * 3, &nan, 4);
  Error e = expect_error(ErrorKind::kProtocol, [&] { int8->decode(nan_scale, out); });
  EXPECT_TRUE(contains(e.what(), "block 3 has scale")) << e.what();
  auto negative_scale = payload;
  std::memcpy(negative_scale.data() + 8, &negative, 4);
  expect_error(ErrorKind::kProtocol, [&] { int8->decode(negative_scale, out); });
  auto other_block = payload;
  other_block[4] = 99;
  expect_error(ErrorKind::kProtocol, [&] { int8->decode(other_block, out); });
  expect_error(ErrorKind::kProtocol, [&] { int8->decode(std::vector<std::uint8_t>(5), out); });

  auto with_nan = g;
  with_nan[417] = nan;
  e = expect_error(ErrorKind::kInvalidArgument,
                   [&] { int8->encode("layer3.bias", with_nan, payload); });
  EXPECT_TRUE(contains(e.what(), "tensor 'layer3.bias' has NaN at element 417")) << e.what();
  // With feedback, a refused step leaves the residual as it was.
  auto fed = make_codec("int8:block=100");
  fed->encode("w", g, payload);
  const auto before = fed->save_state();
  expect_error(ErrorKind::kInvalidArgument, [&] { fed->encode("w", with_nan, payload); });
  EXPECT_EQ(fed->save_state(), before);
}

// QSGD is unbiased: the mean of many independently seeded decodes converges to the input (to
// within 5 standard deviations of the mean, sigma <= step / 2 / sqrt(T)), and every single
// decode is within one step. Same seed and stream: the same payload.
TEST(Codecs, QsgdIsUnbiasedAndReproducible) {
  const std::size_t n = 1000, block = 64, trials = 2000;
  const float levels = 4;
  const auto g = gradient(n, 11);
  auto codec = make_codec("qsgd:levels=4,block=64");
  EXPECT_EQ(codec->spec(), "qsgd:block=64,levels=4,seed=0");
  std::vector<double> mean(n, 0.0);
  std::vector<float> step(n);
  for (std::size_t b = 0; b * block < n; ++b) {
    double sq = 0;
    for (std::size_t i = b * block; i < std::min(n, (b + 1) * block); ++i)
      sq += double(g[i]) * g[i];
    for (std::size_t i = b * block; i < std::min(n, (b + 1) * block); ++i) {
      step[i] = static_cast<float>(std::sqrt(sq)) / levels;
    }
  }
  for (std::size_t t = 0; t < trials; ++t) {  // each encode is a new step: new draws
    const auto out = round_trip(*codec, g);
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_LE(std::fabs(out[i] - g[i]), step[i] * 1.0001f) << i;
      mean[i] += out[i] / static_cast<double>(trials);
    }
  }
  for (std::size_t i = 0; i < n; ++i) {
    EXPECT_LE(std::fabs(mean[i] - g[i]), 5 * step[i] / 2 / std::sqrt(double(trials)) + 1e-9) << i;
  }
  std::vector<std::uint8_t> a, b, c;
  make_codec("qsgd:seed=7")->encode("w", g, a);
  make_codec("qsgd:seed=7")->encode("w", g, b);
  auto other = make_codec("qsgd:seed=7");
  other->set_stream(1);
  other->encode("w", g, c);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

// Extreme but finite gradients stay decodable: an L2 or L1 norm past FLT_MAX still gives a
// finite scale, and a block of denormals keeps its zeros zero.
TEST(Codecs, HugeAndDenormalGradientsRoundTrip) {
  std::vector<float> huge(512, 3e38f), tiny(512, 0.0f);
  for (std::size_t i = 0; i < tiny.size(); i += 3) tiny[i] = 1e-44f;
  for (const char* spec : {"qsgd:levels=127,block=512", "sign:ef=0", "int8:ef=0"}) {
    const auto out = round_trip(*make_codec(spec), huge);
    for (float x : out) ASSERT_TRUE(std::isfinite(x)) << spec;
    // Within one step: qsgd's is the block norm over the levels, sqrt(512) / 127 of each.
    const float step = contains(spec, "qsgd") ? 0.18f : 0.02f;
    EXPECT_NEAR(out[0], 3e38f, 3e38f * step) << spec;
  }
  const auto out = round_trip(*make_codec("qsgd:levels=127,block=512"), tiny);
  for (std::size_t i = 0; i < tiny.size(); ++i) {
    if (tiny[i] == 0.0f) {
      ASSERT_EQ(out[i], 0.0f) << i;
    }
  }
}

// Top-k: exactly the k = ceil(ratio n) largest magnitudes, ties to the lower index, indices
// ascending; the sampled-threshold path (large tensors) picks the same elements as exact=1.
TEST(Codecs, TopKIsTheKLargestWithTiesToTheLowerIndex) {
  auto picks = [](compress::Codec& codec, const std::vector<float>& g) {
    std::vector<std::uint8_t> payload;
    codec.encode("t", g, payload);
    std::uint32_t pairs;
    std::memcpy(&pairs, payload.data() + 4, 4);
    EXPECT_EQ(payload.size(), 8 + 8 * std::size_t{pairs});
    std::vector<std::uint32_t> idx(pairs);
    if (pairs) std::memcpy(idx.data(), payload.data() + 8, 4 * pairs);
    return idx;
  };
  const std::vector<float> tied = {1, -3, 3, 2, -3, 0, 3};
  EXPECT_EQ(picks(*make_codec("topk:ratio=0.25,ef=0"), tied), (std::vector<std::uint32_t>{1, 2}));
  EXPECT_EQ(picks(*make_codec("topk:ratio=0.5,ef=0"), tied),
            (std::vector<std::uint32_t>{1, 2, 4, 6}));
  EXPECT_EQ(picks(*make_codec("topk:ratio=0.01,ef=0"), tied), (std::vector<std::uint32_t>{1}));
  for (std::size_t n : {std::size_t{1000}, std::size_t{200003}}) {
    // Magnitudes on a coarse grid: many ties, some straddling the k-th value.
    auto g = gradient(n, 12);
    for (float& x : g) x = std::round(x * 2e4f) / 2e4f;
    for (double ratio : {0.001, 0.01, 0.1}) {
      const std::size_t k = static_cast<std::size_t>(std::ceil(ratio * static_cast<double>(n)));
      std::vector<std::uint32_t> order(n);
      for (std::size_t i = 0; i < n; ++i) order[i] = static_cast<std::uint32_t>(i);
      std::stable_sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
        return std::fabs(g[a]) > std::fabs(g[b]);
      });
      std::vector<std::uint32_t> want(order.begin(), order.begin() + static_cast<long>(k));
      std::sort(want.begin(), want.end());
      const std::string r = std::to_string(ratio);
      EXPECT_EQ(picks(*make_codec("topk:ef=0,ratio=" + r), g), want) << n << " " << ratio;
      EXPECT_EQ(picks(*make_codec("topk:ef=0,exact=1,ratio=" + r), g), want) << n << " " << ratio;
    }
  }
  EXPECT_TRUE(picks(*make_codec("topk:ratio=0.5"), {}).empty());
}

// DGC's warm-up: the ratio starts at 0.25 and falls exponentially to the target over each
// tensor's first S steps (counted per tensor), the top-k selection itself unchanged.
TEST(Codecs, TopKWarmUpFallsFromAQuarterToTheRatio) {
  const std::size_t n = 10000;
  EXPECT_EQ(make_codec("topk:ratio=0.01,warmup=10")->spec(), "topk:ratio=0.01,warmup=10,ef=1");
  auto codec = make_codec("topk:ratio=0.01,warmup=10,exact=1,ef=0");
  EXPECT_TRUE(codec->size_varies());
  compress::Codec& topk = *codec;
  std::vector<std::uint8_t> payload;
  for (std::uint64_t step = 0; step < 12; ++step) {
    const auto g = gradient(n, 700 + static_cast<unsigned>(step));
    topk.encode("a", g, payload);
    const double ratio = step >= 10 ? 0.01 : 0.25 * std::pow(0.04, static_cast<double>(step) / 10);
    const auto k = static_cast<std::size_t>(std::ceil(ratio * n));
    EXPECT_EQ(payload.size(), 8 + 8 * k) << "step " << step;
    EXPECT_LE(payload.size(), topk.encoded_bytes(n));
    if (step == 3) {  // another tensor starts its own warm-up
      topk.encode("b", g, payload);
      EXPECT_EQ(payload.size(), 8 + 8 * 2500u);
    }
  }
}

TEST(Codecs, ThresholdKeepsExactlyTheElementsAtOrAboveTheCut) {
  const auto g = gradient(5000, 13);
  float peak = 0;
  for (float x : g) peak = std::max(peak, std::fabs(x));
  auto codec = make_codec("threshold:rel=0.25,ef=0");
  const auto out = round_trip(*codec, g);
  const float cut = 0.25f * peak;
  std::size_t kept = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    const bool keep = std::fabs(g[i]) >= cut;
    kept += keep;
    ASSERT_EQ(out[i], keep ? g[i] : 0.0f) << i;
  }
  EXPECT_GT(kept, 0u);
  EXPECT_LT(kept, g.size() / 10);
  EXPECT_TRUE(codec->size_varies());
  std::size_t bytes = 0;
  round_trip(*codec, std::vector<float>(100, 0.0f), &bytes);
  EXPECT_EQ(bytes, 8u);  // nothing above the cut of an all-zero gradient
}

// Random-k: k values at one index per stratum, the same indices for every codec with the same
// seed (every rank), new ones at every step; the payload carries no indices.
TEST(Codecs, RandomKDrawsTheSameIndicesEverywhereAndNewOnesEachStep) {
  const std::size_t n = 10007;
  std::vector<float> g(n);
  for (std::size_t i = 0; i < n; ++i) g[i] = 1.0f + static_cast<float>(i);  // no zeros
  auto a = make_codec("randomk:ratio=0.01,ef=0"), b = make_codec("randomk:ratio=0.01,ef=0");
  std::vector<std::uint32_t> previous;
  for (int step = 0; step < 3; ++step) {
    std::size_t bytes = 0;
    const auto out_a = round_trip(*a, g, &bytes);
    const auto out_b = round_trip(*b, g);
    EXPECT_EQ(out_a, out_b);
    const std::size_t k = 101;  // ceil(0.01 * 10007)
    EXPECT_EQ(bytes, 16 + 4 * k);
    std::vector<std::uint32_t> picked;
    for (std::size_t i = 0; i < n; ++i) {
      if (out_a[i] != 0) {
        ASSERT_EQ(out_a[i], g[i]);
        picked.push_back(static_cast<std::uint32_t>(i));
      }
    }
    ASSERT_EQ(picked.size(), k);
    for (std::size_t j = 0; j < k; ++j) {  // one per stratum [j n / k, (j + 1) n / k)
      EXPECT_GE(picked[j], j * n / k);
      EXPECT_LT(picked[j], (j + 1) * n / k);
    }
    EXPECT_NE(picked, previous);
    previous = picked;
  }
  auto seeded = make_codec("randomk:ratio=0.01,ef=0,seed=5");
  EXPECT_NE(round_trip(*seeded, g), round_trip(*make_codec("randomk:ratio=0.01,ef=0"), g));
}

TEST(Codecs, SignIsOneBitPerElementAndTheMeanMagnitude) {
  const auto g = gradient(1001, 14);
  double mean = 0;
  for (float x : g) mean += std::fabs(x) / static_cast<double>(g.size());
  std::size_t bytes = 0;
  const auto out = round_trip(*make_codec("sign:ef=0"), g, &bytes);
  EXPECT_EQ(bytes, 8 + (1001 + 7) / 8);
  for (std::size_t i = 0; i < g.size(); ++i) {
    ASSERT_NEAR(std::fabs(out[i]), mean, mean * 1e-6) << i;
    ASSERT_EQ(std::signbit(out[i]), std::signbit(g[i])) << i;
  }
  // block=B: one scale per block of B, the mean magnitude of that block (the last is short).
  std::vector<float> g2 = g;
  for (std::size_t i = 0; i < 64; ++i) g2[i] *= 100;  // a loud first block
  const auto blocked = round_trip(*make_codec("sign:block=64,ef=0"), g2, &bytes);
  EXPECT_EQ(bytes, 4 + 4 * 16 + (1001 + 7) / 8);
  for (std::size_t first = 0; first < g2.size(); first += 64) {
    const std::size_t last = std::min(g2.size(), first + 64);
    double block_mean = 0;
    for (std::size_t i = first; i < last; ++i) {
      block_mean += std::fabs(g2[i]) / static_cast<double>(last - first);
    }
    for (std::size_t i = first; i < last; ++i) {
      ASSERT_NEAR(std::fabs(blocked[i]), block_mean, block_mean * 1e-6) << i;
      ASSERT_EQ(std::signbit(blocked[i]), std::signbit(g2[i])) << i;
    }
  }
  Error e = expect_error(ErrorKind::kInvalidArgument, [] { make_codec("sign:block=12"); });
  EXPECT_TRUE(contains(e.what(), "multiple of 8")) << e.what();
}

// PowerSGD: an exactly rank-R matrix comes back (to float rounding); with a smaller rank it
// cannot; vectors travel as float32. Payload: header + P (rows x R) + Q (cols x R).
TEST(Codecs, PowerSgdReconstructsAnExactlyRankRMatrix) {
  const std::size_t rows = 60, cols = 40, r = 3;
  std::mt19937 rng(15);
  std::normal_distribution<float> normal;
  std::vector<float> a(rows * r), b(cols * r), m(rows * cols, 0.0f);
  for (float& x : a) x = normal(rng);
  for (float& x : b) x = normal(rng);
  float peak = 0;
  for (std::size_t i = 0; i < rows; ++i) {
    for (std::size_t c = 0; c < cols; ++c) {
      for (std::size_t j = 0; j < r; ++j) m[i * cols + c] += a[i * r + j] * b[c * r + j];
      peak = std::max(peak, std::fabs(m[i * cols + c]));
    }
  }
  auto worst_error = [&](const char* spec, std::size_t* bytes) {
    auto codec = make_codec(spec);
    std::vector<std::uint8_t> payload;
    codec->encode(compress::Tensor("w", rows), m, payload);
    *bytes = payload.size();
    std::vector<float> out(m.size());
    codec->decode(payload, out);
    float worst = 0;
    for (std::size_t i = 0; i < m.size(); ++i) worst = std::max(worst, std::fabs(out[i] - m[i]));
    return worst;
  };
  std::size_t bytes = 0;
  EXPECT_LT(worst_error("powersgd:rank=3,ef=0", &bytes), peak * 1e-4f);
  EXPECT_EQ(bytes, 12 + 4 * (rows + cols) * r);
  EXPECT_GT(worst_error("powersgd:rank=2,ef=0", &bytes), peak * 1e-2f);
  auto codec = make_codec("powersgd:rank=4");
  const auto v = gradient(77, 16);
  EXPECT_EQ(round_trip(*codec, v, &bytes), v);  // a vector: float32
  EXPECT_EQ(bytes, 12 + 4 * v.size());
}

// Error feedback conserves mass for every biased codec: after T steps, what the wire carried
// plus the residual equals the sum of the inputs.
TEST(ErrorFeedback, ConservesMassForEveryBiasedCodec) {
  const std::size_t rows = 32, n = 32 * 24;
  for (const char* spec : {"topk:ratio=0.05", "randomk:ratio=0.05", "threshold:rel=0.5", "sign",
                           "powersgd:rank=2", "qsgd:levels=2,ef=1"}) {
    auto codec = make_codec(spec);
    const compress::Tensor tensor("layer.w", rows);
    std::vector<double> sent(n, 0), fed(n, 0);
    std::vector<std::uint8_t> payload;
    std::vector<float> decoded(n);
    for (unsigned step = 0; step < 50; ++step) {
      const auto g = gradient(n, 200 + step);
      codec->encode(tensor, g, payload);
      codec->decode(payload, decoded);
      for (std::size_t i = 0; i < n; ++i) {
        sent[i] += decoded[i];
        fed[i] += g[i];
      }
    }
    const bool power = std::string(spec).rfind("powersgd", 0) == 0;
    const auto residual = state_entry(codec->save_state(), power ? "r:layer.w" : "layer.w");
    ASSERT_EQ(residual.size(), n) << spec;
    double worst = 0, scale = 0;
    for (std::size_t i = 0; i < n; ++i) {
      worst = std::max(worst, std::fabs(sent[i] + residual[i] - fed[i]));
      scale = std::max(scale, std::fabs(fed[i]));
    }
    EXPECT_LT(worst, scale * 1e-4) << spec;
  }
}

// Momentum correction (Deep Gradient Compression) against the algorithm written out: u =
// m u + g; owed = residual + u; top-k of owed is sent; residual = owed - sent; u is cleared
// where top-k sent (momentum factor masking). Same float operations, so the same bits.
TEST(ErrorFeedback, MomentumCorrectionIsDeepGradientCompressions) {
  const std::size_t n = 400, k = 20;
  const float m = 0.9f;
  auto codec = make_codec("topk:ratio=0.05,exact=1,momentum=0.9");
  std::vector<float> u(n, 0.0f), residual(n, 0.0f), owed(n), decoded(n);
  std::vector<std::uint8_t> payload;
  for (unsigned step = 0; step < 20; ++step) {
    const auto g = gradient(n, 500 + step);
    for (std::size_t i = 0; i < n; ++i) {
      u[i] = m * u[i] + g[i];
      owed[i] = residual[i] + u[i];
    }
    std::vector<std::size_t> order(n);
    for (std::size_t i = 0; i < n; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return std::fabs(owed[a]) > std::fabs(owed[b]);
    });
    std::vector<float> want(n, 0.0f);
    residual = owed;
    for (std::size_t j = 0; j < k; ++j) {
      want[order[j]] = owed[order[j]];
      residual[order[j]] = 0.0f;
      u[order[j]] = 0.0f;
    }
    codec->encode("w", g, payload);
    codec->decode(payload, decoded);
    ASSERT_EQ(decoded, want) << "step " << step;
    ASSERT_EQ(state_entry(codec->save_state(), "w"), residual) << "step " << step;
  }
  // A codec without momentum refuses this state rather than silently dropping the momentum.
  Error e = expect_error(ErrorKind::kProtocol, [&] {
    make_codec("topk:ratio=0.05,exact=1")->load_state(codec->save_state());
  });
  EXPECT_TRUE(contains(e.what(), "holds momentum")) << e.what();
}

// Every codec's state (residuals, step counters behind qsgd's and randomk's draws, PowerSGD's
// warm-start Q) survives save and restore: a restored codec continues exactly as the original.
TEST(Codecs, EveryCodecsStateSurvivesSaveAndRestore) {
  const compress::Tensor a("block1.w", 40), b("block2.w", 25);
  for (const char* spec :
       {"int8", "qsgd", "topk:ratio=0.05", "randomk:ratio=0.05", "threshold:rel=0.3", "sign",
        "powersgd:rank=3", "fp16:ef=1", "topk:ratio=0.05,momentum=0.9", "sign:momentum=0.8"}) {
    auto original = make_codec(spec);
    std::vector<std::uint8_t> pa, pb;
    for (unsigned step = 0; step < 3; ++step) {
      original->encode(a, gradient(1000, 300 + step), pa);
      original->encode(b, gradient(500, 400 + step), pa);
    }
    auto restored = make_codec(spec);
    restored->load_state(original->save_state());
    EXPECT_EQ(restored->save_state(), original->save_state()) << spec;
    for (unsigned step = 3; step < 5; ++step) {
      const auto g = gradient(1000, 300 + step);
      original->encode(a, g, pa);
      restored->encode(a, g, pb);
      ASSERT_EQ(pa, pb) << spec << " step " << step;
    }
  }
}

// Malformed payloads of the new codecs: refused, naming what is wrong.
TEST(Codecs, MalformedSparseSignAndLowRankPayloadsAreRefused) {
  const auto g = gradient(1000, 17);
  std::vector<float> out(1000);
  auto topk = make_codec("topk:ratio=0.01,ef=0");
  std::vector<std::uint8_t> payload;
  topk->encode("t", g, payload);
  auto out_of_range = payload;
  const std::uint32_t big = 1000;
  std::memcpy(out_of_range.data() + 8 + 4 * 9, &big, 4);
  Error e = expect_error(ErrorKind::kProtocol, [&] { topk->decode(out_of_range, out); });
  EXPECT_TRUE(contains(e.what(), "index 1000 at pair 9 is out of range")) << e.what();
  auto repeated = payload;
  std::memcpy(repeated.data() + 8 + 4 * 3, repeated.data() + 8 + 4 * 2, 4);
  e = expect_error(ErrorKind::kProtocol, [&] { topk->decode_add(repeated, out); });
  EXPECT_TRUE(contains(e.what(), "not ascending")) << e.what();
  auto too_many = payload;
  too_many[4] = 0xff;
  expect_error(ErrorKind::kProtocol, [&] { topk->decode(too_many, out); });

  auto sign = make_codec("sign:ef=0");
  sign->encode("t", g, payload);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(payload.data() + 4, &nan, 4);
  e = expect_error(ErrorKind::kProtocol, [&] { sign->decode(payload, out); });
  EXPECT_TRUE(contains(e.what(), "sign payload: scale")) << e.what();

  auto randomk = make_codec("randomk:ratio=0.1,ef=0");
  randomk->encode("t", g, payload);
  payload[4] = 7;  // k
  expect_error(ErrorKind::kProtocol, [&] { randomk->decode(payload, out); });

  auto power = make_codec("powersgd:rank=2,ef=0");
  power->encode(compress::Tensor("m", 40), g, payload);
  auto high_rank = payload;
  high_rank[8] = 41;
  e = expect_error(ErrorKind::kProtocol, [&] { power->decode(high_rank, out); });
  EXPECT_TRUE(contains(e.what(), "rank 41 above")) << e.what();
  auto nan_p = payload;
  std::memcpy(nan_p.data() + 12, &nan, 4);
  expect_error(ErrorKind::kProtocol, [&] { power->decode(nan_p, out); });
  auto other_shape = payload;
  other_shape[0] = 41;
  expect_error(ErrorKind::kProtocol, [&] { power->decode(other_shape, out); });

  for (const char* spec : {"topk:ratio=0.1", "threshold:rel=0.1", "sign", "qsgd"}) {
    auto with_inf = g;
    with_inf[5] = std::numeric_limits<float>::infinity();
    e = expect_error(ErrorKind::kInvalidArgument,
                     [&] { make_codec(spec)->encode("layer9.w", with_inf, payload); });
    EXPECT_TRUE(contains(e.what(), "tensor 'layer9.w' has Inf at element 5")) << e.what();
  }
  for (const char* bad : {"topk", "topk:ratio=0", "topk:ratio=1.5", "qsgd:levels=128",
                          "powersgd:rank=0", "threshold:rel=-1", "randomk:ratio=0.1,seed=-1"}) {
    expect_error(ErrorKind::kInvalidArgument, [&] { make_codec(bad); });
  }
}

}  // namespace
}  // namespace gradsync
