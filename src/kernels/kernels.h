// Reduction and conversion loops over every dtype and op. Vectorised with AVX2/F16C when
// the CPU has them (chosen once at run time); portable scalar fallback otherwise.
#pragma once

#include <cstddef>
#include <cstdint>

#include "gradsync/types.h"

namespace gradsync::kernels {

// dst[i] = op(dst[i], src[i]) for i < count. kAvg reduces as kSum (finish with
// scale_for_average). All ops are commutative bit-for-bit, including with NaN (min/max
// propagate NaN), so every rank computes identical results whatever the operand order.
// float16/bfloat16 are widened to float32, combined, and rounded to nearest even.
void reduce_into(void* dst, const void* src, std::size_t count, DataType dtype, ReduceOp op);

// dst[i] = op(a[i], b[i]); dst may alias a or b.
void reduce(void* dst, const void* a, const void* b, std::size_t count, DataType dtype,
            ReduceOp op);

// Divides every element by `divisor` (float types: multiply by nothing clever, a true
// division, so results match the reference x / n exactly; integers: truncating division).
void scale_for_average(void* data, std::size_t count, DataType dtype, int divisor);

void float_to_half(const float* src, std::uint16_t* dst, std::size_t count);
void half_to_float(const std::uint16_t* src, float* dst, std::size_t count);
void float_to_bfloat16(const float* src, std::uint16_t* dst, std::size_t count);
void bfloat16_to_float(const std::uint16_t* src, float* dst, std::size_t count);
// The same, for a 16-bit float type chosen at run time (kFloat16 or kBFloat16).
void float_to_16bit(const float* src, std::uint16_t* dst, std::size_t count, DataType to);
void float_from_16bit(const std::uint16_t* src, float* dst, std::size_t count, DataType from);

// Scalar conversions (reference and tests).
std::uint16_t float_to_half(float f);
float half_to_float(std::uint16_t h);
std::uint16_t float_to_bfloat16(float f);
float bfloat16_to_float(std::uint16_t h);

// Which implementation run-time dispatch picked ("avx2+f16c" or "scalar").
const char* isa_name();
// Forces the scalar path (tests compare both paths). Safe while kernels run: both paths
// produce identical bits.
void force_scalar(bool on);

}  // namespace gradsync::kernels
