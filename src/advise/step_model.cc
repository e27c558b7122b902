// The advisor's step model: the workload's compute, the Reducer's buckets (ddp::assign_buckets)
// priced by the cost model that picks each call's algorithm, and an event-driven run of one
// rank's backward against its worker, sharing the cores where the host has fewer than two
// per rank (every rank alike: stragglers are not modelled).
#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <numeric>
#include <sstream>

#include "cost/cost_model.h"
#include "ddp/buckets.h"
#include "ddp/sharded_schedule.h"
#include "gradsync/advise.h"
#include "gradsync/compress.h"
#include "gradsync/error.h"
#include "gradsync/sharded.h"

namespace gradsync::advise {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

Error invalid(const std::string& what) {
  return Error(ErrorKind::kInvalidArgument, what, Error::kUnknownRank, Error::kNoPeer, "advise");
}

cost::CostModel cost_model_of(const Profile& p) {
  cost::LinkParams l;
  l.alpha_us = p.intra.alpha_us;
  l.bandwidth_gbps = p.intra.bandwidth_gbps;
  // A reduction that runs in the transfer's pass adds no time: as if infinitely fast.
  l.reduce_gbps = p.reduce_in_transfer ? std::numeric_limits<double>::infinity() : p.reduce_gbps;
  l.copy_gbps = p.copy_gbps;
  l.cache_mib = p.cache_mib;
  l.inter_alpha_us = p.inter.alpha_us;
  l.inter_bandwidth_gbps = p.inter.bandwidth_gbps;
  return cost::CostModel(l);
}

// One collective call of `floats` gradient floats through the plan's codec, as the Reducer
// issues it: its time, the part of it that keeps a core busy, its latency alone (the same
// call with no payload), and the bytes one rank sends.
struct CallCost {
  double us = 0, cpu_us = 0, latency_us = 0, codec_us = 0;
  std::size_t wire_bytes = 0;
};

class CallPricer {
 public:
  // `algorithm`: every all-reduce by that one, priced by the cost model; kAuto: the timed
  // curves where the profile has them, else the cost model's pick.
  CallPricer(const Profile& profile, const Plan& plan, Algorithm algorithm = Algorithm::kAuto)
      : profile_(profile), plan_(plan), model_(cost_model_of(profile)), algorithm_(algorithm) {
    for (const auto& t : profile.timed) {
      if (algorithm == Algorithm::kAuto && t.ranks == plan.ranks && t.hosts == plan.hosts) {
        timed_[t.collective].push_back(t);
      }
    }
    for (auto& [name, curve] : timed_) {
      std::sort(curve.begin(), curve.end(),
                [](const auto& a, const auto& b) { return a.bytes < b.bytes; });
    }
    if (plan.codec != "none") {
      codec_ = compress::make_codec(plan.codec);
      const auto spec = compress::CodecSpec::parse(codec_->spec());  // defaults filled in
      const std::string& name = spec.name;
      const auto speeds = profile.codecs.find(name);
      if (speeds == profile.codecs.end() || speeds->second.empty()) {
        throw invalid("profile '" + profile.name + "' has no encode and decode speed for codec '" +
                      name + "'");
      }
      speeds_ = by_size(speeds->second);
      // A ring's hops re-encode without error feedback, at that speed where probed.
      const auto raw = profile.codecs.find(name + ":ef=0");
      reencode_speeds_ = raw != profile.codecs.end() ? by_size(raw->second) : speeds_;
      powersgd_rank_ = static_cast<std::size_t>(spec.get("rank", 0));
      holds_back_ = spec.get("ef", 0) == 1;
    }
  }

  bool whole_buckets() const { return !codec_ || codec_->traits().whole_buckets; }
  // The codec keeps residuals (error feedback, PowerSGD's own included): what step-ahead
  // steps by.
  bool holds_back() const { return holds_back_; }

  // One call over a tensor (or a bucket) of `floats` floats; `rows`: its matrix rows, for
  // PowerSGD (0: a vector, or a bucket of several tensors).
  CallCost allreduce(std::size_t floats, std::size_t rows = 0) const {
    const int n = plan_.ranks;
    CallCost c;
    if (n <= 1) return c;
    const std::size_t raw = floats * sizeof(float);
    const auto pattern = codec_ ? codec_->traits().pattern : compress::Pattern::kFloat32;
    const std::size_t cols = rows ? floats / rows : 0;
    const double encode_gbps =
        codec_ ? speed_at(speeds_, floats, &Profile::CodecSpeed::encode_gbps) : 0;
    const double decode_gbps =
        codec_ ? speed_at(speeds_, floats, &Profile::CodecSpeed::decode_gbps) : 0;
    const bool low_rank = pattern == compress::Pattern::kLowRank;
    const bool fused_in_shm = pattern == compress::Pattern::kHalfRing && in_shared_memory() &&
                              model_.choose_allreduce(n, raw, true, 1) == Algorithm::kSharedMemory;
    if (fused_in_shm) {
      // The shared-memory all-reduce rounds its sums to 16 bits as it copies: a float32
      // all-reduce's work, no codec pass of its own.
      add_allreduce(c, raw);
    } else if (low_rank && (rows < 2 || cols < 2)) {
      add_allreduce(c, raw);  // PowerSGD sends vectors as they are
    } else if (low_rank) {
      // P (rows x r) and Q (cols x r), each all-reduced in float32.
      const std::size_t r = std::min({powersgd_rank_, rows, cols});
      add_allreduce(c, rows * r * sizeof(float));
      add_allreduce(c, cols * r * sizeof(float));
      c.codec_us = raw * 1e-3 / encode_gbps + raw * 1e-3 / decode_gbps;
    } else if (pattern == compress::Pattern::kGather || pattern == compress::Pattern::kIndexUnion) {
      // Every rank's payload to every rank, each decoded and added.
      const std::size_t payload = codec_->encoded_bytes(floats);
      c.us = gather_us(payload * static_cast<std::size_t>(n));
      c.latency_us = gather_us(0);
      c.wire_bytes = payload * static_cast<std::size_t>(n - 1);
      c.codec_us = raw * 1e-3 / encode_gbps + (n - 1) * raw * 1e-3 / decode_gbps;
    } else {
      add_allreduce(c, codec_ ? codec_->encoded_bytes(floats) : raw);
      if (codec_) {
        // One encode and one decode, and for a ring of 16-bit or quantised chunks a decode,
        // add and re-encode of its share at each of the N-1 reduce-scatter hops.
        const bool per_hop =
            pattern == compress::Pattern::kHalfRing || pattern == compress::Pattern::kQuantizedRing;
        const double hops = per_hop ? static_cast<double>(n - 1) / n : 0;
        const double reencode_gbps =
            speed_at(reencode_speeds_, floats, &Profile::CodecSpeed::encode_gbps);
        c.codec_us =
            raw * 1e-3 * ((1 + hops) / decode_gbps + 1 / encode_gbps + hops / reencode_gbps);
      }
    }
    const double wire_us = c.us;
    c.us += c.codec_us;
    // Ranks sharing a host's memory move every byte through the cores; otherwise the cores
    // (or a GPU's) reduce what arrives and run the codec, and the links do the rest.
    c.cpu_us = in_shared_memory()
                   ? c.us
                   : c.codec_us + std::min(wire_us, raw * 1e-3 / profile_.reduce_gbps);
    return c;
  }

  // What prices a float32 `collective` of `bytes`: "timed" where the profile's curves do,
  // else the cost model's all-reduce pick (a reduce-scatter is half of it) or the ring
  // all-gather.
  std::string algorithm(const std::string& collective, std::size_t bytes) const {
    const bool from_curve = collective == "allreduce" ? timed("allreduce") != nullptr
                                                      : timed(collective) || timed("allreduce");
    if (from_curve) return "timed";
    if (collective == "allgather") return "ring";
    return to_string(allreduce_algorithm(bytes));
  }

  // ZeRO: the gradients reduce-scattered (half a ring all-reduce) and the updated parameters
  // all-gathered, each once over the whole model.
  double allreduce_us(std::size_t floats) const {
    if (plan_.ranks <= 1) return 0;
    CallCost c;
    add_allreduce(c, floats * sizeof(float));
    return c.us;
  }
  // Timed where the profile has them, else half an all-reduce (a ring's two halves).
  double reduce_scatter_us(std::size_t floats) const {
    if (plan_.ranks <= 1) return 0;
    if (const auto* curve = timed("reduce_scatter")) {
      return interpolate(*curve, floats * sizeof(float));
    }
    return allreduce_us(floats) / 2;
  }
  double allgather_us(std::size_t floats) const { return gather_us(floats * sizeof(float)); }
  // ShardedDataParallel's int8 gradients: each element quantised once and decoded twice (its
  // residual, and the sum of its shard's pieces), at the probed int8 speeds.
  double quantise_us(std::size_t floats) const {
    if (plan_.ranks <= 1 || !codec_) return 0;
    const double raw = static_cast<double>(floats * sizeof(float));
    return raw * 1e-3 *
           (1 / speed_at(speeds_, floats, &Profile::CodecSpeed::encode_gbps) +
            2 / speed_at(speeds_, floats, &Profile::CodecSpeed::decode_gbps));
  }

 private:
  // An all-reduce of `bytes`, added to `c`: as timed on this cluster shape if the profile
  // has such times, else by the algorithm the cost model picks.
  void add_allreduce(CallCost& c, std::size_t bytes) const {
    const int n = plan_.ranks;
    if (const auto* curve = timed("allreduce")) {
      c.us += interpolate(*curve, bytes);
      c.latency_us += curve->front().us;
    } else {
      const Algorithm a = allreduce_algorithm(bytes);
      c.us += model_.allreduce_us(a, n, bytes, plan_.hosts);
      c.latency_us += model_.allreduce_us(a, n, 0, plan_.hosts);
    }
    // A ring sends 2(N-1)/N of the message; the others about as much.
    c.wire_bytes += static_cast<std::size_t>(2.0 * (n - 1) / n * static_cast<double>(bytes));
  }

  // An all-gather after which every rank holds `total_bytes`: as timed at this shape, else
  // the second half of a timed all-reduce, else the cost model's.
  double gather_us(std::size_t total_bytes) const {
    if (plan_.ranks <= 1) return 0;
    total_bytes = std::max<std::size_t>(total_bytes, 1);
    if (const auto* curve = timed("allgather")) return interpolate(*curve, total_bytes);
    if (const auto* curve = timed("allreduce")) return interpolate(*curve, total_bytes) / 2;
    return model_.allgather_us(plan_.ranks, total_bytes, plan_.hosts, in_shared_memory());
  }

  static std::vector<Profile::CodecSpeed> by_size(std::vector<Profile::CodecSpeed> speeds) {
    std::sort(speeds.begin(), speeds.end(),
              [](const auto& a, const auto& b) { return a.floats < b.floats; });
    return speeds;
  }
  // On a log-log line through the two timed sizes around `floats`; beyond them, the nearest.
  static double speed_at(const std::vector<Profile::CodecSpeed>& speeds, std::size_t floats,
                         double Profile::CodecSpeed::*gbps) {
    if (floats <= speeds.front().floats || speeds.size() == 1) return speeds.front().*gbps;
    for (std::size_t i = 1; i < speeds.size(); ++i) {
      const auto& lo = speeds[i - 1];
      const auto& hi = speeds[i];
      if (floats <= hi.floats) {
        if (lo.floats == 0) return hi.*gbps;  // "any size" beside timed sizes: those rule
        const double x = std::log(static_cast<double>(floats) / lo.floats) /
                         std::log(static_cast<double>(hi.floats) / lo.floats);
        return std::exp(std::log(lo.*gbps) + x * std::log(hi.*gbps / lo.*gbps));
      }
    }
    return speeds.back().*gbps;
  }

  // The all-reduce algorithm of an untimed call: the one asked for, else the cost model's pick.
  Algorithm allreduce_algorithm(std::size_t bytes) const {
    if (algorithm_ != Algorithm::kAuto) return algorithm_;
    return model_.choose_allreduce(plan_.ranks, bytes, in_shared_memory(), plan_.hosts);
  }

  // The shared-memory all-reduce is open to the plan: one host whose ranks share memory.
  bool in_shared_memory() const { return plan_.hosts == 1 && profile_.shared_memory; }

  const std::vector<Profile::Timed>* timed(const std::string& collective) const {
    const auto it = timed_.find(collective);
    return it == timed_.end() ? nullptr : &it->second;
  }

  // Linear in the size between the timed sizes, a log-log line through the nearest two;
  // below the smallest its time, beyond the largest its time per byte.
  static double interpolate(const std::vector<Profile::Timed>& curve, std::size_t bytes) {
    if (bytes <= curve.front().bytes) return curve.front().us;
    for (std::size_t i = 1; i < curve.size(); ++i) {
      if (bytes <= curve[i].bytes) {
        const auto& lo = curve[i - 1];
        const auto& hi = curve[i];
        const double x = std::log(static_cast<double>(bytes) / lo.bytes) /
                         std::log(static_cast<double>(hi.bytes) / lo.bytes);
        return std::exp(std::log(lo.us) + x * std::log(hi.us / lo.us));
      }
    }
    return curve.back().us * static_cast<double>(bytes) / curve.back().bytes;
  }

  const Profile& profile_;
  const Plan& plan_;
  cost::CostModel model_;
  Algorithm algorithm_;
  // This plan's ranks and hosts, per collective, by size.
  std::map<std::string, std::vector<Profile::Timed>> timed_;
  std::size_t powersgd_rank_ = 0;
  bool holds_back_ = false;
  std::unique_ptr<compress::Codec> codec_;
  std::vector<Profile::CodecSpeed> speeds_, reencode_speeds_;  // by size
};

// A stretch of a bucket's work on the worker. While backward also runs, each goes at its
// speed here (relative to alone); alone, each at full speed.
struct Phase {
  double seconds = 0;
  double compute_speed = 1, worker_speed = 1;
};

// One rank's backward and its worker, advanced together event by event. Backward layer times
// in backward order, the gradients of layer i ready at its end; each bucket waits for the
// layer `waits_for` and the worker, then runs its phases. Returns backward's end and the
// worker's, and fills each bucket's start and end.
std::pair<double, double> run_step(const std::vector<double>& layers,
                                   std::vector<BucketPrediction>& buckets,
                                   const std::vector<std::size_t>& waits_for,
                                   const std::vector<std::vector<Phase>>& work, bool overlap) {
  constexpr double kDone = 1e-15;
  double t = 0, backward_end = layers.empty() ? 0 : -1;
  std::size_t layer = 0, bucket = 0, phase = 0;
  double layer_left = layers.empty() ? 0 : layers[0], phase_left = 0;
  bool holding = false;  // the worker runs bucket `bucket`, phase `phase`
  const std::size_t nb = buckets.size();
  while (layer < layers.size() || bucket < nb) {
    if (!holding && bucket < nb && (backward_end >= 0 || (overlap && layer > waits_for[bucket]))) {
      buckets[bucket].start_s = t;
      holding = true;
      phase = 0;
      phase_left = work[bucket].empty() ? 0 : work[bucket][0].seconds;
    }
    if (holding && phase_left <= kDone) {  // this phase is over: the next, or the next bucket
      if (++phase < work[bucket].size()) {
        phase_left = work[bucket][phase].seconds;
      } else {
        buckets[bucket++].end_s = t;
        holding = false;
      }
      continue;
    }
    const bool computing = layer < layers.size();
    if (!computing && !holding) break;  // unreachable: every bucket is ready once backward ends
    const bool both = computing && holding;
    const Phase none;
    const Phase& ph = holding ? work[bucket][phase] : none;
    const double cs = both ? ph.compute_speed : 1.0, ws = both ? ph.worker_speed : 1.0;
    double dt = std::numeric_limits<double>::infinity();
    if (computing) dt = std::min(dt, layer_left / cs);
    if (holding) dt = std::min(dt, phase_left / ws);
    t += dt;
    if (holding) phase_left -= dt * ws;
    if (computing) {
      layer_left -= dt * cs;
      if (layer_left <= kDone) {
        if (++layer < layers.size()) {
          layer_left = layers[layer];
        } else {
          backward_end = t;
        }
      }
    }
  }
  if (backward_end < 0) backward_end = t;
  return {backward_end, std::max(t, backward_end)};
}

// One micro-batch of ShardedDataParallel (sharded.h), each layer a unit, as its training
// thread issues and waits for calls. Stage 3: each layer's parameters are gathered before its
// forward and again before its backward, the gathers of the `prefetch_depth` uses after the
// current one queued meanwhile (uses run forward, then backward; the last prefetch_depth + 1
// layers stay whole from forward to backward, and a layer still whole is not gathered again),
// and as many reduce-scatters stay in flight. Stage 2: the gathers queued by the last
// step are waited for by each forward (`gather` all zero where there is nothing to gather),
// and two reduce-scatters stay in flight. `stepping`, unless empty: the optimizer's step
// before the micro-batch, each layer's shard in turn, its gather queued once it has stepped
// (stage 2 every layer's, stage 3 those the first acquire would queue). The worker runs the
// calls in issue order; while both it and the thread are busy each goes at its overlapped
// speed, alone at full speed. Layer times, gathers and reduce-scatters in seconds, forward
// order. Returns the micro-batch's end, counted from the step's start.
double sharded_micro_batch(int stage, const std::vector<double>& forward,
                           const std::vector<double>& backward, const std::vector<double>& gather,
                           const std::vector<double>& scatter, const std::vector<double>& stepping,
                           double compute_speed, double comm_speed) {
  // The thread's script: queue a call, wait for one, or compute. Calls are numbered: layer
  // l's forward gather l, its backward gather L + l, its reduce-scatter 2L + l.
  struct Op {
    enum Kind { kIssue, kWait, kCompute } kind;
    std::size_t call = 0;
    double seconds = 0;
  };
  const std::size_t layers = forward.size();
  std::vector<double> seconds(3 * layers);
  for (std::size_t l = 0; l < layers; ++l) {
    seconds[l] = seconds[layers + l] = gather[l];
    seconds[2 * layers + l] = scatter[l];
  }
  std::vector<Op> ops;
  const std::size_t depth = static_cast<std::size_t>(ShardedOptions{}.prefetch_depth);
  std::vector<bool> whole(layers, false);  // stage 3: gathered or being gathered, not dropped
  const std::size_t gathered_by_step = stage == 2 ? layers : ddp::zero3::gathered_by_step(depth);
  for (std::size_t l = 0; l < layers; ++l) {
    if (!stepping.empty()) ops.push_back({Op::kCompute, 0, stepping[l]});
    if (l < gathered_by_step && (stage == 2 || !stepping.empty())) {
      ops.push_back({Op::kIssue, l});
      whole[l] = stage == 3;
    }
  }
  std::vector<bool> issued(seconds.size(), false);
  // Stage 3's acquire at use `use`: its own gather unless whole, then those of the next uses.
  const auto acquire = [&](std::size_t use) {
    for (std::size_t next = use; next <= std::min(use + depth, ddp::zero3::last_use(layers));
         ++next) {
      const auto [l, backward_use] = ddp::zero3::use_at(next, layers);
      if (!whole[l]) {
        const std::size_t call = backward_use ? layers + l : l;
        ops.push_back({Op::kIssue, call});
        issued[call] = true;
        whole[l] = true;
      }
    }
  };
  for (std::size_t l = 0; l < layers; ++l) {
    if (stage == 3) acquire(l);
    ops.push_back({Op::kWait, l});
    ops.push_back({Op::kCompute, 0, forward[l]});
    if (stage == 3 && !ddp::zero3::kept_for_backward(l, layers, depth)) whole[l] = false;
  }
  const std::size_t in_flight = stage == 3 ? ddp::zero3::reduce_scatters_in_flight(depth) : 2;
  std::vector<std::size_t> reducing;
  for (std::size_t l = layers; l-- > 0;) {
    if (stage == 3) {
      acquire(ddp::zero3::use_of(l, true, layers));
      if (issued[layers + l]) ops.push_back({Op::kWait, layers + l});
    }
    ops.push_back({Op::kCompute, 0, backward[l]});
    ops.push_back({Op::kIssue, 2 * layers + l});
    reducing.push_back(2 * layers + l);
    if (reducing.size() > in_flight) {
      ops.push_back({Op::kWait, reducing[reducing.size() - in_flight - 1]});
    }
    if (stage == 3) whole[l] = false;
  }
  for (std::size_t call : reducing) ops.push_back({Op::kWait, call});

  std::vector<bool> done(seconds.size(), false);
  std::deque<std::size_t> queue;
  double t = 0, computing = -1, working = -1;  // seconds of work left; < 0: idle
  std::size_t next = 0, current = 0;
  while (true) {
    while (computing < 0 && next < ops.size()) {
      const Op& op = ops[next];
      if (op.kind == Op::kWait && !done[op.call]) break;
      if (op.kind == Op::kIssue) queue.push_back(op.call);
      if (op.kind == Op::kCompute) computing = op.seconds;
      ++next;
    }
    if (working < 0 && !queue.empty()) {
      current = queue.front();
      queue.pop_front();
      working = seconds[current];
    }
    if (computing < 0 && working < 0)
      break;  // the script is done (it waits only for calls it queued)
    const double compute_rate = working >= 0 ? compute_speed : 1.0;
    const double work_rate = computing >= 0 ? comm_speed : 1.0;
    double dt = std::numeric_limits<double>::infinity();
    if (computing >= 0) dt = std::min(dt, computing / compute_rate);
    if (working >= 0) dt = std::min(dt, working / work_rate);
    t += dt;
    if (computing >= 0)
      computing = computing - dt * compute_rate <= 1e-15 ? -1 : computing - dt * compute_rate;
    if (working >= 0 && (working -= dt * work_rate) <= 1e-15) {
      working = -1;
      done[current] = true;
    }
  }
  return t;
}

std::size_t optimizer_state_floats(const std::string& optimizer) {
  return optimizer == "sgd" ? 1 : 2;
}

std::string ms(double s) {
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(s < 0.01 ? 2 : 1);
  o << s * 1e3 << " ms";
  return o.str();
}

// The bottleneck, in a word and a sentence.
void classify(Prediction& p, double latency_s, const Profile& profile, const Plan& plan) {
  const double compute_share = (p.compute_s + p.optimizer_s) / p.step_s;
  std::ostringstream why;
  if (profile.memory_bytes_per_rank > 0 &&
      p.memory_per_rank_bytes > profile.memory_bytes_per_rank) {
    p.bottleneck = "memory";
    why << "memory-bound: parameters, gradients and optimizer state need "
        << p.memory_per_rank_bytes / (1 << 20) << " MiB a rank, more than the "
        << profile.memory_bytes_per_rank / (1 << 20) << " MiB it has";
  } else if (p.exposed_comm_s <= 0.1 * p.step_s) {
    p.bottleneck = "compute";
    why << "compute-bound: " << static_cast<int>(std::lround(100 * compute_share)) << "% of the "
        << ms(p.step_s) << " step computes, and only " << ms(p.exposed_comm_s)
        << " of communication shows";
  } else if (p.codec_s > 0.5 * p.comm_s) {
    p.bottleneck = "codec";
    why << "codec-bound: encoding and decoding take " << ms(p.codec_s) << " of the " << ms(p.comm_s)
        << " of communication, " << ms(p.exposed_comm_s)
        << " of the step not hidden behind compute; a cheaper codec or none may pay";
  } else if (latency_s > 0.5 * p.comm_s) {
    p.bottleneck = "latency";
    why << "latency-bound: the calls' fixed costs take " << ms(latency_s) << " of the "
        << ms(p.comm_s) << " of communication, " << ms(p.exposed_comm_s)
        << " of it exposed; fewer, larger calls pay";
  } else {
    p.bottleneck = "bandwidth";
    why << "bandwidth-bound: " << p.wire_bytes_per_rank / (1 << 20) << " MiB a rank per step "
        << (plan.hosts > 1 ? "between hosts" : "within the host") << " take " << ms(p.comm_s)
        << ", " << ms(p.exposed_comm_s) << " of it not hidden behind compute";
  }
  p.explanation = why.str();
}

// The seeds' pitfalls (seed 002's bucket_cap_mb advice, seed 000's layer groups of 4-8 and
// accumulation), where this prediction shows them.
void find_pitfalls(Prediction& p, double latency_s, const Workload& workload, const Plan& plan,
                   bool whole_buckets) {
  std::size_t calls = 0;
  for (const auto& b : p.buckets) calls += b.calls;
  if (calls == 0) return;
  const double bytes_per_call = 4.0 * static_cast<double>(workload.parameters()) / calls;
  if (calls > 4 && latency_s > 0.3 * p.comm_s && bytes_per_call < 1 << 20) {
    std::ostringstream o;
    o << calls << " calls a step of " << static_cast<long>(bytes_per_call / 1024)
      << " KiB on average: their fixed costs are " << ms(latency_s) << " of the " << ms(p.comm_s)
      << " of communication; larger buckets (--bucket-mb) pay them fewer times";
    p.pitfalls.push_back(o.str());
  }
  // Only where buckets are what decides it: a codec that reduces tensor by tensor makes a
  // call per tensor whatever the buckets.
  // And where four such calls would fit DDP's default 25 MiB bucket: layers of gigabytes are
  // calls of their own whatever the buckets.
  if (whole_buckets && workload.layers.size() > 2 && calls >= workload.layers.size() &&
      4 * bytes_per_call <= 25 * kMiB) {
    std::ostringstream o;
    o << "one all-reduce per layer or more (" << calls << " calls for " << workload.layers.size()
      << " layers): group layers into buckets of several (seed 000: 4-8 layers)";
    p.pitfalls.push_back(o.str());
  }
  if (plan.accumulate == 1 && p.bottleneck == "bandwidth" && p.exposed_comm_s > 0.3 * p.step_s) {
    std::ostringstream o;
    o << "accumulation is off while the link is the limit (" << ms(p.exposed_comm_s) << " of the "
      << ms(p.step_s) << " step waits for it): --accumulate 4 all-reduces a "
      << "quarter as often";
    p.pitfalls.push_back(o.str());
  }
}

}  // namespace

// The value, the gradient and the state, each read, and the value and state written back.
double optimizer_bytes_per_parameter(const std::string& optimizer) {
  if (optimizer == "sgd") return 5 * sizeof(float);
  if (optimizer == "adam" || optimizer == "adamw") return 7 * sizeof(float);
  throw invalid("optimizer '" + optimizer + "': the model knows sgd, adam and adamw");
}

std::size_t Layer::parameters() const {
  std::size_t n = 0;
  for (const auto& t : tensors) n += t.count;
  return n;
}

std::size_t Workload::parameters() const {
  std::size_t n = 0;
  for (const auto& l : layers) n += l.parameters();
  return n;
}

CollectivePrediction predict_collective(const Profile& profile, const std::string& collective,
                                        int ranks, int hosts, std::size_t bytes,
                                        Algorithm algorithm) {
  if (ranks < 1 || hosts < 1 || ranks % hosts != 0 || bytes < sizeof(float)) {
    throw invalid(collective + " of " + std::to_string(bytes) + " bytes over " +
                  std::to_string(ranks) + " ranks on " + std::to_string(hosts) +
                  " hosts: ranks must be a multiple of hosts, and bytes at least one float");
  }
  Plan plan;
  plan.ranks = ranks;
  plan.hosts = hosts;
  const CallPricer pricer(profile, plan, algorithm);
  const std::size_t floats = bytes / sizeof(float);
  const double n = ranks;
  CollectivePrediction c;
  double bus_factor = (n - 1) / n;
  if (collective == "allreduce") {
    c.us = pricer.allreduce(floats).us;
    bus_factor *= 2;
  } else if (collective == "reduce_scatter") {
    c.us = pricer.reduce_scatter_us(floats);
  } else if (collective == "allgather") {
    c.us = pricer.allgather_us(floats);
  } else {
    throw invalid("collective '" + collective +
                  "': the model knows allreduce, reduce_scatter and allgather");
  }
  c.algorithm = ranks > 1 ? pricer.algorithm(collective, bytes) : "none";
  if (c.us > 0) {
    c.algbw_gbps = static_cast<double>(bytes) / c.us * 1e-3;
    c.busbw_gbps = c.algbw_gbps * bus_factor;
  }
  return c;
}

bool zero_takes_codec(const std::string& codec) {
  return codec == "none" || codec == "fp16" || codec == "bf16" || codec == "int8";
}

Prediction predict(const Profile& profile, const Workload& workload, const Plan& plan) {
  if (plan.ranks < 1 || plan.hosts < 1 || plan.ranks % plan.hosts != 0) {
    throw invalid("plan of " + std::to_string(plan.ranks) + " ranks on " +
                  std::to_string(plan.hosts) + " hosts: ranks must be a multiple of hosts");
  }
  if (plan.accumulate < 1 || plan.zero < 0 || plan.zero > 3 || plan.bucket_mb <= 0 ||
      plan.first_bucket_mb <= 0 || workload.batch < 1 || workload.layers.empty()) {
    throw invalid(
        "plan or workload out of range (accumulate >= 1, zero 0-3, bucket sizes > 0, "
        "batch >= 1, at least one layer)");
  }
  if (plan.zero >= 1 && !zero_takes_codec(plan.codec)) {
    throw invalid("ZeRO with codec " + plan.codec +
                  ": gradsync-train refuses it (a shard is gathered and reduce-scattered in "
                  "float32 or 16 bits, fp16 or bf16, or its gradients in int8; never "
                  "compressed whole)");
  }
  const CallPricer pricer(profile, plan, plan.algorithm);
  const double flops_per_s = profile.compute_gflops * 1e9;
  const auto batch = static_cast<double>(workload.batch);

  Prediction p;
  double forward_s = 0;
  std::vector<double> backward;  // backward order
  // A layer's measured time where the workload has one, else its FLOPs at the profile's speed.
  for (const auto& l : workload.layers) {
    forward_s += l.forward_ms > 0 ? l.forward_ms * 1e-3 : l.forward_flops * batch / flops_per_s;
  }
  for (auto l = workload.layers.rbegin(); l != workload.layers.rend(); ++l) {
    backward.push_back(l->backward_ms > 0 ? l->backward_ms * 1e-3
                                          : l->backward_flops * batch / flops_per_s);
  }
  double backward_s = 0;
  for (double b : backward) backward_s += b;
  p.compute_s = plan.accumulate * (forward_s + backward_s);

  // Gradients in the order backward makes them, each with the backward layer that makes it.
  std::vector<std::size_t> counts, rows, layer_of;
  for (auto l = workload.layers.rbegin(); l != workload.layers.rend(); ++l) {
    for (const auto& t : l->tensors) {
      counts.push_back(t.count);
      rows.push_back(t.rows);
      layer_of.push_back(static_cast<std::size_t>(l - workload.layers.rbegin()));
    }
  }
  const std::size_t psi = workload.parameters();
  const int n = plan.ranks;
  const double cores_per_rank = static_cast<double>(profile.cores_per_host) * plan.hosts / n;
  // How backward and the worker slow each other while both run. The probe measures it for
  // a float32 all-reduce (the whole call) and for a codec's passes; without its figures, a
  // host with fewer than two cores per rank shares them, for the part of a call that keeps a
  // core busy.
  const double shared = std::clamp(cores_per_rank / 2, 0.5, 1.0);
  const bool measured = profile.overlap_compute_speed > 0 && profile.overlap_comm_speed > 0;
  const Phase codec_phase =
      profile.overlap_codec_compute_speed > 0 && profile.overlap_codec_speed > 0
          ? Phase{0, profile.overlap_codec_compute_speed, profile.overlap_codec_speed}
          : Phase{0, shared, shared};
  const Phase busy_phase = measured
                               ? Phase{0, profile.overlap_compute_speed, profile.overlap_comm_speed}
                               : Phase{0, shared, shared};

  const std::size_t owned = plan.zero > 0 ? (psi + n - 1) / n : psi;
  // ShardedDataParallel first averages its shard of the gradients in place: 8 bytes more a
  // parameter it owns.
  const double averaging = plan.zero >= 1 ? 8 : 0;
  p.optimizer_s = (optimizer_bytes_per_parameter(workload.optimizer) + averaging) *
                  static_cast<double>(owned) / (profile.optimizer_gbps * 1e9);
  if (plan.step_ahead && plan.zero == 0 && workload.optimizer == "sgd" && pricer.holds_back()) {
    // Save every value, move each by lr x its residual, copy the saved values back
    // (examples/train/training.cc, look_ahead and look_back): 8 + 12 + 8 bytes a parameter.
    p.optimizer_s += 28.0 * static_cast<double>(psi) / (profile.optimizer_gbps * 1e9);
  }

  // The micro-batch that communicates, from the start of its forward (ZeRO: of the optimizer's
  // step before it, which it overlaps).
  double last_micro_s = 0;
  double latency_s = 0;  // of comm_s, the calls' fixed costs
  // A micro-batch before the last, where it differs from forward and backward alone (ZeRO 2
  // and 3 communicate in every one); and memory beyond the shards (ZeRO 3's gathered layers).
  double accumulated_micro_s = forward_s + backward_s;
  std::size_t working_floats = 0;
  if (plan.zero == 0) {
    // DDP: the Reducer all-reduces bucket by bucket.
    std::vector<std::size_t> waits_for;
    std::vector<std::vector<Phase>> work;
    for (const auto& positions :
         ddp::assign_buckets(counts, static_cast<std::size_t>(plan.first_bucket_mb * kMiB),
                             static_cast<std::size_t>(plan.bucket_mb * kMiB))) {
      BucketPrediction b;
      CallCost sum;
      auto add = [&](std::size_t f, std::size_t matrix_rows) {
        const CallCost c = pricer.allreduce(f, matrix_rows);
        sum.us += c.us;
        sum.cpu_us += c.cpu_us;
        sum.codec_us += c.codec_us;
        sum.wire_bytes += c.wire_bytes;
        latency_s += c.latency_us * 1e-6;
        ++b.calls;
      };
      for (std::size_t at : positions) b.parameters += counts[at];
      if (n > 1) {
        if (pricer.whole_buckets()) {
          add(b.parameters, positions.size() == 1 ? rows[positions[0]] : 0);
        } else {
          for (std::size_t at : positions) add(counts[at], rows[at]);
        }
      }
      b.wire_bytes = sum.wire_bytes;
      p.comm_s += sum.us * 1e-6;
      p.codec_s += sum.codec_us * 1e-6;
      p.wire_bytes_per_rank += sum.wire_bytes;
      waits_for.push_back(layer_of[positions.back()]);
      // The codec's passes, then the collective's core work, then its wait on the links.
      const double busy_us = (measured ? sum.us : sum.cpu_us) - sum.codec_us;
      work.push_back({codec_phase, busy_phase, Phase{}});
      work.back()[0].seconds = sum.codec_us * 1e-6;
      work.back()[1].seconds = busy_us * 1e-6;
      work.back()[2].seconds = (sum.us - sum.codec_us - busy_us) * 1e-6;
      p.buckets.push_back(b);
    }
    const auto [backward_end, worker_end] =
        run_step(backward, p.buckets, waits_for, work, plan.overlap);
    std::vector<double> layer_end(backward.size());  // as if backward ran alone
    std::partial_sum(backward.begin(), backward.end(), layer_end.begin());
    for (std::size_t b = 0; b < p.buckets.size(); ++b)
      p.buckets[b].ready_s = layer_end[waits_for[b]];
    last_micro_s = forward_s + std::max(backward_end, worker_end);
  } else {
    const auto depth = static_cast<std::size_t>(ShardedOptions{}.prefetch_depth);
    // ShardedDataParallel, one unit per layer, its calls priced at their wire size: 16-bit
    // wires carry half the floats' bytes; int8 gradients a byte an element and a float scale
    // a block of 256, plus their quantising inside the call.
    const bool int8 = plan.codec == "int8";
    const double parameter_wire = plan.codec == "fp16" || plan.codec == "bf16" ? 0.5 : 1.0;
    const double gradient_wire = int8 ? (1 + 4.0 / 256) / 4 : parameter_wire;
    const auto on_wire = [](double wire, std::size_t floats) {
      return static_cast<std::size_t>(std::ceil(wire * static_cast<double>(floats)));
    };
    std::vector<double> forward_layers, gather, scatter;
    std::vector<double> stepping;  // each layer's share of the optimizer's step, in turn
    std::size_t largest = 0;
    for (const auto& l : workload.layers) {
      const std::size_t floats = l.parameters();
      largest = std::max(largest, floats);
      stepping.push_back(p.optimizer_s * static_cast<double>(floats) / static_cast<double>(psi));
      forward_layers.push_back(l.forward_ms > 0 ? l.forward_ms * 1e-3
                                                : l.forward_flops * batch / flops_per_s);
      gather.push_back(
          floats > 0 && n > 1 ? pricer.allgather_us(on_wire(parameter_wire, floats)) * 1e-6 : 0);
      const double quantise = int8 && floats > 0 ? pricer.quantise_us(floats) * 1e-6 : 0;
      p.codec_s += plan.accumulate * quantise;
      scatter.push_back(floats > 0 && n > 1
                            ? pricer.reduce_scatter_us(on_wire(gradient_wire, floats)) * 1e-6 +
                                  quantise
                            : 0);
    }
    const std::size_t units = static_cast<std::size_t>(
        std::count_if(gather.begin(), gather.end(), [](double g) { return g > 0; }));
    const double gather_latency = n > 1 ? pricer.allgather_us(1) * 1e-6 : 0;
    const double scatter_latency = n > 1 ? pricer.reduce_scatter_us(1) * 1e-6 : 0;
    const std::vector<double> backward_layers(backward.rbegin(), backward.rend());
    double gathers = 0, scatters = 0;
    for (std::size_t l = 0; l < gather.size(); ++l) {
      gathers += gather[l];
      scatters += scatter[l];
    }
    const double share = n > 1 ? static_cast<double>(n - 1) / n * psi * sizeof(float) : 0;
    const double gather_bytes = parameter_wire * share, scatter_bytes = gradient_wire * share;
    // Every micro-batch reduce-scatters: the gradients stay sharded.
    if (plan.zero == 3) {
      // Twice a step but for the last layers, kept from forward to backward.
      double kept_gathers = 0, kept_floats = 0;
      for (std::size_t l = 0; l < gather.size(); ++l) {
        if (!ddp::zero3::kept_for_backward(l, gather.size(), depth)) continue;
        kept_gathers += gather[l];
        kept_floats += static_cast<double>(workload.layers[l].parameters());
      }
      p.comm_s = plan.accumulate * (2 * gathers - kept_gathers + scatters);
      latency_s = plan.accumulate * units * (2 * gather_latency + scatter_latency);
      last_micro_s =
          sharded_micro_batch(3, forward_layers, backward_layers, gather, scatter, stepping,
                              busy_phase.compute_speed, busy_phase.worker_speed);
      accumulated_micro_s =
          sharded_micro_batch(3, forward_layers, backward_layers, gather, scatter, {},
                              busy_phase.compute_speed, busy_phase.worker_speed);
      p.wire_bytes_per_rank = static_cast<std::size_t>(
          ((2 - kept_floats / static_cast<double>(psi)) * gather_bytes + scatter_bytes) *
          plan.accumulate);
    } else {
      // The gathers after the step are waited for by the next step's first forward. Stage 2
      // reduce-scatters every micro-batch; stage 1 only the last, which sends the sum of
      // those before, added up on each rank in a pass over the whole gradient each (8 bytes
      // a parameter to copy the first, 12 to add each later one).
      const int scattering = plan.zero == 2 ? plan.accumulate : 1;
      p.comm_s = gathers + scattering * scatters;
      latency_s = units * (gather_latency + scattering * scatter_latency);
      last_micro_s =
          sharded_micro_batch(2, forward_layers, backward_layers, gather, scatter, stepping,
                              busy_phase.compute_speed, busy_phase.worker_speed);
      const std::vector<double> nothing(gather.size(), 0.0);
      accumulated_micro_s = sharded_micro_batch(2, forward_layers, backward_layers, nothing,
                                                plan.zero == 2 ? scatter : nothing, {},
                                                busy_phase.compute_speed, busy_phase.worker_speed);
      if (plan.zero == 1 && plan.accumulate > 1) {
        const double pass_s = static_cast<double>(psi) / (profile.optimizer_gbps * 1e9);
        accumulated_micro_s += (8 + 12.0 * (plan.accumulate - 2)) / (plan.accumulate - 1) * pass_s;
        last_micro_s += 12 * pass_s;
      }
      p.wire_bytes_per_rank = static_cast<std::size_t>(gather_bytes + scattering * scatter_bytes);
    }
    // Layers whole at once, at most: stage 3 the one computing and those prefetched, and as
    // many gradients (this one's, those still being reduce-scattered); stages 1 and 2 the
    // gradient being written and two in flight (ShardedDataParallel::mark_ready).
    working_floats =
        (plan.zero == 3 ? 2 * std::min(workload.layers.size(), 1 + depth) : 3) * largest;
  }
  p.step_s = (plan.accumulate - 1) * accumulated_micro_s + last_micro_s +
             (plan.zero == 0 ? p.optimizer_s : 0);
  p.exposed_comm_s = std::max(0.0, p.step_s - p.compute_s - p.optimizer_s);

  const std::size_t state = optimizer_state_floats(workload.optimizer) * owned;
  // Stage 1 accumulating keeps the whole gradient too.
  const std::size_t grads =
      plan.zero == 0 ? psi : owned + (plan.zero == 1 && plan.accumulate > 1 ? psi : 0);
  // Stages 1 and 2 keep the whole model and its float32 shard (the master copy).
  const std::size_t params = plan.zero == 3 ? owned : plan.zero >= 1 ? psi + owned : psi;
  p.memory_per_rank_bytes = (params + grads + state + working_floats) * sizeof(float);
  classify(p, latency_s, profile, plan);
  find_pitfalls(p, latency_s, workload, plan, pricer.whole_buckets());
  return p;
}

}  // namespace gradsync::advise
