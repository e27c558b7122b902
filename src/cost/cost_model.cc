// Alpha-beta-gamma formulas of each all-reduce algorithm (Thakur, Rabenseifner & Gropp,
// "Optimization of Collective Communication Operations in MPICH", 2005), plus the main-memory
// traffic of messages too large for the cache.
#include "cost/cost_model.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>

namespace gradsync::cost {

namespace {
int floor_pow2(int n) {
  int p = 1;
  while (p * 2 <= n) p *= 2;
  return p;
}
// The hierarchical algorithm applies: several hosts, the same number of ranks on each, and
// more than one on each (collectives::hierarchical_applicable is its run-time twin).
bool spread_evenly(int n, int hosts) {
  return hosts > 1 && n % hosts == 0 && n > hosts;
}
int log2_int(int p) {
  int k = 0;
  while ((1 << k) < p) ++k;
  return k;
}
// The shared-memory all-reduce's chunk (AlgorithmConfig::shared_memory_chunk_bytes), and its
// one-shot form's limit between 2 ranks, twice it among more
// (AlgorithmConfig::shared_memory_one_shot_limit).
constexpr double kSharedMemoryChunkBytes = 512 * 1024;
constexpr std::size_t kSharedMemoryOneShotBytes = 32 * 1024;
// The shared-memory all-gather's one-shot form: blocks up to the arena's one-shot buffer
// (collectives/arena_call.h's kOneShotMaxBytes).
constexpr std::size_t kSharedMemoryOneShotBlockBytes = 64 * 1024;
// Reading a cache line another core has just written, on current x86 (a zero-byte message
// over the shm transport, one such transfer plus bookkeeping, costs a little more:
// docs/performance-notes.md).
constexpr double kCacheLineTransferUs = 0.1;

// Bytes of main-memory traffic (reads, writes, and the read-for-ownership of every line
// written through the cache) one rank causes in its user and scratch buffers when they do not
// fit in cache. The transports' own buffers stay in cache and are charged by beta.
double memory_traffic_bytes(Algorithm a, int n, double S) {
  const int p = floor_pow2(n);
  const double frac = static_cast<double>(n - 1) / n, pfrac = static_cast<double>(p - 1) / p;
  // Folding the extra ranks costs about one more exchange-and-reduce step, and writing the
  // result back a full buffer with its read-for-ownership.
  const double fold = (n != p) ? 8 * S : 0.0;
  switch (a) {
    case Algorithm::kRing:
      // Reads its input once; writes partial sums and the gathered result, 2(N-1)/N of S.
      return S + 2 * (2 * frac * S);
    case Algorithm::kRecursiveDoubling:
      // Per step: read S to send, write S of scratch (x2), read both and write the result.
      return log2_int(p) * 6 * S + fold;
    case Algorithm::kHalvingDoubling:
      // Reduce-scatter steps as one recursive-doubling step over halving sizes (6x), then the
      // all-gather reads what it sends and writes what it receives (3x), both (P-1)/P of S.
      return 9 * pfrac * S + fold;
    case Algorithm::kParameterServer:
      // The root receives N-1 full buffers (x2), reduces each (3x) and sends N-1 copies.
      return 6 * (n - 1) * S;
    case Algorithm::kHierarchical:  // priced without memory traffic (see allreduce_us)
      return 0.0;
    case Algorithm::kSharedMemory:
      // Reads its input once; writes the result once with non-temporal stores (no
      // read-for-ownership) when the messages are large enough for this term to matter.
      return 2 * S;
    case Algorithm::kAuto:
      break;
  }
  return 0.0;
}
}  // namespace

double CostModel::allgather_us(int n, std::size_t total_bytes, int hosts,
                               bool shared_memory) const {
  if (n <= 1) return 0.0;
  if (shared_memory && hosts == 1) {
    // Every rank writes its block to shared memory once and reads every other block once: the
    // whole output's bytes, at the speed fitted at start-up. One wait for every rank where the
    // blocks fit the one-shot buffers; else two steps per piece, the first piece's two of the
    // all-reduce's three measured steps.
    const double S = static_cast<double>(total_bytes);
    const double copy = p_.shm_gbps > 0 ? 1e-3 / p_.shm_gbps : p_.beta_us_per_byte();
    const bool one_shot =
        total_bytes / static_cast<std::size_t>(n) <= kSharedMemoryOneShotBlockBytes;
    const double fixed =
        one_shot ? (p_.shm_one_shot_us > 0 ? p_.shm_one_shot_us
                    : p_.shm_call_us > 0   ? p_.shm_call_us / 3
                                           : log2_int(n) * p_.alpha_us)
                 : (p_.shm_call_us > 0 ? 2 * p_.shm_call_us / 3 : 2 * log2_int(n) * p_.alpha_us);
    return fixed + S * copy;
  }
  const double alpha = hosts > 1 && p_.inter_alpha_us > 0 ? p_.inter_alpha_us : p_.alpha_us;
  const double gbps =
      hosts > 1 && p_.inter_bandwidth_gbps > 0 ? p_.inter_bandwidth_gbps : p_.bandwidth_gbps;
  const double frac = static_cast<double>(n - 1) / n;
  return (n - 1) * alpha + frac * static_cast<double>(total_bytes) * 1e-3 / gbps;
}

double CostModel::allreduce_us(Algorithm a, int n, std::size_t bytes, int hosts) const {
  if (n <= 1) return 0.0;
  const bool spread = spread_evenly(n, hosts);
  if (hosts > 1) {
    // Every flat algorithm sends across hosts at most steps, and a step lasts as long as its
    // slowest hop: charge them the links between hosts.
    LinkParams across = p_;
    if (p_.inter_alpha_us > 0) across.alpha_us = p_.inter_alpha_us;
    if (p_.inter_bandwidth_gbps > 0) across.bandwidth_gbps = p_.inter_bandwidth_gbps;
    const CostModel flat(across);
    if (a == Algorithm::kHierarchical && spread) {
      // Reduce-scatter and all-gather among a host's L ranks over the fast link; across hosts
      // a ring of H ranks per local index, all L of them at once over the host's one link,
      // each with 1/L of the message: the link carries 2(H-1)/H of it.
      const int L = n / hosts;
      const double S = static_cast<double>(bytes);
      const double lfrac = (L - 1.0) / L, hfrac = (hosts - 1.0) / hosts;
      const double inside = 2 * (L - 1) * p_.alpha_us + 2 * lfrac * S * p_.beta_us_per_byte() +
                            lfrac * S * p_.gamma_us_per_byte();
      const double between = 2 * (hosts - 1) * across.alpha_us +
                             2 * hfrac * S * across.beta_us_per_byte() +
                             hfrac * (S / L) * p_.gamma_us_per_byte();
      return inside + between;
    }
    if (a == Algorithm::kHierarchical || a == Algorithm::kSharedMemory) a = Algorithm::kRing;
    if ((a == Algorithm::kRecursiveDoubling || a == Algorithm::kHalvingDoubling) && spread) {
      // Their partners differ in one bit of the rank per step. Launchers number each host's
      // L ranks in a row, so partners under L apart share a host, and in the other log2(H)
      // steps every rank of a host sends at once over the host's one link. Recursive doubling
      // sends the whole message in each step; halving-doubling's reduce-scatter starts with
      // the farthest partner (half the message across hosts, then a quarter, ...) and its
      // all-gather ends with it, so the host's link carries L(H-1)/H of the message each way:
      // L times what the hierarchical algorithm sends (measured: docs/performance-notes.md).
      const int L = n / hosts;
      const double S = static_cast<double>(bytes);
      const double steps_across = log2_int(floor_pow2(hosts));
      const double hfrac = (hosts - 1.0) / hosts;
      const double local = p_.beta_us_per_byte() + p_.gamma_us_per_byte();  // stage and reduce
      if (a == Algorithm::kRecursiveDoubling) {
        const double here = doubling_in_place(S) ? p_.gamma_us_per_byte() : local;
        return allreduce_us(a, L, bytes, 1) +
               steps_across * (across.alpha_us + L * S * across.beta_us_per_byte() + S * here);
      }
      return allreduce_us(a, L, static_cast<std::size_t>(S / hosts), 1) +
             2 * steps_across * across.alpha_us + 2 * L * hfrac * S * across.beta_us_per_byte() +
             hfrac * S * local;
    }
    return flat.allreduce_us(a, n, bytes, 1);
  }
  if (a == Algorithm::kHierarchical) a = Algorithm::kRing;  // what it runs on one host
  const double S = static_cast<double>(bytes);
  const double alpha = p_.alpha_us, beta = p_.beta_us_per_byte(), gamma = p_.gamma_us_per_byte();
  const int p = floor_pow2(n);
  const int steps = log2_int(p);
  // Non-power-of-two: fold the extra ranks in (one full message + reduction) and the
  // result back out (one full message).
  const double fold = (n != p) ? 2 * (alpha + S * beta) + S * gamma : 0.0;
  // Recursive doubling and halving-doubling receive each step whole into a scratch buffer
  // and only then reduce it: one more pass over the received bytes, at transfer speed,
  // that the ring avoids by reducing each piece straight out of the transport's buffer
  // while the next one is in flight. Recursive doubling avoids it too where its send left
  // the user's buffer at once (doubling_in_place).
  const double staged = beta;
  const double doubling_staged = doubling_in_place(S) ? 0.0 : beta;
  // Large messages are bound by main memory as much as by the transfers: beta and gamma are
  // measured on buffers that fit in cache. The share of the ranks' send and receive buffers
  // that the shared last-level cache cannot hold goes to memory, whose traffic a rank moves
  // at twice its copy rate (a copy reads and writes each byte).
  const double working_set = 2.0 * n * S;
  const double spill = std::max(0.0, 1.0 - p_.cache_mib * 1048576.0 / std::max(working_set, 1.0));
  const double memory = spill * memory_traffic_bytes(a, n, S) * p_.copy_us_per_byte() / 2;
  switch (a) {
    case Algorithm::kRing: {
      const double frac = static_cast<double>(n - 1) / n;
      return 2 * (n - 1) * alpha + 2 * frac * S * beta + frac * S * gamma + memory;
    }
    case Algorithm::kRecursiveDoubling:
      return steps * (alpha + S * (beta + doubling_staged) + S * gamma) + fold + memory;
    case Algorithm::kHalvingDoubling: {
      const double frac = static_cast<double>(p - 1) / p;
      return 2 * steps * alpha + 2 * frac * S * beta + frac * S * (gamma + staged) + fold + memory;
    }
    case Algorithm::kParameterServer:
      // The server receives and then sends N-1 full copies, one after another.
      return 2 * (n - 1) * (alpha + S * beta) + (n - 1) * S * gamma + memory;
    case Algorithm::kSharedMemory:
      return shared_memory_us(n, bytes, bytes <= (n > 2 ? 2 : 1) * kSharedMemoryOneShotBytes) +
             memory;
    case Algorithm::kHierarchical:  // mapped to the ring above
    case Algorithm::kAuto:
      return allreduce_us(choose_allreduce(n, bytes), n, bytes);
  }
  return 0.0;
}

// A message the transport buffers at once: up to half the buffer, since the previous call's
// message to the same partner may still hold the rest.
bool CostModel::doubling_in_place(double bytes) const {
  return bytes <= p_.buffered_send_bytes / 2;
}

double CostModel::shared_memory_us(int n, std::size_t bytes, bool one_shot) const {
  const double S = static_cast<double>(bytes);
  const double alpha = p_.alpha_us, beta = p_.beta_us_per_byte(), gamma = p_.gamma_us_per_byte();
  const double copy = p_.shm_gbps > 0 ? 1e-3 / p_.shm_gbps : beta;
  if (one_shot) {
    // One wait for every rank; each rank copies its input in once and reduces the whole
    // message over N inputs itself (N - 1 additions of S bytes; reading the others' inputs
    // out of the cores that wrote them is part of those): what its measured time grows by
    // from 4 to 32 KiB (docs/performance-notes.md, session 30).
    const double fixed = p_.shm_one_shot_us > 0 ? p_.shm_one_shot_us
                         : p_.shm_call_us > 0   ? p_.shm_call_us / 3
                                                : log2_int(n) * alpha;
    return fixed + S * copy + (n - 1) * S * gamma;
  }
  // No messages: each rank copies its input into shared memory and the result out of it,
  // once each, at the speed fitted at start-up (shm_gbps; else a message's, beta), and reduces
  // its 1/N of every chunk over N inputs (the ring's reduction work). Each chunk passes three
  // steps (stage, reduce, copy out), each ending in a wait for every other rank. The first
  // chunk's three steps depend on each other: the fixed cost measured at start-up, or else
  // three barriers' worth of latencies (log2(N) each). Later chunks find the others mostly
  // done (a spare staging slot gives each rank a chunk of slack), so their waits cost the
  // reads of the N-1 counters.
  const double frac = static_cast<double>(n - 1) / n;
  const double chunks = std::max(1.0, std::ceil(S / kSharedMemoryChunkBytes));
  const double first = p_.shm_call_us > 0 ? p_.shm_call_us : 3 * log2_int(n) * alpha;
  const double sync = first + 3 * (chunks - 1) * (n - 1) * kCacheLineTransferUs;
  // The steps form a pipeline three chunks deep: the first chunk's bytes pass the three
  // steps one after another, later chunks overlap. So a message of one chunk is not
  // overlapped at all, which is why the ring (pipelined in smaller pieces) beats this
  // algorithm on messages of a few hundred KiB with 2 ranks (docs/performance-notes.md). The
  // reduce and copy-out steps handle 1/N and (N-1)/N of a chunk per rank: together about
  // one more pass over it. A fitted throughput (shm_gbps) is already the average per byte
  // of a call of two chunks, the first unpipelined: measured, the algorithm's time grows in
  // proportion to the bytes from 256 KiB up, as the ring's does (docs/performance-notes.md).
  const double fill = p_.shm_gbps > 0 ? 0.0 : std::min(S, kSharedMemoryChunkBytes) * copy;
  return sync + fill + S * copy + frac * S * gamma;
}

double CostModel::fit_gbps(LinkParams params, double LinkParams::*field, Algorithm a, int ranks,
                           std::size_t bytes, double measured_us) {
  auto predict = [&](double gbps) {
    params.*field = gbps;
    return CostModel(params).allreduce_us(a, ranks, bytes);
  };
  const double fixed = predict(std::numeric_limits<double>::max());  // per-byte cost ~0
  const double per_inverse = predict(1.0) - fixed;                   // at 1 GB/s
  if (!(measured_us > fixed) || !(per_inverse > 0)) return 0.0;
  return per_inverse / (measured_us - fixed);
}

Algorithm CostModel::choose_allreduce(int n, std::size_t bytes, bool shared_memory,
                                      int hosts) const {
  Algorithm best = Algorithm::kRing;
  double best_us = allreduce_us(best, n, bytes, hosts);
  for (Algorithm a : {Algorithm::kRecursiveDoubling, Algorithm::kHalvingDoubling,
                      Algorithm::kSharedMemory, Algorithm::kHierarchical}) {
    if (a == Algorithm::kSharedMemory && !shared_memory) continue;
    if (a == Algorithm::kHierarchical && !spread_evenly(n, hosts)) continue;
    double t = allreduce_us(a, n, bytes, hosts);
    if (t < best_us) {
      best = a;
      best_us = t;
    }
  }
  return best;
}

std::optional<LinkParams> CostModel::parse(std::string_view spec, LinkParams base) {
  LinkParams p = base;
  while (!spec.empty()) {
    std::size_t comma = spec.find(',');
    std::string_view item = spec.substr(0, comma);
    spec = comma == std::string_view::npos ? std::string_view{} : spec.substr(comma + 1);
    std::size_t eq = item.find('=');
    if (eq == std::string_view::npos) return std::nullopt;
    std::string_view key = item.substr(0, eq), value = item.substr(eq + 1);
    double v = 0;
    auto [ptr, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
    if (ec != std::errc() || ptr != value.data() + value.size() || !(v > 0) || !std::isfinite(v)) {
      return std::nullopt;
    }
    if (key == "alpha_us") {
      p.alpha_us = v;
    } else if (key == "bandwidth_gbps") {
      p.bandwidth_gbps = v;
    } else if (key == "reduce_gbps") {
      p.reduce_gbps = v;
    } else if (key == "copy_gbps") {
      p.copy_gbps = v;
    } else if (key == "cache_mib") {
      p.cache_mib = v;
    } else if (key == "shm_call_us") {
      p.shm_call_us = v;
    } else if (key == "shm_one_shot_us") {
      p.shm_one_shot_us = v;
    } else if (key == "shm_gbps") {
      p.shm_gbps = v;
    } else if (key == "buffered_send_bytes") {
      p.buffered_send_bytes = v;
    } else if (key == "inter_alpha_us") {
      p.inter_alpha_us = v;
    } else if (key == "inter_bandwidth_gbps") {
      p.inter_bandwidth_gbps = v;
    } else {
      return std::nullopt;
    }
  }
  return p;
}

std::string CostModel::to_string() const {
  std::ostringstream o;
  // Every digit: parsed back, the constants are the same doubles and choose the same
  // algorithms (a resumed training run continues bit for bit only if they do).
  o.precision(std::numeric_limits<double>::max_digits10);
  o << "alpha_us=" << p_.alpha_us << ",bandwidth_gbps=" << p_.bandwidth_gbps
    << ",reduce_gbps=" << p_.reduce_gbps << ",copy_gbps=" << p_.copy_gbps
    << ",cache_mib=" << p_.cache_mib;
  if (p_.shm_call_us > 0) o << ",shm_call_us=" << p_.shm_call_us;
  if (p_.shm_one_shot_us > 0) o << ",shm_one_shot_us=" << p_.shm_one_shot_us;
  if (p_.shm_gbps > 0) o << ",shm_gbps=" << p_.shm_gbps;
  if (p_.buffered_send_bytes > 0) o << ",buffered_send_bytes=" << p_.buffered_send_bytes;
  if (p_.inter_alpha_us > 0) o << ",inter_alpha_us=" << p_.inter_alpha_us;
  if (p_.inter_bandwidth_gbps > 0) o << ",inter_bandwidth_gbps=" << p_.inter_bandwidth_gbps;
  return o.str();
}

}  // namespace gradsync::cost
