// gradsync::Error: composes one readable message from kind, rank, peer, op and bytes.
#include "gradsync/error.h"

#include <sstream>

namespace gradsync {

const char* to_string(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument:
      return "invalid argument";
    case ErrorKind::kMismatch:
      return "mismatched call";
    case ErrorKind::kPeerLost:
      return "peer lost";
    case ErrorKind::kTimeout:
      return "timeout";
    case ErrorKind::kProtocol:
      return "protocol error";
    case ErrorKind::kAborted:
      return "aborted";
    case ErrorKind::kSystem:
      return "system error";
  }
  return "error";
}

namespace {
std::string compose(ErrorKind kind, const std::string& detail, int rank, int peer,
                    const std::string& op, std::size_t bytes) {
  std::ostringstream s;
  s << "gradsync: ";
  if (rank != Error::kUnknownRank) s << "rank " << rank << ": ";
  s << to_string(kind);
  if (!op.empty()) s << " in " << op;
  if (peer != Error::kNoPeer) s << " (peer " << peer << ")";
  s << ": " << detail;
  if (bytes != 0) s << " [" << bytes << " bytes]";
  return s.str();
}
}  // namespace

Error::Error(ErrorKind kind, std::string detail, int rank, int peer, std::string op,
             std::size_t bytes)
    : std::runtime_error(compose(kind, detail, rank, peer, op, bytes)),
      kind_(kind),
      rank_(rank),
      peer_(peer),
      op_(std::move(op)),
      bytes_(bytes),
      detail_(std::move(detail)) {}

}  // namespace gradsync
