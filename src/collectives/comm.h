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

  // The same call restricted to `members` (global ranks, this rank among them): ranks and
  // peers of the result are indices into `members`, so any algorithm runs on a subgroup, in
  // the order given (ring algorithms follow it). Messages keep the call's tag: a subgroup's
  // pairs of ranks are disjoint from those of any other subgroup the call uses at the same
  // time, and per pair messages stay in order, so the phases of a hierarchical algorithm
  // cannot take each other's messages.
  Comm subgroup(std::vector<int> members) const {
    Comm sub(transport_, sig_, deadline_, nullptr);
    sub.tag_ = tag_;
    for (std::size_t i = 0; i < members.size(); ++i) {
      if (members[i] == transport_.rank()) sub.my_index_ = static_cast<int>(i);
    }
    sub.members_ = std::move(members);
    return sub;
  }

  // The same call with `count` in its messages' tags: where each pair of ranks exchanges its
  // own amount (alltoallv), the receiver then names both counts when the pair disagrees.
  Comm with_count(std::uint64_t count) const {
    Comm c = *this;
    c.sig_.count = count;
    c.tag_ = encode(c.sig_);
    return c;
  }

  int rank() const { return members_.empty() ? transport_.rank() : my_index_; }
  int size() const {
    return members_.empty() ? transport_.size() : static_cast<int>(members_.size());
  }
  // See Transport::channel: two threads may drive peers whose channels differ.
  const transport::Transport* channel(int peer) const {
    return transport_.channel(global_rank(peer));
  }
  // Fails every pending and later operation of the transport on every rank (sticky).
  void abort(const std::string& reason) { transport_.abort(reason); }

  // The global rank of peer index `peer` (itself outside a subgroup).
  int global_rank(int peer) const {
    return members_.empty() ? peer : members_[static_cast<std::size_t>(peer)];
  }
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
    return transport_.isend(global_rank(peer), tag_, data, bytes);
  }
  transport::RequestPtr irecv(int peer, void* data, std::size_t bytes) {
    return transport_.irecv(global_rank(peer), tag_, data, bytes);
  }
  transport::RequestPtr irecv_consume(int peer, std::size_t bytes, transport::Consumer consume) {
    return transport_.irecv_consume(global_rank(peer), tag_, bytes, std::move(consume));
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
  std::vector<int> members_;  // empty: the whole world
  int my_index_ = -1;
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
