// Entry points of the AVX2/F16C kernels (kernels_avx2.cc). Private to src/kernels: only the
// dispatcher in kernels.cc calls them, and only after checking the CPU has avx2+f16c+fma.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gradsync/types.h"

namespace gradsync::kernels {

// The integer hash behind qsgd's counter-based draws, on both paths: h ^= h >> 16,
// h *= kDrawMul1, h ^= h >> 15, h *= kDrawMul2, h ^= h >> 15 (C. Wellons' hash-prospector,
// "lowbias32" with its improved constants). Two multiply-xorshift rounds of 32 bits: cheap
// in vector lanes (AVX2 has no 64-bit multiply), and less biased than murmur3's finaliser.
inline constexpr std::uint32_t kDrawMul1 = 0x21F0AAADu;
inline constexpr std::uint32_t kDrawMul2 = 0x735A2D97u;

}  // namespace gradsync::kernels

namespace gradsync::kernels::avx2 {

// Same contracts as the public functions in kernels.h; arguments are already validated
// (count > 0, pointers non-null, divisor > 1, no bitwise op on a float dtype).
// Returns false, having done nothing, for what it does not vectorise (int8, int16 and bool
// but for int8/int16 bitwise ops), which the caller then runs on the scalar path.
bool reduce(void* dst, const void* a, const void* b, std::size_t count, DataType dtype,
            ReduceOp op);
// Returns false for dtypes it does not vectorise (int64: no SIMD division; int8, int16,
// bool), which the caller then runs on the scalar path.
bool scale_for_average(void* data, std::size_t count, DataType dtype, int divisor);
std::size_t sum_finish(void* dst, DataType dst_type, const float* a, const float* b,
                       std::size_t count, int divisor);
void float_from_16bit_streaming(const std::uint16_t* src, float* dst, std::size_t count,
                                DataType from);
void float_to_half(const float* src, std::uint16_t* dst, std::size_t count);
void half_to_float(const std::uint16_t* src, float* dst, std::size_t count);
void float_to_bfloat16(const float* src, std::uint16_t* dst, std::size_t count);
void bfloat16_to_float(const std::uint16_t* src, float* dst, std::size_t count);

void quantize_int8_blocks(const float* in, std::size_t count, std::size_t block, float* scales,
                          std::int8_t* q);
void dequantize_int8_blocks(const std::int8_t* q, const float* scales, std::size_t count,
                            std::size_t block, float* out, bool accumulate);
void pack_signs(const float* in, std::size_t count, std::uint8_t* bits);
void unpack_signs_scaled(const std::uint8_t* bits, std::size_t count, float scale, float* out,
                         bool accumulate);
// The 32 lane sums of sum_abs (lane j: elements i with i % 32 == j), which the caller
// combines in its fixed order.
void sum_abs_lanes(const float* in, std::size_t count, double lanes[32]);
// Sum of in[i]^2 in double, lane i % 32, the lanes combined in sum_abs's fixed order (in
// registers here); NaN payloads are not canonical (the caller does that).
double sum_squares(const float* in, std::size_t count);
// The values of one run of quantize_stochastic_int8_blocks: q[j] from the level times 2^24,
// (|in[j]| * pre) * post clamped to `top`, and the draw of hash input start + j * step
// (mod 2^32).
void stochastic_levels(const float* in, std::size_t count, float pre, float post, float top,
                       std::uint32_t start, std::uint32_t step, std::int8_t* q);
// max over (bits & 0x7FFFFFFF) as unsigned integers: NaN patterns rank above Inf.
std::uint32_t max_abs_bits(const float* in, std::size_t count);
std::size_t first_non_finite(const float* in, std::size_t count);

}  // namespace gradsync::kernels::avx2
