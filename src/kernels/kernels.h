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
// Integers wrap; bitwise ops act on their bits and throw Error(kInvalidArgument) for a float
// dtype. bool is logic: a nonzero byte is true, results are 0 or 1 (sum/max/bor: OR,
// prod/min/band: AND, bxor: XOR).
void reduce_into(void* dst, const void* src, std::size_t count, DataType dtype, ReduceOp op);

// dst[i] = op(a[i], b[i]); dst may alias a or b.
void reduce(void* dst, const void* a, const void* b, std::size_t count, DataType dtype,
            ReduceOp op);

// Divides every element by `divisor` (float types: multiply by nothing clever, a true
// division, so results match the reference x / n exactly; integers and bool: truncating
// division).
void scale_for_average(void* data, std::size_t count, DataType dtype, int divisor);

// The last step of a float32 sum (kSum or kAvg), fused into one pass over registers:
// (a[i] + b[i]) / divisor (divisor 1: a sum), stored to dst as dst_type: kFloat32, or
// kFloat16/kBFloat16 rounded to nearest even (the finished sum as a 16-bit wire carries
// it). Bit for bit what reduce, scale_for_average and float_to_16bit give one after the
// other. Returns the index of the first non-finite result (as stored: a sum past the 16-bit
// range is Inf), or count. dst may alias a or b when dst_type is kFloat32.
std::size_t sum_finish(void* dst, DataType dst_type, const float* a, const float* b,
                       std::size_t count, int divisor);

void float_to_half(const float* src, std::uint16_t* dst, std::size_t count);
void half_to_float(const std::uint16_t* src, float* dst, std::size_t count);
// On the vector path, a call that reads and writes kStreamBytes or more in all stores its
// output with non-temporal stores: the same bits, not left in cache. Past about that size
// (a core's share of last-level cache) it would not stay there anyway, and a plain store
// first reads every output line it overwrites.
void float_to_bfloat16(const float* src, std::uint16_t* dst, std::size_t count);
void bfloat16_to_float(const std::uint16_t* src, float* dst, std::size_t count);
inline constexpr std::size_t kStreamBytes = std::size_t{16} << 20;
// The same, for a 16-bit float type chosen at run time (kFloat16 or kBFloat16).
void float_to_16bit(const float* src, std::uint16_t* dst, std::size_t count, DataType to);
void float_from_16bit(const std::uint16_t* src, float* dst, std::size_t count, DataType from);
// float_from_16bit whose output always bypasses the cache (non-temporal stores, fenced
// before it returns), for a caller that knows the output is not read again soon even though
// this one call is small: a piece of a large message.
void float_from_16bit_streaming(const std::uint16_t* src, float* dst, std::size_t count,
                                DataType from);

// ---------------------------------------------------------------- gradient codecs
// Building blocks of the gradient codecs (src/compress/). Both paths give identical bits
// for every input, NaN and Inf included, so every rank encodes and decodes alike whatever
// its CPU. Inputs are not checked for NaN/Inf (callers that must refuse them use
// first_non_finite); such inputs still never cause out-of-bounds access or undefined
// behaviour. `block` must be >= 1 (throws Error(kInvalidArgument) otherwise); a null pointer
// with count > 0 throws too.

// Symmetric int8 with one scale per block of `block` elements (the last block may be
// short), so one outlier costs precision only within its block: scales[b] = max|x| / 127
// over block b (0 for an all-zero block; NaN elements do not count towards the max), and
// q[i] = clamp(nearbyint(x * (1.0f / scale)), -127, 127), rounding ties to even, computed in
// float exactly in that order; a NaN product (NaN input, or 0 * Inf when 1/scale overflows
// for a denormal peak) quantises to 0. Writes ceil(count / block) scales and count values.
void quantize_int8_blocks(const float* in, std::size_t count, std::size_t block, float* scales,
                          std::int8_t* q);
// The inverse: out[i] = float(q[i]) * scales[i / block].
void dequantize_int8_blocks(const std::int8_t* q, const float* scales, std::size_t count,
                            std::size_t block, float* out);
// out[i] += float(q[i]) * scales[i / block] (multiply, then add: never fused), so decoded
// payloads are summed without a temporary; a NaN sum is the canonical quiet NaN.
void dequantize_int8_blocks_add(const std::int8_t* q, const float* scales, std::size_t count,
                                std::size_t block, float* out);

// QSGD's stochastic rounding to `levels` (1..127) levels a sign, one scale per block of
// `block` elements (the last may be short). Per block: norm = sqrt(sum of x^2), squared and
// summed in double in 32 lanes (lane k % 32 for the block's k-th element) combined in
// sum_abs's fixed order; scales[b] = float(norm / levels); inverse = norm > 0 ?
// levels / norm : 0, in double. Per element: level = |x| * inverse clamped to [0, levels],
// q = sign(x) * (floor(level) + (u < level - floor(level) ? 1 : 0)) with u uniform in
// [0, 1), so E[q * scale] = x up to rounding. u is a hash of (key, the element's index in this
// call): it does not depend on order, path or block size. Both are 24-bit fixed point: the level is
// float(level * 2^24) truncated to an integer, u the top 24 bits of the hash, so an element
// rounds up with probability frac(level) to within 2^-24, and never when the level has no
// fraction (a zero stays zero).
// level * 2^24 is (|x| * pre) * post in float, pre a power of two (1, 2^64 or 2^-64) that
// keeps post = inverse * 2^24 / pre normal: a norm past FLT_MAX or a denormal one still
// gives finite levels, and no precision goes to a denormal inverse.
// A block holding NaN or Inf gets a NaN or Inf scale (values: +-levels for its NaN and Inf
// elements, 0 for the rest). Writes ceil(count / block) scales and count values; levels
// outside 1..127 throw Error(kInvalidArgument).
void quantize_stochastic_int8_blocks(const float* in, std::size_t count, std::size_t block,
                                     int levels, std::uint64_t key, float* scales, std::int8_t* q);

// Sign bits for 1-bit codecs: bit i (LSB first in byte i / 8) is in[i]'s sign bit, so -0.0f
// and NaNs with the sign set count as negative. Writes ceil(count / 8) bytes; the unused
// high bits of the last byte are zero, so payloads compare equal byte for byte.
void pack_signs(const float* in, std::size_t count, std::uint8_t* bits);
// out[i] = bit i ? -scale : +scale (or += that when `accumulate`, to sum decoded payloads in
// place; a NaN sum is the canonical quiet NaN). Reads ceil(count / 8) bytes.
void unpack_signs_scaled(const std::uint8_t* bits, std::size_t count, float scale, float* out,
                         bool accumulate);

// L1 norm, summed in double over 32 lanes (lane i % 32) added in a fixed order: the same
// bits on every path and machine, which a scale every rank must agree on needs more than the
// last bit of speed. Returned in double: the norm of finite floats can pass FLT_MAX while
// their mean does not. NaN anywhere gives NaN.
double sum_abs(const float* in, std::size_t count);
// max |in[i]| (0 for count 0). NaN anywhere gives the canonical quiet NaN (propagated, not
// skipped: a scale computed from it must not look healthy).
float max_abs(const float* in, std::size_t count);
// Whether no element is NaN or Inf (exponent bits all ones), to report a bad gradient
// before it is encoded; first_non_finite says where (count if all are finite).
bool all_finite(const float* in, std::size_t count);
std::size_t first_non_finite(const float* in, std::size_t count);

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
