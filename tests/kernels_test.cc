// Kernels: every dtype x op against an independent reference, scalar vs AVX2 bit identity,
// awkward counts, unaligned and aliased buffers, conversions (exhaustive over 16-bit
// values, ties-to-even), integer wrap-around and averaging. The gradient codecs' kernels are
// codec_kernels_test.cc's.
#include "kernels/kernels.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gradsync/error.h"
#include "kernel_paths.h"

namespace gradsync::kernels {
namespace {

constexpr DataType kAllTypes[] = {DataType::kFloat32,  DataType::kFloat64, DataType::kFloat16,
                                  DataType::kBFloat16, DataType::kInt32,   DataType::kInt64,
                                  DataType::kUInt8,    DataType::kInt8,    DataType::kInt16,
                                  DataType::kBool};
// Loops over both skip the pairs !dtype_op_valid refuses (a bitwise op on a float type).
constexpr ReduceOp kAllOps[] = {ReduceOp::kSum,  ReduceOp::kAvg,  ReduceOp::kMin, ReduceOp::kMax,
                                ReduceOp::kProd, ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor};
constexpr std::size_t kCounts[] = {0, 1, 7, 8, 9, 31, 33, 1000003};

// ---------------------------------------------------------------- independent reference

// Value of a 16-bit float with `mbits` mantissa bits and bias `bias` (non-NaN, non-Inf
// patterns; the first Inf pattern decodes as the next power of two, which is what the
// rounding search needs as its upper neighbour).
double decode16(std::uint16_t mag, int mbits, int bias) {
  const int e = mag >> mbits;
  const int m = mag & ((1 << mbits) - 1);
  if (e == 0) return std::ldexp(m, 1 - bias - mbits);
  return std::ldexp((1 << mbits) + m, e - bias - mbits);
}

struct Format16 {
  int mbits, bias;
  std::uint16_t inf;        // magnitude bits of +Inf
  std::vector<double> val;  // val[k] = value of magnitude k for k in [0, inf]
  Format16(int m, int b, std::uint16_t i) : mbits(m), bias(b), inf(i) {
    for (std::uint32_t k = 0; k <= inf; ++k)
      val.push_back(decode16(static_cast<std::uint16_t>(k), m, b));
  }
};
const Format16& half_fmt() {
  static const Format16 f(10, 15, 0x7C00);
  return f;
}
const Format16& bf16_fmt() {
  static const Format16 f(7, 127, 0x7F80);
  return f;
}

// Nearest value by search over the sorted table; ties pick the even pattern.
std::uint16_t ref_encode(float f, const Format16& fmt) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  if (std::isnan(f)) {
    if (fmt.mbits == 10)
      return static_cast<std::uint16_t>(sign | 0x7E00u | ((bits >> 13) & 0x3FFu));
    return static_cast<std::uint16_t>((bits >> 16) | 0x40u);
  }
  const double x = std::fabs(static_cast<double>(f));
  if (x >= fmt.val.back()) return static_cast<std::uint16_t>(sign | fmt.inf);
  const auto it = std::upper_bound(fmt.val.begin(), fmt.val.end(), x);
  const auto hi = static_cast<std::uint16_t>(it - fmt.val.begin());
  const auto lo = static_cast<std::uint16_t>(hi - 1);
  if (fmt.val[lo] == x) return static_cast<std::uint16_t>(sign | lo);
  const double dlo = x - fmt.val[lo], dhi = fmt.val[hi] - x;
  std::uint16_t pick = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) == 0 ? lo : hi);
  return static_cast<std::uint16_t>(sign | pick);
}

float ref_decode(std::uint16_t h, const Format16& fmt) {
  const std::uint16_t mag = h & 0x7FFFu;
  const bool neg = (h & 0x8000u) != 0;
  if (mag > fmt.inf) return std::numeric_limits<float>::quiet_NaN();  // caller checks bits
  const double v = mag == fmt.inf ? std::numeric_limits<double>::infinity() : fmt.val[mag];
  return static_cast<float>(neg ? -v : v);
}

template <class F>
F canonical_nan() {
  if constexpr (sizeof(F) == 4)
    return std::bit_cast<F>(0x7FC00000u);
  else
    return std::bit_cast<F>(0x7FF8000000000000ull);
}

template <class F>
F ref_float(F a, F b, ReduceOp op) {
  F r{};
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      r = a + b;
      break;
    case ReduceOp::kProd:
      r = a * b;
      break;
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      ADD_FAILURE() << "bitwise op on a float type";
      return F{};
    case ReduceOp::kMin:
    case ReduceOp::kMax:
      if (std::isnan(a) || std::isnan(b)) return canonical_nan<F>();
      if (a == b) {  // equal values; only {-0,+0} can differ in bits
        const bool neg = std::signbit(a) && std::signbit(b);
        const bool any_neg = std::signbit(a) || std::signbit(b);
        return (op == ReduceOp::kMin ? any_neg : neg) ? -std::fabs(a) : std::fabs(a);
      }
      r = op == ReduceOp::kMin ? std::min(a, b) : std::max(a, b);
      break;
  }
  return std::isnan(r) ? canonical_nan<F>() : r;
}

template <class T>
T ref_int(T a, T b, ReduceOp op) {
  using U = std::make_unsigned_t<T>;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    case ReduceOp::kProd: {
      // Compute in 64-bit unsigned and truncate: the low bits of a product do not depend
      // on the width it is computed in.
      const std::uint64_t p = static_cast<std::uint64_t>(static_cast<U>(a)) * static_cast<U>(b);
      return static_cast<T>(static_cast<U>(p));
    }
    case ReduceOp::kMin:
      return std::min(a, b);
    case ReduceOp::kMax:
      return std::max(a, b);
    case ReduceOp::kBand:
      return static_cast<T>(a & b);
    case ReduceOp::kBor:
      return static_cast<T>(a | b);
    case ReduceOp::kBxor:
      return static_cast<T>(a ^ b);
  }
  return T{};
}

// bool: any nonzero byte is true; the result is 0 or 1.
std::uint8_t ref_bool(std::uint8_t a, std::uint8_t b, ReduceOp op) {
  const bool x = a != 0, y = b != 0;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
    case ReduceOp::kMax:
    case ReduceOp::kBor:
      return x || y;
    case ReduceOp::kProd:
    case ReduceOp::kMin:
    case ReduceOp::kBand:
      return x && y;
    case ReduceOp::kBxor:
      return x != y;
  }
  return 0;
}

template <class T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class T>
void store(unsigned char* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

void ref_elem(DataType t, ReduceOp op, const unsigned char* a, const unsigned char* b,
              unsigned char* out) {
  switch (t) {
    case DataType::kFloat32:
      return store(out, ref_float(load<float>(a), load<float>(b), op));
    case DataType::kFloat64:
      return store(out, ref_float(load<double>(a), load<double>(b), op));
    case DataType::kFloat16:
    case DataType::kBFloat16: {
      const Format16& fmt = t == DataType::kFloat16 ? half_fmt() : bf16_fmt();
      const float r = ref_float(ref_decode(load<std::uint16_t>(a), fmt),
                                ref_decode(load<std::uint16_t>(b), fmt), op);
      return store(out, ref_encode(r, fmt));
    }
    case DataType::kInt32:
      return store(out, ref_int(load<std::int32_t>(a), load<std::int32_t>(b), op));
    case DataType::kInt64:
      return store(out, ref_int(load<std::int64_t>(a), load<std::int64_t>(b), op));
    case DataType::kUInt8:
      return store(out, ref_int(load<std::uint8_t>(a), load<std::uint8_t>(b), op));
    case DataType::kInt8:
      return store(out, ref_int(load<std::int8_t>(a), load<std::int8_t>(b), op));
    case DataType::kInt16:
      return store(out, ref_int(load<std::int16_t>(a), load<std::int16_t>(b), op));
    case DataType::kBool:
      return store(out, ref_bool(load<std::uint8_t>(a), load<std::uint8_t>(b), op));
  }
}

// ---------------------------------------------------------------- data

// A buffer whose data() is a 64-byte aligned address plus `offset_bytes`, so an offset of
// one element makes every vector access unaligned.
class Buffer {
 public:
  Buffer(std::size_t bytes, std::size_t offset_bytes) : raw_(bytes + 128) {
    auto base = reinterpret_cast<std::uintptr_t>(raw_.data());
    base = (base + 63) & ~std::uintptr_t{63};
    p_ = reinterpret_cast<unsigned char*>(base) + offset_bytes;
  }
  unsigned char* data() { return p_; }

 private:
  std::vector<unsigned char> raw_;
  unsigned char* p_;
};

std::vector<std::uint64_t> specials(DataType t) {
  switch (t) {
    case DataType::kFloat32:
      return {0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000,
              0x7FC00001, 0x7F800001, 0xFFA5A5A5, 0x7FFFFFFF, 0x00000001, 0x80000001,
              0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000, 0xBF800000};
    case DataType::kFloat64:
      return {0x0000000000000000, 0x8000000000000000, 0x7FF0000000000000, 0xFFF0000000000000,
              0x7FF8000000000000, 0xFFF8000000000000, 0x7FF8000000000001, 0x7FF0000000000001,
              0xFFFDEADBEEF00000, 0x0000000000000001, 0x800FFFFFFFFFFFFF, 0x7FEFFFFFFFFFFFFF,
              0x3FF0000000000000, 0xBFF0000000000000};
    case DataType::kFloat16:
      return {0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE00, 0x7C01, 0x7E55, 0xFDFF,
              0x0001, 0x8001, 0x03FF, 0x0400, 0x7BFF, 0xFBFF, 0x3C00, 0xBC00};
    case DataType::kBFloat16:
      return {0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0x7FD5, 0xFFBF,
              0x0001, 0x8001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80};
    case DataType::kInt32:
      return {0, 1, 0xFFFFFFFF, 0x7FFFFFFF, 0x80000000, 2, 0xFFFFFFFE};
    case DataType::kInt64:
      return {0,           1,         0xFFFFFFFFFFFFFFFF, 0x7FFFFFFFFFFFFFFF, 0x8000000000000000,
              0x100000000, 0xFFFFFFFF};
    case DataType::kUInt8:
    case DataType::kInt8:
      return {0, 1, 2, 127, 128, 255, 16};
    case DataType::kInt16:
      return {0, 1, 2, 0x7FFF, 0x8000, 0xFFFF, 0x00FF, 0xFF00};
    case DataType::kBool:  // mostly 0 and 1; a stray other byte still counts as true
      return {0, 1, 0, 1, 0, 1, 2, 255};
  }
  return {};
}

// Mix of raw random bits (NaN payloads, denormals), special values and small numbers, so
// equal pairs, {-0,+0} pairs and NaN pairs with different payloads all occur.
void fill(DataType t, unsigned char* p, std::size_t n, std::mt19937_64& rng) {
  const std::size_t sz = dtype_size(t);
  const auto sp = specials(t);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t r = rng();
    std::uint64_t v = rng();
    switch (r % 4) {
      case 0:
        v = sp[(r >> 8) % sp.size()];
        break;
      case 1: {  // small value with few bits, so sums and products stay in range
        const int k = static_cast<int>((r >> 8) % 17) - 8;
        switch (t) {
          case DataType::kFloat32:
            v = std::bit_cast<std::uint32_t>(static_cast<float>(k));
            break;
          case DataType::kFloat64:
            v = std::bit_cast<std::uint64_t>(static_cast<double>(k));
            break;
          case DataType::kFloat16:
            v = ref_encode(static_cast<float>(k), half_fmt());
            break;
          case DataType::kBFloat16:
            v = ref_encode(static_cast<float>(k), bf16_fmt());
            break;
          default:
            v = static_cast<std::uint64_t>(static_cast<std::int64_t>(k));
            break;
        }
        break;
      }
      default:
        break;  // raw bits
    }
    std::memcpy(p + i * sz, &v, sz);  // little-endian: low bytes
  }
}

std::string hex(const unsigned char* p, std::size_t sz) {
  std::uint64_t v = 0;
  std::memcpy(&v, p, sz);
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%0*llx", static_cast<int>(sz * 2),
                static_cast<unsigned long long>(v));
  return buf;
}

// Compares n elements bitwise; reports only the first mismatch.
::testing::AssertionResult same_bits(const unsigned char* got, const unsigned char* want,
                                     std::size_t n, std::size_t sz,
                                     const unsigned char* a = nullptr,
                                     const unsigned char* b = nullptr) {
  for (std::size_t i = 0; i < n; ++i) {
    if (std::memcmp(got + i * sz, want + i * sz, sz) != 0) {
      auto f = ::testing::AssertionFailure();
      f << "element " << i << " of " << n << ": got " << hex(got + i * sz, sz) << " want "
        << hex(want + i * sz, sz);
      if (a != nullptr) f << " (a " << hex(a + i * sz, sz) << ", b " << hex(b + i * sz, sz) << ")";
      return f;
    }
  }
  return ::testing::AssertionSuccess();
}

std::string label(DataType t, ReduceOp op, std::size_t n, bool scalar) {
  return std::string(to_string(t)) + " " + to_string(op) + " n=" + std::to_string(n) +
         (scalar ? " scalar" : " vector");
}

// ---------------------------------------------------------------- reductions

TEST(Kernels, ReduceMatchesReferenceEveryDtypeOpCountAndPath) {
  std::mt19937_64 rng(42);
  for (DataType t : kAllTypes) {
    const std::size_t sz = dtype_size(t);
    for (std::size_t n : kCounts) {
      // Offset by one element: no buffer is 32-byte aligned.
      Buffer a(n * sz, sz), b(n * sz, sz), want(n * sz, 0), got(n * sz, sz), dst(n * sz, sz);
      fill(t, a.data(), n, rng);
      fill(t, b.data(), n, rng);
      for (ReduceOp op : kAllOps) {
        if (!dtype_op_valid(t, op)) continue;
        for (std::size_t i = 0; i < n; ++i) {
          ref_elem(t, op, a.data() + i * sz, b.data() + i * sz, want.data() + i * sz);
        }
        for (bool scalar : paths()) {
          SCOPED_TRACE(label(t, op, n, scalar));
          ScopedScalar mode(scalar);
          reduce(got.data(), a.data(), b.data(), n, t, op);
          ASSERT_TRUE(same_bits(got.data(), want.data(), n, sz, a.data(), b.data()));
          reduce(got.data(), b.data(), a.data(), n, t, op);  // commutative bit for bit
          ASSERT_TRUE(same_bits(got.data(), want.data(), n, sz, b.data(), a.data()));
          if (n > 0) std::memcpy(dst.data(), a.data(), n * sz);
          reduce_into(dst.data(), b.data(), n, t, op);
          ASSERT_TRUE(same_bits(dst.data(), want.data(), n, sz));
        }
      }
    }
  }
}

TEST(Kernels, ScalarAndVectorPathsAreBitIdentical) {
  if (!have_vector_path()) GTEST_SKIP() << "no AVX2/F16C on this CPU";
  std::mt19937_64 rng(7);
  const std::size_t n = 100003;
  for (DataType t : kAllTypes) {
    const std::size_t sz = dtype_size(t);
    Buffer a(n * sz, 0), b(n * sz, 0), s(n * sz, 0), v(n * sz, 0);
    fill(t, a.data(), n, rng);
    fill(t, b.data(), n, rng);
    for (ReduceOp op : kAllOps) {
      if (!dtype_op_valid(t, op)) continue;
      SCOPED_TRACE(std::string(to_string(t)) + " " + to_string(op));
      {
        ScopedScalar mode(true);
        reduce(s.data(), a.data(), b.data(), n, t, op);
      }
      reduce(v.data(), a.data(), b.data(), n, t, op);
      ASSERT_TRUE(same_bits(v.data(), s.data(), n, sz, a.data(), b.data()));
    }
    for (int divisor : {2, 3, 7, 1000}) {
      SCOPED_TRACE(std::string(to_string(t)) + " / " + std::to_string(divisor));
      std::memcpy(s.data(), a.data(), n * sz);
      std::memcpy(v.data(), a.data(), n * sz);
      {
        ScopedScalar mode(true);
        scale_for_average(s.data(), n, t, divisor);
      }
      scale_for_average(v.data(), n, t, divisor);
      ASSERT_TRUE(same_bits(v.data(), s.data(), n, sz, a.data(), a.data()));
    }
  }
}

TEST(Kernels, DstMayAliasEitherInput) {
  std::mt19937_64 rng(3);
  for (DataType t : kAllTypes) {
    const std::size_t sz = dtype_size(t);
    for (std::size_t n : {std::size_t{1}, std::size_t{33}, std::size_t{4099}}) {
      Buffer a(n * sz, sz), b(n * sz, sz), want(n * sz, 0), x(n * sz, sz);
      fill(t, a.data(), n, rng);
      fill(t, b.data(), n, rng);
      for (ReduceOp op : kAllOps) {
        if (!dtype_op_valid(t, op)) continue;
        for (std::size_t i = 0; i < n; ++i) {
          ref_elem(t, op, a.data() + i * sz, b.data() + i * sz, want.data() + i * sz);
        }
        for (bool scalar : paths()) {
          SCOPED_TRACE(label(t, op, n, scalar));
          ScopedScalar mode(scalar);
          std::memcpy(x.data(), a.data(), n * sz);
          reduce(x.data(), x.data(), b.data(), n, t, op);  // dst == a
          ASSERT_TRUE(same_bits(x.data(), want.data(), n, sz));
          std::memcpy(x.data(), b.data(), n * sz);
          reduce(x.data(), a.data(), x.data(), n, t, op);  // dst == b
          ASSERT_TRUE(same_bits(x.data(), want.data(), n, sz));
        }
      }
    }
  }
}

TEST(Kernels, FloatNanAndSignedZeroRules) {
  const float nan1 = std::bit_cast<float>(0x7FC00001u);
  const float nan2 = std::bit_cast<float>(0xFFC12345u);
  const auto bits = [](float f) { return std::bit_cast<std::uint32_t>(f); };
  for (bool scalar : paths()) {
    ScopedScalar mode(scalar);
    for (ReduceOp op : kAllOps) {
      if (!dtype_op_valid(DataType::kFloat32, op)) continue;
      float x[2] = {nan1, nan2}, y[2] = {nan2, 1.0f}, r[2];
      reduce(r, x, y, 2, DataType::kFloat32, op);
      EXPECT_EQ(bits(r[0]), 0x7FC00000u) << to_string(op);
      EXPECT_EQ(bits(r[1]), 0x7FC00000u) << to_string(op);
    }
    float z[2] = {-0.0f, 0.0f}, w[2] = {0.0f, -0.0f}, r[2];
    reduce(r, z, w, 2, DataType::kFloat32, ReduceOp::kMin);
    EXPECT_EQ(bits(r[0]), 0x80000000u);
    EXPECT_EQ(bits(r[1]), 0x80000000u);
    reduce(r, z, w, 2, DataType::kFloat32, ReduceOp::kMax);
    EXPECT_EQ(bits(r[0]), 0u);
    EXPECT_EQ(bits(r[1]), 0u);
    // Inf - Inf is NaN; canonical too.
    float inf[1] = {INFINITY}, ninf[1] = {-INFINITY};
    reduce(r, inf, ninf, 1, DataType::kFloat32, ReduceOp::kSum);
    EXPECT_EQ(bits(r[0]), 0x7FC00000u);
    std::uint16_t h[1] = {0x7C01}, g[1] = {0xFE00}, hr[1];
    reduce(hr, h, g, 1, DataType::kFloat16, ReduceOp::kMax);
    EXPECT_EQ(hr[0], 0x7E00u);
    std::uint16_t bh[1] = {0x7F81}, bg[1] = {0xFFC5};
    reduce(hr, bh, bg, 1, DataType::kBFloat16, ReduceOp::kSum);
    EXPECT_EQ(hr[0], 0x7FC0u);
  }
}

TEST(Kernels, IntegerArithmeticWraps) {
  for (bool scalar : paths()) {
    ScopedScalar mode(scalar);
    constexpr std::size_t n = 9;  // one vector plus a tail
    std::int32_t a32[n], b32[n], r32[n];
    std::int64_t a64[n], b64[n], r64[n];
    std::uint8_t a8[n], b8[n], r8[n];
    for (std::size_t i = 0; i < n; ++i) {
      a32[i] = std::numeric_limits<std::int32_t>::max();
      b32[i] = 1;
      a64[i] = std::numeric_limits<std::int64_t>::max();
      b64[i] = 1;
      a8[i] = 200;
      b8[i] = 100;
    }
    reduce(r32, a32, b32, n, DataType::kInt32, ReduceOp::kSum);
    reduce(r64, a64, b64, n, DataType::kInt64, ReduceOp::kSum);
    reduce(r8, a8, b8, n, DataType::kUInt8, ReduceOp::kSum);
    for (std::size_t i = 0; i < n; ++i) {
      EXPECT_EQ(r32[i], std::numeric_limits<std::int32_t>::min());
      EXPECT_EQ(r64[i], std::numeric_limits<std::int64_t>::min());
      EXPECT_EQ(r8[i], 44);
    }
    for (std::size_t i = 0; i < n; ++i) {
      a32[i] = 65536;
      b32[i] = 65537;  // 2^32 + 2^16 wraps to 65536
      a64[i] = std::int64_t{1} << 40;
      b64[i] = (std::int64_t{1} << 30) + 3;  // 2^70 + 3*2^40 wraps to 3*2^40
      a8[i] = 16;
      b8[i] = 17;  // 272 wraps to 16
    }
    reduce(r32, a32, b32, n, DataType::kInt32, ReduceOp::kProd);
    reduce(r64, a64, b64, n, DataType::kInt64, ReduceOp::kProd);
    reduce(r8, a8, b8, n, DataType::kUInt8, ReduceOp::kProd);
    for (std::size_t i = 0; i < n; ++i) {
      EXPECT_EQ(r32[i], 65536);
      EXPECT_EQ(r64[i], std::int64_t{3} << 40);
      EXPECT_EQ(r8[i], 16);
    }
    a64[0] = -5;  // signed compare, not unsigned
    b64[0] = 3;
    reduce(r64, a64, b64, 1, DataType::kInt64, ReduceOp::kMin);
    EXPECT_EQ(r64[0], -5);
    reduce(r64, a64, b64, 1, DataType::kInt64, ReduceOp::kMax);
    EXPECT_EQ(r64[0], 3);
  }
}

// ---------------------------------------------------------------- averaging

TEST(Kernels, ScaleForAverageIsTrueDivision) {
  std::mt19937_64 rng(11);
  for (DataType t : kAllTypes) {
    const std::size_t sz = dtype_size(t);
    for (std::size_t n : {std::size_t{1}, std::size_t{9}, std::size_t{33}, std::size_t{10007}}) {
      for (int divisor : {1, 2, 3, 5, 8, 255, 1000}) {
        Buffer src(n * sz, sz), want(n * sz, 0), got(n * sz, sz);
        fill(t, src.data(), n, rng);
        for (std::size_t i = 0; i < n && divisor == 1; ++i) {  // 1 leaves data untouched
          std::memcpy(want.data() + i * sz, src.data() + i * sz, sz);
        }
        for (std::size_t i = 0; i < n && divisor != 1; ++i) {
          const unsigned char* s = src.data() + i * sz;
          unsigned char* w = want.data() + i * sz;
          switch (t) {
            case DataType::kFloat32:
              store(w, load<float>(s) / static_cast<float>(divisor));
              break;
            case DataType::kFloat64:
              store(w, load<double>(s) / divisor);
              break;
            case DataType::kFloat16:
            case DataType::kBFloat16: {
              const Format16& fmt = t == DataType::kFloat16 ? half_fmt() : bf16_fmt();
              const std::uint16_t h = load<std::uint16_t>(s);
              if ((h & 0x7FFF) > fmt.inf) {  // NaN stays the same NaN, quieted
                store(w, static_cast<std::uint16_t>(h | (fmt.mbits == 10 ? 0x200 : 0x40)));
              } else {
                store(w, ref_encode(ref_decode(h, fmt) / static_cast<float>(divisor), fmt));
              }
              break;
            }
            case DataType::kInt32:
              store(w, static_cast<std::int32_t>(load<std::int32_t>(s) / divisor));
              break;
            case DataType::kInt64:
              store(w, static_cast<std::int64_t>(load<std::int64_t>(s) / divisor));
              break;
            case DataType::kUInt8:
            case DataType::kBool:
              store(w, static_cast<std::uint8_t>(load<std::uint8_t>(s) / divisor));
              break;
            case DataType::kInt8:
              store(w, static_cast<std::int8_t>(load<std::int8_t>(s) / divisor));
              break;
            case DataType::kInt16:
              store(w, static_cast<std::int16_t>(load<std::int16_t>(s) / divisor));
              break;
          }
        }
        for (bool scalar : paths()) {
          SCOPED_TRACE(std::string(to_string(t)) + " n=" + std::to_string(n) + " / " +
                       std::to_string(divisor) + (scalar ? " scalar" : " vector"));
          ScopedScalar mode(scalar);
          std::memcpy(got.data(), src.data(), n * sz);
          scale_for_average(got.data(), n, t, divisor);
          // Float NaNs divided keep their (quieted) payload; compare NaN-ness there.
          if (t == DataType::kFloat32 || t == DataType::kFloat64) {
            for (std::size_t i = 0; i < n; ++i) {
              const bool gn = t == DataType::kFloat32
                                  ? std::isnan(load<float>(got.data() + i * sz))
                                  : std::isnan(load<double>(got.data() + i * sz));
              if (gn) std::memcpy(want.data() + i * sz, got.data() + i * sz, sz);
            }
          }
          ASSERT_TRUE(same_bits(got.data(), want.data(), n, sz, src.data(), src.data()));
        }
      }
    }
  }
}

TEST(Kernels, AverageOfIntegerValuedSumsIsExact) {
  // The collective flow: sum N ranks' contributions, then divide by N.
  for (bool scalar : paths()) {
    ScopedScalar mode(scalar);
    std::vector<float> acc(37, 0.0f), contrib(37);
    const int ranks = 3;
    for (int r = 0; r < ranks; ++r) {
      for (std::size_t i = 0; i < acc.size(); ++i) contrib[i] = static_cast<float>(i + r);
      reduce_into(acc.data(), contrib.data(), acc.size(), DataType::kFloat32, ReduceOp::kAvg);
    }
    scale_for_average(acc.data(), acc.size(), DataType::kFloat32, ranks);
    for (std::size_t i = 0; i < acc.size(); ++i) {
      EXPECT_EQ(acc[i], static_cast<float>(3 * i + 3) / 3.0f);
    }
    std::int32_t v[3] = {-7, 7, std::numeric_limits<std::int32_t>::min()};
    scale_for_average(v, 3, DataType::kInt32, 2);
    EXPECT_EQ(v[0], -3);  // truncates toward zero
    EXPECT_EQ(v[1], 3);
    EXPECT_EQ(v[2], std::numeric_limits<std::int32_t>::min() / 2);
    std::uint8_t u[2] = {255, 7};
    scale_for_average(u, 2, DataType::kUInt8, 2);
    EXPECT_EQ(u[0], 127);
    EXPECT_EQ(u[1], 3);
  }
}

// ---------------------------------------------------------------- conversions

TEST(Kernels, EveryHalfRoundTripsThroughFloat) {
  std::vector<std::uint16_t> all(65536), back(65536), back_scalar(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<std::uint16_t>(i);
  std::vector<float> f(65536), f_scalar(65536);
  half_to_float(all.data(), f.data(), all.size());
  float_to_half(f.data(), back.data(), f.size());
  {
    ScopedScalar mode(true);
    half_to_float(all.data(), f_scalar.data(), all.size());
    float_to_half(f_scalar.data(), back_scalar.data(), f_scalar.size());
  }
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<std::uint16_t>(i);
    const bool nan = (h & 0x7FFF) > 0x7C00;
    const std::uint32_t fb = std::bit_cast<std::uint32_t>(f[i]);
    ASSERT_EQ(fb, std::bit_cast<std::uint32_t>(f_scalar[i]))
        << "half " << hex(reinterpret_cast<const unsigned char*>(&h), 2);
    ASSERT_EQ(fb, std::bit_cast<std::uint32_t>(half_to_float(h)));
    if (nan) {
      // Quiet NaN with the sign and payload kept.
      ASSERT_EQ(fb, (static_cast<std::uint32_t>(h & 0x8000) << 16) | 0x7FC00000u |
                        (static_cast<std::uint32_t>(h & 0x3FF) << 13));
      ASSERT_EQ(back[i], h | 0x200) << i;
    } else {
      const float want = ref_decode(h, half_fmt());
      ASSERT_EQ(fb, std::bit_cast<std::uint32_t>(want)) << i;
      ASSERT_EQ(back[i], h) << i;  // exact, including -0 and subnormals
    }
    ASSERT_EQ(back_scalar[i], back[i]) << i;
    ASSERT_EQ(float_to_half(f[i]), back[i]) << i;
  }
}

TEST(Kernels, EveryBFloat16RoundTripsThroughFloat) {
  std::vector<std::uint16_t> all(65536), back(65536), back_scalar(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<std::uint16_t>(i);
  std::vector<float> f(65536), f_scalar(65536);
  bfloat16_to_float(all.data(), f.data(), all.size());
  float_to_bfloat16(f.data(), back.data(), f.size());
  {
    ScopedScalar mode(true);
    bfloat16_to_float(all.data(), f_scalar.data(), all.size());
    float_to_bfloat16(f_scalar.data(), back_scalar.data(), f_scalar.size());
  }
  for (std::uint32_t i = 0; i < 65536; ++i) {
    const auto h = static_cast<std::uint16_t>(i);
    const std::uint32_t fb = std::bit_cast<std::uint32_t>(f[i]);
    ASSERT_EQ(fb, i << 16) << i;  // widening is exact for every pattern, NaN included
    ASSERT_EQ(std::bit_cast<std::uint32_t>(f_scalar[i]), fb) << i;
    const bool nan = (h & 0x7FFF) > 0x7F80;
    ASSERT_EQ(back[i], nan ? (h | 0x40) : h) << i;
    ASSERT_EQ(back_scalar[i], back[i]) << i;
  }
}

// Floats whose high 16 bits take every value and whose low bits sit on and around the
// rounding points of both formats (half rounds away 13 bits, bf16 16 bits), plus random.
std::vector<float> rounding_probe_floats() {
  std::vector<float> v;
  std::mt19937 rng(5);
  const std::uint32_t lows[] = {0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x1FFF,
                                0x2000, 0x3000, 0x7FFF, 0x8000, 0x8001, 0xFFFF};
  for (std::uint32_t hi = 0; hi < 65536; ++hi) {
    for (std::uint32_t lo : lows) v.push_back(std::bit_cast<float>((hi << 16) | lo));
    v.push_back(std::bit_cast<float>((hi << 16) | static_cast<std::uint32_t>(rng() & 0xFFFF)));
  }
  return v;
}

TEST(Kernels, FloatToHalfRoundsToNearestEven) {
  const auto h = [](std::uint32_t bits) { return float_to_half(std::bit_cast<float>(bits)); };
  EXPECT_EQ(float_to_half(1.0f + 0x1p-11f), 0x3C00u);             // tie: down to even 1.0
  EXPECT_EQ(float_to_half(1.0f + 3 * 0x1p-11f), 0x3C02u);         // tie: up to even
  EXPECT_EQ(float_to_half(1.0f + 0x1p-11f + 0x1p-20f), 0x3C01u);  // above tie: up
  EXPECT_EQ(float_to_half(65504.0f), 0x7BFFu);
  EXPECT_EQ(float_to_half(65519.99f), 0x7BFFu);
  EXPECT_EQ(float_to_half(65520.0f), 0x7C00u);  // tie between max and 2^16: Inf (even)
  EXPECT_EQ(float_to_half(-1e10f), 0xFC00u);
  EXPECT_EQ(float_to_half(0x1p-25f), 0x0000u);  // tie between 0 and 2^-24
  EXPECT_EQ(float_to_half(0x1p-25f * 1.0000001f), 0x0001u);
  EXPECT_EQ(float_to_half(3 * 0x1p-25f), 0x0002u);  // tie 1 vs 2 ulps: even
  EXPECT_EQ(float_to_half(-0x1p-24f), 0x8001u);
  EXPECT_EQ(float_to_half(0x1p-14f - 0x1p-26f), 0x0400u);  // rounds up to smallest normal
  EXPECT_EQ(float_to_half(-0.0f), 0x8000u);
  EXPECT_EQ(h(0x7F800001u), 0x7E00u);  // sNaN with only low payload bits: still NaN
  EXPECT_EQ(h(0xFFFFFFFFu), 0xFFFFu);

  const auto in = rounding_probe_floats();
  std::vector<std::uint16_t> vec(in.size()), sca(in.size());
  float_to_half(in.data() + 1, vec.data() + 1, in.size() - 1);  // unaligned, odd count
  {
    ScopedScalar mode(true);
    float_to_half(in.data() + 1, sca.data() + 1, in.size() - 1);
  }
  for (std::size_t i = 1; i < in.size(); ++i) {
    const std::uint16_t want = ref_encode(in[i], half_fmt());
    ASSERT_EQ(sca[i], want) << "float bits " << std::bit_cast<std::uint32_t>(in[i]);
    ASSERT_EQ(vec[i], want) << "float bits " << std::bit_cast<std::uint32_t>(in[i]);
  }
}

TEST(Kernels, FloatToBFloat16RoundsToNearestEven) {
  const auto b = [](std::uint32_t bits) { return float_to_bfloat16(std::bit_cast<float>(bits)); };
  EXPECT_EQ(b(0x3F808000u), 0x3F80u);  // tie: down to even
  EXPECT_EQ(b(0x3F818000u), 0x3F82u);  // tie: up to even
  EXPECT_EQ(b(0x3F808001u), 0x3F81u);  // above tie
  EXPECT_EQ(b(0x7F7FFFFFu), 0x7F80u);  // FLT_MAX rounds to Inf
  EXPECT_EQ(b(0x7F7F7FFFu), 0x7F7Fu);
  EXPECT_EQ(b(0x00008000u), 0x0000u);  // subnormal tie
  EXPECT_EQ(b(0x00018000u), 0x0002u);
  EXPECT_EQ(b(0x7F800001u), 0x7FC0u);  // NaN with only low payload bits stays NaN
  EXPECT_EQ(b(0x7FFFFFFFu), 0x7FFFu);  // no carry into the sign
  EXPECT_EQ(b(0xFF800000u), 0xFF80u);

  const auto in = rounding_probe_floats();
  std::vector<std::uint16_t> vec(in.size()), sca(in.size());
  float_to_bfloat16(in.data() + 1, vec.data() + 1, in.size() - 1);
  {
    ScopedScalar mode(true);
    float_to_bfloat16(in.data() + 1, sca.data() + 1, in.size() - 1);
  }
  for (std::size_t i = 1; i < in.size(); ++i) {
    const std::uint16_t want = ref_encode(in[i], bf16_fmt());
    ASSERT_EQ(sca[i], want) << "float bits " << std::bit_cast<std::uint32_t>(in[i]);
    ASSERT_EQ(vec[i], want) << "float bits " << std::bit_cast<std::uint32_t>(in[i]);
  }
}

TEST(Kernels, ConversionTailsAndZeroCount) {
  for (std::size_t n : kCounts) {
    if (n > 100) continue;
    for (bool scalar : paths()) {
      ScopedScalar mode(scalar);
      std::vector<float> f(n + 1, 1.5f), back(n + 1, -1.0f);
      std::vector<std::uint16_t> h(n + 1, 0xABCD);
      float_to_half(f.data(), h.data(), n);
      EXPECT_EQ(h[n], 0xABCD) << "wrote past the end, n=" << n;
      half_to_float(h.data(), back.data(), n);
      EXPECT_EQ(back[n], -1.0f);
      for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(back[i], 1.5f);
      float_to_bfloat16(f.data(), h.data(), n);
      EXPECT_EQ(h[n], 0xABCD);
      bfloat16_to_float(h.data(), back.data(), n);
      EXPECT_EQ(back[n], -1.0f);
      for (std::size_t i = 0; i < n; ++i) EXPECT_EQ(back[i], 1.5f);
    }
  }
  float_to_half(nullptr, nullptr, 0);  // zero count accepts null
  reduce(nullptr, nullptr, nullptr, 0, DataType::kFloat32, ReduceOp::kSum);
}

// A NaN of each kind at every position of 40 finite floats: the vector path converts 16 at a
// time and fixes NaNs up only in a group that holds one, so a NaN in either half of a
// group, or in the tail, must still come out quiet with its sign and top payload bits.
TEST(Kernels, FloatToBFloat16QuietsANaNAnywhere) {
  const std::uint32_t nans[] = {0x7F800001u, 0xFF800001u, 0x7FFFFFFFu, 0xFFBFFFFFu,
                                0x7FC00000u, 0x7F808000u, 0xFFFF8000u};
  for (std::uint32_t nan : nans) {
    for (std::size_t at = 0; at < 40; ++at) {
      std::vector<float> in(40);
      for (std::size_t i = 0; i < in.size(); ++i) {
        in[i] = std::bit_cast<float>(0x3F808000u + (static_cast<std::uint32_t>(i) << 16));
      }
      in[at] = std::bit_cast<float>(nan);
      for (bool scalar : paths()) {
        ScopedScalar mode(scalar);
        for (std::size_t n : {at + 1, std::size_t{40}}) {
          std::vector<std::uint16_t> out(n);
          float_to_bfloat16(in.data(), out.data(), n);
          for (std::size_t i = 0; i < n; ++i) {
            ASSERT_EQ(out[i], ref_encode(in[i], bf16_fmt()))
                << "NaN " << std::hex << nan << std::dec << " at " << at << " n=" << n
                << " element " << i << (scalar ? " scalar" : " vector");
          }
        }
      }
    }
  }
}

// Calls past kStreamBytes write with streaming stores from the first 32-byte aligned output
// element on: every offset of the output within 32 bytes, on both paths, for the rounding
// probes (every high half with the low halves around the tie) and every bfloat16.
TEST(Kernels, StreamedBFloat16ConversionsMatchTheScalarPath) {
  const std::vector<float> probes = rounding_probe_floats();
  const std::size_t n = kStreamBytes / 6 + 1001;  // odd: a tail after the vectors
  std::vector<float> in(n + 16);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = probes[(i * 7) % probes.size()];
  std::vector<std::uint16_t> halves(n + 16);
  for (std::size_t i = 0; i < halves.size(); ++i) halves[i] = static_cast<std::uint16_t>(i * 3);
  std::vector<std::uint16_t> want16(n), got16(n + 16);
  std::vector<float> want32(n), got32(n + 16);
  for (std::size_t off : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{15}}) {
    {
      ScopedScalar mode(true);
      float_to_bfloat16(in.data() + off, want16.data(), n);
      bfloat16_to_float(halves.data() + off, want32.data(), n);
    }
    std::fill(got16.begin(), got16.end(), 0xABCD);
    std::fill(got32.begin(), got32.end(), -1.0f);
    float_to_bfloat16(in.data() + off, got16.data() + off, n);
    bfloat16_to_float(halves.data() + off, got32.data() + off, n);
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(got16[off + i], want16[i]) << "offset " << off << " element " << i;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got32[off + i]),
                std::bit_cast<std::uint32_t>(want32[i]))
          << "offset " << off << " element " << i;
    }
    for (std::size_t i = 0; i < off; ++i) ASSERT_EQ(got16[i], 0xABCD) << "wrote before dst";
    for (std::size_t i = off + n; i < got16.size(); ++i) ASSERT_EQ(got16[i], 0xABCD);
    for (std::size_t i = 0; i < off; ++i) ASSERT_EQ(got32[i], -1.0f) << "wrote before dst";
    for (std::size_t i = off + n; i < got32.size(); ++i) ASSERT_EQ(got32[i], -1.0f);
  }
  for (std::size_t i = 0; i < n; i += 4099) {
    ASSERT_EQ(want16[i], ref_encode(in[15 + i], bf16_fmt())) << i;
  }
}

TEST(Kernels, ReduceDoesNotWritePastCount) {
  for (DataType t : kAllTypes) {
    const std::size_t sz = dtype_size(t);
    for (std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{9}, std::size_t{33}}) {
      for (bool scalar : paths()) {
        ScopedScalar mode(scalar);
        std::vector<unsigned char> a((n + 8) * sz, 1), b((n + 8) * sz, 1), d((n + 8) * sz, 0xEE);
        reduce(d.data(), a.data(), b.data(), n, t, ReduceOp::kSum);
        for (std::size_t i = n * sz; i < d.size(); ++i) ASSERT_EQ(d[i], 0xEE) << to_string(t);
      }
    }
  }
}

// ---------------------------------------------------------------- dispatch and errors

TEST(Kernels, DispatchNamesThePath) {
  {
    ScopedScalar mode(true);
    EXPECT_STREQ(isa_name(), "scalar");
  }
  // AVX2+FMA CPUs all have F16C (and clang cannot query "f16c" here).
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
      std::string(std::getenv("GRADSYNC_KERNELS_ISA") ? std::getenv("GRADSYNC_KERNELS_ISA") : "") !=
          "scalar") {
    EXPECT_STREQ(isa_name(), "avx2+f16c");
  }
}

TEST(Kernels, InvalidArgumentsThrow) {
  float x[1] = {1.0f};
  EXPECT_THROW(scale_for_average(x, 1, DataType::kFloat32, 0), Error);
  EXPECT_THROW(scale_for_average(x, 1, DataType::kFloat32, -2), Error);
  EXPECT_THROW(reduce(nullptr, x, x, 1, DataType::kFloat32, ReduceOp::kSum), Error);
  EXPECT_THROW(reduce_into(x, nullptr, 1, DataType::kFloat32, ReduceOp::kSum), Error);
  EXPECT_THROW(reduce(x, x, x, 1, static_cast<DataType>(99), ReduceOp::kSum), Error);
  EXPECT_THROW(reduce(x, x, x, 1, DataType::kFloat32, static_cast<ReduceOp>(99)), Error);
  try {
    scale_for_average(x, 1, DataType::kFloat32, 0);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("scale_for_average"), std::string::npos);
  }
}

}  // namespace
}  // namespace gradsync::kernels
