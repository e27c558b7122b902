// Run-time dispatch between the AVX2/F16C kernels and the portable scalar kernels, and the
// scalar kernels themselves (the reference the vector path must match bit for bit).
//
// Bitwise rules every path obeys (so every rank and every operand order agrees):
//  * Any float op (sum/avg/prod/min/max) whose result is NaN yields the canonical quiet NaN
//    (+qNaN: f32 0x7FC00000, f64 0x7FF8000000000000, f16 0x7E00, bf16 0x7FC0). x86 returns
//    the first operand's payload when both are NaN, which is not commutative.
//  * min/max propagate NaN and order -0 below +0: min(-0,+0) = -0, max(-0,+0) = +0.
//  * Integers wrap modulo 2^bits (computed in unsigned arithmetic, no UB).
//  * Bitwise and/or/xor act on the integer's bytes, so one byte loop serves every width.
//  * bool reads any nonzero byte as true and always writes 0 or 1: sum/max/bor are OR,
//    prod/min/band are AND, bxor is XOR (avg: the OR, then the integer division).
//  * f16/bf16 widen to f32, combine, round once to nearest even. float32 carries more than
//    2p+2 bits of either format, so this double rounding equals a single correct rounding.
//  * Conversions of NaN keep the sign and the top payload bits and set the quiet bit (what
//    F16C does); finite values round to nearest even; half overflows to +-Inf.
#include "kernels/kernels.h"

#include <cpuid.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>

#include "core/knobs.h"
#include "gradsync/error.h"
#include "kernels/kernels_avx2.h"

namespace gradsync::kernels {
namespace {

// ---------------------------------------------------------------- scalar conversions

// Internal and ahead of the loops so they inline into them; the half codecs are forced,
// since GCC otherwise leaves them as calls inside the large dispatch switch, which is
// measurably slower (docs/performance-notes.md).

[[gnu::always_inline]] inline std::uint16_t encode_half(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) {  // NaN: quiet it, keep the top 10 payload bits
    return static_cast<std::uint16_t>(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
  }
  // 65520 = 0x477FF000 is halfway between 65504 (max half, odd mantissa) and 2^16: ties
  // go to the even neighbour, which is Inf.
  if (ax >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);
  if (ax >= 0x38800000u) {  // normal half: rebias exponent (127-15)<<23, round 13 bits
    std::uint32_t r = ax - 0x38000000u;
    r += 0xFFFu + ((r >> 13) & 1u);  // a carry into the exponent is the correct result
    return static_cast<std::uint16_t>(sign | (r >> 13));
  }
  if (ax <= 0x33000000u) return sign;  // <= 2^-25: rounds to (signed) zero, tie goes to 0
  // Subnormal half: value / 2^-24 rounded to nearest even. value = m * 2^(e-150).
  const std::uint32_t e = ax >> 23;  // 102..112
  const std::uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;
  const std::uint32_t shift = 126u - e;  // 14..24
  std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u) != 0)) ++q;
  return static_cast<std::uint16_t>(sign | q);
}

[[gnu::always_inline]] inline float decode_half(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t e = (h >> 10) & 0x1Fu;
  std::uint32_t m = h & 0x3FFu;
  std::uint32_t out;
  if (e == 0x1Fu) {  // Inf or NaN; a signalling NaN comes out quiet, as with F16C
    out = sign | 0x7F800000u | (m << 13) | (m != 0 ? 0x400000u : 0u);
  } else if (e != 0) {
    out = sign | ((e + 112u) << 23) | (m << 13);
  } else if (m == 0) {
    out = sign;
  } else {  // subnormal m * 2^-24: normalise
    e = 113;
    while ((m & 0x400u) == 0) {
      m <<= 1;
      --e;
    }
    out = sign | (e << 23) | ((m & 0x3FFu) << 13);
  }
  return std::bit_cast<float>(out);
}

std::uint16_t encode_bf16(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t rounded = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
  const std::uint32_t quiet = (x >> 16) | 0x40u;  // NaN: keep the top bits, set quiet bit
  // A select rather than a branch: the loops that call this stay branch-free.
  return static_cast<std::uint16_t>((x & 0x7FFFFFFFu) > 0x7F800000u ? quiet : rounded);
}

float decode_bf16(std::uint16_t h) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}

// ---------------------------------------------------------------- scalar element ops

template <class F>
struct Bits;
template <>
struct Bits<float> {
  using U = std::uint32_t;
  static constexpr U kQNaN = 0x7FC00000u;
};
template <>
struct Bits<double> {
  using U = std::uint64_t;
  static constexpr U kQNaN = 0x7FF8000000000000ull;
};

template <class F>
F qnan() {
  return std::bit_cast<F>(Bits<F>::kQNaN);
}

template <class F>
F canon(F x) {
  return x != x ? qnan<F>() : x;
}

template <class F>
F float_min(F a, F b) {
  if (a != a || b != b) return qnan<F>();
  if (a < b) return a;
  if (b < a) return b;
  // Equal: identical bits, or -0 and +0, where OR picks -0.
  using U = typename Bits<F>::U;
  return std::bit_cast<F>(static_cast<U>(std::bit_cast<U>(a) | std::bit_cast<U>(b)));
}

template <class F>
F float_max(F a, F b) {
  if (a != a || b != b) return qnan<F>();
  if (a > b) return a;
  if (b > a) return b;
  using U = typename Bits<F>::U;  // AND of -0 and +0 is +0
  return std::bit_cast<F>(static_cast<U>(std::bit_cast<U>(a) & std::bit_cast<U>(b)));
}

struct OpSum {
  template <class F>
  static F f(F a, F b) {
    return canon(a + b);
  }
  template <class U>
  static U u(U a, U b) {
    return static_cast<U>(a + b);
  }
};
struct OpProd {
  template <class F>
  static F f(F a, F b) {
    return canon(a * b);
  }
  template <class U>
  static U u(U a, U b) {
    // Multiplied as at least `unsigned`: uint8 and uint16 would promote to int, where
    // 65535 * 65535 overflows (undefined); the low bits are the same in any width.
    using W = std::common_type_t<U, unsigned>;
    return static_cast<U>(static_cast<W>(a) * static_cast<W>(b));
  }
};
struct OpMin {
  template <class F>
  static F f(F a, F b) {
    return float_min(a, b);
  }
};
struct OpMax {
  template <class F>
  static F f(F a, F b) {
    return float_max(a, b);
  }
};

template <class T, class Fn>
void loop(void* dst, const void* a, const void* b, std::size_t n, Fn fn) {
  T* d = static_cast<T*>(dst);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  for (std::size_t i = 0; i < n; ++i) d[i] = fn(x[i], y[i]);
}

template <class F>
void reduce_float(void* d, const void* a, const void* b, std::size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return loop<F>(d, a, b, n, [](F x, F y) { return OpSum::f(x, y); });
    case ReduceOp::kProd:
      return loop<F>(d, a, b, n, [](F x, F y) { return OpProd::f(x, y); });
    case ReduceOp::kMin:
      return loop<F>(d, a, b, n, [](F x, F y) { return OpMin::f(x, y); });
    case ReduceOp::kMax:
      return loop<F>(d, a, b, n, [](F x, F y) { return OpMax::f(x, y); });
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      return;  // refused by check_dtype_op before any loop runs
  }
}

// 16-bit float formats stored as uint16_t; Codec supplies decode/encode.
template <class Codec, class Op>
void loop_narrow(void* d, const void* a, const void* b, std::size_t n) {
  loop<std::uint16_t>(d, a, b, n, [](std::uint16_t x, std::uint16_t y) {
    return Codec::encode(Op::f(Codec::decode(x), Codec::decode(y)));
  });
}

template <class Codec>
void reduce_narrow(void* d, const void* a, const void* b, std::size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return loop_narrow<Codec, OpSum>(d, a, b, n);
    case ReduceOp::kProd:
      return loop_narrow<Codec, OpProd>(d, a, b, n);
    case ReduceOp::kMin:
      return loop_narrow<Codec, OpMin>(d, a, b, n);
    case ReduceOp::kMax:
      return loop_narrow<Codec, OpMax>(d, a, b, n);
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      return;  // refused by check_dtype_op before any loop runs
  }
}

struct HalfCodec {
  static float decode(std::uint16_t h) { return decode_half(h); }
  static std::uint16_t encode(float f) { return encode_half(f); }
};
struct BFloat16Codec {
  static float decode(std::uint16_t h) { return decode_bf16(h); }
  static std::uint16_t encode(float f) { return encode_bf16(f); }
};

// Integers: sum and prod wrap in the unsigned type U of the same width; min/max compare T.
template <class T, class U>
void reduce_int(void* d, const void* a, const void* b, std::size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return loop<U>(d, a, b, n, [](U x, U y) { return OpSum::u(x, y); });
    case ReduceOp::kProd:
      return loop<U>(d, a, b, n, [](U x, U y) { return OpProd::u(x, y); });
    case ReduceOp::kMin:
      return loop<T>(d, a, b, n, [](T x, T y) { return y < x ? y : x; });
    case ReduceOp::kMax:
      return loop<T>(d, a, b, n, [](T x, T y) { return y > x ? y : x; });
    case ReduceOp::kBand:
      return loop<U>(d, a, b, n, [](U x, U y) { return static_cast<U>(x & y); });
    case ReduceOp::kBor:
      return loop<U>(d, a, b, n, [](U x, U y) { return static_cast<U>(x | y); });
    case ReduceOp::kBxor:
      return loop<U>(d, a, b, n, [](U x, U y) { return static_cast<U>(x ^ y); });
  }
}

// bool as logic on bytes, nonzero meaning true, so a byte other than 0 or 1 from a careless
// caller still reduces the same on every rank and comes out 0 or 1.
void reduce_bool(void* d, const void* a, const void* b, std::size_t n, ReduceOp op) {
  using B = std::uint8_t;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
    case ReduceOp::kMax:
    case ReduceOp::kBor:
      return loop<B>(d, a, b, n, [](B x, B y) { return static_cast<B>((x | y) != 0); });
    case ReduceOp::kProd:
    case ReduceOp::kMin:
    case ReduceOp::kBand:
      return loop<B>(d, a, b, n, [](B x, B y) { return static_cast<B>(x != 0 && y != 0); });
    case ReduceOp::kBxor:
      return loop<B>(d, a, b, n, [](B x, B y) { return static_cast<B>((x != 0) != (y != 0)); });
  }
}

void scalar_reduce(void* d, const void* a, const void* b, std::size_t n, DataType dtype,
                   ReduceOp op) {
  switch (dtype) {
    case DataType::kFloat32:
      return reduce_float<float>(d, a, b, n, op);
    case DataType::kFloat64:
      return reduce_float<double>(d, a, b, n, op);
    case DataType::kFloat16:
      return reduce_narrow<HalfCodec>(d, a, b, n, op);
    case DataType::kBFloat16:
      return reduce_narrow<BFloat16Codec>(d, a, b, n, op);
    case DataType::kInt32:
      return reduce_int<std::int32_t, std::uint32_t>(d, a, b, n, op);
    case DataType::kInt64:
      return reduce_int<std::int64_t, std::uint64_t>(d, a, b, n, op);
    case DataType::kUInt8:
      return reduce_int<std::uint8_t, std::uint8_t>(d, a, b, n, op);
    case DataType::kInt8:
      return reduce_int<std::int8_t, std::uint8_t>(d, a, b, n, op);
    case DataType::kInt16:
      return reduce_int<std::int16_t, std::uint16_t>(d, a, b, n, op);
    case DataType::kBool:
      return reduce_bool(d, a, b, n, op);
  }
}

template <class T, class Fn>
void map(void* data, std::size_t n, Fn fn) {
  T* p = static_cast<T*>(data);
  for (std::size_t i = 0; i < n; ++i) p[i] = fn(p[i]);
}

void scalar_scale(void* data, std::size_t n, DataType dtype, int divisor) {
  const float fd = static_cast<float>(divisor);
  switch (dtype) {
    case DataType::kFloat32:
      return map<float>(data, n, [fd](float x) { return x / fd; });
    case DataType::kFloat64: {
      const double dd = divisor;
      return map<double>(data, n, [dd](double x) { return x / dd; });
    }
    case DataType::kFloat16:
      return map<std::uint16_t>(data, n,
                                [fd](std::uint16_t h) { return encode_half(decode_half(h) / fd); });
    case DataType::kBFloat16:
      return map<std::uint16_t>(data, n,
                                [fd](std::uint16_t h) { return encode_bf16(decode_bf16(h) / fd); });
    // divisor >= 1 (checked), so INT_MIN / -1 cannot happen.
    case DataType::kInt32:
      return map<std::int32_t>(data, n, [divisor](std::int32_t x) { return x / divisor; });
    case DataType::kInt64: {
      const std::int64_t d64 = divisor;
      return map<std::int64_t>(data, n, [d64](std::int64_t x) { return x / d64; });
    }
    case DataType::kUInt8:
    case DataType::kBool:  // the OR of the ranks divided: 0 for more than one rank, as ints do
      return map<std::uint8_t>(
          data, n, [divisor](std::uint8_t x) { return static_cast<std::uint8_t>(x / divisor); });
    case DataType::kInt8:
      return map<std::int8_t>(
          data, n, [divisor](std::int8_t x) { return static_cast<std::int8_t>(x / divisor); });
    case DataType::kInt16:
      return map<std::int16_t>(
          data, n, [divisor](std::int16_t x) { return static_cast<std::int16_t>(x / divisor); });
  }
}

// ---------------------------------------------------------------- scalar codec kernels

// The int8 codec's clamp(nearbyint(t), -127, 127), NaN to 0 (a float-to-int cast of NaN is
// undefined). Clamping first rounds the same (nearbyint is monotonic and maps +-127 to
// themselves), and then adding and subtracting 1.5 * 2^23 rounds to nearest even exactly
// (|t| < 2^22), without the libm call nearbyint is on baseline x86-64, which is far slower
// (docs/performance-notes.md).
std::int8_t quantize_one(float t) {
  if (t != t) return 0;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  const float v = (std::clamp(t, -127.0f, 127.0f) + kRound) - kRound;
  return static_cast<std::int8_t>(v);
}

void scalar_quantize_int8(const float* in, std::size_t n, std::size_t block, float* scales,
                          std::int8_t* q) {
  for (std::size_t b = 0, lo = 0; lo < n; ++b, lo += block) {
    const std::size_t hi = n - lo < block ? n : lo + block;
    float peak = 0.0f;
    // std::max keeps `peak` when fabs(x) is NaN, as maxps(|x|, peak) does on the AVX2 path.
    for (std::size_t i = lo; i < hi; ++i) peak = std::max(peak, std::fabs(in[i]));
    const float scale = peak / 127.0f;
    scales[b] = scale;
    const float inverse = scale > 0 ? 1.0f / scale : 0.0f;
    for (std::size_t i = lo; i < hi; ++i) q[i] = quantize_one(in[i] * inverse);
  }
}

// The multiply is its own statement and the baseline x86-64 target has no FMA, so the
// product is rounded before the add, as on the AVX2 path.
void scalar_dequantize_int8(const std::int8_t* q, const float* scales, std::size_t n,
                            std::size_t block, float* out, bool accumulate) {
  for (std::size_t b = 0, lo = 0; lo < n; ++b, lo += block) {
    const std::size_t hi = n - lo < block ? n : lo + block;
    const float scale = scales[b];
    for (std::size_t i = lo; i < hi; ++i) {
      const float v = static_cast<float>(q[i]) * scale;
      out[i] = accumulate ? canon(out[i] + v) : v;
    }
  }
}

void scalar_pack_signs(const float* in, std::size_t n, std::uint8_t* bits) {
  std::memset(bits, 0, (n + 7) / 8);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t sign = std::bit_cast<std::uint32_t>(in[i]) >> 31;
    bits[i / 8] = static_cast<std::uint8_t>(bits[i / 8] | (sign << (i % 8)));
  }
}

// A byte at a time with the mode hoisted, so the compiler keeps the loop simple.
void scalar_unpack_signs(const std::uint8_t* bits, std::size_t n, float scale, float* out,
                         bool accumulate) {
  const float pm[2] = {scale, -scale};
  for (std::size_t i = 0; i < n; i += 8) {
    const unsigned byte = bits[i / 8];
    const std::size_t len = n - i < 8 ? n - i : 8;
    float* o = out + i;
    if (accumulate) {
      for (std::size_t k = 0; k < len; ++k) o[k] = canon(o[k] + pm[(byte >> k) & 1u]);
    } else {
      for (std::size_t k = 0; k < len; ++k) o[k] = pm[(byte >> k) & 1u];
    }
  }
}

constexpr std::size_t kSumLanes = 32;

// Lane j sums |in[i]| for i % 32 == j in index order: exactly what the AVX2 path's eight
// four-double accumulators do, so each lane's sequence of double additions is the same.
void scalar_sum_abs_lanes(const float* in, std::size_t n, double lanes[kSumLanes]) {
  for (std::size_t i = 0; i < n; ++i) lanes[i % kSumLanes] += std::fabs(static_cast<double>(in[i]));
}

// One fixed pairwise order for the 32 lanes of sum_abs and of qsgd's sums of squares (the
// AVX2 sum_squares does the same additions in registers).
double combine_lanes(double lanes[kSumLanes]) {
  for (std::size_t width = kSumLanes / 2; width >= 1; width /= 2) {
    for (std::size_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  }
  return lanes[0];
}

// A float squared is exact in double (48 significant bits, exponents well inside double's
// range), so a fused multiply-add here would round the same as this multiply, then add.
double scalar_sum_squares(const float* in, std::size_t n) {
  double lanes[kSumLanes] = {};
  for (std::size_t i = 0; i < n; ++i) {
    const double x = in[i];
    lanes[i % kSumLanes] += x * x;
  }
  return combine_lanes(lanes);
}

std::uint32_t draw_hash(std::uint32_t h) {
  h ^= h >> 16;
  h *= kDrawMul1;
  h ^= h >> 15;
  h *= kDrawMul2;
  return h ^ (h >> 15);
}

// The element rule of quantize_stochastic_int8_blocks, written as the AVX2 path computes
// it: minps semantics for the clamp (a NaN level becomes the top one), truncation for the
// float-to-int conversion (the level is >= 0), and 24-bit fixed point below 2^31.
void scalar_stochastic_levels(const float* in, std::size_t n, float pre, float post, float top,
                              std::uint32_t start, std::uint32_t step, std::int8_t* q) {
  std::uint32_t input = start;
  for (std::size_t j = 0; j < n; ++j, input += step) {
    float level = (std::fabs(in[j]) * pre) * post;
    level = level < top ? level : top;
    const auto fixed = static_cast<std::uint32_t>(static_cast<std::int32_t>(level));
    const std::uint32_t l = (fixed >> 24) + ((draw_hash(input) >> 8) < (fixed & 0xFFFFFFu) ? 1 : 0);
    const auto v = static_cast<std::int8_t>(l);
    q[j] = std::signbit(in[j]) ? static_cast<std::int8_t>(-v) : v;
  }
}

std::uint32_t scalar_max_abs_bits(const float* in, std::size_t n) {
  std::uint32_t m = 0;
  for (std::size_t i = 0; i < n; ++i) {
    m = std::max(m, std::bit_cast<std::uint32_t>(in[i]) & 0x7FFFFFFFu);
  }
  return m;
}

std::size_t scalar_first_non_finite(const float* in, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    if ((std::bit_cast<std::uint32_t>(in[i]) & 0x7F800000u) == 0x7F800000u) return i;
  }
  return n;
}

// ---------------------------------------------------------------- dispatch

struct Cpu {
  bool has_avx2 = false;    // the CPU (and OS) can run kernels_avx2.cc
  bool env_scalar = false;  // GRADSYNC_KERNELS_ISA=scalar
};

// CPUID directly rather than __builtin_cpu_supports: clang (used for the fuzz build) does
// not know "f16c" there. AVX state must also be enabled by the OS (OSXSAVE, XCR0 bits 1-2).
bool cpu_has_avx2_f16c_fma() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return false;
  const bool fma = (ecx & bit_FMA) != 0;
  const bool osxsave = (ecx & bit_OSXSAVE) != 0;
  const bool avx = (ecx & bit_AVX) != 0;
  const bool f16c = (ecx & bit_F16C) != 0;
  if (!(fma && osxsave && avx && f16c)) return false;
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if ((xcr0_lo & 0x6u) != 0x6u) return false;  // XMM and YMM state saved by the OS
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  return (ebx & bit_AVX2) != 0;
}

Cpu detect() {
  Cpu c;
  c.has_avx2 = cpu_has_avx2_f16c_fma();
  // Read on first kernel use; init() reads it first (env::resolve), so a bad value fails a
  // program there rather than in a collective.
  if (auto isa = knobs::text("GRADSYNC_KERNELS_ISA")) {
    if (*isa == "scalar") {
      c.env_scalar = true;
    } else if (*isa != "auto") {
      throw knobs::refusal("GRADSYNC_KERNELS_ISA", *isa);
    }
  }
  return c;
}

const Cpu& cpu() {
  static const Cpu c = detect();
  return c;
}

// Relaxed is enough: both paths produce identical bits, so a racing flip is harmless.
std::atomic<bool> g_force_scalar{false};

bool use_avx2() {
  return cpu().has_avx2 && !cpu().env_scalar && !g_force_scalar.load(std::memory_order_relaxed);
}

void check_dtype_op(DataType dtype, ReduceOp op, const char* fn) {
  if (dtype_size(dtype) == 0) {
    throw Error(ErrorKind::kInvalidArgument,
                "unknown dtype " + std::to_string(static_cast<unsigned>(dtype)),
                Error::kUnknownRank, Error::kNoPeer, fn);
  }
  if (static_cast<unsigned>(op) > static_cast<unsigned>(ReduceOp::kBxor)) {
    throw Error(ErrorKind::kInvalidArgument,
                "unknown reduce op " + std::to_string(static_cast<unsigned>(op)),
                Error::kUnknownRank, Error::kNoPeer, fn);
  }
  if (!dtype_op_valid(dtype, op)) {
    throw Error(ErrorKind::kInvalidArgument,
                std::string("bitwise ") + to_string(op) + " on " + to_string(dtype) +
                    ": bitwise ops take integer or bool dtypes",
                Error::kUnknownRank, Error::kNoPeer, fn);
  }
}

void check_ptr(const void* p, std::size_t count, std::size_t elem, const char* what,
               const char* fn) {
  if (p == nullptr && count != 0) {
    throw Error(ErrorKind::kInvalidArgument, std::string("null ") + what + " buffer",
                Error::kUnknownRank, Error::kNoPeer, fn, count * elem);
  }
}

void check_block(std::size_t block, const char* fn) {
  if (block == 0) {
    throw Error(ErrorKind::kInvalidArgument, "block must be >= 1, got 0", Error::kUnknownRank,
                Error::kNoPeer, fn);
  }
}

}  // namespace

// ---------------------------------------------------------------- public entry points

std::uint16_t float_to_half(float f) {
  return encode_half(f);
}
float half_to_float(std::uint16_t h) {
  return decode_half(h);
}
std::uint16_t float_to_bfloat16(float f) {
  return encode_bf16(f);
}
float bfloat16_to_float(std::uint16_t h) {
  return decode_bf16(h);
}

void reduce(void* dst, const void* a, const void* b, std::size_t count, DataType dtype,
            ReduceOp op) {
  check_dtype_op(dtype, op, "reduce");
  const std::size_t elem = dtype_size(dtype);
  check_ptr(dst, count, elem, "dst", "reduce");
  check_ptr(a, count, elem, "a", "reduce");
  check_ptr(b, count, elem, "b", "reduce");
  if (count == 0) return;
  if (use_avx2() && avx2::reduce(dst, a, b, count, dtype, op)) return;
  scalar_reduce(dst, a, b, count, dtype, op);
}

void reduce_into(void* dst, const void* src, std::size_t count, DataType dtype, ReduceOp op) {
  reduce(dst, dst, src, count, dtype, op);
}

void scale_for_average(void* data, std::size_t count, DataType dtype, int divisor) {
  check_dtype_op(dtype, ReduceOp::kAvg, "scale_for_average");
  check_ptr(data, count, dtype_size(dtype), "data", "scale_for_average");
  if (divisor < 1) {
    throw Error(ErrorKind::kInvalidArgument, "divisor must be >= 1, got " + std::to_string(divisor),
                Error::kUnknownRank, Error::kNoPeer, "scale_for_average");
  }
  if (count == 0 || divisor == 1) return;
  if (use_avx2() && avx2::scale_for_average(data, count, dtype, divisor)) return;
  scalar_scale(data, count, dtype, divisor);
}

std::size_t sum_finish(void* dst, DataType dst_type, const float* a, const float* b,
                       std::size_t count, int divisor) {
  if (dst_type != DataType::kFloat32 && dst_type != DataType::kFloat16 &&
      dst_type != DataType::kBFloat16) {
    throw Error(
        ErrorKind::kInvalidArgument,
        std::string("sum_finish stores float32, float16 or bfloat16, not ") + to_string(dst_type),
        Error::kUnknownRank, Error::kNoPeer, "sum_finish");
  }
  check_ptr(dst, count, dtype_size(dst_type), "dst", "sum_finish");
  check_ptr(a, count, 4, "a", "sum_finish");
  check_ptr(b, count, 4, "b", "sum_finish");
  if (divisor < 1) {
    throw Error(ErrorKind::kInvalidArgument, "divisor must be >= 1, got " + std::to_string(divisor),
                Error::kUnknownRank, Error::kNoPeer, "sum_finish");
  }
  if (count == 0) return 0;
  if (use_avx2()) return avx2::sum_finish(dst, dst_type, a, b, count, divisor);
  const float fd = static_cast<float>(divisor);
  std::size_t first_bad = count;
  for (std::size_t i = 0; i < count; ++i) {
    float s = OpSum::f(a[i], b[i]);
    if (divisor != 1) s = s / fd;
    if (dst_type == DataType::kFloat16) {
      const std::uint16_t h = encode_half(s);
      static_cast<std::uint16_t*>(dst)[i] = h;
      s = decode_half(h);
    } else if (dst_type == DataType::kBFloat16) {
      const std::uint16_t h = encode_bf16(s);
      static_cast<std::uint16_t*>(dst)[i] = h;
      s = decode_bf16(h);
    } else {
      static_cast<float*>(dst)[i] = s;
    }
    if (first_bad == count && !std::isfinite(s)) first_bad = i;
  }
  return first_bad;
}

void float_from_16bit_streaming(const std::uint16_t* src, float* dst, std::size_t count,
                                DataType from) {
  check_ptr(src, count, 2, "src", "float_from_16bit_streaming");
  check_ptr(dst, count, 4, "dst", "float_from_16bit_streaming");
  if (count == 0) return;
  if (use_avx2()) return avx2::float_from_16bit_streaming(src, dst, count, from);
  float_from_16bit(src, dst, count, from);  // the same bits; streaming is a vector-path matter
}

void float_to_half(const float* src, std::uint16_t* dst, std::size_t count) {
  check_ptr(src, count, 4, "src", "float_to_half");
  check_ptr(dst, count, 2, "dst", "float_to_half");
  if (count == 0) return;
  if (use_avx2()) return avx2::float_to_half(src, dst, count);
  for (std::size_t i = 0; i < count; ++i) dst[i] = encode_half(src[i]);
}

void half_to_float(const std::uint16_t* src, float* dst, std::size_t count) {
  check_ptr(src, count, 2, "src", "half_to_float");
  check_ptr(dst, count, 4, "dst", "half_to_float");
  if (count == 0) return;
  if (use_avx2()) return avx2::half_to_float(src, dst, count);
  for (std::size_t i = 0; i < count; ++i) dst[i] = decode_half(src[i]);
}

void float_to_bfloat16(const float* src, std::uint16_t* dst, std::size_t count) {
  check_ptr(src, count, 4, "src", "float_to_bfloat16");
  check_ptr(dst, count, 2, "dst", "float_to_bfloat16");
  if (count == 0) return;
  if (use_avx2()) return avx2::float_to_bfloat16(src, dst, count);
  for (std::size_t i = 0; i < count; ++i) dst[i] = encode_bf16(src[i]);
}

void bfloat16_to_float(const std::uint16_t* src, float* dst, std::size_t count) {
  check_ptr(src, count, 2, "src", "bfloat16_to_float");
  check_ptr(dst, count, 4, "dst", "bfloat16_to_float");
  if (count == 0) return;
  if (use_avx2()) return avx2::bfloat16_to_float(src, dst, count);
  for (std::size_t i = 0; i < count; ++i) dst[i] = decode_bf16(src[i]);
}

void float_to_16bit(const float* src, std::uint16_t* dst, std::size_t count, DataType to) {
  if (to == DataType::kBFloat16) {
    float_to_bfloat16(src, dst, count);
  } else {
    float_to_half(src, dst, count);
  }
}

void float_from_16bit(const std::uint16_t* src, float* dst, std::size_t count, DataType from) {
  if (from == DataType::kBFloat16) {
    bfloat16_to_float(src, dst, count);
  } else {
    half_to_float(src, dst, count);
  }
}

void quantize_int8_blocks(const float* in, std::size_t count, std::size_t block, float* scales,
                          std::int8_t* q) {
  check_block(block, "quantize_int8_blocks");
  check_ptr(in, count, 4, "in", "quantize_int8_blocks");
  check_ptr(scales, count, 4, "scales", "quantize_int8_blocks");
  check_ptr(q, count, 1, "q", "quantize_int8_blocks");
  if (count == 0) return;
  if (use_avx2()) return avx2::quantize_int8_blocks(in, count, block, scales, q);
  scalar_quantize_int8(in, count, block, scales, q);
}

namespace {
// Both dequantize entry points: checked arguments, then one dispatch with `add` passed on.
void dequantize(const std::int8_t* q, const float* scales, std::size_t count, std::size_t block,
                float* out, bool add, const char* name) {
  check_block(block, name);
  check_ptr(q, count, 1, "q", name);
  check_ptr(scales, count, 4, "scales", name);
  check_ptr(out, count, 4, "out", name);
  if (count == 0) return;
  if (use_avx2()) return avx2::dequantize_int8_blocks(q, scales, count, block, out, add);
  scalar_dequantize_int8(q, scales, count, block, out, add);
}
}  // namespace

void dequantize_int8_blocks(const std::int8_t* q, const float* scales, std::size_t count,
                            std::size_t block, float* out) {
  dequantize(q, scales, count, block, out, false, "dequantize_int8_blocks");
}

void dequantize_int8_blocks_add(const std::int8_t* q, const float* scales, std::size_t count,
                                std::size_t block, float* out) {
  dequantize(q, scales, count, block, out, true, "dequantize_int8_blocks_add");
}

void quantize_stochastic_int8_blocks(const float* in, std::size_t count, std::size_t block,
                                     int levels, std::uint64_t key, float* scales, std::int8_t* q) {
  const char* fn = "quantize_stochastic_int8_blocks";
  check_block(block, fn);
  if (levels < 1 || levels > 127) {
    throw Error(ErrorKind::kInvalidArgument,
                "levels must be in 1..127, got " + std::to_string(levels), Error::kUnknownRank,
                Error::kNoPeer, fn);
  }
  check_ptr(in, count, 4, "in", fn);
  check_ptr(scales, count, 4, "scales", fn);
  check_ptr(q, count, 1, "q", fn);
  if (count == 0) return;
  const bool vector = use_avx2();
  const double s = levels;
  const auto top = static_cast<float>(levels) * 0x1p24f;  // < 2^31: fits an int32
  // The hash input of element i is (i mod 2^32) * step + offset, with step (odd) and offset
  // drawn per 2^32 elements from the key by a splitmix64 finaliser: a Weyl sequence through
  // a 32-bit mixer, so that another key (another rank, step or hop) gives unrelated draws.
  std::uint64_t segment = ~std::uint64_t{0};
  std::uint32_t step = 0, offset = 0;
  for (std::size_t b = 0, lo = 0; lo < count; ++b, lo += block) {
    const std::size_t hi = count - lo < block ? count : lo + block;
    double sum_sq =
        vector ? avx2::sum_squares(in + lo, hi - lo) : scalar_sum_squares(in + lo, hi - lo);
    if (std::isnan(sum_sq)) sum_sq = qnan<double>();  // x86 keeps an operand's payload
    // In double: the norm of finite floats can pass FLT_MAX (the scale, norm / levels,
    // need not), and the inverse of a denormal norm would overflow a float.
    const double norm = std::sqrt(sum_sq);
    scales[b] = static_cast<float>(norm / s);
    const double inverse = norm > 0 ? s / norm : 0.0;
    // Levels are computed in float, 8 lanes a vector, as level * 2^24 = (|x| * pre) * post
    // with post normal. pre = 2^64 only for a norm below levels * 2^-100, whose elements are
    // all that small, so |x| * pre is exact; pre = 2^-64 only for a norm above levels *
    // 2^100, where an element that |x| * pre takes below 2^-126 has a level under 2^-150.
    float pre = 1.0f;
    if (inverse > 0x1p100) {
      pre = 0x1p64f;
    } else if (inverse > 0 && inverse < 0x1p-100) {
      pre = 0x1p-64f;
    }
    const auto post = static_cast<float>(inverse * 0x1p24 / pre);
    for (std::size_t i = lo; i < hi;) {
      const std::uint64_t seg = static_cast<std::uint64_t>(i) >> 32;
      if (seg != segment) {
        segment = seg;
        std::uint64_t z = key + (seg + 1) * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        step = static_cast<std::uint32_t>(z) | 1u;
        offset = static_cast<std::uint32_t>(z >> 32);
      }
      const std::uint64_t seg_end = seg < 0xFFFFFFFFu ? (seg + 1) << 32 : ~std::uint64_t{0};
      const std::size_t end = std::min<std::uint64_t>(hi, seg_end);
      const std::uint32_t start = static_cast<std::uint32_t>(i) * step + offset;
      if (vector) {
        avx2::stochastic_levels(in + i, end - i, pre, post, top, start, step, q + i);
      } else {
        scalar_stochastic_levels(in + i, end - i, pre, post, top, start, step, q + i);
      }
      i = end;
    }
  }
}

void pack_signs(const float* in, std::size_t count, std::uint8_t* bits) {
  check_ptr(in, count, 4, "in", "pack_signs");
  check_ptr(bits, count, 1, "bits", "pack_signs");
  if (count == 0) return;
  if (use_avx2()) return avx2::pack_signs(in, count, bits);
  scalar_pack_signs(in, count, bits);
}

void unpack_signs_scaled(const std::uint8_t* bits, std::size_t count, float scale, float* out,
                         bool accumulate) {
  check_ptr(bits, count, 1, "bits", "unpack_signs_scaled");
  check_ptr(out, count, 4, "out", "unpack_signs_scaled");
  if (count == 0) return;
  if (use_avx2()) return avx2::unpack_signs_scaled(bits, count, scale, out, accumulate);
  scalar_unpack_signs(bits, count, scale, out, accumulate);
}

double sum_abs(const float* in, std::size_t count) {
  check_ptr(in, count, 4, "in", "sum_abs");
  double lanes[kSumLanes] = {};
  if (count != 0 && use_avx2()) {
    avx2::sum_abs_lanes(in, count, lanes);
  } else {
    scalar_sum_abs_lanes(in, count, lanes);
  }
  const double sum = combine_lanes(lanes);
  return std::isnan(sum) ? qnan<double>() : sum;
}

float max_abs(const float* in, std::size_t count) {
  check_ptr(in, count, 4, "in", "max_abs");
  const std::uint32_t m =
      count != 0 && use_avx2() ? avx2::max_abs_bits(in, count) : scalar_max_abs_bits(in, count);
  return m > 0x7F800000u ? qnan<float>() : std::bit_cast<float>(m);
}

std::size_t first_non_finite(const float* in, std::size_t count) {
  check_ptr(in, count, 4, "in", "first_non_finite");
  if (count == 0) return 0;
  if (use_avx2()) return avx2::first_non_finite(in, count);
  return scalar_first_non_finite(in, count);
}

bool all_finite(const float* in, std::size_t count) {
  return first_non_finite(in, count) == count;
}

const char* isa_name() {
  return use_avx2() ? "avx2+f16c" : "scalar";
}

void force_scalar(bool on) {
  g_force_scalar.store(on, std::memory_order_relaxed);
}

}  // namespace gradsync::kernels
