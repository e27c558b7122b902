// Single-knob changes to a plan, each priced by the step model and ranked by predicted time
// per sample (accumulation changes how many samples a step holds). The risks cite what
// BENCHMARKS.md measured of each knob on this project's trainer.
#include <algorithm>
#include <sstream>

#include "gradsync/advise.h"
#include "gradsync/error.h"

namespace gradsync::advise {

namespace {

std::string number(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

struct Candidate {
  std::string knob, proposed;
  Plan plan;
  std::string why, risk;
};

std::vector<Candidate> candidates(const Profile& profile, const Plan& now) {
  std::vector<Candidate> out;
  for (double mb : {1.0, 4.0, 10.0, 25.0, 50.0, 100.0}) {
    if (mb == now.bucket_mb) continue;
    Plan p = now;
    p.bucket_mb = mb;
    out.push_back({"bucket-mb", number(mb), p,
                   mb > now.bucket_mb ? "fewer calls, each paying its latency once"
                                      : "buckets launch earlier in backward and overlap more",
                   "none to accuracy"});
  }
  for (double mb : {0.25, 1.0, 4.0}) {
    if (mb == now.first_bucket_mb) continue;
    Plan p = now;
    p.first_bucket_mb = mb;
    out.push_back({"first-bucket-mb", number(mb), p, "the first bucket starts communication early",
                   "none to accuracy"});
  }
  {
    struct Codec {
      const char* spec;
      const char* name;
      const char* risk;
    };
    static const Codec kCodecs[] = {
        {"bf16", "bf16", "within 0.3 points of float32 (BENCHMARKS.md, convergence)"},
        {"fp16", "fp16", "within 0.3 points of float32 (BENCHMARKS.md, convergence)"},
        {"int8", "int8", "with error feedback, within 0.5 points (BENCHMARKS.md, convergence)"},
        {"topk:ratio=0.01", "topk",
         "0.75 points behind float32 at 15 epochs, level with step-ahead (BENCHMARKS.md)"},
        {"powersgd:rank=4", "powersgd",
         "rank 4 within 0.3 points on the MLP (BENCHMARKS.md, convergence)"},
    };
    for (const auto& c : kCodecs) {
      if (now.codec.rfind(c.name, 0) == 0 || !profile.codecs.count(c.name)) continue;
      // ZeRO reduce-scatters shards: only codecs that cut anywhere (predict refuses others).
      if (now.zero > 0 && !zero_takes_codec(c.spec)) continue;
      Plan p = now;
      p.codec = c.spec;
      out.push_back(
          {"codec", c.spec, p, "fewer bytes on the wire, for encode and decode work", c.risk});
    }
  }
  for (int k : {2, 4, 8}) {
    if (k <= now.accumulate) continue;
    Plan p = now;
    p.accumulate = k;
    out.push_back({"accumulate", number(k), p,
                   "one all-reduce for every " + number(k) + " micro-batches",
                   "a " + number(static_cast<double>(k) / now.accumulate) +
                       "x larger batch per step: scale the learning rate and re-check accuracy"});
  }
  {
    Plan p = now;
    p.overlap = !now.overlap;
    out.push_back({"overlap", p.overlap ? "on" : "off", p,
                   p.overlap ? "buckets all-reduce while backward goes on"
                             : "backward and the all-reduces no longer slow each other where "
                               "they share the cores",
                   "none to accuracy"});
  }
  // ZeRO shards the optimizer's work as well as its state: each rank steps 1/N of the
  // parameters, for an all-gather of them after the step.
  for (int z : {1, 2, 3}) {
    if (z == now.zero || !zero_takes_codec(now.codec) || now.ranks == 1) continue;
    Plan p = now;
    p.zero = z;
    out.push_back(
        {"zero", number(z), p,
         z == 1   ? "optimizer state and its step sharded across ranks, each layer's gradients "
                    "reduce-scattered once a step as backward ends it"
         : z == 2 ? "optimizer state, its step and the reduced gradients sharded, each layer's "
                    "reduce-scattered as backward ends it"
                  : "parameters sharded too: each layer gathered just before its forward and "
                    "backward",
         z <= 2 ? "none to accuracy; the parameters' all-gather waits for the next forward"
                : "none to accuracy; 1.5x DDP's traffic, each layer's gather before it runs"});
  }
  return out;
}

std::string describe(const Plan& p, const std::string& knob) {
  if (knob == "bucket-mb") return number(p.bucket_mb);
  if (knob == "first-bucket-mb") return number(p.first_bucket_mb);
  if (knob == "codec") return p.codec;
  if (knob == "accumulate") return number(p.accumulate);
  if (knob == "overlap") return p.overlap ? "on" : "off";
  return number(p.zero);  // "zero"
}

}  // namespace

std::vector<Recommendation> recommend(const Profile& profile, const Workload& workload,
                                      const Plan& plan) {
  const Prediction current = predict(profile, workload, plan);
  const double per_sample = current.step_s / plan.accumulate;
  std::vector<Recommendation> out;
  for (auto& c : candidates(profile, plan)) {
    Prediction p = predict(profile, workload, c.plan);
    const double change = p.step_s / c.plan.accumulate / per_sample - 1;
    const bool fits = profile.memory_bytes_per_rank == 0 ||
                      p.memory_per_rank_bytes <= profile.memory_bytes_per_rank;
    // Never a plan that does not fit; where the current one does not, every one that does.
    if (!fits || (change >= -0.01 && current.bottleneck != "memory")) continue;
    out.push_back(
        {c.knob, describe(plan, c.knob), c.proposed, c.plan, std::move(p), change, c.why, c.risk});
  }
  std::stable_sort(out.begin(), out.end(), [](const Recommendation& a, const Recommendation& b) {
    return a.change < b.change;
  });
  return out;
}

}  // namespace gradsync::advise
