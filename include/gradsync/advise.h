// The advisor's model of one data-parallel training step: from a hardware profile, a workload
// (layers in forward order with their compute) and a plan (ranks, buckets, codec,
// accumulation, ZeRO stage), it predicts the step's time and where it goes, names the
// bottleneck, and ranks changes to the plan by their predicted step. The step is simulated
// as the Reducer runs it: gradients become ready layer by layer in backward, fill buckets in
// that order, and each full bucket is all-reduced on the context's worker while backward goes
// on, sharing the cores with it where a host has fewer than two per rank.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "gradsync/types.h"

namespace gradsync::advise {

// One class of link: between ranks of one host, or between hosts.
struct Link {
  double alpha_us = 5.0;        // one message's fixed cost
  double bandwidth_gbps = 5.0;  // point-to-point payload bandwidth, 1e9 B/s
};

// What a cluster can do, as gradsync-probe measures it or a shipped profile states it.
struct Profile {
  std::string name;
  std::vector<std::string> sources;  // where each figure comes from
  int cores_per_host = 2;            // the cores a host's ranks share (compute and communication)
  Link intra;                        // ranks of one host (shared memory)
  Link inter;                        // hosts
  double reduce_gbps = 10.0;         // reduction throughput over the input bytes
  double copy_gbps = 10.0;           // one rank's memcpy beyond the cache, payload bytes/s
  // The memory a host's ranks keep their collectives' buffers in without a cost beyond the
  // links', MiB, all ranks of a host together: the last-level cache of a CPU (beyond it the
  // cost model adds main-memory traffic); for GPUs, their memories, which their collectives
  // read at several times the links' speed, in the same pass as they transfer.
  double cache_mib = 32;
  // Ranks of one host may use gradsync's shared-memory all-reduce: processes on CPUs, not
  // GPUs (whose peers are reached over NVLink or PCIe, by the ring and its relatives).
  bool shared_memory = true;
  // Reductions run in the same pass as the transfers and cost no time of their own: GPUs,
  // whose collective kernels add what arrives at memory speed, several times the links'.
  // On CPUs the cores that reduce also move the bytes: reduce_gbps adds its time.
  bool reduce_in_transfer = false;
  // Compute speed of one rank while every rank of its host computes, 1e9 FLOP/s; and the
  // optimizer's memory traffic rate, bytes/s, likewise.
  double compute_gflops = 20.0;
  double optimizer_gbps = 10.0;
  std::size_t memory_bytes_per_rank = 0;  // what a rank may hold; 0: unknown
  // Speeds of backward and of the worker's collectives while both run, each relative to its
  // speed alone (gradsync-probe measures them). 0: unknown, then derived from the cores per
  // rank (a host with two per rank runs both at full speed).
  double overlap_compute_speed = 0, overlap_comm_speed = 0;
  // Likewise backward against a codec's encoding (core work against core work).
  double overlap_codec_compute_speed = 0, overlap_codec_speed = 0;
  // Collectives timed on the cluster (gradsync-probe: float32 "allreduce", "reduce_scatter"
  // and "allgather" of 4 KiB to 64 MiB in all, at the job's ranks and hosts). A plan of those
  // ranks and hosts is priced by them, interpolated in the size; any other by the cost model
  // over the links above.
  struct Timed {
    std::string collective;
    int ranks = 0, hosts = 0;
    std::size_t bytes = 0;  // the whole vector: every rank's share together
    double us = 0;
  };
  std::vector<Timed> timed;
  // Codec throughput over the float32 gradient bytes: encode, and decode (decode_add) of one
  // payload, for a tensor of `floats` floats (0: any size). Top-k's selection and the caches
  // make the speed depend on the size: a call between two timed sizes is priced on a
  // log-log line through them, beyond them at the nearest.
  struct CodecSpeed {
    std::size_t floats = 0;
    double encode_gbps = 0, decode_gbps = 0;
  };
  // Per codec name ("int8", "topk", ...), by size; a codec missing here is refused.
  // "int8:ef=0" and the like: without error feedback, as a quantised ring re-encodes at
  // every hop.
  std::map<std::string, std::vector<CodecSpeed>> codecs;
};

// A profile from its JSON file: {"name", "sources": [...], "cores_per_host",
// "intra": {"alpha_us", "bandwidth_gbps"}, "inter": {...}, "reduce_gbps", "copy_gbps",
// "cache_mib", "shared_memory", "reduce_in_transfer",
// "compute_gflops", "optimizer_gbps", "memory_bytes_per_rank", "overlap_compute_speed",
// "overlap_comm_speed", "overlap_codec_compute_speed", "overlap_codec_speed", "codecs":
// {codec: [{"floats", "encode_gbps", "decode_gbps"}, ...]}, "timed": [{"collective", "ranks",
// "hosts", "bytes", "us"}, ...]}; a field left out keeps Profile's default. Throws
// Error(kInvalidArgument) naming the file and the field it cannot read.
Profile load_profile(const std::string& path);
// The same JSON (gradsync-probe writes it).
std::string profile_json(const Profile& profile);

// One layer of the model, forward order. FLOPs per sample.
struct Layer {
  std::string name;
  // Its parameter tensors in the order backward finishes them (a weight, then its bias): the
  // Reducer buckets tensors, not layers. rows: a weight's output features (PowerSGD
  // compresses rows x count/rows), 0 for a vector.
  struct Tensor {
    std::size_t count = 0, rows = 0;
  };
  std::vector<Tensor> tensors;
  double forward_flops = 0, backward_flops = 0;
  // Measured times of the whole micro-batch (ms), where known: they take the place of the
  // FLOPs over the profile's compute speed.
  double forward_ms = 0, backward_ms = 0;

  std::size_t parameters() const;
};

struct Workload {
  std::string name;
  std::vector<Layer> layers;      // forward order; backward runs them in reverse
  std::size_t batch = 64;         // samples per rank per micro-batch
  std::string optimizer = "sgd";  // sgd (with momentum), adam, adamw

  std::size_t parameters() const;
};

// A workload from its JSON file: {"name", "batch", "optimizer", "layers": [{"name",
// "tensors": [{"count", "rows"}] or "parameters", "forward_flops" and "backward_flops" (per
// sample) or "forward_ms" and "backward_ms" (per micro-batch)}]}, layers in forward order.
// Throws Error(kInvalidArgument) naming the file and what it cannot read.
Workload load_workload(const std::string& path);

// The trainer's models by name: "mlp" (784-2048x4-10, 14.2 M parameters), "mlp:256,256" for
// other hidden sizes, "cnn" (215 k parameters); throws Error(kInvalidArgument) otherwise.
Workload model_workload(const std::string& model, std::size_t batch, std::string optimizer);

// Bytes an optimizer step reads and writes per parameter it updates ("sgd", "adam",
// "adamw"): how a profile's optimizer_gbps turns into time.
double optimizer_bytes_per_parameter(const std::string& optimizer);

// The configuration of a run: gradsync-train's flags.
struct Plan {
  int ranks = 2;
  int hosts = 1;  // ranks spread evenly over them
  std::string codec = "none";
  double bucket_mb = 25, first_bucket_mb = 1;
  int accumulate = 1;  // micro-batches per optimizer step
  // 0: DDP (the Reducer); 1-3: ZeRO as ShardedDataParallel runs it (sharded.h): optimizer
  // state sharded, gradients too (2), parameters too, each layer's gathered before its
  // forward and backward (3).
  int zero = 0;
  bool overlap = true;
  // Every all-reduce by this algorithm, as GRADSYNC_ALGO (or NCCL_ALGO) fixes it; kAuto: the
  // profile's timed curves, else the cost model's pick.
  Algorithm algorithm = Algorithm::kAuto;
  // gradsync-train's step-ahead error feedback, with SGD and a codec that holds gradient
  // back: three more passes over the parameters a step.
  bool step_ahead = true;
};

// Whether ZeRO (plan.zero > 0) can send this codec's gradients: none, fp16, bf16 and int8
// cut a tensor anywhere; the others compress whole tensors, which a shard is not.
bool zero_takes_codec(const std::string& codec);

struct BucketPrediction {
  std::size_t parameters = 0;                  // floats in the bucket
  std::size_t calls = 0;                       // collective calls it takes
  std::size_t wire_bytes = 0;                  // bytes one rank sends for it
  double ready_s = 0, start_s = 0, end_s = 0;  // from the start of backward
};

struct Prediction {
  double step_s = 0;                      // one optimizer step (all its micro-batches)
  double compute_s = 0;                   // forward and backward, as if alone on the cores
  double comm_s = 0;                      // the buckets' collectives, start to end, summed
  double exposed_comm_s = 0;              // of the step, the part beyond compute and optimizer
  double codec_s = 0;                     // encode and decode, part of comm_s
  double optimizer_s = 0;                 // the step, and step-ahead's passes where they apply
  std::size_t memory_per_rank_bytes = 0;  // parameters, gradients, optimizer state, buckets
  std::size_t wire_bytes_per_rank = 0;    // per optimizer step
  // "compute", "bandwidth", "latency", "codec" (encoding and decoding dominate the
  // communication) or "memory".
  std::string bottleneck;
  std::string explanation;  // the bottleneck in one sentence
  // The pitfalls of the seeds this plan falls into, a sentence each: buckets so small that
  // per-call latency dominates, one all-reduce per layer, accumulation left off where the
  // link is the limit.
  std::vector<std::string> pitfalls;
  std::vector<BucketPrediction> buckets;  // launch order
};

// The step of `plan` on `profile`. Throws Error(kInvalidArgument) for a plan it cannot model
// (ranks not a multiple of hosts, an unknown codec or one the profile has no speed for).
Prediction predict(const Profile& profile, const Workload& workload, const Plan& plan);

// One float32 collective alone, as nccl-tests times it: "allreduce", "reduce_scatter" or
// "allgather" of `bytes` (the whole vector: every rank's share together) over `ranks` ranks
// spread evenly over `hosts` hosts, on `profile` (its timed curves at that shape, else the
// cost model's pick). Bus bandwidth as nccl-tests defines it: the algorithm bandwidth
// (bytes / time) times 2(N-1)/N for an all-reduce, (N-1)/N for the others, so that it reads
// against a link's speed whatever N.
struct CollectivePrediction {
  double us = 0;
  double algbw_gbps = 0, busbw_gbps = 0;
  std::string algorithm;  // to_string(Algorithm): "ring", "hier", ...; "timed" off a curve
};
// `algorithm`: priced as that all-reduce algorithm (nccl-tests' NCCL_ALGO=Ring is kRing);
// kAuto: as gradsync would pick.
CollectivePrediction predict_collective(const Profile& profile, const std::string& collective,
                                        int ranks, int hosts, std::size_t bytes,
                                        Algorithm algorithm = Algorithm::kAuto);

// What a GRADSYNC_TIMELINE trace of a training run measured (gradsync-train's spans: compute,
// comm, wait, pack, optimizer; a step ends with its optimizer span; or gradsync.torch's: a
// step span per DDP forward, forward and backward, the backend's calls). Per step, the slowest
// rank's figures; medians over the steps after the first two (the Reducer rebuilds its
// buckets after the first).
struct MeasuredStep {
  double step_s = 0, compute_s = 0, comm_s = 0, exposed_comm_s = 0, pack_s = 0, optimizer_s = 0;
};
struct TraceReport {
  // The run's kind: gradsync-train's, or a PyTorch job's through gradsync.torch (steps from
  // one DDP forward to the next; its optimizer_s is all that follows backward and its
  // all-reduces until the next forward).
  bool pytorch = false;
  int ranks = 0;
  std::size_t steps = 0;                // complete steps on every rank
  MeasuredStep median;                  // of the slowest rank's steps
  std::vector<double> bucket_s;         // per bucket index: median all-reduce time
  std::vector<std::string> stragglers;  // a sentence per rank whose compute lags the others'
};
// Throws Error(kInvalidArgument) naming the file if it is not such a trace, or holds no
// complete step.
TraceReport read_trace(const std::string& path);

struct Recommendation {
  std::string knob;  // "bucket-mb", "codec", "accumulate", ...
  std::string now, proposed;
  Plan plan;             // the plan with this one change
  Prediction predicted;  // of `plan`
  double change = 0;     // predicted step over the current plan's, minus 1 (negative: faster)
  std::string why, risk;
};

// Single-knob changes to `plan`, fastest predicted step first; only those predicted faster.
std::vector<Recommendation> recommend(const Profile& profile, const Workload& workload,
                                      const Plan& plan);

}  // namespace gradsync::advise
