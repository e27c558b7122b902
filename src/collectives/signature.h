// The signature of one collective call, carried in every message tag so that a rank
// receiving a message from a peer that issued a different call (count, dtype, op,
// collective or order) detects it at once and can name both sides' arguments.
#pragma once

#include <cstdint>
#include <string>

#include "gradsync/types.h"
#include "transport/transport.h"

namespace gradsync::collectives {

enum class CollectiveKind : std::uint8_t {
  kAllreduce = 1,
  kReduceScatter,
  kAllgather,
  kAllgatherv,
  kBroadcast,
  kReduce,
  kBarrier,
  kInternal,             // context set-up traffic (cost-model probes)
  kCompressedAllreduce,  // compress/: dtype is the wire format, count the float32 elements,
                         // root a hash of the codec's spec
};
const char* to_string(CollectiveKind kind);

struct CallSignature {
  std::uint64_t seq = 0;  // per-context call number, identical on every rank
  CollectiveKind kind = CollectiveKind::kInternal;
  DataType dtype = DataType::kUInt8;
  ReduceOp op = ReduceOp::kSum;
  Algorithm algorithm = Algorithm::kAuto;
  std::int32_t root = -1;
  std::uint64_t count = 0;  // total elements of the call (allgatherv: sum of counts)
  // A call made of several collectives (a compressed all-reduce, a reducer's bucket) runs
  // them as numbered steps under its own sequence number: step k of call #seq is matched
  // only by step k of #seq on the peer, whatever else is queued behind the call.
  std::uint16_t step = 0;
};

transport::Tag encode(const CallSignature& sig);
CallSignature decode(const transport::Tag& tag);
// "allreduce #7 (count=100 float32 sum algo=ring)"
std::string describe(const CallSignature& sig);
std::string describe_tag(const transport::Tag& tag);

}  // namespace gradsync::collectives
