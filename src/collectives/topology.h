// Which ranks share a host, and the ring order that follows from it. A ring over ranks
// numbered without regard to hosts (round-robin placement, say) would cross the slow links
// between hosts at almost every step; ordering the ring host by host makes it cross each host
// boundary once in each direction, the fewest a ring that spans H hosts can (H crossings).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace gradsync::collectives {

class Topology {
 public:
  // One host, ranks in order: what a single process group without host information gets.
  static Topology flat(int world_size);
  // host_of[r]: any label per rank; ranks with equal labels share a host. Hosts are numbered
  // by their lowest rank; the ring visits hosts in that order, ranks ascending within each.
  static Topology from_hosts(const std::vector<std::string>& host_of);

  int size() const { return static_cast<int>(host_.size()); }
  int hosts() const { return static_cast<int>(members_.size()); }
  int host_of(int rank) const { return host_[static_cast<std::size_t>(rank)]; }
  // Ranks of host h, ascending.
  const std::vector<int>& host_members(int h) const {
    return members_[static_cast<std::size_t>(h)];
  }

  // Ring order: ring_rank(p) is the rank at position p (taken modulo the size, so p - 1 and
  // p + 1 name the neighbours), ring_position(r) the inverse.
  int ring_rank(long long position) const;
  int ring_position(int rank) const { return position_[static_cast<std::size_t>(rank)]; }
  const std::vector<int>& ring() const { return ring_; }
  // Ring edges whose ends are on different hosts.
  int ring_crossings() const;

  std::string describe() const;  // "2 hosts: [0 2] [1 3]"

 private:
  std::vector<int> host_;                  // host index per rank
  std::vector<std::vector<int>> members_;  // ranks per host
  std::vector<int> ring_, position_;
};

// GRADSYNC_TOPOLOGY: the ranks of each host (or of any group whose members should be
// neighbours in the ring and share the hierarchical algorithms' first level), groups
// separated by ';' or newlines, ranks by ',' or spaces: "0,2,4;1,3,5". Every rank of the
// world exactly once. Returns one label per rank, or nullopt with `error` set.
std::optional<std::vector<std::string>> parse_topology(std::string_view spec, int world_size,
                                                       std::string* error);

}  // namespace gradsync::collectives
