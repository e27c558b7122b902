// What an algorithm sees of the world during one call: its rank, the transport, the
// call's tag and deadline. Algorithms never know which transport carries them.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "collectives/signature.h"
#include "collectives/topology.h"
#include "transport/transport.h"

namespace gradsync::collectives {

class Comm {
 public:
  // `topology` (null: one host, ranks in order) must outlive the Comm.
  Comm(transport::Transport& transport, const CallSignature& sig,
       transport::Clock::time_point deadline, const Topology* topology = nullptr)
      : transport_(transport),
        sig_(sig),
        tag_(encode(sig)),
        deadline_(deadline),
        topology_(topology) {}

  int rank() const { return transport_.rank(); }
  int size() const { return transport_.size(); }
  // Ring algorithms run over positions, not ranks: the ring visits each host's ranks in a row.
  int ring_position() const { return topology_ ? topology_->ring_position(rank()) : rank(); }
  int ring_rank(long long position) const {
    if (topology_) return topology_->ring_rank(position);
    const long long n = size();
    return static_cast<int>(((position % n) + n) % n);
  }
  const Topology* topology() const { return topology_; }
  const CallSignature& signature() const { return sig_; }
  // The call's signature as carried in message tags; algorithms that bypass messages (shared
  // memory) exchange it themselves to detect mismatched calls.
  const transport::Tag& tag() const { return tag_; }
  transport::Clock::time_point deadline() const { return deadline_; }

  transport::RequestPtr isend(int peer, const void* data, std::size_t bytes) {
    return transport_.isend(peer, tag_, data, bytes);
  }
  transport::RequestPtr irecv(int peer, void* data, std::size_t bytes) {
    return transport_.irecv(peer, tag_, data, bytes);
  }
  transport::RequestPtr irecv_consume(int peer, std::size_t bytes, transport::Consumer consume) {
    return transport_.irecv_consume(peer, tag_, bytes, std::move(consume));
  }
  void wait(const transport::RequestPtr& request) {
    if (request) request->wait(deadline_);
  }
  void wait_all(std::vector<transport::RequestPtr>& requests) {
    for (auto& r : requests) wait(r);
    requests.clear();
  }
  void send(int peer, const void* data, std::size_t bytes) { wait(isend(peer, data, bytes)); }
  void recv(int peer, void* data, std::size_t bytes) { wait(irecv(peer, data, bytes)); }
  // Exchanges with two peers at once (both directions progress together: no deadlock).
  void sendrecv(int to, const void* send_data, std::size_t send_bytes, int from, void* recv_data,
                std::size_t recv_bytes) {
    auto r = irecv(from, recv_data, recv_bytes);
    auto s = isend(to, send_data, send_bytes);
    wait(r);
    wait(s);
  }

 private:
  transport::Transport& transport_;
  CallSignature sig_;
  transport::Tag tag_;
  transport::Clock::time_point deadline_;
  const Topology* topology_;
};

// Splits `count` elements into `parts` contiguous blocks whose sizes differ by at most one
// (the first count % parts blocks get the extra element).
struct Partition {
  std::size_t count;
  std::size_t parts;
  std::size_t offset(std::size_t i) const {
    std::size_t base = count / parts, extra = count % parts;
    return i * base + (i < extra ? i : extra);
  }
  std::size_t size(std::size_t i) const { return count / parts + (i < count % parts ? 1 : 0); }
};

}  // namespace gradsync::collectives
