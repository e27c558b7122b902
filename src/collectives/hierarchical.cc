// Two-level collectives for ranks spread over hosts: what moves inside a host (shared memory,
// tens of GB/s) is kept apart from what must cross between hosts (a NIC, ~0.1-10 GB/s).
//
// All-reduce: reduce-scatter inside each host (local rank i ends up with slice i of the host's
// sum), all-reduce of slice i among the ranks with local index i on every host (all local
// ranks at once, each over its own connections, each with 1/L of the data), all-gather inside
// each host. A host then sends 2(H-1)/H of the message across its link per call, against
// 2(N-1)/N for a flat ring over all N ranks (whose boundary edges carry every rank's share).
//
// Reduce-scatter and all-gather(v) nest the same way, with the blocks regrouped so that each
// level moves contiguous ranges.
#include <cstring>
#include <numeric>
#include <vector>

#include "collectives/algorithms.h"
#include "kernels/kernels.h"

namespace gradsync::collectives {

namespace {

// The two levels as seen from this rank: its host's ranks, and the ranks that share its local
// index on every host (one per host, in host order).
struct Levels {
  int hosts = 0;
  int local_size = 0;
  int local_index = 0;
  std::vector<int> host_ranks;  // global ranks of this host
  std::vector<int> peers;       // global rank with this local index on host h
  const Topology* topology = nullptr;

  explicit Levels(const Comm& c) : topology(c.topology()) {
    const int me = c.rank();
    const int host = topology->host_of(me);
    hosts = topology->hosts();
    host_ranks = topology->host_members(host);
    local_size = static_cast<int>(host_ranks.size());
    for (int i = 0; i < local_size; ++i) {
      if (host_ranks[static_cast<std::size_t>(i)] == me) local_index = i;
    }
    for (int h = 0; h < hosts; ++h) {
      peers.push_back(topology->host_members(h)[static_cast<std::size_t>(local_index)]);
    }
  }
  // Global rank of local index i on host h.
  int rank_at(int h, int i) const { return topology->host_members(h)[static_cast<std::size_t>(i)]; }
};

}  // namespace

bool hierarchical_applicable(const Comm& c) {
  const Topology* t = c.topology();
  if (!t || t->hosts() < 2 || t->size() != c.size() || t->hosts() == c.size()) return false;
  const std::size_t local = t->host_members(0).size();
  for (int h = 1; h < t->hosts(); ++h) {
    if (t->host_members(h).size() != local) return false;
  }
  return true;
}

void hierarchical_allreduce(Comm& c, const void* send_v, void* recv_v, std::size_t count,
                            DataType dtype, ReduceOp op, const AlgorithmConfig& cfg) {
  if (!hierarchical_applicable(c)) {
    ring_allreduce(c, send_v, recv_v, count, dtype, op, cfg);
    return;
  }
  const Levels lv(c);
  const std::size_t es = dtype_size(dtype);
  auto* recv = static_cast<unsigned char*>(recv_v);
  const auto L = static_cast<std::size_t>(lv.local_size);
  std::vector<std::size_t> slices(L);
  for (std::size_t i = 0; i < L; ++i) slices[i] = Partition{count, L}.size(i);
  const auto li = static_cast<std::size_t>(lv.local_index);
  unsigned char* slice = recv + Partition{count, L}.offset(li) * es;
  // Averages are summed through both levels and divided once, by the whole world.
  const ReduceOp inner = op == ReduceOp::kAvg ? ReduceOp::kSum : op;

  Comm intra = c.subgroup(lv.host_ranks);
  ring_reduce_scatter(intra, send_v, slice, slices, dtype, inner, cfg);
  Comm inter = c.subgroup(lv.peers);
  ring_allreduce(inter, slice, slice, slices[li], dtype, inner, cfg);
  if (op == ReduceOp::kAvg) kernels::scale_for_average(slice, slices[li], dtype, c.size());
  ring_allgatherv(intra, slice, recv, slices, dtype, cfg);
}

void hierarchical_reduce_scatter(Comm& c, const void* send_v, void* recv_v,
                                 std::span<const std::size_t> block_counts, DataType dtype,
                                 ReduceOp op, const AlgorithmConfig& cfg) {
  if (!hierarchical_applicable(c)) {
    ring_reduce_scatter(c, send_v, recv_v, block_counts, dtype, op, cfg);
    return;
  }
  const Levels lv(c);
  const std::size_t es = dtype_size(dtype);
  const auto* send = static_cast<const unsigned char*>(send_v);
  const std::size_t n = block_counts.size();
  std::vector<std::size_t> offset(n + 1, 0);
  for (std::size_t r = 0; r < n; ++r) offset[r + 1] = offset[r] + block_counts[r];

  // Regroup the blocks by local index, then host: local rank i's range of the host-level
  // reduce-scatter holds the blocks of every rank with local index i, in host order, which the
  // host-crossing reduce-scatter then hands out one per host.
  std::vector<unsigned char> grouped(offset[n] * es);
  std::vector<std::size_t> per_local(static_cast<std::size_t>(lv.local_size), 0);
  std::vector<std::size_t> per_host(static_cast<std::size_t>(lv.hosts));
  std::size_t at = 0;
  for (int i = 0; i < lv.local_size; ++i) {
    for (int h = 0; h < lv.hosts; ++h) {
      const auto r = static_cast<std::size_t>(lv.rank_at(h, i));
      if (block_counts[r])
        std::memcpy(grouped.data() + at * es, send + offset[r] * es, block_counts[r] * es);
      at += block_counts[r];
      per_local[static_cast<std::size_t>(i)] += block_counts[r];
      if (i == lv.local_index) per_host[static_cast<std::size_t>(h)] = block_counts[r];
    }
  }
  const ReduceOp inner = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  std::vector<unsigned char> mine(per_local[static_cast<std::size_t>(lv.local_index)] * es);
  Comm intra = c.subgroup(lv.host_ranks);
  ring_reduce_scatter(intra, grouped.data(), mine.data(), per_local, dtype, inner, cfg);
  Comm inter = c.subgroup(lv.peers);
  ring_reduce_scatter(inter, mine.data(), recv_v, per_host, dtype, inner, cfg);
  if (op == ReduceOp::kAvg) {
    kernels::scale_for_average(recv_v, block_counts[static_cast<std::size_t>(c.rank())], dtype,
                               c.size());
  }
}

void hierarchical_allgatherv(Comm& c, const void* send_v, void* recv_v,
                             std::span<const std::size_t> block_counts, DataType dtype,
                             const AlgorithmConfig& cfg) {
  if (!hierarchical_applicable(c)) {
    ring_allgatherv(c, send_v, recv_v, block_counts, dtype, cfg);
    return;
  }
  const Levels lv(c);
  const std::size_t es = dtype_size(dtype);
  auto* recv = static_cast<unsigned char*>(recv_v);
  const std::size_t n = block_counts.size();
  std::vector<std::size_t> offset(n + 1, 0);
  for (std::size_t r = 0; r < n; ++r) offset[r + 1] = offset[r] + block_counts[r];

  // Across hosts first: the ranks with this local index gather their blocks (host order),
  // then each host's ranks gather those ranges, grouped by local index, and the result is
  // put back in rank order.
  std::vector<std::size_t> per_local(static_cast<std::size_t>(lv.local_size), 0);
  std::vector<std::size_t> per_host(static_cast<std::size_t>(lv.hosts));
  std::vector<std::size_t> local_start(static_cast<std::size_t>(lv.local_size), 0);
  for (int i = 0; i < lv.local_size; ++i) {
    if (i)
      local_start[static_cast<std::size_t>(i)] =
          local_start[static_cast<std::size_t>(i - 1)] + per_local[static_cast<std::size_t>(i - 1)];
    for (int h = 0; h < lv.hosts; ++h) {
      const auto r = static_cast<std::size_t>(lv.rank_at(h, i));
      per_local[static_cast<std::size_t>(i)] += block_counts[r];
      if (i == lv.local_index) per_host[static_cast<std::size_t>(h)] = block_counts[r];
    }
  }
  std::vector<unsigned char> grouped(offset[n] * es);
  unsigned char* mine = grouped.data() + local_start[static_cast<std::size_t>(lv.local_index)] * es;
  Comm inter = c.subgroup(lv.peers);
  ring_allgatherv(inter, send_v, mine, per_host, dtype, cfg);
  Comm intra = c.subgroup(lv.host_ranks);
  ring_allgatherv(intra, mine, grouped.data(), per_local, dtype, cfg);
  std::size_t at = 0;
  for (int i = 0; i < lv.local_size; ++i) {
    for (int h = 0; h < lv.hosts; ++h) {
      const auto r = static_cast<std::size_t>(lv.rank_at(h, i));
      if (block_counts[r])
        std::memcpy(recv + offset[r] * es, grouped.data() + at * es, block_counts[r] * es);
      at += block_counts[r];
    }
  }
}

}  // namespace gradsync::collectives
