// Inputs whose reductions are exact in every dtype, and plain reference reductions, so a
// collective's output can be compared bit for bit.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "gradsync/types.h"
#include "kernels/kernels.h"

namespace gradsync::testing {

using Buffer = std::vector<std::uint8_t>;

// The bytes rank `src` has for rank `dst` in message or call `k`: a pattern of their own, so
// a block that lands at the wrong rank or offset, in the wrong order or cut short shows.
inline Buffer pattern(int src, int dst, std::size_t bytes, int k = 0) {
  Buffer b(bytes);
  std::uint32_t x = 2166136261u ^ (static_cast<std::uint32_t>(src) * 16777619u) ^
                    (static_cast<std::uint32_t>(dst) * 40503u) ^
                    (static_cast<std::uint32_t>(k) * 2654435761u);
  for (auto& c : b) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<std::uint8_t>(x >> 24);
  }
  return b;
}

// Receive buffers carry kGuard bytes of kGuardByte behind what a call may write.
inline constexpr std::size_t kGuard = 64;
inline constexpr std::uint8_t kGuardByte = 0xEE;
inline bool guard_intact(const Buffer& b, std::size_t bytes) {
  for (std::size_t i = bytes; i < b.size(); ++i) {
    if (b[i] != kGuardByte) return false;
  }
  return true;
}

// `got` holds `want` at byte `offset` (and is long enough to).
inline bool holds_at(const Buffer& got, std::size_t offset, const Buffer& want) {
  return offset <= got.size() && want.size() <= got.size() - offset &&
         std::equal(want.begin(), want.end(), got.begin() + static_cast<std::ptrdiff_t>(offset));
}

inline bool is_bitwise(ReduceOp op) {
  return op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor;
}

// Small integers: sums of up to 8 ranks stay exact even in bfloat16 (8 mantissa bits);
// products use only 1 and 2 so 8 ranks reach at most 256. Bitwise ops get every pattern of
// the low byte (sign-extended in signed types). bool leans towards the value that leaves
// the op's result open (false for OR-like ops, true for AND-like), so results vary even
// over 8 ranks.
inline double input_value(ReduceOp op, DataType dtype, int rank, std::size_t i) {
  const auto h =
      static_cast<long long>((static_cast<std::size_t>(rank) * 7919u + i * 104729u) % 9973u);
  if (dtype == DataType::kBool) {
    if (op == ReduceOp::kProd || op == ReduceOp::kMin || op == ReduceOp::kBand) {
      return h % 5 != 0 ? 1.0 : 0.0;
    }
    if (op == ReduceOp::kBxor) return static_cast<double>(h % 2);
    return h % 5 == 0 ? 1.0 : 0.0;
  }
  if (is_bitwise(op)) {
    return static_cast<double>(dtype == DataType::kUInt8 ? h % 256 : h % 256 - 128);
  }
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
    case DataType::kInt8: {
      auto x = static_cast<std::int8_t>(static_cast<long long>(v));
      std::memcpy(p, &x, 1);
      break;
    }
    case DataType::kInt16: {
      auto x = static_cast<std::int16_t>(static_cast<long long>(v));
      std::memcpy(p, &x, 2);
      break;
    }
    case DataType::kBool: {
      const std::uint8_t x = v != 0 ? 1 : 0;
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
// integers, then the one rounding the library also does (the division of kAvg). On bool the
// small integers are 0 and 1, and a sum, product, min or max of them is nonzero exactly when
// the OR (sum, max) or AND (prod, min) is true.
inline void reference_element(DataType t, ReduceOp op, int n, std::size_t i, void* out) {
  double acc = input_value(op, t, 0, i);
  for (int r = 1; r < n; ++r) {
    double v = input_value(op, t, r, i);
    const auto x = static_cast<long long>(acc), y = static_cast<long long>(v);
    switch (op) {
      case ReduceOp::kBand:
        acc = static_cast<double>(x & y);
        break;
      case ReduceOp::kBor:
        acc = static_cast<double>(x | y);
        break;
      case ReduceOp::kBxor:
        acc = static_cast<double>(x ^ y);
        break;
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
    case DataType::kInt8: {  // likewise int8 and int16
      auto s = static_cast<std::int8_t>(static_cast<long long>(acc));
      return store_value(t, out, static_cast<double>(s / n));
    }
    case DataType::kInt16: {
      auto s = static_cast<std::int16_t>(static_cast<long long>(acc));
      return store_value(t, out, static_cast<double>(s / n));
    }
    case DataType::kBool:  // the OR of the ranks, divided: an integer division
      return store_value(t, out, static_cast<double>((acc != 0 ? 1 : 0) / n));
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

// Large inputs repeat the first kInputPeriod elements of make_input, so exact references of a
// million elements cost milliseconds. The period is prime: no chunk or sub-block boundary of
// the algorithm lines up with it, so a misplaced block still shows.
constexpr std::size_t kInputPeriod = 99991;

inline Buffer repeat_to(const Buffer& period, std::size_t bytes) {
  Buffer out(bytes);
  for (std::size_t at = 0; at < bytes; at += period.size()) {
    std::memcpy(out.data() + at, period.data(), std::min(period.size(), bytes - at));
  }
  return out;
}
inline Buffer periodic_input(DataType t, ReduceOp op, int rank, std::size_t count) {
  return repeat_to(make_input(t, op, rank, std::min(count, kInputPeriod)), count * dtype_size(t));
}
inline Buffer periodic_reference(DataType t, ReduceOp op, int n, std::size_t count) {
  return repeat_to(reference_reduce(t, op, n, std::min(count, kInputPeriod)),
                   count * dtype_size(t));
}

constexpr DataType kAllDtypes[] = {DataType::kFloat32,  DataType::kFloat64, DataType::kFloat16,
                                   DataType::kBFloat16, DataType::kInt32,   DataType::kInt64,
                                   DataType::kUInt8,    DataType::kInt8,    DataType::kInt16,
                                   DataType::kBool};
// Whether `t` is the first of kAllDtypes with its element size (one dtype per size).
inline bool first_of_its_element_size(DataType t) {
  for (DataType u : kAllDtypes) {
    if (dtype_size(u) == dtype_size(t)) return u == t;
  }
  return false;
}
// Not every pair is valid: loops over both skip !dtype_op_valid(t, op) (bitwise on floats).
constexpr ReduceOp kAllOps[] = {ReduceOp::kSum,  ReduceOp::kAvg,  ReduceOp::kMin, ReduceOp::kMax,
                                ReduceOp::kProd, ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor};

using DtypeOp = std::pair<DataType, ReduceOp>;

// Every valid dtype x op pair: the kernels' grid.
inline std::vector<DtypeOp> every_dtype_op_pair() {
  std::vector<DtypeOp> cases;
  for (DataType t : kAllDtypes)
    for (ReduceOp op : kAllOps)
      if (dtype_op_valid(t, op)) cases.emplace_back(t, op);
  return cases;
}

// Every dtype once (each element size meets a collective's chunking and partition among
// ranks) and every op once: what a collective adds to the kernels, without repeating the
// kernels' grid at every count and algorithm (minutes under ThreadSanitizer).
inline std::vector<DtypeOp> each_dtype_and_each_op() {
  std::vector<DtypeOp> cases;
  for (DataType t : kAllDtypes)
    cases.emplace_back(t, is_floating(t) ? ReduceOp::kSum : ReduceOp::kBxor);
  for (ReduceOp op : kAllOps)
    cases.emplace_back(
        dtype_op_valid(DataType::kFloat32, op) ? DataType::kFloat32 : DataType::kInt32, op);
  return cases;
}

}  // namespace gradsync::testing
