// Packing of call signatures into transport tags, and their human-readable form.
#include "collectives/signature.h"

#include <sstream>

namespace gradsync::collectives {

const char* to_string(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllreduce:
      return "allreduce";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllgather:
      return "allgather";
    case CollectiveKind::kAllgatherv:
      return "allgatherv";
    case CollectiveKind::kBroadcast:
      return "broadcast";
    case CollectiveKind::kReduce:
      return "reduce";
    case CollectiveKind::kBarrier:
      return "barrier";
    case CollectiveKind::kInternal:
      return "setup";
    case CollectiveKind::kCompressedAllreduce:
      return "compressed_allreduce";
    case CollectiveKind::kGather:
      return "gather";
    case CollectiveKind::kScatter:
      return "scatter";
    case CollectiveKind::kAlltoall:
      return "alltoall";
    case CollectiveKind::kAlltoallv:
      return "alltoallv";
    case CollectiveKind::kPointToPoint:
      return "p2p";
  }
  return "unknown";
}

// Layout: word0 = seq; word1 = kind | dtype<<8 | op<<16 | algorithm<<24 | root<<32;
// word2 = count; word3 = a 16-bit marker so a stray tag is recognisably not a signature, the
// caller's fingerprint, the step. dtype and op are uint8_t enums: their 8 bits hold every value.
constexpr std::uint64_t kSignatureMarker = 0x6773ull << 48;  // "gs"
constexpr std::uint64_t kMarkerBits = 0xffffull << 48;
constexpr std::uint64_t kStepBits = 0xffff;

transport::Tag encode(const CallSignature& sig) {
  transport::Tag t;
  t.words[0] = sig.seq;
  t.words[1] = static_cast<std::uint64_t>(sig.kind) | (static_cast<std::uint64_t>(sig.dtype) << 8) |
               (static_cast<std::uint64_t>(sig.op) << 16) |
               (static_cast<std::uint64_t>(sig.algorithm) << 24) |
               (static_cast<std::uint64_t>(static_cast<std::uint32_t>(sig.root)) << 32);
  t.words[2] = sig.count;
  t.words[3] = kSignatureMarker | (static_cast<std::uint64_t>(sig.fingerprint) << 16) | sig.step;
  return t;
}

CallSignature decode(const transport::Tag& t) {
  CallSignature s;
  s.seq = t.words[0];
  s.kind = static_cast<CollectiveKind>(t.words[1] & 0xff);
  s.dtype = static_cast<DataType>((t.words[1] >> 8) & 0xff);
  s.op = static_cast<ReduceOp>((t.words[1] >> 16) & 0xff);
  s.algorithm = static_cast<Algorithm>((t.words[1] >> 24) & 0xff);
  s.root = static_cast<std::int32_t>(static_cast<std::uint32_t>(t.words[1] >> 32));
  s.count = t.words[2];
  s.step = static_cast<std::uint16_t>(t.words[3] & kStepBits);
  s.fingerprint = static_cast<std::uint32_t>(t.words[3] >> 16);
  return s;
}

std::int32_t counts_digest(std::span<const std::size_t> counts) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the counts' bytes
  for (std::size_t count : counts) {
    for (int byte = 0; byte < 8; ++byte) {
      h = (h ^ ((static_cast<std::uint64_t>(count) >> (8 * byte)) & 0xFF)) * 1099511628211ull;
    }
  }
  return static_cast<std::int32_t>((h ^ (h >> 32)) & 0x7fffffff);
}

std::string describe(const CallSignature& s) {
  std::ostringstream o;
  o << to_string(s.kind) << " #" << s.seq;
  if (s.step) o << "." << s.step;
  o << " (count=" << s.count;
  if (s.kind != CollectiveKind::kBarrier && s.kind != CollectiveKind::kInternal) {
    o << " " << to_string(s.dtype);
  }
  if (s.kind == CollectiveKind::kAllreduce || s.kind == CollectiveKind::kReduceScatter ||
      s.kind == CollectiveKind::kReduce) {
    o << " " << to_string(s.op);
  }
  if (s.kind == CollectiveKind::kAllreduce) o << " algo=" << to_string(s.algorithm);
  if (s.kind == CollectiveKind::kBroadcast || s.kind == CollectiveKind::kReduce ||
      s.kind == CollectiveKind::kGather || s.kind == CollectiveKind::kScatter) {
    o << " root=" << s.root;
  }
  if (s.kind == CollectiveKind::kPointToPoint) o << " tag=" << s.root;           // the user's tag
  if (s.kind == CollectiveKind::kCompressedAllreduce) o << " codec#" << s.root;  // spec hash
  if (s.kind == CollectiveKind::kAllgatherv) o << " counts#" << s.root;
  if (s.fingerprint) o << " fingerprint=" << s.fingerprint;
  o << ")";
  return o.str();
}

std::string describe_tag(const transport::Tag& tag) {
  if ((tag.words[3] & kMarkerBits) != kSignatureMarker) return transport::default_format_tag(tag);
  return describe(decode(tag));
}

}  // namespace gradsync::collectives
