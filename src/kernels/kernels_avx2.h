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

}  // namespace gradsync::kernels::avx2
