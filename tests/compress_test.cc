// Codecs against numbers: round-trip bounds per codec, error feedback conserving mass over many
// steps, state saved and restored by tensor name, and malformed specs and payloads refused
// with a clear error instead of read out of bounds.
#include "gradsync/compress.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "gradsync/bytes.h"
#include "gradsync/error.h"
#include "harness.h"
#include "kernels/kernels.h"

namespace gradsync {
namespace {

using compress::CodecSpec;
using compress::make_codec;
using compress::TensorSlice;
using testing::contains;
using testing::expect_error;

// Gradient-like data: mostly small, a few large, both signs, some exact zeros.
std::vector<float> gradient(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  std::vector<float> g(n);
  for (std::size_t i = 0; i < n; ++i) {
    g[i] = i % 97 == 0 ? 0.0f : normal(rng) * (i % 31 == 0 ? 100.0f : 1.0f);
  }
  return g;
}

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

// fp16/bf16 all-reduce: half the wire bytes of the float32 ring (transport counters), float32
// additions at every hop, so within a few rounding units of the exact sum; identical bits on
// every rank.
class HalfWireAllreduce : public ::testing::TestWithParam<int> {};

TEST_P(HalfWireAllreduce, HalfTheBytesWithinRoundingAndIdenticalEverywhere) {
  const int n = GetParam();
  for (const char* spec : {"fp16", "bf16"}) {
    const double unit = std::string(spec) == "bf16" ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, static_cast<std::size_t>(n + 2),
                              std::size_t{1031}, std::size_t{99991}}) {
      std::vector<std::vector<float>> results(static_cast<std::size_t>(n));
      std::vector<std::uint64_t> half_bytes(static_cast<std::size_t>(n)),
          full_bytes(results.size());
      std::vector<std::vector<float>> inputs;
      for (int k = 0; k < n; ++k) inputs.push_back(gradient(count, 50 + static_cast<unsigned>(k)));
      testing::run_inproc_contexts(n, [&](Context& ctx) {
        const int r = ctx.rank();
        auto codec = make_codec(spec);
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          std::vector<float> data = inputs[static_cast<std::size_t>(r)];
          const auto before = ctx.total_traffic().bytes_sent;
          compress::compressed_allreduce(ctx, data, *codec, "w", op);
          half_bytes[static_cast<std::size_t>(r)] = ctx.total_traffic().bytes_sent - before;
          if (op == ReduceOp::kSum) results[static_cast<std::size_t>(r)] = data;
          // Against the exact sum (double): one rounding per hop of a partial sum.
          for (std::size_t i = 0; i < count; i += 1 + i / 8) {
            double exact = 0, magnitude = 0;
            for (const auto& x : inputs) {
              exact += x[i];
              magnitude += std::fabs(x[i]);
            }
            if (op == ReduceOp::kAvg) {
              exact /= n;
              magnitude /= n;
            }
            const double bound = (n + 1) * unit * magnitude + 1e-7;
            ASSERT_LE(std::fabs(data[i] - exact), bound) << spec << " n=" << n << " i=" << i;
          }
        }
        std::vector<float> plain = inputs[static_cast<std::size_t>(r)];
        const auto before = ctx.total_traffic().bytes_sent;
        ctx.allreduce(plain.data(), plain.data(), count, DataType::kFloat32, ReduceOp::kSum,
                      {.algorithm = Algorithm::kRing});
        full_bytes[static_cast<std::size_t>(r)] = ctx.total_traffic().bytes_sent - before;
      });
      for (int r = 1; r < n; ++r) {
        ASSERT_EQ(results[static_cast<std::size_t>(r)], results[0]) << spec << " rank " << r;
      }
      if (count >= 1031 && n > 1) {
        for (int r = 0; r < n; ++r) {
          const double ratio = static_cast<double>(half_bytes[static_cast<std::size_t>(r)]) /
                               static_cast<double>(full_bytes[static_cast<std::size_t>(r)]);
          EXPECT_NEAR(ratio, 0.5, 0.01) << spec << " n=" << n << " count=" << count;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, HalfWireAllreduce, ::testing::Values(1, 2, 3, 4, 5, 8),
                         [](const auto& p) { return "n" + std::to_string(p.param); });

// Where every rank shares memory, fp16/bf16 sum in float32 through the shared-memory path and
// round once: exactly the float32 all-reduce's result, rounded, on every rank. The larger
// count spans many chunks and is past the size whose output streams past the cache.
TEST(CompressedAllreduce, HalfOnSharedMemoryIsTheFloat32SumRoundedOnce) {
  struct Case {
    const char* spec;
    int count, ranks;
  };
  // A struct, not a structured binding: the lambda captures the fields, and Debian 12's
  // clang 14 refuses to capture bindings.
  for (const Case c : {Case{"fp16", 300007, 4}, Case{"bf16", 300007, 4}, Case{"fp16", 2500011, 3},
                       Case{"bf16", 2500011, 2}}) {
    const char* spec = c.spec;
    const int count = c.count;
    testing::run_shm_contexts(c.ranks, [&](Context& ctx) {
      auto codec = make_codec(spec);
      std::vector<float> data = gradient(count, 90 + static_cast<unsigned>(ctx.rank()));
      std::vector<float> want = data;
      ctx.allreduce(want.data(), want.data(), count, DataType::kFloat32, ReduceOp::kSum);
      for (float& x : want) {
        x = std::string(spec) == "fp16" ? kernels::half_to_float(kernels::float_to_half(x))
                                        : kernels::bfloat16_to_float(kernels::float_to_bfloat16(x));
      }
      compress::compressed_allreduce(ctx, data, *codec, "w");
      EXPECT_EQ(0, std::memcmp(data.data(), want.data(), count * 4)) << spec << " " << count;
    });
  }
}

// Entry `key` of a codec's saved state (format in src/compress/codecs.h: magic, u32 entries,
// per entry u32 name bytes, name, u64 floats, floats; error feedback's residuals follow
// "GSEW", u64 bytes and its inner codec's state, u64 bytes); empty if absent.
std::vector<float> state_entry(const std::vector<std::uint8_t>& state, const std::string& key) {
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

// A bucket call ranks the whole bucket: a small tensor of large gradients takes all of the k
// that 1% of each tensor would have spread. Its error-feedback state is the bucket's, kept under
// the bucket's name (or by the caller, as the reducer does): step after step, what was sent
// plus every rank's residual is what the ranks put in.
TEST(CompressedAllreduce, BucketCallsRankAcrossTensorsAndConserveTheBucket) {
  const std::size_t na = 37, nb = 1000;
  for (int ranks : {1, 2, 3, 4, 5, 8}) {
    std::vector<std::vector<float>> owed(static_cast<std::size_t>(ranks)), left(owed.size());
    std::vector<float> sent(na + nb, 0.0f);
    testing::run_inproc_contexts(ranks, [&](Context& ctx) {
      const auto r = static_cast<std::size_t>(ctx.rank());
      auto codec = make_codec("topk:ratio=0.02");  // k = 21 of 1037
      owed[r].assign(na + nb, 0.0f);
      const std::vector<TensorSlice> ab{{compress::Tensor("a"), 0, na}, {"b", na, nb}};
      for (unsigned step = 0; step < 3; ++step) {  // a (37, large) then b (1000, small)
        std::vector<float> g = gradient(na + nb, 700 + step + 10 * static_cast<unsigned>(r));
        for (std::size_t i = 0; i < na; ++i) g[i] = (i % 2 ? 1.0f : -1.0f) * (1.0f + g[i]);
        for (std::size_t i = 0; i < na + nb; ++i) owed[r][i] += g[i];
        compress::compressed_allreduce(ctx, g, *codec, "bucket 0 (a, b)", ab);
        if (step == 0) {
          for (std::size_t i = na; i < na + nb; ++i) ASSERT_EQ(g[i], 0.0f) << "b got k, i " << i;
        }
        if (r == 0) {
          for (std::size_t i = 0; i < g.size(); ++i) sent[i] += g[i];
        }
      }
      const std::vector<std::uint8_t> state = codec->save_state();
      EXPECT_TRUE(state_entry(state, "a").empty());
      left[r] = state_entry(state, "bucket 0 (a, b)");
      ASSERT_EQ(left[r].size(), na + nb);
    });
    for (std::size_t i = 0; i < na + nb; ++i) {
      double total_owed = 0, total_left = 0;
      for (std::size_t r = 0; r < owed.size(); ++r) {
        total_owed += owed[r][i];
        total_left += left[r][i];
      }
      ASSERT_NEAR(sent[i] + total_left, total_owed, 1e-4) << "ranks " << ranks << " i " << i;
    }
  }
}

// With momentum correction too, a bucket call is a call on the bucket as one tensor, step
// after step, and across a save and restore of the codec between steps.
TEST(CompressedAllreduce, BucketCallsMatchOneTensorWithMomentum) {
  testing::run_inproc_contexts(3, [&](Context& ctx) {
    auto parted = make_codec("topk:ratio=0.05,momentum=0.9,warmup=3");
    auto whole = make_codec("topk:ratio=0.05,momentum=0.9,warmup=3");
    const std::vector<TensorSlice> parts{{compress::Tensor("a", 5), 0, 300},
                                         {compress::Tensor("b"), 300, 77}};
    for (unsigned step = 0; step < 4; ++step) {
      std::vector<float> x = gradient(377, 800 + step + 10 * static_cast<unsigned>(ctx.rank()));
      std::vector<float> y = x;
      compress::compressed_allreduce(ctx, x, *parted, "ab", parts, ReduceOp::kAvg);
      compress::compressed_allreduce(ctx, y, *whole, "ab", ReduceOp::kAvg);
      ASSERT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * 4)) << "step " << step;
      if (step != 1) continue;
      // Saved under the bucket's name, and a codec restored from it continues as the original.
      const std::vector<std::uint8_t> state = parted->save_state();
      EXPECT_EQ(state_entry(state, "ab").size(), 377u);
      EXPECT_TRUE(state_entry(state, "a").empty());
      parted = make_codec("topk:ratio=0.05,momentum=0.9,warmup=3");
      parted->load_state(state);
    }
  });
}

// The reducer's buckets take turns on one codec, step after step, with a call on one tensor
// alone between them: each keeps its own state under its own name, and continues exactly as
// it would on a codec of its own, through a save and restore.
TEST(CompressedAllreduce, BucketsTakingTurnsMatchACodecEach) {
  testing::run_inproc_contexts(3, [&](Context& ctx) {
    const char* spec = "topk:ratio=0.05,momentum=0.9";
    auto shared = make_codec(spec), only_ab = make_codec(spec), only_cd = make_codec(spec);
    const std::vector<TensorSlice> ab{{compress::Tensor("a"), 0, 200}, {"b", 200, 37}};
    const std::vector<TensorSlice> cd{{compress::Tensor("c"), 0, 90}, {"d", 90, 310}};
    const auto seed = [&](unsigned step, unsigned bucket) {
      return 1000 + 10 * step + 3 * bucket + 100 * static_cast<unsigned>(ctx.rank());
    };
    for (unsigned step = 0; step < 5; ++step) {
      std::vector<float> x = gradient(237, seed(step, 0)), y = x;
      compress::compressed_allreduce(ctx, x, *shared, "ab", ab, ReduceOp::kAvg);
      compress::compressed_allreduce(ctx, y, *only_ab, "ab", ab, ReduceOp::kAvg);
      ASSERT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * 4)) << "ab, step " << step;
      x = gradient(400, seed(step, 1)), y = x;
      compress::compressed_allreduce(ctx, x, *shared, "cd", cd, ReduceOp::kAvg);
      compress::compressed_allreduce(ctx, y, *only_cd, "cd", cd, ReduceOp::kAvg);
      ASSERT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * 4)) << "cd, step " << step;
      if (step == 2) {  // c alone: a state of its own, the buckets' untouched
        x = gradient(90, seed(step, 2)), y = x;
        compress::compressed_allreduce(ctx, x, *shared, "c", ReduceOp::kAvg);
        compress::compressed_allreduce(ctx, y, *only_cd, "c", ReduceOp::kAvg);
        ASSERT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * 4)) << "c alone";
      }
      if (step == 3) {
        const std::vector<std::uint8_t> state = shared->save_state();
        ASSERT_EQ(state_entry(state, "ab").size(), 237u);
        ASSERT_EQ(state_entry(state, "cd").size(), 400u);
        ASSERT_EQ(state_entry(state, "c").size(), 90u);
        EXPECT_EQ(state_entry(state, "ab"), state_entry(only_ab->save_state(), "ab"));
        EXPECT_EQ(state_entry(state, "cd"), state_entry(only_cd->save_state(), "cd"));
        shared = make_codec(spec);
        shared->load_state(state);
      }
    }
  });
}

// PowerSGD's matrices are the tensors': a bucket call reduces part by part, exactly as calls
// on the tensors one by one.
TEST(CompressedAllreduce, PowerSgdBucketCallsGoPartByPart) {
  testing::run_inproc_contexts(3, [&](Context& ctx) {
    auto parted = make_codec("powersgd:rank=2"), single = make_codec("powersgd:rank=2");
    const compress::Tensor a("a", 20), b("b");
    const std::vector<TensorSlice> parts{{a, 0, 20 * 30}, {b, 600, 45}};
    for (unsigned step = 0; step < 3; ++step) {
      std::vector<float> x = gradient(645, 900 + step + 10 * static_cast<unsigned>(ctx.rank()));
      std::vector<float> ya(x.begin(), x.begin() + 600), yb(x.begin() + 600, x.end());
      compress::compressed_allreduce(ctx, x, *parted, "bucket 0 (a, b)", parts);
      compress::compressed_allreduce(ctx, ya, *single, a);
      compress::compressed_allreduce(ctx, yb, *single, b);
      ASSERT_EQ(0, std::memcmp(x.data(), ya.data(), 600 * 4)) << "step " << step;
      ASSERT_EQ(0, std::memcmp(x.data() + 600, yb.data(), 45 * 4)) << "step " << step;
    }
  });
}

// Parts that do not tile the bucket would lose a residual or feed one back twice.
TEST(CompressedAllreduce, BucketPartsMustTileTheBucket) {
  testing::run_inproc_contexts(1, [&](Context& ctx) {
    auto codec = make_codec("topk:ratio=0.1");
    std::vector<float> g(100, 1.0f);
    const compress::Tensor a("a"), b("b");
    const std::pair<std::vector<TensorSlice>, const char*> cases[] = {
        {{{a, 0, 60}, {b, 50, 50}}, "part 'b' at [50, 100) overlaps the part before it"},
        {{{a, 0, 40}, {b, 50, 50}}, "part 'b' at [50, 100) leaves a gap after 40"},
        {{{a, 0, 60}, {b, 60, 50}}, "part 'b' at [60, 110) ends past the bucket's 100 floats"},
        {{{a, 0, 60}, {b, 60, 30}}, "its parts cover 90 of its 100 floats"},
    };
    for (const auto& c : cases) {
      Error e = testing::expect_error(ErrorKind::kInvalidArgument, [&] {
        compress::compressed_allreduce(ctx, g, *codec, "bucket 7", c.first);
      });
      EXPECT_TRUE(contains(e.what(), "bucket 'bucket 7': ")) << e.what();
      EXPECT_TRUE(contains(e.what(), c.second)) << e.what();
    }
    EXPECT_EQ(g, std::vector<float>(100, 1.0f));  // refused before anything happened
  });
}

// Dense codecs keep their momentum (no masking), so over T steps what was sent plus the
// residual is the sum of the momentum sequence u_t = m u_(t-1) + g_t; through the all-reduce
// too (int8 re-quantised at every hop, summed over ranks).
TEST(ErrorFeedback, MomentumIsConservedByDenseCodecsAndTheQuantisedRing) {
  const std::size_t n = 999;
  const float m = 0.8f;
  for (const char* spec : {"sign:momentum=0.8", "int8:block=64,momentum=0.8"}) {
    for (int ranks : {1, 3}) {
      std::vector<std::vector<double>> sent(static_cast<std::size_t>(ranks)), owed(sent.size());
      std::vector<std::vector<float>> residuals(sent.size());
      testing::run_inproc_contexts(ranks, [&](Context& ctx) {
        const auto r = static_cast<std::size_t>(ctx.rank());
        auto codec = make_codec(spec);
        std::vector<float> u(n, 0.0f);
        sent[r].assign(n, 0.0);
        owed[r].assign(n, 0.0);
        for (unsigned step = 0; step < 12; ++step) {
          auto g = gradient(n, 600 + step + 100 * static_cast<unsigned>(r));
          for (std::size_t i = 0; i < n; ++i) {
            u[i] = m * u[i] + g[i];
            owed[r][i] += u[i];
          }
          compress::compressed_allreduce(ctx, g, *codec, "w");
          for (std::size_t i = 0; i < n; ++i) sent[r][i] += g[i];
        }
        residuals[r] = state_entry(codec->save_state(), "w");
      });
      for (std::size_t i = 0; i < n; ++i) {
        double total_owed = 0, total_residual = 0;
        for (std::size_t r = 0; r < sent.size(); ++r) {
          total_owed += owed[r][i];
          total_residual += residuals[r][i];
        }
        // Every rank holds the all-reduced sum: sent once, not once per rank.
        ASSERT_NEAR(sent[0][i] + total_residual, total_owed, 1e-3)
            << spec << " ranks " << ranks << " i " << i;
      }
    }
  }
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

// The ranks' inputs of one all-reduce test.
std::vector<std::vector<float>> inputs_of(int n, std::size_t count, unsigned seed) {
  std::vector<std::vector<float>> inputs;
  for (int r = 0; r < n; ++r) inputs.push_back(gradient(count, seed + static_cast<unsigned>(r)));
  return inputs;
}

// "Decode every rank's payload and sum in rank order", from fresh codecs (the first step of
// a codec with feedback encodes like one without).
std::vector<float> decode_and_sum(const std::string& spec,
                                  const std::vector<std::vector<float>>& inputs) {
  const std::size_t count = inputs[0].size();
  std::vector<float> sum(count, 0.0f);
  for (std::size_t r = 0; r < inputs.size(); ++r) {
    auto codec = make_codec(spec);
    codec->set_stream(r);
    std::vector<std::uint8_t> payload;
    codec->encode("w", inputs[r], payload);
    if (r == 0) {
      codec->decode(payload, sum);
    } else {
      codec->decode_add(payload, sum);
    }
  }
  return sum;
}

class CompressedAllreduceWorlds : public ::testing::TestWithParam<int> {};

// Codecs that all-gather payloads: exactly "decode every payload and sum", the same bits on
// every rank, and the bytes of a ring all-gather of the payloads ((N-1) payloads per rank,
// plus the 8-byte finiteness check). Tiny tensors may go dense (cheaper than the all-gather's
// steps): the same sum to rounding.
TEST_P(CompressedAllreduceWorlds, GatheredCodecsEqualDecodeEveryPayloadAndSum) {
  const int n = GetParam();
  for (const char* spec :
       {"topk:ratio=0.01", "topk:ratio=0.02,ef=0", "threshold:rel=0.3", "sign", "sign:ef=0"}) {
    for (std::size_t count : {std::size_t{1}, static_cast<std::size_t>(n + 2), std::size_t{4099}}) {
      const bool large = count == 4099;
      const auto inputs = inputs_of(n, count, 70);
      const auto want = decode_and_sum(spec, inputs);
      std::vector<std::vector<float>> results(static_cast<std::size_t>(n));
      testing::run_inproc_contexts(n, [&](Context& ctx) {
        auto codec = make_codec(spec);
        std::vector<float> data = inputs[static_cast<std::size_t>(ctx.rank())];
        std::vector<std::uint8_t> payload;
        make_codec(spec)->encode("w", data, payload);
        const auto before = ctx.total_traffic().bytes_sent;
        EXPECT_TRUE(compress::compressed_allreduce(ctx, data, *codec, "w"));
        const auto sent = ctx.total_traffic().bytes_sent - before;
        if (large && !codec->size_varies()) {
          EXPECT_EQ(sent, static_cast<std::uint64_t>(n - 1) * (payload.size() + 8)) << spec;
        }
        results[static_cast<std::size_t>(ctx.rank())] = data;
      });
      for (int r = 0; r < n; ++r) {
        const auto& got = results[static_cast<std::size_t>(r)];
        ASSERT_EQ(got, results[0]) << spec << " count " << count << " rank " << r;
        if (large) {
          ASSERT_EQ(0, std::memcmp(got.data(), want.data(), count * 4)) << spec << " rank " << r;
        }
        for (std::size_t i = 0; i < count; ++i) {
          ASSERT_NEAR(got[i], want[i], 1e-6f * (1 + std::fabs(want[i]))) << spec << " " << i;
        }
      }
    }
  }
}

// int8 and qsgd are quantised again at every hop: the result is within one quantisation step
// per hop of the exact sum, the same bits everywhere, at a quarter of the float32 ring's
// bytes plus the scales; with feedback, residuals + result = the sum of the inputs over all
// ranks.
TEST_P(CompressedAllreduceWorlds, QuantisedRingIsAQuarterOfTheBytesAndConservesMass) {
  const int n = GetParam();
  for (const char* spec : {"int8:block=64", "int8:ef=0,block=256", "qsgd:levels=127,block=64"}) {
    for (std::size_t count :
         {std::size_t{1}, static_cast<std::size_t>(n + 2), std::size_t{40009}}) {
      const auto inputs = inputs_of(n, count, 80);
      std::vector<std::vector<float>> results(static_cast<std::size_t>(n)),
          residuals(results.size());
      std::vector<double> ratio(results.size());
      testing::run_inproc_contexts(n, [&](Context& ctx) {
        const auto r = static_cast<std::size_t>(ctx.rank());
        auto codec = make_codec(spec);
        std::vector<float> data = inputs[r];
        auto before = ctx.total_traffic().bytes_sent;
        compress::compressed_allreduce(ctx, data, *codec, "w");
        const auto sent = ctx.total_traffic().bytes_sent - before;
        results[r] = data;
        residuals[r] = state_entry(codec->save_state(), "w");
        std::vector<float> plain = inputs[r];
        before = ctx.total_traffic().bytes_sent;
        ctx.allreduce(plain.data(), plain.data(), count, DataType::kFloat32, ReduceOp::kSum,
                      {.algorithm = Algorithm::kRing});
        ratio[r] = static_cast<double>(sent) / static_cast<double>(std::max<std::uint64_t>(
                                                   1, ctx.total_traffic().bytes_sent - before));
      });
      float peak = 0;
      for (const auto& x : inputs)
        for (float v : x) peak = std::max(peak, std::fabs(v));
      const bool feedback = contains(make_codec(spec)->spec(), "ef=1");
      for (std::size_t i = 0; i < count; ++i) {
        double exact = 0, conserved = 0;
        for (int r = 0; r < n; ++r) {
          exact += inputs[static_cast<std::size_t>(r)][i];
          if (feedback) conserved += residuals[static_cast<std::size_t>(r)][i];
        }
        // Every hop's partial sum is at most n peak: a step is that / 127 (qsgd: block norm,
        // at most sqrt(block) n peak, / levels), n encodings touch each element.
        const double hop_step =
            n * peak * (std::string(spec).rfind("qsgd", 0) == 0 ? 8.0 : 1.0) / 127;
        ASSERT_LE(std::fabs(results[0][i] - exact), n * hop_step) << spec << " i " << i;
        if (feedback) {
          ASSERT_NEAR(conserved + results[0][i], exact, 1e-5 * n * peak) << spec << " i " << i;
        }
      }
      for (int r = 1; r < n; ++r) {
        ASSERT_EQ(results[static_cast<std::size_t>(r)], results[0]) << spec << " rank " << r;
      }
      if (count == 40009 && n > 1) {
        const double block = std::string(spec).find("256") != std::string::npos ? 256 : 64;
        EXPECT_NEAR(ratio[0], (1 + 4 / block) / 4, 0.01) << spec << " n=" << n;
      }
    }
  }
}

// randomk all-reduces its k values (no indices travel); powersgd all-reduces P and Q. Both:
// the same bits everywhere, the bytes of those all-reduces.
TEST_P(CompressedAllreduceWorlds, RandomKAndPowerSgdAllreduceOnlyTheirFactors) {
  const int n = GetParam();
  const std::size_t count = 9000;
  const auto inputs = inputs_of(n, count, 90);
  const auto want = decode_and_sum("randomk:ratio=0.05", inputs);
  // PowerSGD on matrices that share a column space A (rows x 2): their sum has rank 2.
  const std::size_t rows = 90, cols = count / rows;
  std::vector<std::vector<float>> matrices;
  std::mt19937 rng(91);
  std::normal_distribution<float> normal;
  std::vector<float> a(rows * 2);
  for (float& x : a) x = normal(rng);
  std::vector<double> exact(count, 0.0);
  for (int r = 0; r < n; ++r) {
    std::vector<float> b(cols * 2), m(count, 0.0f);
    for (float& x : b) x = normal(rng);
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t c = 0; c < cols; ++c)
        for (std::size_t j = 0; j < 2; ++j) m[i * cols + c] += a[i * 2 + j] * b[c * 2 + j];
    for (std::size_t i = 0; i < count; ++i) exact[i] += m[i];
    matrices.push_back(m);
  }
  std::vector<std::vector<float>> random_results(static_cast<std::size_t>(n)),
      power_results(random_results.size());
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    const auto r = static_cast<std::size_t>(ctx.rank());
    auto randomk = make_codec("randomk:ratio=0.05");
    std::vector<float> data = inputs[r];
    compress::compressed_allreduce(ctx, data, *randomk, "w");
    random_results[r] = data;
    for (std::size_t i = 0; i < count; ++i) {
      ASSERT_NEAR(data[i], want[i], 1e-6f * (1 + std::fabs(want[i]))) << i;
    }
    auto power = make_codec("powersgd:rank=2");
    data = matrices[r];
    const auto before = ctx.total_traffic().bytes_sent;
    compress::compressed_allreduce(ctx, data, *power, compress::Tensor("m", rows), ReduceOp::kAvg);
    const auto sent = ctx.total_traffic().bytes_sent - before;
    power_results[r] = data;
    for (std::size_t i = 0; i < count; ++i) {
      ASSERT_NEAR(data[i], exact[i] / n, 1e-3 * (1 + std::fabs(exact[i]))) << i;
    }
    if (n > 1) {  // a ring all-reduce of (rows + cols) x 2 floats moves ~2 (N-1)/N of them
      const double factors = 4.0 * (rows + cols) * 2 * 2 * (n - 1) / n;
      EXPECT_LT(static_cast<double>(sent), factors * 1.5 + 4096);
    }
  });
  for (int r = 1; r < n; ++r) {
    ASSERT_EQ(random_results[static_cast<std::size_t>(r)], random_results[0]);
    ASSERT_EQ(power_results[static_cast<std::size_t>(r)], power_results[0]);
  }
}

// top-k with union=1: every rank's value at every index any rank picked, summed; the
// residuals keep the rest (so over two steps residuals + results = the inputs), the same
// bits everywhere, a fraction of a dense all-reduce's bytes.
TEST_P(CompressedAllreduceWorlds, TopKUnionSendsEveryRanksValueAtEveryPickedIndex) {
  const int n = GetParam();
  for (const char* spec : {"topk:ratio=0.01,union=1", "topk:ratio=0.02,union=1,momentum=0.9"}) {
    for (std::size_t count : {std::size_t{1}, static_cast<std::size_t>(n + 2), std::size_t{4099}}) {
      const auto first = inputs_of(n, count, 110), second = inputs_of(n, count, 120);
      // The first step owes exactly the input (no residual yet, and u = g): the union of what
      // plain top-k picks on each rank.
      std::vector<bool> picked(count, false);
      for (const auto& in : first) {
        std::vector<std::uint8_t> payload;
        make_codec("topk:ratio=" + std::string(contains(spec, "0.02") ? "0.02" : "0.01"))
            ->encode("w", in, payload);
        auto u32_at = [&](std::size_t at) {
          std::uint32_t v;
          std::memcpy(&v, payload.data() + at, 4);
          return v;
        };
        for (std::uint32_t j = 0, pairs = u32_at(4); j < pairs; ++j)
          picked[u32_at(8 + 4 * j)] = true;
      }
      std::vector<std::vector<float>> results(static_cast<std::size_t>(n)), later(results.size()),
          residuals(results.size());
      std::vector<std::uint64_t> sent(results.size());
      testing::run_inproc_contexts(n, [&](Context& ctx) {
        const auto r = static_cast<std::size_t>(ctx.rank());
        auto codec = make_codec(spec);
        std::vector<float> data = first[r];
        const auto before = ctx.total_traffic().bytes_sent;
        EXPECT_TRUE(compress::compressed_allreduce(ctx, data, *codec, "w"));
        sent[r] = ctx.total_traffic().bytes_sent - before;
        results[r] = data;
        data = second[r];
        compress::compressed_allreduce(ctx, data, *codec, "w");
        later[r] = data;
        residuals[r] = state_entry(codec->save_state(), "w");
      });
      for (std::size_t i = 0; i < count; ++i) {
        double sum = 0, fed = 0, kept = 0;
        for (std::size_t r = 0; r < first.size(); ++r) {
          sum += first[r][i];
          fed += first[r][i] + second[r][i];
          kept += residuals[r][i];
        }
        ASSERT_NEAR(results[0][i], picked[i] ? sum : 0.0, 1e-6 * (1 + std::fabs(sum)))
            << spec << " count " << count << " element " << i;
        if (!contains(spec, "momentum")) {  // with momentum what is owed is not the input
          ASSERT_NEAR(results[0][i] + later[0][i] + kept, fed, 1e-6 * (1 + std::fabs(fed)))
              << spec << " element " << i;
        }
      }
      for (int r = 1; r < n; ++r) {
        ASSERT_EQ(results[static_cast<std::size_t>(r)], results[0]) << spec << " rank " << r;
        ASSERT_EQ(later[static_cast<std::size_t>(r)], later[0]) << spec << " rank " << r;
      }
      if (count == 4099 && n > 1) {  // k indices and at most N k values, not 4099 floats
        EXPECT_LT(sent[0], count * 4 / 4) << spec << " n=" << n;
      }
    }
  }
  Error e = testing::expect_error(ErrorKind::kInvalidArgument,
                                  [] { make_codec("topk:ratio=0.01,union=1,ef=0"); });
  EXPECT_TRUE(contains(e.what(), "it needs ef=1")) << e.what();
  // Tensors of different sizes with the same k: every rank names the mismatch.
  if (n == 1) return;
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    auto codec = make_codec("topk:ratio=0.01,union=1");
    std::vector<float> data = gradient(ctx.rank() == n - 1 ? 999 : 1000, 130);
    Error m = testing::expect_error(
        ErrorKind::kMismatch, [&] { compress::compressed_allreduce(ctx, data, *codec, "w"); });
    const std::string want = ctx.rank() == n - 1 ? "has 1000 elements on rank 0 and 999 here"
                                                 : "has 999 elements on rank " +
                                                       std::to_string(n - 1) + " and 1000 here";
    EXPECT_TRUE(contains(m.what(), want)) << m.what();
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, CompressedAllreduceWorlds, ::testing::Values(1, 2, 3, 4, 5, 8),
                         [](const auto& p) { return "n" + std::to_string(p.param); });

// When the payloads together outweigh the tensor (top-k of everything), the cost model sends
// the decoded tensor through a float32 all-reduce instead: fewer bytes than the all-gather,
// the same sum to rounding, the same bits everywhere.
TEST(CompressedAllreduce, DenseUnionGoesThroughTheFloat32Allreduce) {
  const int n = 4;
  const std::size_t count = 20000;
  const auto inputs = inputs_of(n, count, 95);
  const auto want = decode_and_sum("topk:ratio=1,ef=0", inputs);
  std::vector<std::vector<float>> results(n);
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    auto codec = make_codec("topk:ratio=1,ef=0");
    std::vector<float> data = inputs[static_cast<std::size_t>(ctx.rank())];
    const auto before = ctx.total_traffic().bytes_sent;
    compress::compressed_allreduce(ctx, data, *codec, "w");
    const auto sent = ctx.total_traffic().bytes_sent - before;
    EXPECT_LT(sent, (n - 1) * (8 + 8 * count) / 2) << "the all-gather would send 3 payloads";
    for (std::size_t i = 0; i < count; ++i) ASSERT_NEAR(data[i], want[i], 1e-6f);
    results[static_cast<std::size_t>(ctx.rank())] = data;
  });
  for (int r = 1; r < n; ++r) EXPECT_EQ(results[static_cast<std::size_t>(r)], results[0]);
}

// NaN or Inf on one rank: every rank throws naming the tensor, the rank and the element
// (kThrow), or every rank skips the step with its data untouched (kSkip).
TEST(CompressedAllreduce, NonFiniteGradientsAreReportedOrSkippedOnEveryRank) {
  const int n = 3;
  const std::size_t count = 1000;
  for (const char* spec : {"none", "fp16", "int8", "topk:ratio=0.1", "powersgd:rank=2"}) {
    testing::run_inproc_contexts(n, [&](Context& ctx) {
      auto codec = make_codec(spec);
      std::vector<float> data = gradient(count, 3);
      if (ctx.rank() == 2) data[17] = std::numeric_limits<float>::quiet_NaN();
      if (ctx.rank() == 1) data[999] = -std::numeric_limits<float>::infinity();
      const auto original = data;
      Error e = expect_error(ErrorKind::kInvalidArgument, [&] {
        compress::compressed_allreduce(ctx, data, *codec, compress::Tensor("fc2.weight", 10));
      });
      EXPECT_TRUE(contains(e.what(),
                           "tensor 'fc2.weight' has Inf on rank 1 (element 999), NaN "
                           "on rank 2 (element 17)"))
          << e.what();
      EXPECT_FALSE(compress::compressed_allreduce(ctx, data, *codec,
                                                  compress::Tensor("fc2.weight", 10),
                                                  ReduceOp::kAvg, compress::NonFinite::kSkip));
      EXPECT_EQ(0, std::memcmp(data.data(), original.data(), count * 4)) << spec;
      // The context is still usable: a clean step goes through.
      std::vector<float> clean(count, 1.0f);
      EXPECT_TRUE(
          compress::compressed_allreduce(ctx, clean, *codec, compress::Tensor("fc2.weight", 10)));
    });
  }
}

// kPropagate skips the check, but codecs whose encoders refuse NaN (top-k, threshold, sign)
// are still checked on every rank: a refusal on one rank alone would leave the others
// waiting for its payload.
TEST(CompressedAllreduce, PropagateStillChecksCodecsThatRefuseNaN) {
  for (const char* spec : {"topk:ratio=0.1", "threshold:rel=0.5", "sign"}) {
    testing::run_inproc_contexts(3, [&](Context& ctx) {
      auto codec = make_codec(spec);
      std::vector<float> data = gradient(1000, 3);
      if (ctx.rank() == 1) data[42] = std::numeric_limits<float>::quiet_NaN();
      Error e = expect_error(ErrorKind::kInvalidArgument, [&] {
        compress::compressed_allreduce(ctx, data, *codec, "w", ReduceOp::kSum,
                                       compress::NonFinite::kPropagate);
      });
      EXPECT_TRUE(contains(e.what(), "tensor 'w' has NaN on rank 1 (element 42)")) << e.what();
    });
  }
}

// On the shared-memory path the sums are searched instead of the inputs: the same report
// (rank, element, NaN or Inf) on every rank, and finite inputs that overflow are named too.
TEST(CompressedAllreduce, NonFiniteOnSharedMemoryIsFoundInTheSums) {
  const std::size_t count = 1 << 20;
  for (const char* spec : {"none", "fp16", "bf16"}) {
    testing::run_shm_contexts(4, [&](Context& ctx) {
      ASSERT_EQ(ctx.choose_allreduce_algorithm(count * 4), Algorithm::kSharedMemory);
      auto codec = make_codec(spec);
      std::vector<float> data = gradient(count, 5);
      if (ctx.rank() == 3) data[count - 2] = std::numeric_limits<float>::quiet_NaN();
      if (ctx.rank() == 0) data[123457] = std::numeric_limits<float>::infinity();
      Error e = expect_error(ErrorKind::kInvalidArgument,
                             [&] { compress::compressed_allreduce(ctx, data, *codec, "emb"); });
      EXPECT_TRUE(contains(e.what(),
                           "tensor 'emb' has Inf on rank 0 (element 123457), NaN on "
                           "rank 3 (element " +
                               std::to_string(count - 2) + ")"))
          << e.what();
      std::vector<float> again = gradient(count, 5);
      if (ctx.rank() == 1) again[7] = -std::numeric_limits<float>::infinity();
      EXPECT_FALSE(compress::compressed_allreduce(ctx, again, *codec, "emb", ReduceOp::kSum,
                                                  compress::NonFinite::kSkip));
      std::vector<float> big(count, 1.0f);
      big[99] = 3e38f;  // finite everywhere, but four of them pass FLT_MAX
      e = expect_error(ErrorKind::kInvalidArgument,
                       [&] { compress::compressed_allreduce(ctx, big, *codec, "emb"); });
      EXPECT_TRUE(contains(e.what(), "Inf in the sum of finite values (element 99)")) << e.what();
      if (std::string(spec) == "fp16") {  // a sum past float16's 65504 is lost as well
        std::vector<float> wide(count, 1.0f);
        wide[5] = 40000.0f;
        e = expect_error(ErrorKind::kInvalidArgument,
                         [&] { compress::compressed_allreduce(ctx, wide, *codec, "emb"); });
        EXPECT_TRUE(contains(e.what(), "in the sum of finite values (element 5)")) << e.what();
      }
      std::vector<float> clean = gradient(count, 6);
      EXPECT_TRUE(compress::compressed_allreduce(ctx, clean, *codec, "emb"));
    });
  }
}

// Ranks that pass different codecs to the same call fail with a mismatch, not garbage: the
// rank that sees it first gets kMismatch, the other kAborted carrying that reason.
TEST(CompressedAllreduce, DifferentCodecsOnDifferentRanksAreAMismatch) {
  testing::run_inproc_contexts(2, [&](Context& ctx) {
    auto codec = make_codec(ctx.rank() == 0 ? "int8:block=256" : "int8:block=128");
    std::vector<float> data = gradient(4096, 4);
    try {
      compress::compressed_allreduce(ctx, data, *codec, "w");
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_TRUE(e.kind() == ErrorKind::kMismatch || e.kind() == ErrorKind::kAborted) << e.what();
      EXPECT_TRUE(contains(e.what(), "mismatched call in compressed_allreduce")) << e.what();
      EXPECT_TRUE(contains(e.what(), "codec#")) << e.what();
    }
  });
}

}  // namespace
}  // namespace gradsync
