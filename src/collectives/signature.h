// The signature of one collective call, carried in every message tag so that a rank
// receiving a message from a peer that issued a different call (count, dtype, op,
// collective or order) detects it at once and can name both sides' arguments.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "gradsync/types.h"
#include "transport/transport.h"

namespace gradsync::collectives {

enum class CollectiveKind : std::uint8_t {
  kAllreduce = 1,
  kReduceScatter,
  kAllgather,
  kAllgatherv,  // root a digest of the block counts (count holds only their sum)
  kBroadcast,
  kReduce,
  kBarrier,
  kInternal,             // context set-up traffic (cost-model probes)
  kCompressedAllreduce,  // compress/: dtype is the wire format, count the float32 elements,
                         // root a hash of the codec's spec
  kGather,
  kScatter,
  kAlltoall,
  kAlltoallv,     // each message's tag carries that pair's count (see Comm::with_count)
  kPointToPoint,  // send/recv: seq numbers the messages of one ordered pair of ranks, not the
                  // context's calls; root is the user's tag
};
const char* to_string(CollectiveKind kind);

struct CallSignature {
  // Per-context call number, identical on every rank; for kPointToPoint, the message's number
  // among those from its sender to its receiver, which only those two count.
  std::uint64_t seq = 0;
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
  // CallOptions::fingerprint: what the caller knows of the data beyond count and dtype (a
  // tensor's shape), compared like the rest; 0 when none was given.
  std::uint32_t fingerprint = 0;
};

// An all-gatherv's block counts as its signature's root (never -1): ranks given different
// counts with the same sum then differ in every message's tag, and fail at the first one.
std::int32_t counts_digest(std::span<const std::size_t> counts);

transport::Tag encode(const CallSignature& sig);
CallSignature decode(const transport::Tag& tag);
// "allreduce #7 (count=100 float32 sum algo=ring)", with " fingerprint=…" where one was given
std::string describe(const CallSignature& sig);
std::string describe_tag(const transport::Tag& tag);

}  // namespace gradsync::collectives
