// Wrapping a transport into a context, and the cost-model calibration every rank agrees on.
#include <algorithm>
#include <chrono>
#include <vector>

#include "core/context_impl.h"
#include "core/env.h"
#include "kernels/kernels.h"
#include "transport/shared_arena.h"

namespace gradsync {

using collectives::CallSignature;
using collectives::CollectiveKind;
using collectives::Comm;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Under a sanitizer the timings mean nothing (its checks cost more than the work they time),
// and every job of the test suites calibrates: there the probes make the same calls, in fewer
// batches and with smaller throughput probes (a 1 MiB ring all-reduce takes ~35 ms under TSan).
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr int kMedianBatches = 3;
constexpr std::size_t kFitBytes = 64 << 10;
#else
constexpr int kMedianBatches = 7;
constexpr std::size_t kFitBytes = 1 << 20;
#endif

// The median of several batches of `calls` calls of `body`, in microseconds per call: a rank
// still finishing its start-up (or another process passing through) slows a batch or two down,
// while ranks that must share cores slow down every batch, since no step that involves all
// ranks completes before each of them has run. (The fastest batch would be one in which the
// scheduler happened to run the ranks in the best order: not what calls will see.)
template <class Body>
double median_batch_us(int calls, Body body) {
  body();  // warm-up: page in buffers, wake every rank
  std::vector<double> batches;
  for (int batch = 0; batch < kMedianBatches; ++batch) {
    const auto t0 = Clock::now();
    for (int i = 0; i < calls; ++i) body();
    batches.push_back(seconds_since(t0) * 1e6 / calls);
  }
  std::nth_element(batches.begin(), batches.begin() + kMedianBatches / 2, batches.end());
  return batches[kMedianBatches / 2];
}

// Runs `body` (a call every rank makes) in batches of 32 until a batch is no longer 20% faster
// than the one before, at most 8 batches: links whose first messages are slow are timed after
// they have warmed up. UCX's shared memory pays page faults on its first ~64 messages a queue
// (about 40 us each on this machine, 2 us after), and ranks that wait that long fall asleep and
// then wake each other late for a while; the 4 KiB probe round over it came out at 40-230 us
// instead of 2-10 (docs/performance-notes.md). Rank 0 decides and broadcasts, so every rank
// makes the same calls; links that start warm stop after two batches.
template <class Body>
void warm_up(Comm& c, const collectives::AlgorithmConfig& cfg, Body body) {
  constexpr int kBatchCalls = 32;
  constexpr int kMaxBatches = 8;
  double previous_us = 0;
  for (int batch = 0; batch < kMaxBatches; ++batch) {
    const auto t0 = Clock::now();
    for (int i = 0; i < kBatchCalls; ++i) body();
    double go_on = 0;
    if (c.rank() == 0) {
      const double us = seconds_since(t0) * 1e6;
      go_on = batch == 0 || us < 0.8 * previous_us ? 1 : 0;
      previous_us = us;
    }
    collectives::broadcast(c, &go_on, 1, DataType::kFloat64, 0, cfg);
    if (go_on == 0) return;
  }
}

// One-way microseconds of a `bytes` message between ranks a and b (a ping-pong, halved), as
// measured on both; other ranks return 0 at once.
double pingpong_us(Comm& c, int a, int b, std::vector<unsigned char>& buf, std::size_t bytes,
                   int calls) {
  const int r = c.rank();
  if (r != a && r != b) return 0;
  const int peer = r == a ? b : a;
  return median_batch_us(calls,
                         [&] {
                           if (r == a) {
                             c.send(peer, buf.data(), bytes);
                             c.recv(peer, buf.data(), bytes);
                           } else {
                             c.recv(peer, buf.data(), bytes);
                             c.send(peer, buf.data(), bytes);
                           }
                         }) /
         2;
}

constexpr std::size_t kProbeBytes = 4096;

// What measure_link times on one host, us per call (a round, for the probe round).
struct OneHostProbes {
  double round_us = 0;     // the dissemination round of kProbeBytes
  double ring_us = 0;      // the ring all-reduce of kFitBytes
  double arena_us = 0;     // the shared-memory all-reduce of kFitBytes (0: no arena)
  double chunked_us = 0;   // ... of kProbeBytes, chunked form
  double one_shot_us = 0;  // ... of kProbeBytes, one-shot form
  double doubling_us = 0;  // recursive doubling of kProbeBytes, where there is an arena
};

// On one host (measure_link's `values`): beta fitted to the ring's call of kFitBytes and alpha
// the probe round less its bytes at that beta, then likewise the arena's throughput fitted to
// its call of kFitBytes and its chunked form's fixed cost its call of kProbeBytes less those
// bytes (each pair moves each other a little: two passes). The one-shot form's fixed cost is
// fitted against recursive doubling, its rival at that size: so that the model's two prices at
// kProbeBytes differ as the two calls measured did: the choice between them at small sizes is
// the one the two calls measured, whatever either model gets wrong there.
void fit_one_host(double* values, int n, const OneHostProbes& probes) {
  cost::LinkParams p;
  p.buffered_send_bytes = values[8];
  const double round_us = probes.round_us;
  p.alpha_us = round_us;
  p.reduce_gbps = values[2];
  for (int pass = 0; pass < 2; ++pass) {
    double gbps = cost::CostModel::fit_gbps(p, &cost::LinkParams::bandwidth_gbps, Algorithm::kRing,
                                            n, kFitBytes, probes.ring_us);
    if (gbps <= 0) {  // the ring's latencies alone would exceed it: charge all of it per byte
      const double sent = 2.0 * (n - 1) / n * kFitBytes;
      gbps = sent / std::max(probes.ring_us, 1e-3) / 1e3;
    }
    p.bandwidth_gbps = gbps;
    p.alpha_us = std::max(round_us - kProbeBytes / gbps / 1e3, 0.1);
  }
  values[0] = p.alpha_us;
  values[1] = p.bandwidth_gbps;
  if (probes.arena_us <= 0) return;
  p.shm_call_us = probes.chunked_us;
  for (int pass = 0; pass < 2; ++pass) {
    p.shm_gbps = cost::CostModel::fit_gbps(p, &cost::LinkParams::shm_gbps, Algorithm::kSharedMemory,
                                           n, kFitBytes, probes.arena_us);
    const double bytes_us =
        cost::CostModel(p).shared_memory_us(n, kProbeBytes, false) - p.shm_call_us;
    p.shm_call_us = std::max(probes.chunked_us - bytes_us, 0.1);
  }
  p.shm_one_shot_us = 0.1;  // known, so that what the model adds to it is the bytes' share
  const cost::CostModel fitted(p);
  const double wanted_us = fitted.allreduce_us(Algorithm::kRecursiveDoubling, n, kProbeBytes) +
                           probes.one_shot_us - probes.doubling_us;
  p.shm_one_shot_us =
      std::max(wanted_us - (fitted.shared_memory_us(n, kProbeBytes, true) - 0.1), 0.1);
  values[3] = p.shm_call_us;
  values[6] = p.shm_gbps;
  values[7] = p.shm_one_shot_us;
}

// Every rank measures with rank 0, and rank 0 broadcasts the constants: every rank must choose
// the same algorithm for the same call, so they must share one set.
//  - alpha, on one host: a round of a dissemination exchange over all ranks with a small
//    (kProbeBytes) message, less its bytes at beta. All ranks at once, so it includes what a
//    two-rank ping-pong cannot see: ranks that share a core wait for each other to be
//    scheduled. A small payload rather than none, because what latency-bound calls pay per
//    message is the cache misses of moving a few KiB between cores as much as the signalling.
//  - beta, on one host: fitted to a ring all-reduce of 1 MiB (kFitBytes), messages both ways
//    at once as every all-reduce sends them; batches of two calls, since this fit and the
//    arena's decide between the two algorithms around 1 MiB, where they run within 20% of
//    each other. A one-way ping-pong prices some transports' messages at several times what
//    they cost inside a collective (UCX's over shared memory: 13-34 GB/s one way, about 10 in
//    a ring: docs/performance-notes.md).
//  - across hosts, alpha and beta twice, by ping-pongs: with a rank of rank 0's host (if it
//    has another) for the link inside a host, with the first rank of the next host for the
//    link between hosts (inter_alpha_us, inter_bandwidth_gbps).
//  - gamma: rank 0 times the float32 sum kernel in cache.
//  - shm_call_us, shm_one_shot_us and shm_gbps: where the ranks share an arena, the
//    shared-memory all-reduce of kProbeBytes in each of its forms, whose waits and cache misses
//    make their fixed costs as alpha's probe makes alpha (the one-shot's against recursive
//    doubling's call of kProbeBytes, see fit_one_host), and of 1 MiB, to which its throughput
//    is fitted.
//  - buffered_send_bytes: not measured, the least over the ranks of what their transports
//    promise (Transport::buffered_send_bytes).
cost::LinkParams measure_link(Comm& c, transport::SharedArena* arena,
                              const collectives::Topology& topology, std::size_t buffered_send) {
  const int n = c.size(), r = c.rank();
  // alpha, bandwidth, reduce, shm call, inter alpha, inter bandwidth, shm gbps, shm one-shot,
  // buffered send bytes
  double values[9] = {0, 0, 0, 0, 0, 0, 0, 0, 0};
  const auto mine = static_cast<double>(buffered_send);
  collectives::recursive_doubling_allreduce(c, &mine, &values[8], 1, DataType::kFloat64,
                                            ReduceOp::kMin);
  OneHostProbes probes;
  collectives::AlgorithmConfig cfg;
  std::vector<float> fit_in(kFitBytes / sizeof(float), 1.0f), fit_out(fit_in.size());
  std::vector<unsigned char> buf(kFitBytes);
  auto alpha_beta = [&](int peer, double* alpha, double* gbps) {
    const double big = pingpong_us(c, 0, peer, buf, buf.size(), 1);
    const double small = pingpong_us(c, 0, peer, buf, kProbeBytes, 5);
    *gbps = static_cast<double>(buf.size()) / std::max(big, 1e-3) / 1e3;
    *alpha = std::max(small - kProbeBytes / *gbps / 1e3, 0.1);
  };

  if (topology.hosts() > 1) {
    const auto& home = topology.host_members(0);  // rank 0's host: hosts go by lowest rank
    const int across = topology.host_members(1)[0];
    alpha_beta(across, &values[4], &values[5]);
    if (home.size() > 1) {
      alpha_beta(home[1], &values[0], &values[1]);
    } else {
      values[0] = values[4];
      values[1] = values[5];
    }
  } else {
    int rounds = 0;
    for (int k = 1; k < n; k <<= 1) ++rounds;
    std::vector<unsigned char> probe_in(kProbeBytes);
    auto probe_round = [&] {
      for (int k = 1; k < n; k <<= 1) {
        c.sendrecv((r + k) % n, buf.data(), kProbeBytes, (r - k + n) % n, probe_in.data(),
                   kProbeBytes);
      }
    };
    warm_up(c, cfg, probe_round);
    probes.round_us = median_batch_us(5, probe_round) / rounds;
    probes.ring_us = median_batch_us(2, [&] {
      collectives::ring_allreduce(c, fit_in.data(), fit_out.data(), fit_in.size(),
                                  DataType::kFloat32, ReduceOp::kSum, cfg);
    });
  }

  if (arena && arena->members() == n) {
    auto arena_probe = [&](const collectives::AlgorithmConfig& form) {
      return median_batch_us(5, [&] {
        collectives::shm_direct_allreduce(c, *arena, fit_in.data(), fit_out.data(),
                                          kProbeBytes / sizeof(float), DataType::kFloat32,
                                          ReduceOp::kSum, form);
      });
    };
    collectives::AlgorithmConfig chunked = cfg;
    chunked.shared_memory_one_shot_bytes = 0;
    probes.chunked_us = arena_probe(chunked);
    probes.one_shot_us = arena_probe(cfg);
    probes.doubling_us = median_batch_us(5, [&] {
      collectives::recursive_doubling_allreduce(c, fit_in.data(), fit_out.data(),
                                                kProbeBytes / sizeof(float), DataType::kFloat32,
                                                ReduceOp::kSum);
    });
    values[3] = probes.chunked_us;  // across hosts (no arena there today), unfitted
    values[7] = probes.one_shot_us;
    probes.arena_us = median_batch_us(2, [&] {
      collectives::shm_direct_allreduce(c, *arena, fit_in.data(), fit_out.data(), fit_in.size(),
                                        DataType::kFloat32, ReduceOp::kSum, cfg);
    });
  }

  if (r == 0) {
    std::vector<float> a(kFitBytes / sizeof(float), 1.0f), b(a.size(), 2.0f);
    const double reduce_us = median_batch_us(2, [&] {
      kernels::reduce_into(a.data(), b.data(), a.size(), DataType::kFloat32, ReduceOp::kSum);
    });
    values[2] = static_cast<double>(a.size() * sizeof(float)) / std::max(reduce_us, 1e-3) / 1e3;
    if (topology.hosts() == 1) fit_one_host(values, n, probes);
  }
  collectives::broadcast(c, values, 9, DataType::kFloat64, 0, cfg);
  cost::LinkParams p{values[0], values[1], values[2]};
  p.shm_call_us = values[3];
  p.inter_alpha_us = values[4];
  p.inter_bandwidth_gbps = values[5];
  p.shm_gbps = values[6];
  p.shm_one_shot_us = values[7];
  p.buffered_send_bytes = values[8];
  return p;
}

// The ring follows hosts, or the groups options.topology names. Ranks that disagreed on the
// ring would wait on neighbours that never send, so with a spec every rank compares its ring
// with rank 0's now, when it is a clear error rather than a timeout in the first collective.
collectives::Topology agreed_topology(Context::Impl& impl, const Options& options,
                                      const std::vector<std::string>& host_of) {
  collectives::Topology topology = collectives::Topology::flat(impl.size);
  if (!options.topology.empty()) {
    std::string error;
    auto groups = collectives::parse_topology(options.topology, impl.size, &error);
    if (!groups) {
      const std::string what =
          "topology '" + options.topology + "' (Options::topology or GRADSYNC_TOPOLOGY)";
      Error e(ErrorKind::kInvalidArgument,
              what + " is not like \"0,2;1,3\" (every rank once): " + error, impl.rank,
              Error::kNoPeer, "init");
      impl.transport->abort(e.what());  // the others would wait for us in the check below
      throw e;
    }
    topology = collectives::Topology::from_hosts(*groups);
  } else if (static_cast<int>(host_of.size()) == impl.size) {
    topology = collectives::Topology::from_hosts(host_of);
  }
  // Host labels come from one store, the same for every rank; a spec comes from each rank's
  // own options or environment, which may differ.
  if (impl.size > 1 && !options.topology.empty()) {
    std::vector<std::int64_t> ring(topology.ring().begin(), topology.ring().end());
    std::vector<std::int64_t> first = ring;
    CallSignature sig{0,
                      CollectiveKind::kInternal,
                      DataType::kInt64,
                      ReduceOp::kSum,
                      Algorithm::kAuto,
                      0,
                      ring.size()};
    impl.submit(
            sig,
            [&](Comm& c) {
              collectives::broadcast(c, first.data(), first.size(), DataType::kInt64, 0, {});
            },
            true)
        .wait();
    if (first != ring) {
      auto show = [](const std::vector<std::int64_t>& v) {
        std::string s;
        for (auto r : v) s += (s.empty() ? "" : " ") + std::to_string(r);
        return "[" + s + "]";
      };
      Error e(ErrorKind::kMismatch,
              "ring order differs from rank 0's: here " + show(ring) + " (" + topology.describe() +
                  "), rank 0 " + show(first) + " (GRADSYNC_TOPOLOGY must be the same everywhere)",
              impl.rank, 0, "init");
      impl.transport->abort(e.what());
      throw e;
    }
  }
  return topology;
}

}  // namespace

std::unique_ptr<Context> make_context(std::unique_ptr<transport::Transport> transport,
                                      const Options& options, std::optional<cost::LinkParams> cost,
                                      const std::vector<std::string>& host_of) {
  auto impl = std::make_unique<Context::Impl>();
  impl->rank = transport->rank();
  impl->size = transport->size();
  impl->local_rank = options.local_rank >= 0 ? options.local_rank : impl->rank;
  impl->local_size = options.local_size >= 0 ? options.local_size : impl->size;
  impl->timeout = options.timeout.count() > 0 ? options.timeout : env::kDefaultTimeout;
  impl->forced_algorithm = options.algorithm;
  for (int p = 0; p < impl->size; ++p) {
    impl->peer_transport.push_back(p == impl->rank ? "self" : transport->name());
  }
  impl->transport = std::move(transport);
  impl->topology = agreed_topology(*impl, options, host_of);
  const auto& neighbours = impl->topology.host_members(impl->topology.host_of(impl->rank));
  impl->waiters_run_calls = neighbours.size() <= transport::usable_cores();
  if (!cost && !options.cost_model.empty()) {  // init() has read GRADSYNC_COST_MODEL into it
    cost = cost::CostModel::parse(options.cost_model);
    if (!cost) {
      throw Error(ErrorKind::kInvalidArgument,
                  "cost model '" + options.cost_model +
                      "' is not like alpha_us=3,bandwidth_gbps=8,reduce_gbps=20",
                  impl->rank);
    }
  }
  if (!cost && impl->size > 1) {
    cost::LinkParams measured;
    CallSignature sig{
        0, CollectiveKind::kInternal, DataType::kFloat64, ReduceOp::kSum, Algorithm::kAuto, 0, 6};
    transport::SharedArena* arena = impl->transport->shared_arena();
    const std::size_t buffered_send = impl->transport->buffered_send_bytes();
    impl->submit(
            sig, [&](Comm& c) { measured = measure_link(c, arena, impl->topology, buffered_send); },
            true)
        .wait();
    cost = measured;
  }
  impl->cost = cost::CostModel(cost.value_or(cost::LinkParams{}));
  impl->restart_sequence();
  return std::make_unique<Context>(std::move(impl));
}

}  // namespace gradsync
