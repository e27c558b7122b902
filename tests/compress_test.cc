// Codecs against numbers: round-trip bounds per codec, error feedback conserving mass over many
// steps, state saved and restored by tensor name, and malformed specs and payloads refused
// with a clear error instead of read out of bounds.
#include "gradsync/compress.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "gradsync/error.h"
#include "harness.h"
#include "kernels/kernels.h"

namespace gradsync {
namespace {

using compress::CodecSpec;
using compress::make_codec;
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
  struct Bad {
    const char* spec;
    const char* says;
  };
  for (const Bad& b : {Bad{"", "no codec name"}, Bad{"zstd", "unknown codec 'zstd'"},
                       Bad{"int8:", "nothing after ':'"}, Bad{"int8:block", "not key=value"},
                       Bad{"fp16:block=4", "takes no 'block'"}, Bad{"int8:block=x", "not a number"},
                       Bad{"int8:block=0", "block is a whole number"},
                       Bad{"int8:block=2.5", "block is a whole number"},
                       Bad{"int8:ef=2", "ef is 0 or 1"}, Bad{"int8:ef=1,ef=0", "given twice"}}) {
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
                      Algorithm::kRing);
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
// round once: exactly the float32 all-reduce's result, rounded, on every rank.
TEST(CompressedAllreduce, HalfOnSharedMemoryIsTheFloat32SumRoundedOnce) {
  for (const char* spec : {"fp16", "bf16"}) {
    const std::size_t count = 300007;
    testing::run_shm_contexts(4, [&](Context& ctx) {
      auto codec = make_codec(spec);
      std::vector<float> data = gradient(count, 90 + static_cast<unsigned>(ctx.rank()));
      std::vector<float> want = data;
      ctx.allreduce(want.data(), want.data(), count, DataType::kFloat32, ReduceOp::kSum);
      for (float& x : want) {
        x = std::string(spec) == "fp16" ? kernels::half_to_float(kernels::float_to_half(x))
                                        : kernels::bfloat16_to_float(kernels::float_to_bfloat16(x));
      }
      compress::compressed_allreduce(ctx, data, *codec, "w");
      EXPECT_EQ(0, std::memcmp(data.data(), want.data(), count * 4)) << spec;
    });
  }
}

// Any other codec: the result is exactly "decode every rank's payload and sum in rank order",
// on every rank.
TEST(CompressedAllreduce, EqualsDecodeEveryPayloadAndSum) {
  for (int n : {1, 2, 3, 5}) {
    const std::size_t count = 4099;
    // The reference, from fresh codecs (no feedback, so no state).
    std::vector<float> want(count, 0.0f), decoded(count);
    for (int r = 0; r < n; ++r) {
      auto codec = make_codec("int8:ef=0,block=32");
      std::vector<std::uint8_t> payload;
      codec->encode("w", gradient(count, 70 + static_cast<unsigned>(r)), payload);
      codec->decode(payload, decoded);
      if (r == 0) {
        want = decoded;
      } else {
        kernels::reduce_into(want.data(), decoded.data(), count, DataType::kFloat32,
                             ReduceOp::kSum);
      }
    }
    testing::run_inproc_contexts(n, [&](Context& ctx) {
      auto codec = make_codec("int8:ef=0,block=32");
      std::vector<float> data = gradient(count, 70 + static_cast<unsigned>(ctx.rank()));
      compress::compressed_allreduce(ctx, data, *codec, "w");
      EXPECT_EQ(0, std::memcmp(data.data(), want.data(), count * 4)) << "n=" << n;
      Error e = expect_error(ErrorKind::kInvalidArgument, [&] {
        compress::compressed_allreduce(ctx, data, *codec, "w", ReduceOp::kMax);
      });
      EXPECT_TRUE(contains(e.what(), "sums or averages")) << e.what();
    });
  }
}

}  // namespace
}  // namespace gradsync
