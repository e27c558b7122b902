// Per-peer dispatch to the underlying transports.
#include "transport/router.h"

#include <algorithm>

#include "transport/shared_arena.h"

namespace gradsync::transport {

RouterTransport::RouterTransport(int rank, int size,
                                 std::vector<std::unique_ptr<Transport>> transports,
                                 std::vector<int> route)
    : rank_(rank), size_(size), transports_(std::move(transports)), route_(std::move(route)) {
  arena_ = whole_world_arena();
}

// An arena is only usable by a collective if every rank of the world is a member, which holds
// when one transport reaches every peer and its arena's members are exactly the world.
SharedArena* RouterTransport::whole_world_arena() const {
  if (size_ < 2) return nullptr;
  const int first_peer = rank_ == 0 ? 1 : 0;
  const int shared = route_[static_cast<std::size_t>(first_peer)];
  for (int peer = 0; peer < size_; ++peer) {
    if (peer != rank_ && route_[static_cast<std::size_t>(peer)] != shared) return nullptr;
  }
  if (shared < 0) return nullptr;
  SharedArena* arena = transports_[static_cast<std::size_t>(shared)]->shared_arena();
  if (!arena || arena->members() != size_ || arena->member_rank(arena->member_index()) != rank_) {
    return nullptr;
  }
  return arena;
}

Transport& RouterTransport::to(int peer) const {
  if (peer < 0 || peer >= size_ || peer == rank_ || route_[static_cast<std::size_t>(peer)] < 0) {
    throw Error(ErrorKind::kInvalidArgument, "no transport reaches this peer", rank_, peer);
  }
  return *transports_[static_cast<std::size_t>(route_[static_cast<std::size_t>(peer)])];
}

const char* RouterTransport::name_for(int peer) const {
  if (peer == rank_) return "self";
  return to(peer).name();
}

RequestPtr RouterTransport::isend(int peer, const Tag& tag, const void* data, std::size_t bytes) {
  return to(peer).isend(peer, tag, data, bytes);
}
RequestPtr RouterTransport::irecv(int peer, const Tag& tag, void* data, std::size_t bytes) {
  return to(peer).irecv(peer, tag, data, bytes);
}
RequestPtr RouterTransport::irecv_consume(int peer, const Tag& tag, std::size_t bytes,
                                          Consumer consume) {
  return to(peer).irecv_consume(peer, tag, bytes, std::move(consume));
}
// Asks every transport in turn: only tcp waits (for answers), so the grace is spent once.
StallReport RouterTransport::explain_stall(Clock::duration grace) {
  StallReport all;
  for (auto& t : transports_) {
    StallReport r = t->explain_stall(grace);
    if (!r.detail.empty()) all.detail += (all.detail.empty() ? "" : "; ") + r.detail;
    all.silent.insert(all.silent.end(), r.silent.begin(), r.silent.end());
  }
  return all;
}

void RouterTransport::abort(const std::string& reason) {
  for (auto& t : transports_) t->abort(reason);
}
const Transport* RouterTransport::channel(int peer) const {
  if (peer == rank_) return this;
  return to(peer).channel(peer);
}

std::size_t RouterTransport::buffered_send_bytes() const {
  std::size_t least = 0;
  bool any = false;
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_ || route_[static_cast<std::size_t>(peer)] < 0) continue;
    const std::size_t bytes = to(peer).buffered_send_bytes();
    least = any ? std::min(least, bytes) : bytes;
    any = true;
  }
  return least;
}

PeerTraffic RouterTransport::traffic(int peer) const {
  if (peer == rank_) return {};
  return to(peer).traffic(peer);
}

}  // namespace gradsync::transport
