// Point-to-point byte movement between ranks: the one interface every transport
// (inproc, shm, tcp) implements and every algorithm uses. Transports know nothing of
// dtypes or reductions.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gradsync/error.h"
#include "gradsync/types.h"

namespace gradsync::transport {

using Clock = std::chrono::steady_clock;

// Opaque 32-byte label carried by every message. The collectives put the call signature
// (sequence number, collective, dtype, op, count...) in it, so a receiver detects a
// mismatched call the moment the first message of it arrives.
struct Tag {
  std::uint64_t words[4] = {0, 0, 0, 0};
  bool operator==(const Tag&) const = default;
};

// Turns a tag into words for error messages ("allreduce #7 count=100 float32 sum").
using TagFormatter = std::function<std::string(const Tag&)>;

// Completion of one isend/irecv. Threading: a request is waited on by the thread that
// created it.
class Request {
 public:
  virtual ~Request() = default;
  // Makes progress without blocking; true once the operation completed. Throws on failure.
  virtual bool test() = 0;
  // Blocks until complete; throws gradsync::Error (kTimeout naming the peer and the bytes
  // still missing, kPeerLost, kMismatch, kAborted...) on failure.
  virtual void wait(Clock::time_point deadline) = 0;
};
using RequestPtr = std::unique_ptr<Request>;

// Called with consecutive pieces of an arriving message: (data, offset in message, length).
using Consumer = std::function<void(const void* data, std::size_t offset, std::size_t len)>;

class SharedArena;  // transport/shared_arena.h

// What a rank learns about its peers once one of its waits timed out: a peer that waits on
// another names the rank the job really waits for, and a stopped or hung process, which
// the kernel still ACKs for over TCP and whose liveness no socket reveals, shows by not
// answering (tcp) or by its process state (shm).
struct StallReport {
  std::string detail;       // added to the timeout's message; "" when nothing was learnt
  std::vector<int> silent;  // ranks found stopped, or that did not answer within the grace
};

// Matching rule: messages between an ordered pair of ranks are FIFO. The k-th receive
// posted for peer p matches the k-th message p sent to this rank. A receive whose tag or
// length differs from the arriving message fails with kMismatch and names both tags; the
// transport does not abort itself for it: its caller names the call and aborts with that
// (TransportConformance.AMismatchIsAbortedWithTheCallersReason).
class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* name() const = 0;

  // `data` must stay valid and unmodified until the request completes.
  virtual RequestPtr isend(int peer, const Tag& tag, const void* data, std::size_t bytes) = 0;
  // `data` must stay valid until the request completes.
  virtual RequestPtr irecv(int peer, const Tag& tag, void* data, std::size_t bytes) = 0;
  // Like irecv, but hands each arriving piece to `consume` instead of copying it to a user
  // buffer: shm lets a reduction read straight out of shared memory. `consume` runs on the
  // thread that waits on the request. Default: receive into a temporary buffer, then consume.
  virtual RequestPtr irecv_consume(int peer, const Tag& tag, std::size_t bytes, Consumer consume);

  // Fails every pending and later operation with `reason` (sticky) and tells every peer,
  // so no rank waits on a communicator that can no longer complete.
  virtual void abort(const std::string& reason) = 0;

  virtual PeerTraffic traffic(int peer) const = 0;

  // Called once a wait timed out, before the timeout is raised: spends at most about
  // `grace` finding out which peers are stopped or hung and what the others wait on.
  // Default: nothing to add.
  virtual StallReport explain_stall(Clock::duration grace) {
    (void)grace;
    return {};
  }

  // The transport that actually carries messages to `peer` (a router forwards each peer to one
  // of several). A transport serves one thread at a time, so an algorithm may drive two sets
  // of peers from two threads at once only where their channels differ.
  virtual const Transport* channel(int peer) const {
    (void)peer;
    return this;
  }

  // The largest message isend copies out of the caller's buffer before it returns, where
  // nothing else is queued to that peer: its request then tests complete at once, and an
  // algorithm may reduce the peer's message straight out of the transport's buffer (recursive
  // doubling does). 0: no such promise (the default).
  virtual std::size_t buffered_send_bytes() const { return 0; }

  // Optional capability: memory every rank of the whole world has mapped, for collectives
  // that reduce straight out of each other's buffers. Null unless all ranks share this host
  // through one transport that offers it. Lives as long as the transport.
  virtual SharedArena* shared_arena() { return nullptr; }
};

// Options every transport takes.
struct TransportOptions {
  TagFormatter format_tag;  // may be empty: tags are then printed as hex
  std::string token;        // job secret presented on every connection (tcp)
};

std::string default_format_tag(const Tag& tag);

// Throws kInvalidArgument (naming `what`) unless `group` is sorted distinct ranks in
// [0, world_size) that include `rank`: what every transport's factory takes.
void check_group(int rank, int world_size, const std::vector<int>& group, const char* what);

// Cores this process may run on (its affinity mask, which cpusets and taskset narrow).
// Transports compare it with the ranks on this host: when ranks outnumber cores, a waiting
// rank yields its core instead of spinning on it.
unsigned usable_cores();

}  // namespace gradsync::transport
