// AVX2/F16C kernels: the same element rules as the scalar path in kernels.cc, bit for bit.
// The gradient codecs' are codec_kernels_avx2.cc's, under the same rules.
//
// This file is compiled with -mavx2 -mf16c -mfma. An inline function or template emitted
// here and also in a baseline file would be merged by the linker, which may keep this copy
// and run AVX code on a CPU without it; so everything here has internal linkage and no
// std:: inline function or template is used (std::memcpy is a builtin/libc call).
// Tails (count not a multiple of the vector width) go through a zero-padded stack buffer
// and the same vector code, so they cannot drift from the main loop.
// No float multiply here feeds an add: with -mfma GCC may fuse such a pair into an FMA
// (-ffp-contract=fast), whose single rounding would differ from the scalar path.
#include "kernels/kernels_avx2.h"

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/avx2_common.h"
#include "kernels/kernels.h"  // declarations and kStreamBytes only: nothing inline to merge

namespace gradsync::kernels::avx2 {
namespace {

// ---------------------------------------------------------------- float ops

struct PsSum {
  static __m256 apply(__m256 a, __m256 b) { return canon_ps(_mm256_add_ps(a, b)); }
};
struct PsProd {
  static __m256 apply(__m256 a, __m256 b) { return canon_ps(_mm256_mul_ps(a, b)); }
};
// minps returns its second operand on equality (and on NaN), so min(a,b) | min(b,a) picks
// -0 for {-0,+0} and is the plain minimum otherwise; NaN is patched afterwards.
struct PsMin {
  static __m256 apply(__m256 a, __m256 b) {
    const __m256 m = _mm256_or_ps(_mm256_min_ps(a, b), _mm256_min_ps(b, a));
    return _mm256_blendv_ps(m, qnan_ps(), _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
  }
};
struct PsMax {  // AND picks +0 for {-0,+0}
  static __m256 apply(__m256 a, __m256 b) {
    const __m256 m = _mm256_and_ps(_mm256_max_ps(a, b), _mm256_max_ps(b, a));
    return _mm256_blendv_ps(m, qnan_ps(), _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
  }
};

struct PdSum {
  static __m256d apply(__m256d a, __m256d b) { return canon_pd(_mm256_add_pd(a, b)); }
};
struct PdProd {
  static __m256d apply(__m256d a, __m256d b) { return canon_pd(_mm256_mul_pd(a, b)); }
};
struct PdMin {
  static __m256d apply(__m256d a, __m256d b) {
    const __m256d m = _mm256_or_pd(_mm256_min_pd(a, b), _mm256_min_pd(b, a));
    return _mm256_blendv_pd(m, qnan_pd(), _mm256_cmp_pd(a, b, _CMP_UNORD_Q));
  }
};
struct PdMax {
  static __m256d apply(__m256d a, __m256d b) {
    const __m256d m = _mm256_and_pd(_mm256_max_pd(a, b), _mm256_max_pd(b, a));
    return _mm256_blendv_pd(m, qnan_pd(), _mm256_cmp_pd(a, b, _CMP_UNORD_Q));
  }
};

// ---------------------------------------------------------------- integer ops (wrapping)

struct I32Sum {
  static __m256i apply(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
};
struct I32Prod {
  static __m256i apply(__m256i a, __m256i b) { return _mm256_mullo_epi32(a, b); }
};
struct I32Min {
  static __m256i apply(__m256i a, __m256i b) { return _mm256_min_epi32(a, b); }
};
struct I32Max {
  static __m256i apply(__m256i a, __m256i b) { return _mm256_max_epi32(a, b); }
};

struct I64Sum {
  static __m256i apply(__m256i a, __m256i b) { return _mm256_add_epi64(a, b); }
};
// AVX2 has no 64-bit low multiply: lo(a)*lo(b) + ((hi(a)*lo(b) + lo(a)*hi(b)) << 32).
struct I64Prod {
  static __m256i apply(__m256i a, __m256i b) {
    const __m256i lo = _mm256_mul_epu32(a, b);
    const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), b),
                                           _mm256_mul_epu32(a, _mm256_srli_epi64(b, 32)));
    return _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32));
  }
};
struct I64Min {  // no vpminsq in AVX2
  static __m256i apply(__m256i a, __m256i b) {
    return _mm256_blendv_epi8(a, b, _mm256_cmpgt_epi64(a, b));
  }
};
struct I64Max {
  static __m256i apply(__m256i a, __m256i b) {
    return _mm256_blendv_epi8(b, a, _mm256_cmpgt_epi64(a, b));
  }
};

struct U8Sum {
  static __m256i apply(__m256i a, __m256i b) { return _mm256_add_epi8(a, b); }
};
// No byte multiply: multiply even and odd bytes in 16-bit lanes; the low byte of a 16-bit
// product of (x + 256y)(u + 256v) is the low byte of x*u.
struct U8Prod {
  static __m256i apply(__m256i a, __m256i b) {
    const __m256i even = _mm256_and_si256(_mm256_mullo_epi16(a, b), _mm256_set1_epi16(0x00FF));
    const __m256i odd =
        _mm256_slli_epi16(_mm256_mullo_epi16(_mm256_srli_epi16(a, 8), _mm256_srli_epi16(b, 8)), 8);
    return _mm256_or_si256(even, odd);
  }
};
struct U8Min {
  static __m256i apply(__m256i a, __m256i b) { return _mm256_min_epu8(a, b); }
};
struct U8Max {
  static __m256i apply(__m256i a, __m256i b) { return _mm256_max_epu8(a, b); }
};
// Bitwise ops are the same on every integer width: one byte loop serves them all.
struct SiAnd {
  static __m256i apply(__m256i a, __m256i b) { return _mm256_and_si256(a, b); }
};
struct SiOr {
  static __m256i apply(__m256i a, __m256i b) { return _mm256_or_si256(a, b); }
};
struct SiXor {
  static __m256i apply(__m256i a, __m256i b) { return _mm256_xor_si256(a, b); }
};

// ---------------------------------------------------------------- lanes: load/store one vector

struct F32Lane {
  using T = float;
  static constexpr std::size_t kWidth = 8;
  static __m256 load(const T* p) { return _mm256_loadu_ps(p); }
  static void store(T* p, __m256 v) { _mm256_storeu_ps(p, v); }
};
struct F64Lane {
  using T = double;
  static constexpr std::size_t kWidth = 4;
  static __m256d load(const T* p) { return _mm256_loadu_pd(p); }
  static void store(T* p, __m256d v) { _mm256_storeu_pd(p, v); }
};
// float16 <-> float32 in registers via F16C; rounding fixed to nearest-even (not MXCSR).
struct F16Lane {
  using T = std::uint16_t;
  static constexpr std::size_t kWidth = 8;
  static __m256 load(const T* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(T* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, kRoundNearest));
  }
};
// bfloat16 in reductions: 16 elements per step as two float vectors. Interleaving zeros
// below each bf16 (unpacklo/hi) widens in one instruction per 8 elements; the order comes
// out permuted within 128-bit lanes, but packus undoes exactly that permutation on the way
// back, and the ops are elementwise. Narrowing adds 0x7FFF + lsb and truncates (nearest
// even). Results here are already canonical NaNs (0x7FC00000), which that rounding maps to
// 0x7FC0 correctly, so no NaN branch is needed.
struct F32x2 {
  __m256 lo, hi;
};
template <class Op>
struct PairOp {
  static F32x2 apply(F32x2 a, F32x2 b) { return {Op::apply(a.lo, b.lo), Op::apply(a.hi, b.hi)}; }
};

inline __m256i bf16_round_to_high_half(__m256 v) {  // rounded bf16 in bits 16..31
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
}

// bfloat16 of 8 floats in the low half of each 32-bit lane, for any input: NaNs of any
// payload are quieted, keeping the top payload bits (a payload such as 0x7FFFFFFF would
// otherwise carry into the sign).
inline __m256i bf16_narrow(__m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  const __m256i quiet = _mm256_or_si256(x, _mm256_set1_epi32(0x00400000));
  return _mm256_srli_epi32(_mm256_blendv_epi8(bf16_round_to_high_half(v), quiet, nan), 16);
}

struct BF16PairLane {
  using T = std::uint16_t;
  static constexpr std::size_t kWidth = 16;
  static F32x2 load(const T* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i zero = _mm256_setzero_si256();
    return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, h)),
            _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, h))};
  }
  static void store(T* p, F32x2 v) {
    const __m256i lo = _mm256_srli_epi32(bf16_round_to_high_half(v.lo), 16);
    const __m256i hi = _mm256_srli_epi32(bf16_round_to_high_half(v.hi), 16);
    // Every 32-bit lane is <= 0xFFFF, so unsigned saturation is just a narrowing.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_packus_epi32(lo, hi));
  }
};

// 8 floats as 8 bfloat16 (bf16_narrow), in order: each 32-bit lane is <= 0xFFFF, so the
// unsigned saturation of packus is just a narrowing.
inline __m128i bf16_pack8(__m256 v) {
  const __m256i r = bf16_narrow(v);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// bfloat16 <-> float32 conversion, 8 at a time, with NaN of any payload (bf16_narrow).
struct BF16Lane {
  using T = std::uint16_t;
  static constexpr std::size_t kWidth = 8;
  static __m256 load(const T* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static void store(T* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_pack8(v));
  }
};

// ---------------------------------------------------------------- bfloat16 conversion

// Stores a whole vector; non-temporal (to a 32-byte aligned address) when kStream.
template <bool kStream>
inline void store_si256(void* p, __m256i v) {
  if constexpr (kStream) {
    _mm256_stream_si256(static_cast<__m256i*>(p), v);
  } else {
    _mm256_storeu_si256(static_cast<__m256i*>(p), v);
  }
}

// 16 floats to 16 bfloat16, in order. The rounding alone is right for every float but NaN,
// so the NaN fix-up (a compare, an OR and a blend per vector, a third of the work) runs
// only for the rare 16 that hold a NaN, which one unordered compare of the two vectors
// finds. packus interleaves 128-bit halves (a0-3 b0-3 a4-7 b4-7); the permute undoes that.
inline __m256i bf16x16(const float* p) {
  const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
  __m256i ra, rb;
  const __m256 nan = _mm256_cmp_ps(a, b, _CMP_UNORD_Q);
  if (_mm256_testz_ps(nan, nan)) [[likely]] {
    ra = _mm256_srli_epi32(bf16_round_to_high_half(a), 16);
    rb = _mm256_srli_epi32(bf16_round_to_high_half(b), 16);
  } else {
    ra = bf16_narrow(a);
    rb = bf16_narrow(b);
  }
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(ra, rb), 0xD8);
}

// Whole vectors of 16 (32 per step); returns how many elements it converted.
template <bool kStream>
std::size_t narrow_bf16(const float* src, std::uint16_t* dst, std::size_t n) {
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i r0 = bf16x16(src + i), r1 = bf16x16(src + i + 16);
    store_si256<kStream>(dst + i, r0);
    store_si256<kStream>(dst + i + 16, r1);
  }
  for (; i + 16 <= n; i += 16) store_si256<kStream>(dst + i, bf16x16(src + i));
  return i;
}

// Fewer than 16 elements, through zero-padded buffers and the same vector code.
void narrow_bf16_partial(const float* src, std::uint16_t* dst, std::size_t n) {
  if (n == 0) return;
  float t[16] = {};
  std::uint16_t td[16];
  std::memcpy(t, src, n * 4);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(td), bf16x16(t));
  std::memcpy(dst, td, n * 2);
}

// 8 bfloat16 / float16 widened to float bits.
inline __m256i widen8_bf16(const std::uint16_t* p) {
  return _mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
}
inline __m256i widen8_half(const std::uint16_t* p) {
  return _mm256_castps_si256(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// 16-bit floats to float, 32 per step through widen8; returns how many elements it converted
// (whole vectors).
template <bool kStream, class Widen8>
std::size_t widen_vectors(const std::uint16_t* src, float* dst, std::size_t n, Widen8 widen8) {
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i v0 = widen8(src + i), v1 = widen8(src + i + 8);
    const __m256i v2 = widen8(src + i + 16), v3 = widen8(src + i + 24);
    store_si256<kStream>(dst + i, v0);
    store_si256<kStream>(dst + i + 8, v1);
    store_si256<kStream>(dst + i + 16, v2);
    store_si256<kStream>(dst + i + 24, v3);
  }
  for (; i + 8 <= n; i += 8) store_si256<kStream>(dst + i, widen8(src + i));
  return i;
}

// Elements before dst reaches a 32-byte boundary (streaming stores need one), or
// kUnaligned if it never can (an address not a multiple of the element size).
constexpr std::size_t kUnaligned = ~std::size_t{0};
std::size_t head_to_align32(const void* dst, std::size_t elem) {
  const auto addr = reinterpret_cast<std::uintptr_t>(dst);
  if (addr % elem != 0) return kUnaligned;
  return (32 - addr % 32) % 32 / elem;
}

struct I32Lane {
  using T = std::int32_t;
  static constexpr std::size_t kWidth = 8;
  static __m256i load(const T* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static void store(T* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
};
struct I64Lane {
  using T = std::int64_t;
  static constexpr std::size_t kWidth = 4;
  static __m256i load(const T* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static void store(T* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
};
struct U8Lane {
  using T = std::uint8_t;
  static constexpr std::size_t kWidth = 32;
  static __m256i load(const T* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  static void store(T* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
};

// ---------------------------------------------------------------- loops

// d[i] = Op(x[i], y[i]). Four vectors per iteration keep both load ports busy; every
// iteration loads before it stores at the same indices, so d may alias x or y.
template <class L, class Op>
void binary(void* dst, const void* a, const void* b, std::size_t n) {
  using T = typename L::T;
  constexpr std::size_t W = L::kWidth;
  T* d = static_cast<T*>(dst);
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  std::size_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    const auto x0 = L::load(x + i), x1 = L::load(x + i + W);
    const auto x2 = L::load(x + i + 2 * W), x3 = L::load(x + i + 3 * W);
    const auto y0 = L::load(y + i), y1 = L::load(y + i + W);
    const auto y2 = L::load(y + i + 2 * W), y3 = L::load(y + i + 3 * W);
    L::store(d + i, Op::apply(x0, y0));
    L::store(d + i + W, Op::apply(x1, y1));
    L::store(d + i + 2 * W, Op::apply(x2, y2));
    L::store(d + i + 3 * W, Op::apply(x3, y3));
  }
  for (; i + W <= n; i += W) L::store(d + i, Op::apply(L::load(x + i), L::load(y + i)));
  if (i < n) {
    const std::size_t bytes = (n - i) * sizeof(T);
    T tx[W] = {}, ty[W] = {}, td[W] = {};
    std::memcpy(tx, x + i, bytes);
    std::memcpy(ty, y + i, bytes);
    L::store(td, Op::apply(L::load(tx), L::load(ty)));
    std::memcpy(d + i, td, bytes);
  }
}

// p[i] = fn(p[i]) in place; the loaded representation comes from L.
template <class L, class Fn>
void unary_in_place(void* data, std::size_t n, Fn fn) {
  using T = typename L::T;
  constexpr std::size_t W = L::kWidth;
  T* p = static_cast<T*>(data);
  std::size_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    const auto v0 = L::load(p + i), v1 = L::load(p + i + W);
    L::store(p + i, fn(v0));
    L::store(p + i + W, fn(v1));
  }
  for (; i + W <= n; i += W) L::store(p + i, fn(L::load(p + i)));
  if (i < n) {
    const std::size_t bytes = (n - i) * sizeof(T);
    T t[W] = {};
    std::memcpy(t, p + i, bytes);
    L::store(t, fn(L::load(t)));
    std::memcpy(p + i, t, bytes);
  }
}

// dst[i] = Out(In(src[i])): both lanes move 8 floats through a __m256.
template <class In, class Out>
void convert(const typename In::T* src, typename Out::T* dst, std::size_t n) {
  static_assert(In::kWidth == 8 && Out::kWidth == 8);
  constexpr std::size_t W = 8;
  std::size_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    const __m256 v0 = In::load(src + i), v1 = In::load(src + i + W);
    const __m256 v2 = In::load(src + i + 2 * W), v3 = In::load(src + i + 3 * W);
    Out::store(dst + i, v0);
    Out::store(dst + i + W, v1);
    Out::store(dst + i + 2 * W, v2);
    Out::store(dst + i + 3 * W, v3);
  }
  for (; i + W <= n; i += W) Out::store(dst + i, In::load(src + i));
  if (i < n) {
    typename In::T ts[W] = {};
    typename Out::T td[W] = {};
    std::memcpy(ts, src + i, (n - i) * sizeof(typename In::T));
    Out::store(td, In::load(ts));
    std::memcpy(dst + i, td, (n - i) * sizeof(typename Out::T));
  }
}

template <class L, class Sum, class Prod, class Min, class Max>
void by_op(void* d, const void* a, const void* b, std::size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return binary<L, Sum>(d, a, b, n);
    case ReduceOp::kProd:
      return binary<L, Prod>(d, a, b, n);
    case ReduceOp::kMin:
      return binary<L, Min>(d, a, b, n);
    case ReduceOp::kMax:
      return binary<L, Max>(d, a, b, n);
    case ReduceOp::kBand:
    case ReduceOp::kBor:
    case ReduceOp::kBxor:
      return;  // reduce() takes these before it gets here
  }
}

// Integer division by n via a floating quotient: exact after truncation whenever every
// dividend and n are exact in the float type, because a non-integer quotient x/n lies at
// least 1/n (relative >= 1/|x|) from the nearest integer, far more than half an ulp.
// int32 uses double (53 bits >= 31), uint8 uses float (24 bits >= 8).
__m256i div_i32(__m256i x, __m256d n) {
  const __m128i lo =
      _mm256_cvttpd_epi32(_mm256_div_pd(_mm256_cvtepi32_pd(_mm256_castsi256_si128(x)), n));
  const __m128i hi =
      _mm256_cvttpd_epi32(_mm256_div_pd(_mm256_cvtepi32_pd(_mm256_extracti128_si256(x, 1)), n));
  return _mm256_set_m128i(hi, lo);
}

__m128i div_u8x16(__m128i x, __m256 n) {
  const __m256i q0 =
      _mm256_cvttps_epi32(_mm256_div_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x)), n));
  const __m256i q1 = _mm256_cvttps_epi32(
      _mm256_div_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(x, 8))), n));
  const __m128i w0 = _mm_packus_epi32(_mm256_castsi256_si128(q0), _mm256_extracti128_si256(q0, 1));
  const __m128i w1 = _mm_packus_epi32(_mm256_castsi256_si128(q1), _mm256_extracti128_si256(q1, 1));
  return _mm_packus_epi16(w0, w1);
}

}  // namespace
bool reduce(void* d, const void* a, const void* b, std::size_t n, DataType dtype, ReduceOp op) {
  // Bitwise ops on integers (never floats: the caller refuses those) run over the bytes.
  // bool is left to the scalar path, which also turns a byte other than 0 or 1 into 0 or 1.
  if (op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor) {
    if (dtype == DataType::kBool) return false;
    const std::size_t bytes = n * dtype_size(dtype);
    if (op == ReduceOp::kBand) binary<U8Lane, SiAnd>(d, a, b, bytes);
    if (op == ReduceOp::kBor) binary<U8Lane, SiOr>(d, a, b, bytes);
    if (op == ReduceOp::kBxor) binary<U8Lane, SiXor>(d, a, b, bytes);
    return true;
  }
  switch (dtype) {
    case DataType::kFloat32:
      by_op<F32Lane, PsSum, PsProd, PsMin, PsMax>(d, a, b, n, op);
      return true;
    case DataType::kFloat64:
      by_op<F64Lane, PdSum, PdProd, PdMin, PdMax>(d, a, b, n, op);
      return true;
    case DataType::kFloat16:
      by_op<F16Lane, PsSum, PsProd, PsMin, PsMax>(d, a, b, n, op);
      return true;
    case DataType::kBFloat16:
      by_op<BF16PairLane, PairOp<PsSum>, PairOp<PsProd>, PairOp<PsMin>, PairOp<PsMax>>(d, a, b, n,
                                                                                       op);
      return true;
    case DataType::kInt32:
      by_op<I32Lane, I32Sum, I32Prod, I32Min, I32Max>(d, a, b, n, op);
      return true;
    case DataType::kInt64:
      by_op<I64Lane, I64Sum, I64Prod, I64Min, I64Max>(d, a, b, n, op);
      return true;
    case DataType::kUInt8:
      by_op<U8Lane, U8Sum, U8Prod, U8Min, U8Max>(d, a, b, n, op);
      return true;
    case DataType::kInt8:  // rare in gradients: the scalar path is fast enough
    case DataType::kInt16:
    case DataType::kBool:
      return false;
  }
  return false;
}

namespace {

// sum_finish over whole vectors of 8, its options fixed at compile time so the loop has no
// branch but the rare one that notes the first non-finite result. A 16-bit result is
// checked in its own bits: all-ones exponent.
template <bool kDivide, DataType kOut>
std::size_t sum_finish_vectors(void* dst, const float* a, const float* b, std::size_t n,
                               float divisor, std::size_t& first_bad) {
  const __m256 fd = _mm256_set1_ps(divisor);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 s = PsSum::apply(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i));
    if constexpr (kDivide) s = _mm256_div_ps(s, fd);
    int bad = 0;
    if constexpr (kOut == DataType::kFloat32) {
      _mm256_storeu_ps(static_cast<float*>(dst) + i, s);
      const __m256i exp = _mm256_set1_epi32(0x7F800000);
      const __m256i bits = _mm256_and_si256(_mm256_castps_si256(s), exp);
      bad = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(bits, exp)));
    } else {
      __m128i h;
      __m128i exp;
      if constexpr (kOut == DataType::kFloat16) {
        h = _mm256_cvtps_ph(s, kRoundNearest);
        exp = _mm_set1_epi16(0x7C00);
      } else {
        h = bf16_pack8(s);
        exp = _mm_set1_epi16(0x7F80);
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<std::uint16_t*>(dst) + i), h);
      // Two mask bits per element; keep one.
      bad = _mm_movemask_epi8(_mm_cmpeq_epi16(_mm_and_si128(h, exp), exp)) & 0x5555;
    }
    if (bad != 0 && first_bad > i) [[unlikely]] {
      const auto lane = static_cast<std::size_t>(__builtin_ctz(static_cast<unsigned>(bad)));
      first_bad = i + (kOut == DataType::kFloat32 ? lane : lane / 2);
    }
  }
  return i;
}

template <bool kDivide, DataType kOut>
std::size_t sum_finish_all(void* dst, const float* a, const float* b, std::size_t n,
                           float divisor) {
  std::size_t first_bad = n;
  const std::size_t done = sum_finish_vectors<kDivide, kOut>(dst, a, b, n, divisor, first_bad);
  if (done < n) {  // the tail through zero-padded buffers and the same vector code
    constexpr std::size_t kOutBytes = kOut == DataType::kFloat32 ? 4 : 2;
    float ta[8] = {}, tb[8] = {};
    unsigned char td[8 * kOutBytes];
    std::size_t tail_bad = 8;
    std::memcpy(ta, a + done, (n - done) * 4);
    std::memcpy(tb, b + done, (n - done) * 4);
    sum_finish_vectors<kDivide, kOut>(td, ta, tb, 8, divisor, tail_bad);
    std::memcpy(static_cast<unsigned char*>(dst) + done * kOutBytes, td, (n - done) * kOutBytes);
    if (first_bad == n && tail_bad < n - done) first_bad = done + tail_bad;
  }
  return first_bad;
}

template <bool kDivide>
std::size_t sum_finish_into(void* dst, DataType dst_type, const float* a, const float* b,
                            std::size_t n, float divisor) {
  switch (dst_type) {
    case DataType::kFloat16:
      return sum_finish_all<kDivide, DataType::kFloat16>(dst, a, b, n, divisor);
    case DataType::kBFloat16:
      return sum_finish_all<kDivide, DataType::kBFloat16>(dst, a, b, n, divisor);
    default:
      return sum_finish_all<kDivide, DataType::kFloat32>(dst, a, b, n, divisor);
  }
}

}  // namespace

std::size_t sum_finish(void* dst, DataType dst_type, const float* a, const float* b, std::size_t n,
                       int divisor) {
  const auto fd = static_cast<float>(divisor);
  return divisor == 1 ? sum_finish_into<false>(dst, dst_type, a, b, n, fd)
                      : sum_finish_into<true>(dst, dst_type, a, b, n, fd);
}

void float_from_16bit_streaming(const std::uint16_t* src, float* dst, std::size_t n,
                                DataType from) {
  const bool bf16 = from == DataType::kBFloat16;
  const auto widen = [bf16](const std::uint16_t* s, float* d, std::size_t count) {
    if (bf16) {
      convert<BF16Lane, F32Lane>(s, d, count);
    } else {
      convert<F16Lane, F32Lane>(s, d, count);
    }
  };
  const std::size_t head = head_to_align32(dst, 4);
  if (head == kUnaligned || head >= n) return widen(src, dst, n);
  widen(src, dst, head);
  const std::size_t done =
      head + (bf16 ? widen_vectors<true>(src + head, dst + head, n - head, widen8_bf16)
                   : widen_vectors<true>(src + head, dst + head, n - head, widen8_half));
  _mm_sfence();
  widen(src + done, dst + done, n - done);
}

bool scale_for_average(void* data, std::size_t n, DataType dtype, int divisor) {
  const __m256 fd = _mm256_set1_ps(static_cast<float>(divisor));
  const __m256d dd = _mm256_set1_pd(static_cast<double>(divisor));
  switch (dtype) {
    case DataType::kFloat32:
      unary_in_place<F32Lane>(data, n, [fd](__m256 v) { return _mm256_div_ps(v, fd); });
      return true;
    case DataType::kFloat64:
      unary_in_place<F64Lane>(data, n, [dd](__m256d v) { return _mm256_div_pd(v, dd); });
      return true;
    case DataType::kFloat16:
      unary_in_place<F16Lane>(data, n, [fd](__m256 v) { return _mm256_div_ps(v, fd); });
      return true;
    case DataType::kBFloat16:  // NaN inputs keep their payload, so quiet them explicitly
      unary_in_place<BF16Lane>(data, n, [fd](__m256 v) { return _mm256_div_ps(v, fd); });
      return true;
    case DataType::kInt32:
      unary_in_place<I32Lane>(data, n, [dd](__m256i v) { return div_i32(v, dd); });
      return true;
    case DataType::kUInt8:
      unary_in_place<U8Lane>(data, n, [fd](__m256i v) {
        return _mm256_set_m128i(div_u8x16(_mm256_extracti128_si256(v, 1), fd),
                                div_u8x16(_mm256_castsi256_si128(v), fd));
      });
      return true;
    case DataType::kInt64:
    case DataType::kInt8:  // the scalar path's plain division
    case DataType::kInt16:
    case DataType::kBool:
      return false;
  }
  return false;
}

void float_to_half(const float* src, std::uint16_t* dst, std::size_t n) {
  convert<F32Lane, F16Lane>(src, dst, n);
}
void half_to_float(const std::uint16_t* src, float* dst, std::size_t n) {
  convert<F16Lane, F32Lane>(src, dst, n);
}
// Large calls stream their output past the cache (kernels.h, kStreamBytes), which is faster
// for both conversions, since a plain store first reads every output line it will overwrite.
// Below that size the output is left in cache for whoever reads it next, where streaming
// would slow widening down (docs/performance-notes.md).
void float_to_bfloat16(const float* src, std::uint16_t* dst, std::size_t n) {
  std::size_t done = 0;
  const std::size_t head = head_to_align32(dst, 2);
  if (n * 6 >= kStreamBytes && head != kUnaligned) {
    narrow_bf16_partial(src, dst, head);
    done = head + narrow_bf16<true>(src + head, dst + head, n - head);
    _mm_sfence();  // order the streaming stores before any later store (a flag, a lock)
  } else {
    done = narrow_bf16<false>(src, dst, n);
  }
  narrow_bf16_partial(src + done, dst + done, n - done);
}

void bfloat16_to_float(const std::uint16_t* src, float* dst, std::size_t n) {
  const std::size_t head = head_to_align32(dst, 4);
  if (n * 6 >= kStreamBytes && head != kUnaligned) {
    convert<BF16Lane, F32Lane>(src, dst, head);
    const std::size_t done =
        head + widen_vectors<true>(src + head, dst + head, n - head, widen8_bf16);
    _mm_sfence();
    convert<BF16Lane, F32Lane>(src + done, dst + done, n - done);
  } else {
    convert<BF16Lane, F32Lane>(src, dst, n);
  }
}

}  // namespace gradsync::kernels::avx2
