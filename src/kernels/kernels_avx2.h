// Entry points of the AVX2/F16C kernels (kernels_avx2.cc). Private to src/kernels: only the
// dispatcher in kernels.cc calls them, and only after checking the CPU has avx2+f16c+fma.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gradsync/types.h"

namespace gradsync::kernels::avx2 {

// Same contracts as the public functions in kernels.h; arguments are already validated
// (count > 0, pointers non-null, divisor > 1).
void reduce(void* dst, const void* a, const void* b, std::size_t count, DataType dtype,
            ReduceOp op);
// Returns false for dtypes it does not vectorise (int64: no SIMD division), which the
// caller then runs on the scalar path.
bool scale_for_average(void* data, std::size_t count, DataType dtype, int divisor);
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
// max over (bits & 0x7FFFFFFF) as unsigned integers: NaN patterns rank above Inf.
std::uint32_t max_abs_bits(const float* in, std::size_t count);
std::size_t first_non_finite(const float* in, std::size_t count);

}  // namespace gradsync::kernels::avx2
