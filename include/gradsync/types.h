// Element types, reduction operators, algorithm names and traffic counters shared by the whole API.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

namespace gradsync {

// New values are appended, never inserted: the numbers travel in every message's signature.
enum class DataType : std::uint8_t {
  kFloat32,
  kFloat64,
  kFloat16,
  kBFloat16,
  kInt32,
  kInt64,
  kUInt8,
  kInt8,
  kInt16,
  kBool,  // one byte, 0 or 1; reduces as logic (see ReduceOp)
};
// Integers wrap modulo 2^bits; kAvg on integers (and bool) divides the sum truncating. On
// kBool: kSum and kMax are logical OR, kProd and kMin logical AND (what torch gives).
// kBand/kBor/kBxor are bitwise and integer/bool only: a float dtype with one is refused
// (ErrorKind::kInvalidArgument).
enum class ReduceOp : std::uint8_t { kSum, kAvg, kMin, kMax, kProd, kBand, kBor, kBxor };

// All-reduce algorithms. kAuto lets the cost model choose per call.
enum class Algorithm : std::uint8_t {
  kAuto,
  kRing,               // reduce-scatter + all-gather around a ring, chunked and pipelined
  kRecursiveDoubling,  // log2(N) full-size exchanges: latency-optimal for small messages
  kHalvingDoubling,    // Rabenseifner: recursive-halving reduce-scatter + doubling all-gather
  kParameterServer,    // reduce to rank 0 then broadcast: a baseline, never chosen by kAuto
  kSharedMemory,       // ranks on one host reduce straight out of each other's shared staging
                       // buffers; where the ranks share no memory it runs the ring instead
  kHierarchical,       // reduce-scatter inside each host, all-reduce of one slice per rank
                       // across hosts, all-gather inside each host; the ring where ranks are
                       // not spread evenly over several hosts
};

std::size_t dtype_size(DataType t);
const char* to_string(DataType t);
const char* to_string(ReduceOp op);
const char* to_string(Algorithm a);
std::optional<DataType> parse_dtype(std::string_view s);  // "float32"/"f32"/"float", ...
// "sum", "avg", "min", "max", "prod", "band", "bor", "bxor"
std::optional<ReduceOp> parse_op(std::string_view s);
// Whether the dtype is a floating-point type (float32/64, float16, bfloat16).
bool is_floating(DataType t);
// Whether op is defined on dtype: both are known values, and op is not a bitwise op on a
// floating-point type.
bool dtype_op_valid(DataType t, ReduceOp op);
// "auto", "ring", "rd", "hd", "ps", "shm"
std::optional<Algorithm> parse_algorithm(std::string_view s);

// Rounds float32 `values` in place to the nearest kFloat16 or kBFloat16 value (ties to even;
// float16 past its range to infinity), as a cast there and back: 16-bit arithmetic emulated
// on hardware without it, as mixed-precision training on a CPU does. Any other type is
// refused (Error kInvalidArgument).
void round_through(DataType type, std::span<float> values);

// Bytes moved to and from one peer by the transports since the context was created.
struct PeerTraffic {
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_received = 0;
  std::uint64_t messages_sent = 0;
  std::uint64_t messages_received = 0;
};

}  // namespace gradsync
