// Host grouping and ring order.
#include "collectives/topology.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <map>

namespace gradsync::collectives {

Topology Topology::flat(int world_size) {
  return from_hosts(std::vector<std::string>(static_cast<std::size_t>(world_size), ""));
}

Topology Topology::from_hosts(const std::vector<std::string>& host_of) {
  Topology t;
  std::map<std::string, int> index;
  for (std::size_t r = 0; r < host_of.size(); ++r) {
    auto [it, fresh] = index.emplace(host_of[r], static_cast<int>(t.members_.size()));
    if (fresh) t.members_.emplace_back();
    t.host_.push_back(it->second);
    t.members_[static_cast<std::size_t>(it->second)].push_back(static_cast<int>(r));
  }
  t.position_.resize(host_of.size());
  for (const auto& members : t.members_) {
    for (int r : members) {
      t.position_[static_cast<std::size_t>(r)] = static_cast<int>(t.ring_.size());
      t.ring_.push_back(r);
    }
  }
  return t;
}

int Topology::ring_rank(long long position) const {
  const long long n = size();
  return ring_[static_cast<std::size_t>(((position % n) + n) % n)];
}

int Topology::ring_crossings() const {
  if (hosts() < 2) return 0;
  int crossings = 0;
  for (int p = 0; p < size(); ++p) crossings += host_of(ring_rank(p)) != host_of(ring_rank(p + 1));
  return crossings;
}

std::string Topology::describe() const {
  std::string s = std::to_string(hosts()) + (hosts() == 1 ? " host:" : " hosts:");
  for (const auto& members : members_) {
    s += " [";
    for (std::size_t i = 0; i < members.size(); ++i) {
      s += (i ? " " : "") + std::to_string(members[i]);
    }
    s += "]";
  }
  return s;
}

std::optional<std::vector<std::string>> parse_topology(std::string_view spec, int world_size,
                                                       std::string* error) {
  std::vector<std::string> label(static_cast<std::size_t>(world_size));
  std::vector<bool> seen(static_cast<std::size_t>(world_size), false);
  auto fail = [&](const std::string& why) -> std::optional<std::vector<std::string>> {
    if (error) *error = why;
    return std::nullopt;
  };
  int group = 0, in_group = 0;
  std::size_t i = 0;
  while (i <= spec.size()) {
    const char ch = i < spec.size() ? spec[i] : ';';
    if (ch == ';' || ch == '\n') {
      if (in_group) ++group;
      in_group = 0;
      ++i;
    } else if (ch == ',' || std::isspace(static_cast<unsigned char>(ch))) {
      ++i;
    } else {
      int rank = -1;
      auto [end, ec] = std::from_chars(spec.data() + i, spec.data() + spec.size(), rank);
      if (ec != std::errc() || end == spec.data() + i) {
        return fail("unexpected '" + std::string(1, ch) + "' at offset " + std::to_string(i));
      }
      if (rank < 0 || rank >= world_size) {
        return fail("rank " + std::to_string(rank) + " is outside the world of " +
                    std::to_string(world_size));
      }
      if (seen[static_cast<std::size_t>(rank)]) {
        return fail("rank " + std::to_string(rank) + " is listed twice");
      }
      seen[static_cast<std::size_t>(rank)] = true;
      label[static_cast<std::size_t>(rank)] = "group" + std::to_string(group);
      ++in_group;
      i = static_cast<std::size_t>(end - spec.data());
    }
  }
  for (int r = 0; r < world_size; ++r) {
    if (!seen[static_cast<std::size_t>(r)])
      return fail("rank " + std::to_string(r) + " is missing");
  }
  return label;
}

}  // namespace gradsync::collectives
