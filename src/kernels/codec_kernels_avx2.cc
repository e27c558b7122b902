// AVX2 kernels of the gradient codecs (int8 blocks, qsgd's stochastic levels, sign bits,
// norms, finiteness): the same element rules as the scalar path in kernels.cc, bit for bit.
// Compiled with -mavx2 -mf16c -mfma, under kernels_avx2.cc's rules (its first comment):
// internal linkage only, and no float multiply feeding an add that GCC could fuse.
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels/avx2_common.h"
#include "kernels/kernels_avx2.h"

namespace gradsync::kernels::avx2 {
namespace {

// Hides a value from the optimiser, so a product is rounded before it feeds an add (GCC
// implements _mm256_mul_ps/_mm256_add_ps as plain vector arithmetic and would contract the
// pair into an FMA, unlike the scalar path).
inline __m256 opaque(__m256 v) {
  __asm__("" : "+x"(v));
  return v;
}

inline __m256 abs_ps(__m256 v) {
  return _mm256_castsi256_ps(
      _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7FFFFFFF)));
}

// Largest |x| over n floats; NaN elements are skipped (maxps returns its second operand,
// the running peak, when the first is NaN), as std::max(peak, fabs(x)) does. All values
// compared are >= +0, so the horizontal order cannot change the result.
float block_peak(const float* p, std::size_t n) {
  __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm256_max_ps(abs_ps(_mm256_loadu_ps(p + i)), m0);
    m1 = _mm256_max_ps(abs_ps(_mm256_loadu_ps(p + i + 8)), m1);
  }
  for (; i + 8 <= n; i += 8) m0 = _mm256_max_ps(abs_ps(_mm256_loadu_ps(p + i)), m0);
  if (i < n) {
    float t[8] = {};  // zero padding cannot raise the peak
    std::memcpy(t, p + i, (n - i) * 4);
    m1 = _mm256_max_ps(abs_ps(_mm256_loadu_ps(t)), m1);
  }
  const __m256 m = _mm256_max_ps(m0, m1);
  __m128 r = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  r = _mm_max_ps(r, _mm_movehl_ps(r, r));
  r = _mm_max_ss(r, _mm_shuffle_ps(r, r, 1));
  return _mm_cvtss_f32(r);
}

// quantize_one of kernels.cc for 8 lanes: round to nearest even, NaN to 0, clamp, to int32.
inline __m256i quantize8(__m256 x, __m256 inverse) {
  const __m256 r = _mm256_round_ps(_mm256_mul_ps(x, inverse), kRoundNearest);
  const __m256 finite = _mm256_and_ps(r, _mm256_cmp_ps(r, r, _CMP_ORD_Q));
  const __m256 c =
      _mm256_min_ps(_mm256_max_ps(finite, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
  return _mm256_cvtps_epi32(c);
}

// Narrows 8 int32 lanes (all within -127..127) to 8 bytes.
inline void store_i8x8(std::int8_t* q, __m256i v) {
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(q), _mm_packs_epi16(w, w));
}

void quantize_block(const float* p, std::size_t n, __m256 inverse, std::int8_t* q) {
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i a = quantize8(_mm256_loadu_ps(p + i), inverse);
    const __m256i b = quantize8(_mm256_loadu_ps(p + i + 8), inverse);
    const __m256i c = quantize8(_mm256_loadu_ps(p + i + 16), inverse);
    const __m256i d = quantize8(_mm256_loadu_ps(p + i + 24), inverse);
    // packs interleave 128-bit halves: bytes come out as a0-3 b0-3 c0-3 d0-3 a4-7 ...;
    // the dword permutation puts them back in order.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(q + i),
        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
  for (; i + 8 <= n; i += 8) store_i8x8(q + i, quantize8(_mm256_loadu_ps(p + i), inverse));
  if (i < n) {
    float t[8] = {};
    std::int8_t tq[8];
    std::memcpy(t, p + i, (n - i) * 4);
    store_i8x8(tq, quantize8(_mm256_loadu_ps(t), inverse));
    std::memcpy(q + i, tq, n - i);
  }
}

inline __m256 widen_i8x8(const std::int8_t* q) {
  return _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}

inline __m256 add_canon(__m256 acc, __m256 v) {
  return canon_ps(_mm256_add_ps(acc, opaque(v)));
}

void dequantize_block(const std::int8_t* q, std::size_t n, __m256 scale, float* out,
                      bool accumulate) {
  std::size_t i = 0;
  if (accumulate) {
    for (; i + 8 <= n; i += 8) {
      const __m256 v = _mm256_mul_ps(widen_i8x8(q + i), scale);
      _mm256_storeu_ps(out + i, add_canon(_mm256_loadu_ps(out + i), v));
    }
  } else {
    for (; i + 16 <= n; i += 16) {
      _mm256_storeu_ps(out + i, _mm256_mul_ps(widen_i8x8(q + i), scale));
      _mm256_storeu_ps(out + i + 8, _mm256_mul_ps(widen_i8x8(q + i + 8), scale));
    }
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(widen_i8x8(q + i), scale));
  }
  if (i < n) {
    std::int8_t tq[8] = {};
    float t[8] = {};
    std::memcpy(tq, q + i, n - i);
    if (accumulate) std::memcpy(t, out + i, (n - i) * 4);
    const __m256 v = _mm256_mul_ps(widen_i8x8(tq), scale);
    _mm256_storeu_ps(t, accumulate ? add_canon(_mm256_loadu_ps(t), v) : v);
    std::memcpy(out + i, t, (n - i) * 4);
  }
}

// ---------------------------------------------------------------- qsgd

// draw_hash of kernels.cc in 8 lanes (vpmulld: the 32-bit low product, modulo 2^32).
inline __m256i draw_hash8(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(kDrawMul1)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(kDrawMul2)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 15));
}

struct LevelParams {
  __m256 pre, post, top;
};

// scalar_stochastic_levels of kernels.cc for 8 elements: int32 lanes, sign applied. Nothing
// here is a product feeding an add, so there is nothing for FMA contraction to fuse.
template <bool kPre>
inline __m256i stochastic8(__m256 x, __m256i input, const LevelParams& p) {
  __m256 scaled = abs_ps(x);
  if constexpr (kPre) scaled = _mm256_mul_ps(scaled, p.pre);  // |x| * 1 is |x|: same bits
  scaled = _mm256_mul_ps(scaled, p.post);
  // level * 2^24 in [0, levels * 2^24]; minps gives its second operand (the top) for NaN.
  const __m256i fixed = _mm256_cvttps_epi32(_mm256_min_ps(scaled, p.top));
  const __m256i frac = _mm256_and_si256(fixed, _mm256_set1_epi32(0xFFFFFF));
  const __m256i u = _mm256_srli_epi32(draw_hash8(input), 8);
  // All ones (-1) where u < frac (both below 2^24), so subtracting the mask rounds up.
  const __m256i l = _mm256_sub_epi32(_mm256_srli_epi32(fixed, 24), _mm256_cmpgt_epi32(frac, u));
  // vpsignd: negated where x's sign bit is set; zeroed where x is +0, whose level is 0.
  return _mm256_sign_epi32(l, _mm256_castps_si256(x));
}

template <bool kPre>
void stochastic_run(const float* in, std::size_t n, const LevelParams& p, std::uint32_t start,
                    std::uint32_t step, std::int8_t* q) {
  const __m256i lane_steps = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                _mm256_set1_epi32(static_cast<int>(step)));
  __m256i input = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(start)), lane_steps);
  const __m256i step8 = _mm256_set1_epi32(static_cast<int>(step * 8u));
  const auto next = [&input, &step8]() {
    const __m256i now = input;
    input = _mm256_add_epi32(input, step8);
    return now;
  };
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i a = stochastic8<kPre>(_mm256_loadu_ps(in + i), next(), p);
    const __m256i b = stochastic8<kPre>(_mm256_loadu_ps(in + i + 8), next(), p);
    const __m256i c = stochastic8<kPre>(_mm256_loadu_ps(in + i + 16), next(), p);
    const __m256i d = stochastic8<kPre>(_mm256_loadu_ps(in + i + 24), next(), p);
    // As in quantize_block: packs interleave 128-bit halves, the permutation restores order.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(q + i),
        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
  for (; i + 8 <= n; i += 8) {
    store_i8x8(q + i, stochastic8<kPre>(_mm256_loadu_ps(in + i), next(), p));
  }
  if (i < n) {
    float t[8] = {};
    std::int8_t tq[8];
    std::memcpy(t, in + i, (n - i) * 4);
    store_i8x8(tq, stochastic8<kPre>(_mm256_loadu_ps(t), next(), p));
    std::memcpy(q + i, tq, n - i);
  }
}

// One mask lane per bit of `byte`: all ones where the bit is set.
inline __m256 bit_lanes(std::uint8_t byte) {
  const __m256i select = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i b = _mm256_and_si256(_mm256_set1_epi32(byte), select);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(b, select));
}

// Eight elements of unpack_signs_scaled: the sign bit of scale flipped where the bit is set
// (exactly -scale, as in the scalar path).
inline __m256 signed_scale(std::uint8_t byte, __m256 scale) {
  return _mm256_xor_ps(scale, _mm256_and_ps(bit_lanes(byte), _mm256_set1_ps(-0.0f)));
}

}  // namespace

void quantize_int8_blocks(const float* in, std::size_t n, std::size_t block, float* scales,
                          std::int8_t* q) {
  for (std::size_t b = 0, lo = 0; lo < n; ++b, lo += block) {
    const std::size_t len = n - lo < block ? n - lo : block;
    // Scalar float arithmetic, as in kernels.cc: the division and reciprocal round once.
    const float scale = block_peak(in + lo, len) / 127.0f;
    scales[b] = scale;
    const float inverse = scale > 0 ? 1.0f / scale : 0.0f;
    quantize_block(in + lo, len, _mm256_set1_ps(inverse), q + lo);
  }
}

void dequantize_int8_blocks(const std::int8_t* q, const float* scales, std::size_t n,
                            std::size_t block, float* out, bool accumulate) {
  for (std::size_t b = 0, lo = 0; lo < n; ++b, lo += block) {
    const std::size_t len = n - lo < block ? n - lo : block;
    dequantize_block(q + lo, len, _mm256_set1_ps(scales[b]), out + lo, accumulate);
  }
}

void pack_signs(const float* in, std::size_t n, std::uint8_t* bits) {
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const std::uint32_t m =
        static_cast<std::uint32_t>(_mm256_movemask_ps(_mm256_loadu_ps(in + i))) |
        static_cast<std::uint32_t>(_mm256_movemask_ps(_mm256_loadu_ps(in + i + 8))) << 8 |
        static_cast<std::uint32_t>(_mm256_movemask_ps(_mm256_loadu_ps(in + i + 16))) << 16 |
        static_cast<std::uint32_t>(_mm256_movemask_ps(_mm256_loadu_ps(in + i + 24))) << 24;
    std::memcpy(bits + i / 8, &m, 4);  // little-endian: byte k holds elements 8k..8k+7
  }
  for (; i + 8 <= n; i += 8) {
    bits[i / 8] = static_cast<std::uint8_t>(_mm256_movemask_ps(_mm256_loadu_ps(in + i)));
  }
  if (i < n) {
    float t[8] = {};  // +0 padding: the unused high bits come out zero
    std::memcpy(t, in + i, (n - i) * 4);
    bits[i / 8] = static_cast<std::uint8_t>(_mm256_movemask_ps(_mm256_loadu_ps(t)));
  }
}

void unpack_signs_scaled(const std::uint8_t* bits, std::size_t n, float scale, float* out,
                         bool accumulate) {
  const __m256 s = _mm256_set1_ps(scale);
  std::size_t i = 0;
  if (accumulate) {
    for (; i + 8 <= n; i += 8) {
      const __m256 v = signed_scale(bits[i / 8], s);
      _mm256_storeu_ps(out + i, add_canon(_mm256_loadu_ps(out + i), v));
    }
  } else {
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, signed_scale(bits[i / 8], s));
  }
  if (i < n) {
    float t[8] = {};
    if (accumulate) std::memcpy(t, out + i, (n - i) * 4);
    const __m256 v = signed_scale(bits[i / 8], s);
    _mm256_storeu_ps(t, accumulate ? add_canon(_mm256_loadu_ps(t), v) : v);
    std::memcpy(out + i, t, (n - i) * 4);
  }
}

// The lanes of scalar_sum_squares (kernels.cc) as sum_abs_lanes keeps them, then
// combine_lanes' additions in the same order: width 16 is acc[k] += acc[k + 4], width 8
// acc[k] += acc[k + 2], width 4 acc[0] += acc[1], then within acc[0]. A square of a float is
// exact in double, so an FMA formed from a multiply and its add rounds alike.
double sum_squares(const float* in, std::size_t n) {
  __m256d acc[8];
  for (auto& a : acc) a = _mm256_setzero_pd();
  const auto add32 = [&acc](const float* p) {
    for (int k = 0; k < 8; ++k) {  // 4 floats a load: vcvtps2pd widens straight from memory
      const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(p + 4 * k));
      acc[k] = _mm256_add_pd(acc[k], _mm256_mul_pd(v, v));
    }
  };
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) add32(in + i);
  if (i < n) {
    float t[32] = {};  // +0 squares leave the lane sums (>= +0, or NaN) unchanged
    std::memcpy(t, in + i, (n - i) * 4);
    add32(t);
  }
  for (int k = 0; k < 4; ++k) acc[k] = _mm256_add_pd(acc[k], acc[k + 4]);
  for (int k = 0; k < 2; ++k) acc[k] = _mm256_add_pd(acc[k], acc[k + 2]);
  acc[0] = _mm256_add_pd(acc[0], acc[1]);
  __m128d r = _mm_add_pd(_mm256_castpd256_pd128(acc[0]), _mm256_extractf128_pd(acc[0], 1));
  r = _mm_add_sd(r, _mm_unpackhi_pd(r, r));
  return _mm_cvtsd_f64(r);
}

void stochastic_levels(const float* in, std::size_t n, float pre, float post, float top,
                       std::uint32_t start, std::uint32_t step, std::int8_t* q) {
  const LevelParams p{_mm256_set1_ps(pre), _mm256_set1_ps(post), _mm256_set1_ps(top)};
  if (pre == 1.0f) {
    stochastic_run<false>(in, n, p, start, step, q);
  } else {
    stochastic_run<true>(in, n, p, start, step, q);
  }
}

// Accumulator k (four doubles) holds lanes 4k..4k+3; every 32 elements add one value to
// each lane in index order, as the scalar loop does. The zero-padded tail adds +0.0 to the
// lanes it does not reach, which leaves their (non-negative or NaN) sums unchanged.
void sum_abs_lanes(const float* in, std::size_t n, double lanes[32]) {
  __m256d acc[8];
  for (auto& a : acc) a = _mm256_setzero_pd();
  const auto add32 = [&acc](const float* p) {
    for (int k = 0; k < 4; ++k) {
      const __m256 v = abs_ps(_mm256_loadu_ps(p + 8 * k));
      acc[2 * k] = _mm256_add_pd(acc[2 * k], _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
      acc[2 * k + 1] = _mm256_add_pd(acc[2 * k + 1], _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    }
  };
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) add32(in + i);
  if (i < n) {
    float t[32] = {};
    std::memcpy(t, in + i, (n - i) * 4);
    add32(t);
  }
  for (int k = 0; k < 8; ++k) _mm256_storeu_pd(lanes + 4 * k, acc[k]);
}

// |x| as an unsigned integer orders every float by magnitude and puts NaN above Inf; an
// integer max is exact and associative, so the lane order cannot matter.
std::uint32_t max_abs_bits(const float* in, std::size_t n) {
  const __m256i mask = _mm256_set1_epi32(0x7FFFFFFF);
  const auto bits = [&mask](const float* p) {
    return _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), mask);
  };
  __m256i m0 = _mm256_setzero_si256(), m1 = _mm256_setzero_si256();
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm256_max_epu32(m0, bits(in + i));
    m1 = _mm256_max_epu32(m1, bits(in + i + 8));
  }
  if (i < n) {
    float t[16] = {};
    std::memcpy(t, in + i, (n - i) * 4);
    m0 = _mm256_max_epu32(m0, bits(t));
    m1 = _mm256_max_epu32(m1, bits(t + 8));
  }
  const __m256i m = _mm256_max_epu32(m0, m1);
  __m128i r = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  r = _mm_max_epu32(r, _mm_shuffle_epi32(r, 0x4E));
  r = _mm_max_epu32(r, _mm_shuffle_epi32(r, 0xB1));
  return static_cast<std::uint32_t>(_mm_cvtsi128_si32(r));
}

// Exponent bits all ones is NaN or Inf. 32 elements are tested per step with one branch;
// the step that has one is searched again for the first.
std::size_t first_non_finite(const float* in, std::size_t n) {
  const __m256i exp = _mm256_set1_epi32(0x7F800000);
  const auto bad = [&exp](const float* p) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_cmpeq_epi32(_mm256_and_si256(x, exp), exp);
  };
  const auto first_in = [&bad](const float* p, std::size_t len) -> std::size_t {
    for (std::size_t k = 0; k < len; k += 8) {
      const int m = _mm256_movemask_ps(_mm256_castsi256_ps(bad(p + k)));
      if (m != 0) return k + static_cast<std::size_t>(__builtin_ctz(static_cast<unsigned>(m)));
    }
    return len;
  };
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i any = _mm256_or_si256(_mm256_or_si256(bad(in + i), bad(in + i + 8)),
                                        _mm256_or_si256(bad(in + i + 16), bad(in + i + 24)));
    if (!_mm256_testz_si256(any, any)) return i + first_in(in + i, 32);
  }
  if (i < n) {
    float t[32] = {};  // zeros are finite
    std::memcpy(t, in + i, (n - i) * 4);
    const std::size_t k = first_in(t, 32);
    if (k < n - i) return i + k;
  }
  return n;
}

}  // namespace gradsync::kernels::avx2
