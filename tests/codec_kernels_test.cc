// The gradient codecs' kernels (int8 blocks, stochastic rounding, sign bits, L1/max norms,
// finiteness, the fused sum-and-narrow) against plain loops, on both paths, over awkward
// counts and block sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gradsync/error.h"
#include "kernel_paths.h"
#include "kernels/kernels.h"

namespace gradsync::kernels {
namespace {

constexpr std::size_t kCodecCounts[] = {0, 1, 7, 8, 9, 31, 33, 1000, 4097};
constexpr std::size_t kBlocks[] = {1, 3, 64, 256};

std::uint32_t bits_of(float f) {
  return std::bit_cast<std::uint32_t>(f);
}

// Gradient-like values with the awkward cases sprinkled in: -0, denormals, huge values,
// runs of zeros (whole zero blocks for small block sizes), exact integers and x.5 steps.
std::vector<float> awkward_floats(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    switch (rng() % 16) {
      case 0:
        v[i] = -0.0f;
        break;
      case 1:
        v[i] = 0.0f;
        break;
      case 2:
        v[i] = std::bit_cast<float>(static_cast<std::uint32_t>(rng() % 0x007FFFFFu + 1));
        break;
      case 3:
        v[i] = (rng() & 1) != 0 ? 1e38f : -3.4e38f;
        break;
      case 4:
        v[i] = static_cast<float>(static_cast<int>(rng() % 255) - 127) + 0.5f;
        break;
      default:
        v[i] = normal(rng);
        break;
    }
  }
  // A run of zeros long enough to make whole blocks of 1, 3 and 64 elements zero.
  for (std::size_t i = n / 3; i < n / 3 + 70 && i < n; ++i) v[i] = (i & 1) != 0 ? 0.0f : -0.0f;
  return v;
}

// The int8 formula written out plainly.
void ref_quantize(const float* in, std::size_t n, std::size_t block, float* scales,
                  std::int8_t* q) {
  for (std::size_t b = 0; b * block < n; ++b) {
    const std::size_t lo = b * block, hi = std::min(n, lo + block);
    float peak = 0.0f;
    for (std::size_t i = lo; i < hi; ++i) {
      if (!std::isnan(in[i]) && std::fabs(in[i]) > peak) peak = std::fabs(in[i]);
    }
    const float scale = peak / 127.0f;
    scales[b] = scale;
    const float inverse = scale > 0 ? 1.0f / scale : 0.0f;
    for (std::size_t i = lo; i < hi; ++i) {
      const float r = std::nearbyint(in[i] * inverse);
      q[i] = std::isnan(r) ? 0 : static_cast<std::int8_t>(std::clamp(r, -127.0f, 127.0f));
    }
  }
}

::testing::AssertionResult same_floats(const float* got, const float* want, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    if (bits_of(got[i]) != bits_of(want[i])) {
      return ::testing::AssertionFailure()
             << "element " << i << " of " << n << ": got " << got[i] << " (" << std::hex
             << bits_of(got[i]) << ") want " << want[i] << " (" << bits_of(want[i]) << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

struct Quantized {
  std::vector<float> scales;
  std::vector<std::int8_t> q;
};

Quantized quantize(const float* in, std::size_t n, std::size_t block) {
  Quantized r{std::vector<float>((n + block - 1) / block + 1, -1.0f),
              std::vector<std::int8_t>(n + 1, 99)};
  quantize_int8_blocks(in, n, block, r.scales.data(), r.q.data());
  return r;
}

TEST(CodecKernels, QuantizeInt8MatchesTheFormulaOnEveryPath) {
  for (std::size_t n : kCodecCounts) {
    // Offset by one float: unaligned on the vector path.
    std::vector<float> buf = awkward_floats(n + 1, n);
    const float* in = buf.data() + 1;
    for (std::size_t block : kBlocks) {
      const std::size_t nb = (n + block - 1) / block;
      std::vector<float> want_s(nb);
      std::vector<std::int8_t> want_q(n);
      ref_quantize(in, n, block, want_s.data(), want_q.data());
      for (bool scalar : paths()) {
        SCOPED_TRACE("n=" + std::to_string(n) + " block=" + std::to_string(block) +
                     (scalar ? " scalar" : " vector"));
        ScopedScalar mode(scalar);
        const Quantized got = quantize(in, n, block);
        ASSERT_TRUE(same_floats(got.scales.data(), want_s.data(), nb));
        for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(got.q[i], want_q[i]) << "element " << i;
        EXPECT_EQ(got.scales[nb], -1.0f) << "wrote a scale past the last block";
        EXPECT_EQ(got.q[n], 99) << "wrote a value past count";
      }
    }
  }
}

TEST(CodecKernels, QuantizeInt8RoundsTiesToEvenAndHandlesExtremes) {
  for (bool scalar : paths()) {
    ScopedScalar mode(scalar);
    // Peak 127: the scale and its inverse are exactly 1, so x.5 values are exact ties.
    const float ties[] = {127.0f, 0.5f,  1.5f, 2.5f, -0.5f,   -1.5f,    -2.5f, 126.5f, -126.5f,
                          3.5f,   -0.0f, 0.0f, 4.5f, -127.0f, 5.49999f, 5.5f,  6.5f};
    const std::size_t n = std::size(ties);
    Quantized r = quantize(ties, n, n);
    EXPECT_EQ(r.scales[0], 1.0f);
    const std::int8_t want[] = {127, 0, 2, 2, 0, -2, -2, 126, -126, 4, 0, 0, 4, -127, 5, 6, 6};
    for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(r.q[i], want[i]) << "element " << i;

    // Every quarter step from -127 to 127 and the floats either side of each half step.
    std::vector<float> sweep{127.0f};
    for (int k = -508; k <= 508; ++k) {
      const float x = static_cast<float>(k) / 4.0f;
      sweep.push_back(x);
      if (k % 2 != 0 && k % 4 != 0) {
        sweep.push_back(std::nextafter(x, 0.0f));
        sweep.push_back(std::nextafter(x, x * 2));
      }
    }
    r = quantize(sweep.data(), sweep.size(), sweep.size());
    for (std::size_t i = 0; i < sweep.size(); ++i) {
      ASSERT_EQ(r.q[i], static_cast<std::int8_t>(std::nearbyint(sweep[i]))) << sweep[i];
    }

    // Huge values: the scale is finite and the peak maps to +-127.
    const float huge[] = {1e38f, -3.4e38f, 3.4028235e38f, 1.0f, -1e30f};
    r = quantize(huge, 5, 5);
    EXPECT_EQ(r.scales[0], 3.4028235e38f / 127.0f);
    EXPECT_EQ(r.q[2], 127);
    EXPECT_EQ(r.q[1], -127);
    EXPECT_EQ(r.q[3], 0);

    // All zero (either sign): scale 0, values 0. A lone smallest denormal: its scale
    // underflows to 0 too.
    const float zeros[] = {0.0f, -0.0f, 0.0f, std::bit_cast<float>(1u), -0.0f};
    r = quantize(zeros, 3, 3);
    EXPECT_EQ(bits_of(r.scales[0]), 0u);
    r = quantize(zeros, 5, 5);
    EXPECT_EQ(bits_of(r.scales[0]), 0u);
    for (std::size_t i = 0; i < 5; ++i) EXPECT_EQ(r.q[i], 0);

    // A denormal peak whose reciprocal scale overflows to Inf: nonzero values saturate,
    // zeros (0 * Inf is NaN) stay 0.
    const float tiny[] = {1e-40f, -1e-40f, 0.0f, -0.0f, 5e-41f};
    r = quantize(tiny, 5, 5);
    EXPECT_GT(r.scales[0], 0.0f);
    EXPECT_EQ(1.0f / r.scales[0], INFINITY);
    const std::int8_t want_tiny[] = {127, -127, 0, 0, 127};
    for (std::size_t i = 0; i < 5; ++i) EXPECT_EQ(r.q[i], want_tiny[i]) << "element " << i;
  }
}

TEST(CodecKernels, QuantizeInt8NonFiniteInputIsDefinedAndSameOnBothPaths) {
  // Not checked by the kernel, but it must stay in bounds and agree across paths.
  std::vector<float> v = awkward_floats(1000, 3);
  v[5] = NAN;
  v[60] = NAN;  // in the last vector a block of 64's peak loop reads
  v[511] = NAN;
  v[300] = INFINITY;
  v[301] = -INFINITY;
  v[999] = -NAN;
  for (std::size_t block : kBlocks) {
    std::vector<float> want_s((v.size() + block - 1) / block);
    std::vector<std::int8_t> want_q(v.size());
    ref_quantize(v.data(), v.size(), block, want_s.data(), want_q.data());
    for (bool scalar : paths()) {
      ScopedScalar mode(scalar);
      const Quantized got = quantize(v.data(), v.size(), block);
      ASSERT_TRUE(same_floats(got.scales.data(), want_s.data(), want_s.size()));
      for (std::size_t i = 0; i < v.size(); ++i) ASSERT_EQ(got.q[i], want_q[i]) << i;
    }
  }
}

TEST(CodecKernels, DequantizeInt8MatchesReferenceAndAddsInPlace) {
  std::mt19937 rng(9);
  for (std::size_t n : kCodecCounts) {
    for (std::size_t block : kBlocks) {
      const std::size_t nb = (n + block - 1) / block;
      std::vector<std::int8_t> q(n + 1);
      for (auto& x : q) x = static_cast<std::int8_t>(static_cast<int>(rng() % 255) - 127);
      std::vector<float> scales(nb);
      for (std::size_t b = 0; b < nb; ++b) {
        scales[b] = b % 7 == 0 ? 0.0f : std::ldexp(static_cast<float>(rng() % 1000 + 1), -20);
      }
      const std::vector<float> base = awkward_floats(n + 1, n + 7);
      std::vector<float> want(n), want_add(n);
      for (std::size_t i = 0; i < n; ++i) {
        want[i] = static_cast<float>(q[i + 1]) * scales[i / block];
        want_add[i] = base[i + 1] + want[i];  // no FMA on the baseline target: two roundings
      }
      for (bool scalar : paths()) {
        SCOPED_TRACE("n=" + std::to_string(n) + " block=" + std::to_string(block) +
                     (scalar ? " scalar" : " vector"));
        ScopedScalar mode(scalar);
        std::vector<float> out(n + 1, 7.0f);
        dequantize_int8_blocks(q.data() + 1, scales.data(), n, block, out.data());
        ASSERT_TRUE(same_floats(out.data(), want.data(), n));
        EXPECT_EQ(out[n], 7.0f);
        std::vector<float> acc(base.begin() + 1, base.end());
        acc.push_back(7.0f);
        dequantize_int8_blocks_add(q.data() + 1, scales.data(), n, block, acc.data());
        ASSERT_TRUE(same_floats(acc.data(), want_add.data(), n));
        EXPECT_EQ(acc[n], 7.0f);
      }
    }
  }
}

TEST(CodecKernels, DequantizeAddIsNotFusedAndCanonicalisesNaN) {
  // 1 + 3 * (1/3 rounded): a fused multiply-add would round once and differ in the last bit
  // for some of these; the kernels must round the product first.
  std::vector<std::int8_t> q(64);
  std::vector<float> out(64), want(64);
  const float scale = 1.0f / 3.0f;
  for (std::size_t i = 0; i < 64; ++i) {
    q[i] = static_cast<std::int8_t>(i * 2 + 1);
    out[i] = 1.0f + static_cast<float>(i) * 0x1p-20f;
  }
  std::vector<float> nan_out(9, NAN);
  nan_out[0] = std::bit_cast<float>(0xFFC12345u);
  const std::vector<std::int8_t> q9(9, 1);
  const float inf_scale[1] = {INFINITY};
  for (bool scalar : paths()) {
    ScopedScalar mode(scalar);
    std::vector<float> acc = out;
    for (std::size_t i = 0; i < 64; ++i) want[i] = out[i] + static_cast<float>(q[i]) * scale;
    dequantize_int8_blocks_add(q.data(), &scale, 64, 64, acc.data());
    ASSERT_TRUE(same_floats(acc.data(), want.data(), 64));
    std::vector<float> n9 = nan_out;
    dequantize_int8_blocks_add(q9.data(), inf_scale, 9, 9, n9.data());
    for (float f : n9) EXPECT_EQ(bits_of(f), 0x7FC00000u);
  }
}

TEST(CodecKernels, PackSignsUsesTheSignBitLsbFirst) {
  for (std::size_t n : kCodecCounts) {
    std::vector<float> in = awkward_floats(n + 1, n + 11);
    if (n > 3) in[3] = -NAN;  // sign set
    if (n > 4) in[4] = NAN;
    const std::size_t bytes = (n + 7) / 8;
    std::vector<std::uint8_t> want(bytes, 0);
    for (std::size_t i = 0; i < n; ++i) {
      if (std::signbit(in[i + 1]))
        want[i / 8] = static_cast<std::uint8_t>(want[i / 8] | (1u << (i % 8)));
    }
    for (bool scalar : paths()) {
      SCOPED_TRACE("n=" + std::to_string(n) + (scalar ? " scalar" : " vector"));
      ScopedScalar mode(scalar);
      std::vector<std::uint8_t> got(bytes + 1, 0xA5);
      pack_signs(in.data() + 1, n, got.data());
      for (std::size_t i = 0; i < bytes; ++i) ASSERT_EQ(got[i], want[i]) << "byte " << i;
      EXPECT_EQ(got[bytes], 0xA5) << "wrote past ceil(n/8) bytes";
    }
  }
  const float z[3] = {-0.0f, 0.0f, -1e-45f};
  for (bool scalar : paths()) {
    ScopedScalar mode(scalar);
    std::uint8_t b = 0xFF;
    pack_signs(z, 3, &b);
    EXPECT_EQ(b, 0b101) << "-0 and negative denormals count as negative; high bits zero";
  }
}

TEST(CodecKernels, UnpackSignsScaledWritesOrAccumulates) {
  std::mt19937 rng(13);
  for (std::size_t n : kCodecCounts) {
    std::vector<std::uint8_t> bits((n + 7) / 8 + 1);
    for (auto& b : bits) b = static_cast<std::uint8_t>(rng());
    const std::vector<float> base = awkward_floats(n + 1, n + 5);
    for (float scale : {0.25f, 1e-3f, -0.0f, 3e38f}) {
      std::vector<float> want(n), want_add(n);
      for (std::size_t i = 0; i < n; ++i) {
        want[i] = ((bits[1 + i / 8] >> (i % 8)) & 1) != 0 ? -scale : scale;
        want_add[i] = base[i + 1] + want[i];
        if (std::isnan(want_add[i])) want_add[i] = std::bit_cast<float>(0x7FC00000u);
      }
      for (bool scalar : paths()) {
        SCOPED_TRACE("n=" + std::to_string(n) + " scale=" + std::to_string(scale) +
                     (scalar ? " scalar" : " vector"));
        ScopedScalar mode(scalar);
        std::vector<float> out(n + 1, 7.0f);
        unpack_signs_scaled(bits.data() + 1, n, scale, out.data(), false);
        ASSERT_TRUE(same_floats(out.data(), want.data(), n));
        EXPECT_EQ(out[n], 7.0f);
        std::vector<float> acc(base.begin() + 1, base.end());
        acc.push_back(7.0f);
        unpack_signs_scaled(bits.data() + 1, n, scale, acc.data(), true);
        ASSERT_TRUE(same_floats(acc.data(), want_add.data(), n));
        EXPECT_EQ(acc[n], 7.0f);
      }
    }
  }
}

TEST(CodecKernels, PackThenUnpackRecoversSigns) {
  constexpr std::size_t n = 4097;
  const std::vector<float> in = awkward_floats(n, 21);
  std::vector<std::uint8_t> bits((n + 7) / 8);
  std::vector<float> out(n);
  pack_signs(in.data(), n, bits.data());
  unpack_signs_scaled(bits.data(), n, 2.0f, out.data(), false);
  for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], std::signbit(in[i]) ? -2.0f : 2.0f) << i;
}

// The documented scheme: lane i % 32 in double, lanes folded pairwise (16, 8, 4, 2, 1).
double ref_sum_abs_lanes(const float* in, std::size_t n) {
  double lanes[32] = {};
  for (std::size_t i = 0; i < n; ++i) lanes[i % 32] += std::fabs(static_cast<double>(in[i]));
  for (std::size_t w = 16; w >= 1; w /= 2) {
    for (std::size_t j = 0; j < w; ++j) lanes[j] += lanes[j + w];
  }
  return lanes[0];
}

TEST(CodecKernels, SumAbsIsTheL1NormIdenticalOnBothPaths) {
  auto dbits = [](double d) { return std::bit_cast<std::uint64_t>(d); };
  for (std::size_t n : kCodecCounts) {
    std::vector<float> v = awkward_floats(n + 1, n + 17);
    for (auto& x : v) {
      if (std::fabs(x) > 1e30f) x = 0.25f;  // keep the plain double sum meaningful
    }
    const float* in = v.data() + 1;
    double plain = 0;
    for (std::size_t i = 0; i < n; ++i) plain += std::fabs(static_cast<double>(in[i]));
    const double want = ref_sum_abs_lanes(in, n);
    EXPECT_NEAR(want, plain, plain * 1e-12);
    for (bool scalar : paths()) {
      ScopedScalar mode(scalar);
      EXPECT_EQ(dbits(sum_abs(in, n)), dbits(want)) << "n=" << n << " scalar=" << scalar;
    }
  }
  // A large sum of values with every exponent: identical on both paths, in the documented
  // lane order.
  std::mt19937 rng(2);
  std::vector<float> big(1000003);
  for (auto& x : big) x = std::bit_cast<float>(static_cast<std::uint32_t>(rng()) & 0xBF7FFFFFu);
  const double s = [&] {
    ScopedScalar mode(true);
    return sum_abs(big.data(), big.size());
  }();
  EXPECT_EQ(dbits(sum_abs(big.data(), big.size())), dbits(s));
  EXPECT_EQ(dbits(s), dbits(ref_sum_abs_lanes(big.data(), big.size())));
  for (bool scalar : paths()) {
    ScopedScalar mode(scalar);
    const float exact[5] = {1.0f, -2.0f, 3.0f, -0.0f, 1e-45f};
    EXPECT_EQ(sum_abs(exact, 3), 6.0);
    EXPECT_EQ(dbits(sum_abs(exact, 0)), 0u);
    EXPECT_EQ(sum_abs(exact + 3, 2), static_cast<double>(1e-45f));  // a denormal survives
    const float huge[2] = {3.4e38f, 3.4e38f};
    EXPECT_EQ(sum_abs(huge, 2), 2.0 * static_cast<double>(3.4e38f));  // past FLT_MAX, exact
    const float with_nan[9] = {1, 2, 3, 4, 5, 6, 7, 8, -NAN};
    EXPECT_TRUE(std::isnan(sum_abs(with_nan, 9)));
  }
}

TEST(CodecKernels, MaxAbsPropagatesNaN) {
  for (std::size_t n : kCodecCounts) {
    const std::vector<float> v = awkward_floats(n + 1, n + 23);
    const float* in = v.data() + 1;
    float want = 0.0f;
    for (std::size_t i = 0; i < n; ++i) want = std::max(want, std::fabs(in[i]));
    for (bool scalar : paths()) {
      ScopedScalar mode(scalar);
      EXPECT_EQ(bits_of(max_abs(in, n)), bits_of(want)) << "n=" << n << " scalar=" << scalar;
    }
  }
  for (bool scalar : paths()) {
    ScopedScalar mode(scalar);
    std::vector<float> v(33, -0.0f);
    EXPECT_EQ(bits_of(max_abs(v.data(), v.size())), 0u) << "-0 gives +0";
    v[32] = -INFINITY;
    EXPECT_EQ(max_abs(v.data(), v.size()), INFINITY);
    for (std::size_t at : {std::size_t{0}, std::size_t{7}, std::size_t{31}, std::size_t{32}}) {
      std::vector<float> w(33, 1.0f);
      w[at] = std::bit_cast<float>(0xFF800001u);  // a signalling NaN with the sign set
      EXPECT_EQ(bits_of(max_abs(w.data(), w.size())), 0x7FC00000u) << at;
    }
  }
}

TEST(CodecKernels, FirstNonFiniteFindsTheFirstNaNOrInf) {
  for (std::size_t n : kCodecCounts) {
    std::vector<float> v = awkward_floats(n + 1, n + 29);  // finite: denormals, 3.4e38
    for (bool scalar : paths()) {
      ScopedScalar mode(scalar);
      EXPECT_EQ(first_non_finite(v.data() + 1, n), n);
      EXPECT_TRUE(all_finite(v.data() + 1, n));
    }
    for (std::size_t at : {std::size_t{0}, n / 2, n > 0 ? n - 1 : 0}) {
      if (at >= n) continue;
      for (float bad : {NAN, -NAN, INFINITY, -INFINITY, std::bit_cast<float>(0x7F800001u)}) {
        std::vector<float> w = v;
        w[at + 1] = bad;
        if (at + 2 < n + 1) w[n] = NAN;  // a later one must not win
        for (bool scalar : paths()) {
          ScopedScalar mode(scalar);
          EXPECT_EQ(first_non_finite(w.data() + 1, n), at) << "n=" << n << " scalar=" << scalar;
          EXPECT_FALSE(all_finite(w.data() + 1, n));
        }
      }
    }
  }
  const float edge[3] = {3.4028235e38f, -3.4028235e38f, std::bit_cast<float>(0x807FFFFFu)};
  EXPECT_TRUE(all_finite(edge, 3));
}

TEST(CodecKernels, SumFinishIsReduceScaleAndNarrowInOnePass) {
  for (std::size_t n : kCodecCounts) {
    std::vector<float> a = awkward_floats(n + 1, n + 7), b = awkward_floats(n + 1, n + 13);
    if (n > 4) {  // non-finite inputs and a sum that overflows: the first must be found
      a[n / 2 + 1] = INFINITY;
      b[n / 2 + 1] = -INFINITY;
      a[n / 3 + 1] = 3.4e38f;
      b[n / 3 + 1] = 3.4e38f;
      b[n - 1] = NAN;
    }
    if (n > 40) a[21] = 40000.0f, b[21] = 30000.0f;  // past float16's range only
    for (int divisor : {1, 3}) {
      for (DataType type : {DataType::kFloat32, DataType::kFloat16, DataType::kBFloat16}) {
        // The composed reference, on the scalar path.
        std::vector<float> sums(n + 1);
        std::vector<std::uint16_t> narrow(n);
        {
          ScopedScalar mode(true);
          reduce(sums.data() + 1, a.data() + 1, b.data() + 1, n, DataType::kFloat32,
                 ReduceOp::kSum);
          scale_for_average(sums.data() + 1, n, DataType::kFloat32, divisor);
          if (type != DataType::kFloat32) {
            float_to_16bit(sums.data() + 1, narrow.data(), n, type);
            float_from_16bit(narrow.data(), sums.data() + 1, n, type);
          }
        }
        std::size_t want_bad = n;
        for (std::size_t i = 0; i < n && want_bad == n; ++i) {
          if (!std::isfinite(sums[i + 1])) want_bad = i;
        }
        const std::size_t out_bytes = dtype_size(type);
        const void* want =
            type == DataType::kFloat32 ? static_cast<const void*>(sums.data() + 1) : narrow.data();
        for (bool scalar : paths()) {
          ScopedScalar mode(scalar);
          std::vector<unsigned char> got((n + 2) * out_bytes, 0xAB);
          const std::size_t bad =
              sum_finish(got.data() + out_bytes, type, a.data() + 1, b.data() + 1, n, divisor);
          const std::string where =
              "n=" + std::to_string(n) + " divisor=" + std::to_string(divisor) +
              " type=" + to_string(type) + " scalar=" + std::to_string(scalar);
          EXPECT_EQ(bad, want_bad) << where;
          EXPECT_EQ(0, std::memcmp(got.data() + out_bytes, want, n * out_bytes)) << where;
          for (std::size_t i = 0; i < out_bytes; ++i) {  // nothing written outside
            EXPECT_EQ(got[i], 0xAB) << where;
            EXPECT_EQ(got[(n + 1) * out_bytes + i], 0xAB) << where;
          }
          if (type == DataType::kFloat32) {  // dst aliasing a
            std::vector<float> in_place = a;
            sum_finish(in_place.data() + 1, type, in_place.data() + 1, b.data() + 1, n, divisor);
            EXPECT_EQ(0, std::memcmp(in_place.data() + 1, want, n * 4)) << where;
          } else {  // and widened again, streaming or not, as float_from_16bit does
            std::vector<float> wide(n + 1, 5.0f);
            float_from_16bit_streaming(narrow.data(), wide.data() + 1, n, type);
            EXPECT_EQ(0, std::memcmp(wide.data() + 1, sums.data() + 1, n * 4)) << where;
            EXPECT_EQ(wide[0], 5.0f);
          }
        }
      }
    }
  }
  float x = 1;
  for (const auto& [type, divisor, says] :
       {std::tuple{DataType::kFloat32, 0, "divisor must be >= 1, got 0"},
        std::tuple{DataType::kInt32, 1, "stores float32, float16 or bfloat16, not int32"}}) {
    try {
      sum_finish(&x, type, &x, &x, 1, divisor);
      ADD_FAILURE() << says;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  }
}

// ---------------------------------------------------------------- qsgd

// quantize_stochastic_int8_blocks as kernels.h specifies it, written out plainly (for calls
// below 2^32 elements: one hash step and offset from the key).
std::uint32_t ref_draw(std::uint64_t key, std::size_t i) {
  std::uint64_t z = key + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const std::uint32_t step = static_cast<std::uint32_t>(z) | 1u;
  std::uint32_t h = static_cast<std::uint32_t>(i) * step + static_cast<std::uint32_t>(z >> 32);
  h ^= h >> 16;
  h *= 0x21F0AAADu;
  h ^= h >> 15;
  h *= 0x735A2D97u;
  h ^= h >> 15;
  return h >> 8;  // u * 2^24
}

void ref_qsgd(const float* in, std::size_t n, std::size_t block, int levels, std::uint64_t key,
              float* scales, std::int8_t* q) {
  for (std::size_t b = 0; b * block < n; ++b) {
    const std::size_t lo = b * block, hi = std::min(n, lo + block);
    double lanes[32] = {};
    for (std::size_t i = lo; i < hi; ++i) {
      lanes[(i - lo) % 32] += static_cast<double>(in[i]) * static_cast<double>(in[i]);
    }
    for (std::size_t w = 16; w >= 1; w /= 2) {
      for (std::size_t j = 0; j < w; ++j) lanes[j] += lanes[j + w];
    }
    const double norm = std::sqrt(std::isnan(lanes[0]) ? NAN : lanes[0]);
    scales[b] = static_cast<float>(norm / levels);
    const double inverse = norm > 0 ? levels / norm : 0.0;
    const float pre = inverse > 0x1p100                   ? 0x1p64f
                      : inverse > 0 && inverse < 0x1p-100 ? 0x1p-64f
                                                          : 1;
    const auto post = static_cast<float>(inverse * 0x1p24 / pre);
    const float top = static_cast<float>(levels) * 0x1p24f;
    for (std::size_t i = lo; i < hi; ++i) {
      const float t = std::fabs(in[i]) * pre;
      float level = t * post;
      if (!(level < top)) level = top;
      const auto fixed = static_cast<std::uint32_t>(level);
      const int l = static_cast<int>(fixed >> 24) + (ref_draw(key, i) < (fixed & 0xFFFFFFu));
      q[i] = static_cast<std::int8_t>(std::signbit(in[i]) ? -l : l);
    }
  }
}

Quantized qsgd(const float* in, std::size_t n, std::size_t block, int levels, std::uint64_t key) {
  Quantized r{std::vector<float>((n + block - 1) / block + 1, -1.0f),
              std::vector<std::int8_t>(n + 1, 99)};
  quantize_stochastic_int8_blocks(in, n, block, levels, key, r.scales.data(), r.q.data());
  return r;
}

TEST(CodecKernels, QuantizeStochasticMatchesTheFormulaOnEveryPath) {
  for (std::size_t n : kCodecCounts) {
    std::vector<float> buf = awkward_floats(n + 1, n + 41);  // zeros, -0, denormals, 3.4e38
    const float* in = buf.data() + 1;                        // unaligned
    for (std::size_t block :
         {std::size_t{1}, std::size_t{3}, std::size_t{33}, std::size_t{64}, std::size_t{512}}) {
      for (int levels : {1, 4, 127}) {
        for (std::uint64_t key : {std::uint64_t{0}, std::uint64_t{1}, ~std::uint64_t{0}}) {
          const std::size_t nb = (n + block - 1) / block;
          std::vector<float> want_s(nb);
          std::vector<std::int8_t> want_q(n);
          ref_qsgd(in, n, block, levels, key, want_s.data(), want_q.data());
          for (bool scalar : paths()) {
            SCOPED_TRACE("n=" + std::to_string(n) + " block=" + std::to_string(block) +
                         " levels=" + std::to_string(levels) + " key=" + std::to_string(key) +
                         (scalar ? " scalar" : " vector"));
            ScopedScalar mode(scalar);
            const Quantized got = qsgd(in, n, block, levels, key);
            ASSERT_TRUE(same_floats(got.scales.data(), want_s.data(), nb));
            for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(got.q[i], want_q[i]) << "element " << i;
            EXPECT_EQ(got.scales[nb], -1.0f) << "wrote a scale past the last block";
            EXPECT_EQ(got.q[n], 99) << "wrote a value past count";
          }
        }
      }
    }
  }
}

// Both paths on a large gradient with every kind of value, NaN and Inf included (whose
// blocks have a NaN or Inf scale, and values that are still defined).
TEST(CodecKernels, QuantizeStochasticPathsAreBitIdentical) {
  std::vector<float> v = awkward_floats(100003, 3);
  std::mt19937 rng(4);
  for (std::size_t i = 0; i < 2000; ++i)
    v[rng() % v.size()] = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
  v[5] = NAN;
  v[700] = -INFINITY;
  v[1500] = std::bit_cast<float>(0xFF800001u);
  for (std::size_t block : {std::size_t{7}, std::size_t{512}, std::size_t{4096}}) {
    const Quantized want = [&] {
      ScopedScalar mode(true);
      return qsgd(v.data(), v.size(), block, 127, 99);
    }();
    const Quantized got = qsgd(v.data(), v.size(), block, 127, 99);
    ASSERT_TRUE(same_floats(got.scales.data(), want.scales.data(), want.scales.size()));
    ASSERT_EQ(got.q, want.q) << "block " << block;
    std::vector<float> want_s(want.scales.size() - 1);
    std::vector<std::int8_t> want_q(v.size());
    ref_qsgd(v.data(), v.size(), block, 127, 99, want_s.data(), want_q.data());
    ASSERT_TRUE(same_floats(got.scales.data(), want_s.data(), want_s.size()));
    ASSERT_TRUE(std::equal(want_q.begin(), want_q.end(), got.q.begin()));
  }
  for (bool scalar : paths()) {
    ScopedScalar mode(scalar);
    const float bad[4] = {1.0f, NAN, -INFINITY, -2.0f};
    const Quantized r = qsgd(bad, 4, 4, 5, 1);
    EXPECT_EQ(bits_of(r.scales[0]), 0x7FC00000u) << "the canonical NaN";
    const std::int8_t want[4] = {0, 5, -5, 0};
    for (int i = 0; i < 4; ++i) EXPECT_EQ(r.q[i], want[i]) << i;
    const float inf[2] = {INFINITY, 1.0f};
    EXPECT_EQ(qsgd(inf, 2, 2, 5, 1).scales[0], INFINITY);
  }
}

// The draw of element i depends on (key, i) only: a prefix quantised alone, in any number
// of blocks, gets the same values; another key gets other draws.
TEST(CodecKernels, QuantizeStochasticDrawsDependOnKeyAndIndexOnly) {
  std::vector<float> v(4096);
  std::mt19937 rng(8);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& x : v) x = normal(rng);
  for (bool scalar : paths()) {
    ScopedScalar mode(scalar);
    const Quantized all = qsgd(v.data(), v.size(), 64, 127, 5);
    for (std::size_t prefix : {std::size_t{64}, std::size_t{64 * 7}, std::size_t{4032}}) {
      const Quantized part = qsgd(v.data(), prefix, 64, 127, 5);
      ASSERT_TRUE(
          std::equal(part.q.begin(), part.q.begin() + static_cast<long>(prefix), all.q.begin()))
          << prefix;
    }
    EXPECT_EQ(qsgd(v.data(), v.size(), 64, 127, 5).q, all.q) << "same key: same values";
    std::size_t differ = 0;
    const Quantized other = qsgd(v.data(), v.size(), 64, 127, 6);
    for (std::size_t i = 0; i < v.size(); ++i) differ += other.q[i] != all.q[i];
    EXPECT_GT(differ, v.size() / 4) << "the next key draws afresh";
  }
}

// Zeros stay zero (also -0, also among denormals), a level with no fraction never rounds,
// and extreme norms still give finite scales and values within a step.
TEST(CodecKernels, QuantizeStochasticExtremes) {
  for (bool scalar : paths()) {
    ScopedScalar mode(scalar);
    for (std::uint64_t key = 0; key < 50; ++key) {
      // Norm 5, levels 5: the inverse is exactly 1, so every level is an integer.
      const float exact[4] = {3.0f, -4.0f, 0.0f, -0.0f};
      const Quantized e = qsgd(exact, 4, 4, 5, key);
      EXPECT_EQ(e.scales[0], 1.0f);
      EXPECT_EQ(e.q[0], 3);
      EXPECT_EQ(e.q[1], -4);
      EXPECT_EQ(e.q[2], 0);
      EXPECT_EQ(e.q[3], 0);
      // A single element is the whole norm: always the top level.
      const float one[3] = {-2.5e-3f, 7.0f, 0x1p-149f};
      const Quantized o = qsgd(one, 3, 1, 127, key);
      EXPECT_EQ(o.q[0], -127);
      EXPECT_EQ(o.q[1], 127);
      EXPECT_EQ(o.q[2], 127);
      EXPECT_EQ(o.scales[2], static_cast<float>(0x1p-149 / 127));
    }
    // Denormals (norm below levels * 2^-100): zeros stay zero, the rest decode within a step.
    std::vector<float> tiny(512, 0.0f);
    for (std::size_t i = 0; i < tiny.size(); i += 3) tiny[i] = i % 2 ? 1e-44f : -0x1p-149f;
    // Past FLT_MAX (norm above levels * 2^100): the scale is still finite.
    std::vector<float> huge(512, 3e38f);
    std::vector<float> mixed(512, 1e-30f);
    mixed[100] = -3.4e38f;
    mixed[101] = 0.0f;
    for (const auto* v : {&tiny, &huge, &mixed}) {
      for (int levels : {1, 127}) {
        for (std::uint64_t key = 0; key < 20; ++key) {
          const Quantized r = qsgd(v->data(), v->size(), 512, levels, key);
          ASSERT_TRUE(std::isfinite(r.scales[0]) || levels == 1) << levels;
          if (!std::isfinite(r.scales[0])) continue;  // levels 1: 512 x 3e38 / 1 overflows
          for (std::size_t i = 0; i < v->size(); ++i) {
            const float x = (*v)[i], got = static_cast<float>(r.q[i]) * r.scales[0];
            if (x == 0.0f) {
              ASSERT_EQ(r.q[i], 0) << i;
            }
            // A step, and the scale's own rounding (a denormal scale is coarse) per level.
            ASSERT_LE(std::fabs(static_cast<double>(got) - x),
                      r.scales[0] * 1.0001 + (levels + 1) * 0x1p-150)
                << i;
            ASSERT_LE(std::abs(r.q[i]), levels);
          }
        }
      }
    }
  }
}

// Unbiased in aggregate: over many keys the mean of q * scale converges to x for every
// element (within 5 standard deviations of the mean), and the spread of those means is what
// independent draws give: correlated draws across keys would not average out.
TEST(CodecKernels, QuantizeStochasticIsUnbiasedOverKeys) {
  const std::size_t n = 1000, block = 64, trials = 4000;
  const int levels = 4;  // coarse: levels near 1, every fraction is drawn
  std::vector<float> v(n);
  std::mt19937 rng(77);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& x : v) x = normal(rng);
  for (std::size_t i = 0; i < n; i += 37) v[i] = i % 2 ? 0.0f : -0.0f;
  for (bool scalar : paths()) {
    ScopedScalar mode(scalar);
    std::vector<double> mean(n, 0.0);
    Quantized first = qsgd(v.data(), n, block, levels, 0);
    for (std::size_t t = 0; t < trials; ++t) {
      const Quantized r = qsgd(v.data(), n, block, levels, t * 0x9E3779B97F4A7C15ull + 12345);
      for (std::size_t i = 0; i < n; ++i) {
        mean[i] += static_cast<double>(r.q[i]) * r.scales[i / block] / trials;
      }
    }
    double chi = 0;
    std::size_t dof = 0;
    for (std::size_t i = 0; i < n; ++i) {
      const double step = first.scales[i / block];
      const double level = std::fabs(v[i]) / step;
      const double frac = level - std::floor(level);
      const double sd = step * std::sqrt(frac * (1 - frac) / trials);
      // For a fraction near 0 or 1, rounding up (or down) is a rare event, which a few
      // occurrences more than expected do not make biased: allow 3 of them beyond 5 sd.
      ASSERT_LE(std::fabs(mean[i] - v[i]), 5 * sd + 3 * step / trials) << "element " << i;
      if (frac > 0.01 && frac < 0.99) {
        chi += (mean[i] - v[i]) * (mean[i] - v[i]) / (sd * sd);
        ++dof;
      }
    }
    ASSERT_GT(dof, n / 2);
    // chi / dof ~ 1 +- sqrt(2 / dof) for independent draws.
    EXPECT_NEAR(chi / static_cast<double>(dof), 1.0, 6 * std::sqrt(2.0 / static_cast<double>(dof)))
        << (scalar ? "scalar" : "vector");
  }
}

// Level 1/2 for every element (64 equal values, norm 8x, levels 4): each rounds up half the
// time, independently of its neighbours at lags 1, 8 (a vector) and 32 (an unrolled step).
TEST(CodecKernels, QuantizeStochasticDrawsLookIndependent) {
  const std::vector<float> v(64 * 256, -0.25f);
  for (bool scalar : paths()) {
    ScopedScalar mode(scalar);
    std::size_t up = 0, total = 0;
    std::size_t same[3] = {}, pairs[3] = {};
    const std::size_t lags[3] = {1, 8, 32};
    for (std::uint64_t key = 0; key < 40; ++key) {
      const Quantized r = qsgd(v.data(), v.size(), 64, 4, key);
      for (std::size_t i = 0; i < v.size(); ++i) {
        ASSERT_TRUE(r.q[i] == 0 || r.q[i] == -1) << int(r.q[i]);
        up += r.q[i] != 0;
        ++total;
        for (int k = 0; k < 3; ++k) {
          if (i + lags[k] < v.size()) {
            same[k] += r.q[i] == r.q[i + lags[k]];
            ++pairs[k];
          }
        }
      }
    }
    const double sd = 0.5 / std::sqrt(static_cast<double>(total));
    EXPECT_NEAR(static_cast<double>(up) / total, 0.5, 5 * sd);
    for (int k = 0; k < 3; ++k) {
      EXPECT_NEAR(static_cast<double>(same[k]) / pairs[k], 0.5, 5 * sd) << "lag " << lags[k];
    }
  }
}

TEST(CodecKernels, InvalidArgumentsThrow) {
  float x[1] = {1.0f}, s[1];
  std::int8_t q[1];
  EXPECT_THROW(quantize_int8_blocks(x, 1, 0, s, q), Error);
  EXPECT_THROW(dequantize_int8_blocks(q, s, 1, 0, x), Error);
  EXPECT_THROW(dequantize_int8_blocks_add(q, s, 1, 0, x), Error);
  EXPECT_THROW(quantize_int8_blocks(nullptr, 1, 4, s, q), Error);
  EXPECT_THROW(pack_signs(x, 1, nullptr), Error);
  EXPECT_THROW(unpack_signs_scaled(nullptr, 1, 1.0f, x, false), Error);
  EXPECT_THROW(sum_abs(nullptr, 1), Error);
  EXPECT_THROW(first_non_finite(nullptr, 1), Error);
  EXPECT_THROW(quantize_stochastic_int8_blocks(x, 1, 0, 4, 0, s, q), Error);
  EXPECT_THROW(quantize_stochastic_int8_blocks(x, 1, 4, 0, 0, s, q), Error);
  EXPECT_THROW(quantize_stochastic_int8_blocks(x, 1, 4, 128, 0, s, q), Error);
  EXPECT_THROW(quantize_stochastic_int8_blocks(x, 1, 4, 4, 0, nullptr, q), Error);
  EXPECT_THROW(quantize_stochastic_int8_blocks(x, 1, 4, 4, 0, s, nullptr), Error);
  // Zero count accepts null everywhere.
  quantize_stochastic_int8_blocks(nullptr, 0, 4, 4, 0, nullptr, nullptr);
  quantize_int8_blocks(nullptr, 0, 4, nullptr, nullptr);
  dequantize_int8_blocks_add(nullptr, nullptr, 0, 4, nullptr);
  pack_signs(nullptr, 0, nullptr);
  unpack_signs_scaled(nullptr, 0, 1.0f, nullptr, true);
  EXPECT_EQ(sum_abs(nullptr, 0), 0.0f);
  EXPECT_EQ(max_abs(nullptr, 0), 0.0f);
  EXPECT_TRUE(all_finite(nullptr, 0));
}

}  // namespace
}  // namespace gradsync::kernels
