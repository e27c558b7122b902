// Inputs whose reductions are exact in every dtype, and plain reference reductions, so a
// collective's output can be compared bit for bit.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "gradsync/types.h"
#include "kernels/kernels.h"

namespace gradsync::testing {

using Buffer = std::vector<std::uint8_t>;

// Small integers: sums of up to 8 ranks stay exact even in bfloat16 (8 mantissa bits);
// products use only 1 and 2 so 8 ranks reach at most 256.
inline double input_value(ReduceOp op, DataType dtype, int rank, std::size_t i) {
  const auto h =
      static_cast<long long>((static_cast<std::size_t>(rank) * 7919u + i * 104729u) % 9973u);
  if (op == ReduceOp::kProd) return static_cast<double>(1 + h % 2);
  if (dtype == DataType::kUInt8) return static_cast<double>(h % 8);
  return static_cast<double>(h % 11 - 3);
}

inline void store_value(DataType t, void* p, double v) {
  switch (t) {
    case DataType::kFloat32: {
      float f = static_cast<float>(v);
      std::memcpy(p, &f, 4);
      break;
    }
    case DataType::kFloat64:
      std::memcpy(p, &v, 8);
      break;
    case DataType::kFloat16: {
      auto h = kernels::float_to_half(static_cast<float>(v));
      std::memcpy(p, &h, 2);
      break;
    }
    case DataType::kBFloat16: {
      auto h = kernels::float_to_bfloat16(static_cast<float>(v));
      std::memcpy(p, &h, 2);
      break;
    }
    case DataType::kInt32: {
      auto x = static_cast<std::int32_t>(static_cast<long long>(v));
      std::memcpy(p, &x, 4);
      break;
    }
    case DataType::kInt64: {
      auto x = static_cast<std::int64_t>(v);
      std::memcpy(p, &x, 8);
      break;
    }
    case DataType::kUInt8: {
      auto x = static_cast<std::uint8_t>(static_cast<long long>(v));
      std::memcpy(p, &x, 1);
      break;
    }
  }
}

inline Buffer make_input(DataType t, ReduceOp op, int rank, std::size_t count,
                         std::size_t first = 0) {
  const std::size_t es = dtype_size(t);
  Buffer b(count * es);
  for (std::size_t i = 0; i < count; ++i)
    store_value(t, b.data() + i * es, input_value(op, t, rank, first + i));
  return b;
}

// Reference reduction of element i over ranks [0, n): exact arithmetic on the small
// integers, then the one rounding the library also does (the division of kAvg).
inline void reference_element(DataType t, ReduceOp op, int n, std::size_t i, void* out) {
  double acc = input_value(op, t, 0, i);
  for (int r = 1; r < n; ++r) {
    double v = input_value(op, t, r, i);
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        acc += v;
        break;
      case ReduceOp::kProd:
        acc *= v;
        break;
      case ReduceOp::kMin:
        acc = v < acc ? v : acc;
        break;
      case ReduceOp::kMax:
        acc = v > acc ? v : acc;
        break;
    }
  }
  if (op != ReduceOp::kAvg) return store_value(t, out, acc);
  switch (t) {
    case DataType::kFloat64:
      return store_value(t, out, acc / n);
    case DataType::kFloat32:
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return store_value(t, out,
                         static_cast<double>(static_cast<float>(acc) / static_cast<float>(n)));
    case DataType::kUInt8: {  // sums of uint8 wrap before the division
      auto s = static_cast<std::uint8_t>(static_cast<long long>(acc));
      return store_value(t, out, static_cast<double>(s / n));
    }
    default:
      return store_value(t, out, static_cast<double>(static_cast<long long>(acc) / n));
  }
}

inline Buffer reference_reduce(DataType t, ReduceOp op, int n, std::size_t count,
                               std::size_t first = 0) {
  const std::size_t es = dtype_size(t);
  Buffer b(count * es);
  for (std::size_t i = 0; i < count; ++i) reference_element(t, op, n, first + i, b.data() + i * es);
  return b;
}

constexpr DataType kAllDtypes[] = {DataType::kFloat32,  DataType::kFloat64, DataType::kFloat16,
                                   DataType::kBFloat16, DataType::kInt32,   DataType::kInt64,
                                   DataType::kUInt8};
constexpr ReduceOp kAllOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax,
                                ReduceOp::kProd};

}  // namespace gradsync::testing
