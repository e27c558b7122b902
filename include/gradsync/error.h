// The single exception type of gradsync: every failure names the rank, the peer, the
// operation and the sizes involved, so a user can tell what went wrong without a debugger.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace gradsync {

enum class ErrorKind {
  kInvalidArgument,  // bad input from the caller (null buffer, bad root, bad dtype...)
  kMismatch,         // ranks issued different collectives (count, dtype, op, kind, order)
  kPeerLost,         // a peer process died or its connection closed
  kTimeout,          // a blocking wait passed its deadline
  kProtocol,         // malformed, oversized or unauthenticated frame
  kAborted,          // the communicator was aborted (by this rank or a peer) after an error
  kSystem,           // an OS call failed (errno in the message)
};

const char* to_string(ErrorKind kind);

class Error : public std::runtime_error {
 public:
  static constexpr int kNoPeer = -1;
  static constexpr int kUnknownRank = -1;

  // `detail` is the human description; the full message adds rank, peer, op and bytes.
  Error(ErrorKind kind, std::string detail, int rank = kUnknownRank, int peer = kNoPeer,
        std::string op = {}, std::size_t bytes = 0);

  ErrorKind kind() const { return kind_; }
  int rank() const { return rank_; }
  int peer() const { return peer_; }
  const std::string& op() const { return op_; }
  std::size_t bytes() const { return bytes_; }
  const std::string& detail() const { return detail_; }

 private:
  ErrorKind kind_;
  int rank_;
  int peer_;
  std::string op_;
  std::size_t bytes_;
  std::string detail_;
};

}  // namespace gradsync
