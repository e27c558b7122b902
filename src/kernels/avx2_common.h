// What the AVX2 kernel files (*_avx2.cc) share: rounding mode and NaN canonicalisation.
// Included only by them, which are compiled with -mavx2 -mf16c -mfma; hence the anonymous
// namespace, for the reason kernels_avx2.cc's first comment gives (internal linkage only).
#pragma once

#include <immintrin.h>

namespace gradsync::kernels::avx2 {
namespace {

constexpr int kRoundNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

inline __m256 qnan_ps() {
  return _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
}
inline __m256d qnan_pd() {
  return _mm256_castsi256_pd(_mm256_set1_epi64x(0x7FF8000000000000ll));
}

// Any NaN result becomes the canonical quiet NaN (x86 keeps the first operand's payload
// when both are NaN, which would make a+b and b+a differ).
inline __m256 canon_ps(__m256 r) {
  return _mm256_blendv_ps(r, qnan_ps(), _mm256_cmp_ps(r, r, _CMP_UNORD_Q));
}
inline __m256d canon_pd(__m256d r) {
  return _mm256_blendv_pd(r, qnan_pd(), _mm256_cmp_pd(r, r, _CMP_UNORD_Q));
}

}  // namespace
}  // namespace gradsync::kernels::avx2
