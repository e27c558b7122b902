// Two-level collectives for ranks spread over hosts: what moves inside a host (shared memory,
// at memory speed) is kept apart from what must cross between hosts (a NIC, far slower).
//
// All-reduce: reduce-scatter inside each host (local rank i ends up with slice i of the host's
// sum), all-reduce of slice i among the ranks with local index i on every host (all local
// ranks at once, each over its own connections, each with 1/L of the data), all-gather inside
// each host. A host then sends 2(H-1)/H of the message across its link per call, against
// 2(N-1)/N for a flat ring over all N ranks (whose boundary edges carry every rank's share).
//
// Reduce-scatter and all-gather(v) nest the same way, with the blocks regrouped so that each
// level moves contiguous ranges.
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/scratch.h"
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

namespace {

// Messages at least this large are cut into segments of about this size, so that the
// host-local phases of one segment run while another segment crosses between hosts: without
// that overlap the host-local phases add to the time on the link instead of hiding behind it
// (docs/performance-notes.md).
constexpr std::size_t kSegmentBytes = std::size_t{4} << 20;

// True if the host's peers and the other hosts' peers are reached through different transports
// (shm inside, tcp across): only then may two threads drive them at once.
bool separate_channels(const Comm& c, const Levels& lv) {
  for (int inside : lv.host_ranks) {
    if (inside == c.rank()) continue;
    for (int across : lv.peers) {
      if (across != c.rank() && c.channel(inside) == c.channel(across)) return false;
    }
  }
  return true;
}

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

// One segment's share of this rank: the segment's offset and length, and this rank's slice of
// it (local index i of L).
struct Segment {
  std::size_t offset, count;
  std::vector<std::size_t> slices;
  std::size_t slice_offset;  // within the segment

  Segment(std::size_t off, std::size_t n, std::size_t L, std::size_t li)
      : offset(off), count(n), slices(L) {
    for (std::size_t i = 0; i < L; ++i) slices[i] = Partition{n, L}.size(i);
    slice_offset = Partition{n, L}.offset(li);
  }
};

}  // namespace

void hierarchical_allreduce(Comm& c, const void* send_v, void* recv_v, std::size_t count,
                            DataType dtype, ReduceOp op, const AlgorithmConfig& cfg) {
  if (!hierarchical_applicable(c)) {
    ring_allreduce(c, send_v, recv_v, count, dtype, op, cfg);
    return;
  }
  const Levels lv(c);
  const std::size_t es = dtype_size(dtype);
  const auto* send = static_cast<const unsigned char*>(send_v);
  auto* recv = static_cast<unsigned char*>(recv_v);
  const auto L = static_cast<std::size_t>(lv.local_size);
  const auto li = static_cast<std::size_t>(lv.local_index);
  // Averages are summed through both levels and divided once, by the whole world.
  const ReduceOp inner = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  Comm intra = c.subgroup(lv.host_ranks);
  Comm inter = c.subgroup(lv.peers);

  // Every rank cuts the same segments (the decision depends only on the call and topology,
  // which all ranks share, and on the channels, which are the same kind everywhere).
  const std::size_t segments =
      separate_channels(c, lv) ? std::max<std::size_t>(1, count * es / kSegmentBytes) : 1;
  std::vector<Segment> seg;
  for (std::size_t k = 0; k < segments; ++k) {
    seg.emplace_back(Partition{count, segments}.offset(k), Partition{count, segments}.size(k), L,
                     li);
  }
  auto scatter = [&](std::size_t k) {
    const Segment& s = seg[k];
    ring_reduce_scatter(intra, send + s.offset * es, recv + (s.offset + s.slice_offset) * es,
                        s.slices, dtype, inner, cfg);
  };
  auto across = [&](std::size_t k) {
    const Segment& s = seg[k];
    unsigned char* slice = recv + (s.offset + s.slice_offset) * es;
    ring_allreduce(inter, slice, slice, s.slices[li], dtype, inner, cfg);
    if (op == ReduceOp::kAvg) kernels::scale_for_average(slice, s.slices[li], dtype, c.size());
  };
  auto gather = [&](std::size_t k) {
    const Segment& s = seg[k];
    ring_allgatherv(intra, recv + (s.offset + s.slice_offset) * es, recv + s.offset * es, s.slices,
                    dtype, cfg);
  };
  if (segments == 1) {
    scatter(0);
    across(0);
    gather(0);
    return;
  }

  // This thread drives the host's peers: scatter(k), then gather(k - 1) once its slice is
  // back from across the hosts; a second thread drives the other hosts' peers, across(k) as
  // soon as scatter(k) is done. Each thread keeps its own peers' messages in one order on
  // every rank. A failure on either side aborts the transport, so the other thread's waits
  // end at once, and the first error is the one reported.
  std::mutex mu;
  std::condition_variable cv;
  std::size_t scattered = 0, reduced = 0;
  std::exception_ptr first_error;
  auto fail = [&](std::exception_ptr e) {
    {
      std::lock_guard lock(mu);
      if (!first_error) first_error = e;
    }
    cv.notify_all();
    c.abort(what_of(e));
  };
  std::thread crossing([&] {
    try {
      for (std::size_t k = 0; k < segments; ++k) {
        {
          std::unique_lock lock(mu);
          cv.wait(lock, [&] { return scattered > k || first_error; });
          if (first_error) return;
        }
        across(k);
        {
          std::lock_guard lock(mu);
          reduced = k + 1;
        }
        cv.notify_all();
      }
    } catch (...) {
      fail(std::current_exception());
    }
  });
  auto wait_reduced = [&](std::size_t k) {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return reduced > k || first_error; });
    if (first_error) std::rethrow_exception(first_error);
  };
  try {
    for (std::size_t k = 0; k < segments; ++k) {
      scatter(k);
      {
        std::lock_guard lock(mu);
        scattered = k + 1;
      }
      cv.notify_all();
      if (k > 0) {
        wait_reduced(k - 1);
        gather(k - 1);
      }
    }
    wait_reduced(segments - 1);
    gather(segments - 1);
  } catch (...) {
    fail(std::current_exception());
  }
  crossing.join();
  if (first_error) std::rethrow_exception(first_error);
}

namespace {

// The blocks of a reduce-scatter or all-gather (one per rank, in rank order) regrouped for the
// two levels: by local index, then host. Local index i's range holds the blocks of every rank
// with local index i, in host order: the host-level step hands that range to local rank i, the
// host-crossing step its blocks one per host.
struct Regrouped {
  std::vector<std::size_t> offset;     // block r's offset in rank order
  std::vector<std::size_t> per_local;  // elements of local index i's range
  std::vector<std::size_t> per_host;   // of this rank's range: host h's block
  std::size_t own_start = 0;           // where this rank's local index range starts
  std::size_t total = 0;

  Regrouped(const Levels& lv, std::span<const std::size_t> counts)
      : offset(counts.size()),
        per_local(static_cast<std::size_t>(lv.local_size), 0),
        per_host(static_cast<std::size_t>(lv.hosts)) {
    for (std::size_t r = 0; r < counts.size(); ++r) {
      offset[r] = total;
      total += counts[r];
    }
    std::size_t at = 0;
    for (int i = 0; i < lv.local_size; ++i) {
      if (i == lv.local_index) own_start = at;
      for (int h = 0; h < lv.hosts; ++h) {
        const std::size_t n = counts[static_cast<std::size_t>(lv.rank_at(h, i))];
        per_local[static_cast<std::size_t>(i)] += n;
        if (i == lv.local_index) per_host[static_cast<std::size_t>(h)] = n;
        at += n;
      }
    }
  }

  // Block r of rank order to grouped order, and back.
  void pack(const Levels& lv, std::size_t es, const unsigned char* ranked,
            unsigned char* grouped) const {
    for_each_block(lv, [&](std::size_t r, std::size_t at, std::size_t n) {
      std::memcpy(grouped + at * es, ranked + offset[r] * es, n * es);
    });
  }
  void unpack(const Levels& lv, std::size_t es, const unsigned char* grouped,
              unsigned char* ranked) const {
    for_each_block(lv, [&](std::size_t r, std::size_t at, std::size_t n) {
      std::memcpy(ranked + offset[r] * es, grouped + at * es, n * es);
    });
  }

 private:
  // fn(rank, offset in grouped order, count) for every non-empty block, in grouped order.
  template <class Fn>
  void for_each_block(const Levels& lv, Fn fn) const {
    std::size_t at = 0;
    for (int i = 0; i < lv.local_size; ++i) {
      for (int h = 0; h < lv.hosts; ++h) {
        const auto r = static_cast<std::size_t>(lv.rank_at(h, i));
        const std::size_t n = (r + 1 < offset.size() ? offset[r + 1] : total) - offset[r];
        if (n) fn(r, at, n);
        at += n;
      }
    }
  }
};

}  // namespace

void hierarchical_reduce_scatter(Comm& c, const void* send_v, void* recv_v,
                                 std::span<const std::size_t> block_counts, DataType dtype,
                                 ReduceOp op, const AlgorithmConfig& cfg) {
  if (!hierarchical_applicable(c)) {
    ring_reduce_scatter(c, send_v, recv_v, block_counts, dtype, op, cfg);
    return;
  }
  const Levels lv(c);
  const std::size_t es = dtype_size(dtype);
  const Regrouped g(lv, block_counts);
  // Both written in full before they are read (pack, then the rings).
  auto* grouped = scratch_of<unsigned char>(ScratchUse::kRegrouped, g.total * es);
  g.pack(lv, es, static_cast<const unsigned char*>(send_v), grouped);
  const ReduceOp inner = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  auto* mine = scratch_of<unsigned char>(
      ScratchUse::kOwnBlocks, g.per_local[static_cast<std::size_t>(lv.local_index)] * es);
  Comm intra = c.subgroup(lv.host_ranks);
  ring_reduce_scatter(intra, grouped, mine, g.per_local, dtype, inner, cfg);
  Comm inter = c.subgroup(lv.peers);
  ring_reduce_scatter(inter, mine, recv_v, g.per_host, dtype, inner, cfg);
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
  // Across hosts first: the ranks with this local index gather their blocks (host order),
  // then each host's ranks gather those ranges, and the result is put back in rank order.
  const Levels lv(c);
  const std::size_t es = dtype_size(dtype);
  const Regrouped g(lv, block_counts);
  // Written in full by the two gathers before unpack reads it.
  auto* grouped = scratch_of<unsigned char>(ScratchUse::kRegrouped, g.total * es);
  unsigned char* mine = grouped + g.own_start * es;
  Comm inter = c.subgroup(lv.peers);
  ring_allgatherv(inter, send_v, mine, g.per_host, dtype, cfg);
  Comm intra = c.subgroup(lv.host_ranks);
  ring_allgatherv(intra, mine, grouped, g.per_local, dtype, cfg);
  g.unpack(lv, es, grouped, static_cast<unsigned char*>(recv_v));
}

}  // namespace gradsync::collectives
