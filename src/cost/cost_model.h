// The alpha-beta-gamma cost model of the collectives: predicts each all-reduce algorithm's
// time from per-message latency (alpha), per-byte transfer time (beta), per-byte reduction
// time (gamma) and, for messages beyond the cache, main-memory traffic, and picks the
// fastest. Pure arithmetic, so the advisor tool can reuse it on constants measured elsewhere.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

#include "gradsync/types.h"

namespace gradsync::cost {

struct LinkParams {
  double alpha_us = 5.0;        // one message's fixed cost
  double bandwidth_gbps = 5.0;  // point-to-point payload bandwidth, 1e9 B/s
  double reduce_gbps = 10.0;    // reduction throughput over the input bytes, 1e9 B/s
  // One rank's memcpy of buffers that do not fit in cache, payload bytes per second (half
  // the STREAM copy figure, which counts bytes read plus written; the default is half the
  // benchmark machine's, docs/performance-notes.md). Not calibrated at start-up: copying
  // enough to miss the cache takes longer than a context should spend starting.
  double copy_gbps = 10.0;
  // Last-level cache the ranks of a host share, MiB: buffers beyond it go to main memory.
  double cache_mib = 32.0;
  // The shared-memory all-reduce's fixed cost, us: its three waits for every rank (where ranks
  // share cores, for each of them to be scheduled) and the cache misses of a few KiB, as
  // alpha_us counts them for a message. Fitted at start-up where the ranks share an arena, to
  // a call of 4 KiB in this form less its bytes; 0 = unknown, then 3 log2(N) alpha.
  double shm_call_us = 0.0;
  // The same for its one-shot form (messages up to 32 KiB): one wait for every rank. Fitted
  // likewise; 0 = unknown, then a third of shm_call_us, or log2(N) alpha.
  double shm_one_shot_us = 0.0;
  // The shared-memory all-reduce's throughput beyond that fixed cost, 1e9 B/s: its copies run
  // at the speed of the memory the ranks share, whatever the transport's messages cost (UCX's
  // over shared memory are several times slower than the shm transport's). Fitted at start-up
  // to one call of 1 MiB; 0 = unknown, then bandwidth_gbps.
  double shm_gbps = 0.0;
  // The largest message every rank's transport copies out of the sender's buffer before isend
  // returns (Transport::buffered_send_bytes; the least over the ranks at start-up): recursive
  // doubling reduces such messages straight out of the transport's buffer. 0 = none.
  double buffered_send_bytes = 0.0;
  // Between hosts (ranks on different hosts), where the world spans several: latency and
  // point-to-point bandwidth of that link. 0 = the same as inside a host.
  double inter_alpha_us = 0.0;
  double inter_bandwidth_gbps = 0.0;

  double beta_us_per_byte() const { return 1e-3 / bandwidth_gbps; }
  double gamma_us_per_byte() const { return 1e-3 / reduce_gbps; }
  double copy_us_per_byte() const { return 1e-3 / copy_gbps; }
};

class CostModel {
 public:
  CostModel() = default;
  explicit CostModel(LinkParams p) : p_(p) {}

  const LinkParams& params() const { return p_; }

  // Predicted time of one all-reduce of `bytes` over `ranks` ranks spread evenly over `hosts`
  // hosts (flat algorithms then run at the speed of the links between hosts).
  double allreduce_us(Algorithm a, int ranks, std::size_t bytes, int hosts = 1) const;
  // The shared-memory all-reduce on one host in either form, whatever its size (allreduce_us
  // takes the one-shot form up to 32 KiB, as the algorithm does).
  double shared_memory_us(int ranks, std::size_t bytes, bool one_shot) const;
  // The fastest of ring, recursive doubling and halving-doubling (never the baseline), of the
  // shared-memory algorithm when `shared_memory` says the ranks can use it, and of the
  // hierarchical algorithm when the ranks are spread evenly over several hosts.
  Algorithm choose_allreduce(int ranks, std::size_t bytes, bool shared_memory = false,
                             int hosts = 1) const;

  // The throughput (1e9 B/s) that `field` of `params` must have for the model to predict
  // `measured_us` for algorithm `a` on one host, all else as in `params`: how a measured call
  // calibrates a per-byte constant. The prediction is linear in the field's inverse. 0 where
  // no throughput would do (the fixed costs alone exceed the measurement).
  static double fit_gbps(LinkParams params, double LinkParams::*field, Algorithm a, int ranks,
                         std::size_t bytes, double measured_us);

  // Predicted time of an all-gather after which every rank holds `total_bytes` (all ranks'
  // blocks together): where the ranks share memory on one host, the arena's (each rank copies
  // its block in and the others out); else a ring's N-1 steps, each moving one rank's share.
  double allgather_us(int ranks, std::size_t total_bytes, int hosts = 1,
                      bool shared_memory = false) const;

  // "alpha_us=3,bandwidth_gbps=8,reduce_gbps=20,copy_gbps=10,cache_mib=32,shm_call_us=1,
  // shm_one_shot_us=0.5,shm_gbps=12,inter_alpha_us=50,inter_bandwidth_gbps=0.12" (any subset);
  // nullopt if malformed.
  static std::optional<LinkParams> parse(std::string_view spec, LinkParams base = {});
  std::string to_string() const;

 private:
  // Whether recursive doubling reduces a step of `bytes` straight out of the transport's
  // buffer, skipping the staging pass (see allreduce_us).
  bool doubling_in_place(double bytes) const;
  LinkParams p_;
};

}  // namespace gradsync::cost
