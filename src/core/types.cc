// Names, sizes and parsers of DataType, ReduceOp and Algorithm.
#include "gradsync/types.h"

#include <algorithm>
#include <cstdint>
#include <string>

#include "gradsync/error.h"
#include "kernels/kernels.h"

namespace gradsync {

std::size_t dtype_size(DataType t) {
  switch (t) {
    case DataType::kFloat32:
      return 4;
    case DataType::kFloat64:
      return 8;
    case DataType::kFloat16:
      return 2;
    case DataType::kBFloat16:
      return 2;
    case DataType::kInt32:
      return 4;
    case DataType::kInt64:
      return 8;
    case DataType::kUInt8:
    case DataType::kInt8:
    case DataType::kBool:
      return 1;
    case DataType::kInt16:
      return 2;
  }
  return 0;
}

const char* to_string(DataType t) {
  switch (t) {
    case DataType::kFloat32:
      return "float32";
    case DataType::kFloat64:
      return "float64";
    case DataType::kFloat16:
      return "float16";
    case DataType::kBFloat16:
      return "bfloat16";
    case DataType::kInt32:
      return "int32";
    case DataType::kInt64:
      return "int64";
    case DataType::kUInt8:
      return "uint8";
    case DataType::kInt8:
      return "int8";
    case DataType::kInt16:
      return "int16";
    case DataType::kBool:
      return "bool";
  }
  return "?";
}

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kProd:
      return "prod";
    case ReduceOp::kBand:
      return "band";
    case ReduceOp::kBor:
      return "bor";
    case ReduceOp::kBxor:
      return "bxor";
  }
  return "?";
}

const char* to_string(Algorithm a) {
  switch (a) {
    case Algorithm::kAuto:
      return "auto";
    case Algorithm::kRing:
      return "ring";
    case Algorithm::kRecursiveDoubling:
      return "rd";
    case Algorithm::kHalvingDoubling:
      return "hd";
    case Algorithm::kParameterServer:
      return "ps";
    case Algorithm::kSharedMemory:
      return "shm";
    case Algorithm::kHierarchical:
      return "hier";
  }
  return "?";
}

std::optional<DataType> parse_dtype(std::string_view s) {
  if (s == "float32" || s == "f32" || s == "float") return DataType::kFloat32;
  if (s == "float64" || s == "f64" || s == "double") return DataType::kFloat64;
  if (s == "float16" || s == "f16" || s == "half") return DataType::kFloat16;
  if (s == "bfloat16" || s == "bf16") return DataType::kBFloat16;
  if (s == "int32" || s == "i32" || s == "int") return DataType::kInt32;
  if (s == "int64" || s == "i64") return DataType::kInt64;
  if (s == "uint8" || s == "u8") return DataType::kUInt8;
  if (s == "int8" || s == "i8") return DataType::kInt8;
  if (s == "int16" || s == "i16") return DataType::kInt16;
  if (s == "bool") return DataType::kBool;
  return std::nullopt;
}

std::optional<ReduceOp> parse_op(std::string_view s) {
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax,
                      ReduceOp::kProd, ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor}) {
    if (s == to_string(op)) return op;
  }
  return std::nullopt;
}

bool is_floating(DataType t) {
  return t == DataType::kFloat32 || t == DataType::kFloat64 || t == DataType::kFloat16 ||
         t == DataType::kBFloat16;
}

bool dtype_op_valid(DataType t, ReduceOp op) {
  // Unknown values (a cast from a bad integer) are not valid with anything.
  if (dtype_size(t) == 0 || static_cast<unsigned>(op) > static_cast<unsigned>(ReduceOp::kBxor)) {
    return false;
  }
  const bool bitwise = op == ReduceOp::kBand || op == ReduceOp::kBor || op == ReduceOp::kBxor;
  return !(bitwise && is_floating(t));
}

std::optional<Algorithm> parse_algorithm(std::string_view s) {
  if (s == "auto") return Algorithm::kAuto;
  if (s == "ring") return Algorithm::kRing;
  if (s == "rd" || s == "recursive_doubling") return Algorithm::kRecursiveDoubling;
  if (s == "hd" || s == "halving_doubling" || s == "rabenseifner") {
    return Algorithm::kHalvingDoubling;
  }
  if (s == "ps" || s == "parameter_server") return Algorithm::kParameterServer;
  if (s == "shm" || s == "shared_memory") return Algorithm::kSharedMemory;
  if (s == "hier" || s == "hierarchical") return Algorithm::kHierarchical;
  return std::nullopt;
}

void round_through(DataType type, std::span<float> values) {
  if (type != DataType::kFloat16 && type != DataType::kBFloat16) {
    throw Error(ErrorKind::kInvalidArgument,
                std::string("round_through ") + to_string(type) + ": float16 or bfloat16 only",
                Error::kUnknownRank, Error::kNoPeer, "round_through");
  }
  // Through a small buffer that stays in cache, with the vectorised conversions.
  constexpr std::size_t kChunk = 4096;
  std::uint16_t halves[kChunk];
  for (std::size_t at = 0; at < values.size(); at += kChunk) {
    const std::size_t n = std::min(kChunk, values.size() - at);
    kernels::float_to_16bit(values.data() + at, halves, n, type);
    kernels::float_from_16bit(halves, values.data() + at, n, type);
  }
}

}  // namespace gradsync
