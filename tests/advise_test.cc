// The advisor's step model against cases worked out by hand: its buckets are the Reducer's,
// a plan without communication is compute plus optimizer, a plan without overlap adds every
// call, a rank with its own core for the worker hides what backward covers and one sharing
// its core hides nothing, and the memory and traffic formulas of ZeRO and codecs.
#include "gradsync/advise.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "ddp/buckets.h"
#include "gradsync/error.h"
#include "gradsync/reducer.h"
#include "harness.h"

namespace gradsync::advise {
namespace {

constexpr std::size_t kMiB = 1 << 20;

Profile simple_profile() {
  Profile p;
  p.name = "test";
  p.cores_per_host = 64;  // a core for every thread: no sharing unless a test asks for it
  p.intra = {1.0, 10.0};
  p.inter = {20.0, 1.0};
  p.compute_gflops = 100;
  p.optimizer_gbps = 10;
  p.codecs = {{"fp16", {{0, 10, 10}}}, {"topk", {{0, 1, 20}}}};
  return p;
}

// Two layers of one tensor each, with round compute times at batch 1 on simple_profile():
// forward 1 ms + 1 ms, backward 2 ms + 2 ms.
Workload two_layers(std::size_t floats) {
  Workload w;
  w.name = "two";
  w.batch = 1;
  w.layers = {{"a", {{floats}}, 1e8, 2e8}, {"b", {{floats}}, 1e8, 2e8}};
  return w;
}

// `call` throws an invalid-argument Error whose message holds `says`.
template <class Call>
void expect_refusal(Call call, const std::string& says) {
  try {
    call();
    ADD_FAILURE() << "accepted what should say: " << says;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
  }
}

TEST(AdviseBuckets, FirstBucketSmallLargeTensorsAlone) {
  const std::vector<std::size_t> counts{100, 100, 4 * kMiB, 10, 10, 300'000};
  // first cap 600 bytes: 100 floats fit, 200 do not; 16 MiB is at least half of 25 MiB:
  // alone; the tensors after it start a new bucket.
  const auto b = ddp::assign_buckets(counts, 600, 25 * kMiB);
  const std::vector<std::vector<std::size_t>> want{{0}, {1}, {2}, {3, 4, 5}};
  EXPECT_EQ(b, want);
}

TEST(AdviseBuckets, SameAsTheReducers) {
  auto ctx = init({.rank = 0, .size = 1});
  ReducerOptions options;
  options.first_bucket_bytes = 1 * kMiB;
  options.bucket_bytes = 4 * kMiB;
  Reducer reducer(*ctx, options);
  const std::vector<std::size_t> sizes{1000, 300'000, 700'000, 10, 2'000'000, 5};
  std::vector<std::vector<float>> grads;
  for (std::size_t s : sizes) grads.emplace_back(s);
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    reducer.add_parameter("p" + std::to_string(i), sizes[i], grads[i]);
  }
  // One step, backward order: the last registered first, as the Reducer assumes before it
  // learns the order (and then keeps, since it is the same).
  for (int id = static_cast<int>(sizes.size()) - 1; id >= 0; --id) reducer.mark_ready(id);
  reducer.finish();
  const std::vector<std::size_t> ready(sizes.rbegin(), sizes.rend());
  const auto want = ddp::assign_buckets(ready, options.first_bucket_bytes, options.bucket_bytes);
  const auto got = reducer.buckets();
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t b = 0; b < want.size(); ++b) {
    ASSERT_EQ(got[b].size(), want[b].size()) << "bucket " << b;
    for (std::size_t i = 0; i < want[b].size(); ++i) {
      EXPECT_EQ(got[b][i], static_cast<int>(sizes.size() - 1 - want[b][i]));
    }
  }
}

TEST(AdvisePredict, OneRankIsComputePlusOptimizer) {
  const Plan plan{.ranks = 1};
  const auto p = predict(simple_profile(), two_layers(1000), plan);
  EXPECT_NEAR(p.compute_s, 6e-3, 1e-12);
  EXPECT_NEAR(p.optimizer_s, 2000 * 20 / 10e9, 1e-15);
  EXPECT_NEAR(p.step_s, p.compute_s + p.optimizer_s, 1e-12);
  EXPECT_EQ(p.comm_s, 0);
  EXPECT_EQ(p.wire_bytes_per_rank, 0u);
  EXPECT_EQ(p.bottleneck, "compute");
}

TEST(AdvisePredict, WithoutOverlapEveryCallAdds) {
  Plan plan{.ranks = 4, .first_bucket_mb = 0.001, .overlap = false};
  plan.bucket_mb = 0.001;  // each layer's tensor its own bucket
  const auto p = predict(simple_profile(), two_layers(1 << 20), plan);
  ASSERT_EQ(p.buckets.size(), 2u);
  EXPECT_NEAR(p.step_s, p.compute_s + p.comm_s + p.optimizer_s, 1e-12);
  EXPECT_NEAR(p.exposed_comm_s, p.comm_s, 1e-12);
  EXPECT_GE(p.buckets[0].start_s, 4e-3 - 1e-12);  // after the whole backward
}

TEST(AdvisePredict, OverlapHidesWhatBackwardCovers) {
  Plan plan{.ranks = 2, .bucket_mb = 0.001, .first_bucket_mb = 0.001};
  const auto workload = two_layers(1 << 18);  // 1 MiB a layer: well under 2 ms to all-reduce
  const auto p = predict(simple_profile(), workload, plan);
  ASSERT_EQ(p.buckets.size(), 2u);
  // The first bucket (layer b, backward's first) starts when its gradient is ready, 2 ms in,
  // and ends before the second layer's backward does: only the last bucket shows.
  EXPECT_NEAR(p.buckets[0].ready_s, 2e-3, 1e-12);
  EXPECT_NEAR(p.buckets[0].start_s, 2e-3, 1e-12);
  EXPECT_LT(p.buckets[0].end_s, 4e-3);
  const double last = p.buckets[1].end_s - p.buckets[1].start_s;
  EXPECT_NEAR(p.exposed_comm_s, last, 1e-9);
}

TEST(AdvisePredict, SharingACoreHidesNothingOnOneHost) {
  Profile profile = simple_profile();
  profile.cores_per_host = 2;  // 2 ranks: one core each, backward and worker share it
  Plan plan{.ranks = 2, .bucket_mb = 0.001, .first_bucket_mb = 0.001};
  const auto p = predict(profile, two_layers(1 << 18), plan);
  // On one host every call is core work: at half speed beside backward, it costs what it
  // would alone, after it.
  EXPECT_NEAR(p.exposed_comm_s, p.comm_s, 1e-9);
}

TEST(AdvisePredict, AccumulationComputesKTimesCommunicatesOnce) {
  const Profile profile = simple_profile();
  const auto w = two_layers(1 << 20);
  Plan once{.ranks = 4, .overlap = false};
  Plan four = once;
  four.accumulate = 4;
  const auto a = predict(profile, w, once), b = predict(profile, w, four);
  EXPECT_NEAR(b.compute_s, 4 * a.compute_s, 1e-12);
  EXPECT_NEAR(b.comm_s, a.comm_s, 1e-12);
  EXPECT_NEAR(b.step_s - a.step_s, 3 * (a.compute_s), 1e-9);
}

TEST(AdvisePredict, ZeroShardsStateAndGradients) {
  Workload w = two_layers(1000);
  w.optimizer = "adamw";
  const Profile profile = simple_profile();
  const auto replicated = predict(profile, w, Plan{.ranks = 4});
  const auto z1 = predict(profile, w, Plan{.ranks = 4, .zero = 1});
  const auto z2 = predict(profile, w, Plan{.ranks = 4, .zero = 2});
  // parameters 2000 + gradients 2000 + two Adam moments 4000, floats
  EXPECT_EQ(replicated.memory_per_rank_bytes, 8000u * 4);
  // Stages 1 and 2: the whole parameters and this rank's master shard of them, a quarter of
  // the gradients and the moments, and whole gradients of up to three layers
  // (ShardedDataParallel). Without accumulation the two run alike.
  EXPECT_EQ(z2.memory_per_rank_bytes, (2000u + 500 + 500 + 2 * 500 + 3 * 1000) * 4);
  EXPECT_EQ(z1.memory_per_rank_bytes, z2.memory_per_rank_bytes);
  EXPECT_EQ(z1.step_s, z2.step_s);
  // A quarter of AdamW's 28 bytes a parameter, plus the 8 of averaging the shard first.
  EXPECT_NEAR(z1.optimizer_s, replicated.optimizer_s / 4 * (28.0 + 8) / 28, 1e-15);
  // Accumulating 4 micro-batches: stage 1 keeps the whole gradient and reduce-scatters once,
  // stage 2 every micro-batch.
  const auto a1 = predict(profile, w, Plan{.ranks = 4, .accumulate = 4, .zero = 1});
  const auto a2 = predict(profile, w, Plan{.ranks = 4, .accumulate = 4, .zero = 2});
  EXPECT_EQ(a1.memory_per_rank_bytes, z1.memory_per_rank_bytes + 2000u * 4);
  EXPECT_EQ(a2.memory_per_rank_bytes, z2.memory_per_rank_bytes);
  EXPECT_NEAR(a1.comm_s, z1.comm_s, 1e-12);
  EXPECT_GT(a2.comm_s, z2.comm_s + 1e-6);
  EXPECT_EQ(a1.wire_bytes_per_rank, z1.wire_bytes_per_rank);
}

// ZeRO 3 by hand: three layers of 1000 floats (forward 1 ms, backward 2 ms each), gathers of
// 0.5 ms and reduce-scatters of 0.3 ms, one use prefetched, so the last two layers stay whole
// from forward to backward; the optimizer steps each layer's shard in 0.3 ms. The step:
// shard 0 [0, 0.3], its gather [0.3, 0.8]; shard 1 [0.3, 0.6], its gather queued [0.8, 1.3];
// shard 2 [0.6, 0.9]. Forward: layer 0 [0.9, 1.9], gather 2 [1.9, 2.4], layer 1 [1.9, 2.9],
// layer 2 [2.9, 3.9]. Backward: layer 2 [3.9, 5.9], its reduce-scatter [5.9, 6.2]; layer 1
// [5.9, 7.9] with layer 0's second gather prefetched [6.2, 6.7], its reduce-scatter [7.9,
// 8.2]; layer 0 [7.9, 9.9], its reduce-scatter [9.9, 10.2]. Exposed: that last one.
TEST(AdvisePredict, ZeroThreeGathersEachLayerBeforeForwardAndBackward) {
  Workload w = two_layers(1000);
  w.layers.push_back(w.layers.back());
  w.optimizer = "adamw";
  Profile profile = simple_profile();
  profile.timed = {{"allgather", 4, 1, 4000, 500}, {"reduce_scatter", 4, 1, 4000, 300}};
  profile.optimizer_gbps = 0.03;
  const auto z3 = predict(profile, w, Plan{.ranks = 4, .zero = 3});
  // adamw: 7 floats a parameter, and the gradients' averaging pass 2 more, a quarter each.
  EXPECT_NEAR(z3.optimizer_s, 36.0 * 750 / 0.03e9, 1e-15);
  EXPECT_NEAR(z3.optimizer_s, 0.9e-3, 1e-12);
  EXPECT_NEAR(z3.step_s, 10.2e-3, 1e-12);
  EXPECT_NEAR(z3.compute_s, 9e-3, 1e-12);
  EXPECT_NEAR(z3.exposed_comm_s, 0.3e-3, 1e-12);
  EXPECT_NEAR(z3.comm_s, 4 * 0.5e-3 + 3 * 0.3e-3, 1e-12);
  // (N-1)/N of four gathers and three reduce-scatters of 1000 floats.
  EXPECT_EQ(z3.wire_bytes_per_rank, 7u * 1000 * 3 / 4 * 4);
  // A quarter of parameters, gradients and both moments, plus the layer computing, the one
  // prefetched (or kept), and the gradients of both.
  EXPECT_EQ(z3.memory_per_rank_bytes, (750u + 750 + 2 * 750 + 4 * 1000) * 4);
  // int8 gradients: the gathers in float32, the reduce-scatter a byte an element and a float
  // scale a block of 256, quantised once and decoded twice at the profile's int8 speeds.
  Profile with_int8 = profile;
  with_int8.codecs["int8"] = {{0, 4, 8}};
  const auto z3_int8 = predict(with_int8, w, Plan{.ranks = 4, .codec = "int8", .zero = 3});
  // (N-1)/N of the 3000 parameters is 9000 bytes: gathered 4/3 times (the last two layers
  // kept), reduce-scattered once at a quarter and a bit.
  EXPECT_EQ(z3_int8.wire_bytes_per_rank,
            static_cast<std::size_t>(4 * 3000 + 9000 * (1 + 4.0 / 256) / 4));
  EXPECT_NEAR(z3_int8.codec_s, 3 * 4000 * 1e-9 * (1 / 4.0 + 2 / 8.0), 1e-12);
  // Every micro-batch gathers and reduce-scatters again; the first, with no step before it,
  // gathers layer 0 itself: [0, 0.5], and ends at 9.8 ms.
  const auto twice = predict(profile, w, Plan{.ranks = 4, .accumulate = 2, .zero = 3});
  EXPECT_NEAR(twice.step_s, 9.8e-3 + 10.2e-3, 1e-12);
  EXPECT_EQ(twice.wire_bytes_per_rank, 2 * z3.wire_bytes_per_rank);
}

TEST(AdvisePredict, Fp16HalvesTheWireBetweenHostsAndIsFreeInSharedMemory) {
  const Profile profile = simple_profile();
  const auto w = two_layers(1 << 20);
  const auto none = predict(profile, w, Plan{.ranks = 4, .hosts = 4});
  const auto fp16 = predict(profile, w, Plan{.ranks = 4, .hosts = 4, .codec = "fp16"});
  EXPECT_EQ(fp16.wire_bytes_per_rank * 2, none.wire_bytes_per_rank);
  EXPECT_GT(fp16.codec_s, 0);
  EXPECT_EQ(none.codec_s, 0);
  // On one host the shared-memory all-reduce rounds to 16 bits as it copies: a float32 call.
  const auto one_host = predict(profile, w, Plan{.ranks = 4, .codec = "fp16"});
  const auto one_host_none = predict(profile, w, Plan{.ranks = 4});
  EXPECT_EQ(one_host.codec_s, 0);
  EXPECT_NEAR(one_host.comm_s, one_host_none.comm_s, 1e-12);
}

TEST(AdvisePredict, PowerSgdSendsFactorsOfMatricesAndVectorsWhole) {
  Profile profile = simple_profile();
  profile.codecs["powersgd"] = {{0, 5, 5}};
  Workload w;
  w.batch = 1;
  w.layers = {{"fc", {{1024 * 512, 1024}, {1024, 0}}, 1e6, 2e6}};
  const auto p = predict(profile, w, Plan{.ranks = 2, .hosts = 2, .codec = "powersgd:rank=4"});
  // P (1024 x 4) and Q (512 x 4) for the weight, the bias as it is: a ring of 2 ranks sends
  // each rank's half and receives the other's, so one message's worth of each.
  EXPECT_EQ(p.wire_bytes_per_rank, (1024u * 4 + 512 * 4 + 1024) * 4);
}

TEST(AdvisePredict, CodecSpeedFollowsTheTensorSize) {
  Profile profile = simple_profile();
  const std::size_t small = std::size_t{1} << 20, large = std::size_t{16} << 20;
  profile.codecs["topk"] = {{large, 1, 20}, {small, 2, 20}};  // any order
  const auto codec_s = [&](std::size_t floats) {
    return predict(profile, two_layers(floats), Plan{.ranks = 2, .codec = "topk:ratio=0.01"})
        .codec_s;
  };
  // Two tensors, each encoded once and its peer's payload decoded once.
  const auto expected = [](std::size_t floats, double encode_gbps) {
    return 2 * 4.0 * floats * (1 / encode_gbps + 1 / 20.0) * 1e-9;
  };
  EXPECT_NEAR(codec_s(small / 4), expected(small / 4, 2), 1e-9);  // below: the smallest's
  EXPECT_NEAR(codec_s(4 * small), expected(4 * small, std::sqrt(2.0)), 1e-9);  // halfway, log-log
  EXPECT_NEAR(codec_s(2 * large), expected(2 * large, 1), 1e-9);  // beyond: the largest's
}

TEST(AdvisePredict, StepAheadPassesWhereACodecHoldsBack) {
  Profile profile = simple_profile();
  for (const char* name : {"int8", "powersgd", "fp16"}) {
    profile.codecs[name] = {{0, 5, 5}};
  }
  const auto w = two_layers(1 << 20);
  for (const std::string codec :
       {"int8", "topk:ratio=0.01", "powersgd:rank=4", "fp16", "int8:ef=0"}) {
    Plan plan{.ranks = 2, .hosts = 2, .codec = codec};
    const double with = predict(profile, w, plan).optimizer_s;
    plan.step_ahead = false;
    const double without = predict(profile, w, plan).optimizer_s;
    const bool holds_back = codec != "fp16" && codec != "int8:ef=0";
    // 28 bytes a parameter: save, move by lr x residual, restore.
    EXPECT_NEAR(with - without, holds_back ? 28.0 * (2 << 20) / 10e9 : 0.0, 1e-12) << codec;
  }
}

// The analytic path (no timed collectives for the shape) from one rank to 16,384: finite,
// and more ranks over the same links never communicate faster per step.
TEST(AdvisePredict, ScalesTo16384Ranks) {
  const Profile profile = simple_profile();
  const auto w = model_workload("mlp", 64, "sgd");
  double previous = -1;
  for (int ranks = 8; ranks <= 16384; ranks *= 4) {
    const auto p = predict(profile, w, Plan{.ranks = ranks, .hosts = ranks / 8});
    ASSERT_TRUE(std::isfinite(p.step_s)) << ranks;
    EXPECT_GE(p.comm_s, previous) << ranks;
    previous = p.comm_s;
  }
}

TEST(AdvisePredict, RefusesWhatItCannotModel) {
  const Profile profile = simple_profile();
  const auto w = two_layers(1000);
  auto refused = [&](const Plan& plan, const std::string& says) {
    expect_refusal([&] { predict(profile, w, plan); }, says);
  };
  refused(Plan{.ranks = 3, .hosts = 2}, "multiple of hosts");
  refused(Plan{.ranks = 2, .codec = "int8"}, "no encode and decode speed for codec 'int8'");
  for (int zero : {1, 2, 3}) {
    refused(Plan{.ranks = 2, .codec = "topk:ratio=0.01", .zero = zero}, "ZeRO with codec topk");
  }
  refused(Plan{.ranks = 2, .codec = "nonsense"}, "nonsense");
  expect_refusal([] { model_workload("resnet", 64, "sgd"); }, "model 'resnet': known are mlp");
  expect_refusal([] { model_workload("mlp:12,x", 64, "sgd"); }, "model 'mlp:12,x'");
}

TEST(AdviseWorkload, TheTrainersModels) {
  EXPECT_EQ(model_workload("mlp", 64, "sgd").parameters(), 14'217'226u);
  EXPECT_EQ(model_workload("cnn", 64, "sgd").parameters(), 215'370u);
  EXPECT_EQ(model_workload("mlp:256,256", 64, "sgd").parameters(),
            784u * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10);
}

TEST(AdviseRecommend, LatencyBoundAsksForLargerBuckets) {
  Profile profile = simple_profile();
  profile.inter = {500.0, 10.0};  // slow to start a message, fast once started
  Workload w;
  w.batch = 1;
  for (int i = 0; i < 50; ++i) w.layers.push_back({"l" + std::to_string(i), {{1000}}, 1e3, 2e3});
  const Plan plan{.ranks = 8, .hosts = 8, .bucket_mb = 0.001, .first_bucket_mb = 0.001};
  const auto now = predict(profile, w, plan);
  EXPECT_EQ(now.bottleneck, "latency") << now.explanation;
  const auto changes = recommend(profile, w, plan);
  ASSERT_FALSE(changes.empty());
  EXPECT_EQ(changes.front().knob, "bucket-mb");
  EXPECT_LT(changes.front().change, -0.5);
  for (std::size_t i = 1; i < changes.size(); ++i)
    EXPECT_LE(changes[i - 1].change, changes[i].change);
}

TEST(AdvisePitfalls, SmallBucketsPerLayerCallsAndNoAccumulationOnASlowLink) {
  Profile profile = simple_profile();
  profile.inter = {500.0, 10.0};
  Workload w;
  w.batch = 1;
  for (int i = 0; i < 20; ++i) w.layers.push_back({"l" + std::to_string(i), {{1000}}, 1e3, 2e3});
  const auto small = predict(
      profile, w, Plan{.ranks = 8, .hosts = 8, .bucket_mb = 0.001, .first_bucket_mb = 0.001});
  ASSERT_EQ(small.pitfalls.size(), 2u);
  EXPECT_NE(small.pitfalls[0].find("fixed costs"), std::string::npos) << small.pitfalls[0];
  EXPECT_NE(small.pitfalls[1].find("one all-reduce per layer"), std::string::npos);

  profile.inter = {1.0, 0.01};  // 10 MB/s: bandwidth-bound
  const auto slow = predict(profile, two_layers(1 << 20), Plan{.ranks = 2, .hosts = 2});
  ASSERT_EQ(slow.bottleneck, "bandwidth") << slow.explanation;
  ASSERT_EQ(slow.pitfalls.size(), 1u);
  EXPECT_NE(slow.pitfalls[0].find("accumulation is off"), std::string::npos);
  EXPECT_TRUE(predict(profile, two_layers(1 << 20), Plan{.ranks = 2, .hosts = 2, .accumulate = 4})
                  .pitfalls.empty());
}

TEST(AdviseWorkload, LayerListWithFlopsOrMeasuredTimes) {
  const std::string path = ::testing::TempDir() + "advise_workload.json";
  {
    std::ofstream(path) << R"({"name": "two", "batch": 4, "optimizer": "adamw", "layers": [
        {"name": "fc1", "tensors": [{"count": 1000, "rows": 10}, {"count": 10}],
         "forward_flops": 2.5e7, "backward_flops": 5e7},
        {"name": "fc2", "parameters": 500, "forward_ms": 3, "backward_ms": 6}]})";
  }
  const Workload w = load_workload(path);
  EXPECT_EQ(w.name, "two");
  EXPECT_EQ(w.batch, 4u);
  EXPECT_EQ(w.optimizer, "adamw");
  ASSERT_EQ(w.layers.size(), 2u);
  EXPECT_EQ(w.layers[0].tensors[0].rows, 10u);
  EXPECT_EQ(w.parameters(), 1510u);
  // fc1: (2.5e7 + 5e7) x 4 samples at 100 GFLOP/s = 3 ms; fc2: 3 + 6 ms as measured.
  EXPECT_NEAR(predict(simple_profile(), w, Plan{.ranks = 1}).compute_s, 12e-3, 1e-12);
  const std::pair<const char*, const char*> bad[] = {
      {R"({"layers": []})", "needs at least one layer"},
      {R"({"layers": [{"name": "x", "parameters": 5}]})", "layer 'x' needs forward_flops"},
      {R"({"layers": [{"name": "x", "parameters": 5, "forward_ms": -1}]})", "none below 0"},
      {R"({"batch": 0, "layers": [{"parameters": 5, "forward_ms": 1}]})", "a batch of at least 1"},
      {R"({"layers": [{"name": "x", "forward_ms": 1}]})", "'parameters' not found"},
      {"not json", "parse error"},
  };
  for (const auto& [text, says] : bad) {
    std::ofstream(path) << text;
    expect_refusal([&] { load_workload(path); }, "workload " + path + ": ");
    expect_refusal([&] { load_workload(path); }, says);
  }
  std::remove(path.c_str());
}

// A trace as gradsync-train writes one: per rank, per step, forward and backward (with a
// nested layer span), two bucket all-reduces on the worker, a wait and the optimizer. Rank 1
// computes 20% longer than rank 0 in every step.
// gradsync-train's spans, or with `pytorch` gradsync.torch's (a "step" span from one DDP
// forward to the next, forward and backward, and the calls as the backend names them).
std::string synthetic_trace(int steps, bool pytorch = false) {
  std::ostringstream o;
  o << R"({"traceEvents":[)";
  bool first = true;
  auto span = [&](const std::string& name, const char* cat, int rank, int tid, double start_ms,
                  double dur_ms) {
    o << (first ? "" : ",") << R"({"name":")" << name << R"(","cat":")" << cat
      << R"(","ph":"X","ts":)" << start_ms * 1000 << R"(,"dur":)" << dur_ms * 1000 << R"(,"pid":)"
      << rank << R"(,"tid":)" << tid << "}";
    first = false;
  };
  for (int rank = 0; rank < 2; ++rank) {
    const double slow = rank == 1 ? 1.2 : 1.0;
    for (int i = 0; i < steps; ++i) {
      const double t = i * 100.0;  // each step 100 ms
      if (pytorch) {
        span("step " + std::to_string(i + 1), "step", rank, 0, t, 100);
        span("forward", "compute", rank, 0, t, 10 * slow);
        span("backward", "compute", rank, 0, t + 10 * slow, 20 * slow);
        span("ALLREDUCE 4 KiB", "comm", rank, 1, t + 20, 2);
        span("ALLREDUCE 16384 KiB", "comm", rank, 1, t + 40, 8);
        continue;
      }
      span("forward", "compute", rank, 0, t + 1, 10 * slow);
      span("backward", "compute", rank, 0, t + 1 + 10 * slow, 20 * slow);
      span("backward fc1", "compute", rank, 0, t + 2 + 10 * slow, 5);
      span("allreduce bucket 0 (4 KiB, none)", "comm", rank, 1, t + 20, 2);
      span("allreduce bucket 1 (16384 KiB, none)", "comm", rank, 1, t + 40, 8);
      span("wait for buckets", "wait", rank, 0, t + 50, 3);
      span("optimizer", "optimizer", rank, 0, t + 60, 30);
    }
  }
  o << "]}";
  return o.str();
}

void expect_median(const TraceReport& t, double step_s, double compute_s, double comm_s,
                   double exposed_s, double optimizer_s) {
  EXPECT_EQ(t.ranks, 2);
  EXPECT_EQ(t.steps, 6u);
  EXPECT_NEAR(t.median.step_s, step_s, 1e-9);
  EXPECT_NEAR(t.median.compute_s, compute_s, 1e-9);
  EXPECT_NEAR(t.median.comm_s, comm_s, 1e-9);
  EXPECT_NEAR(t.median.exposed_comm_s, exposed_s, 1e-9);
  EXPECT_NEAR(t.median.optimizer_s, optimizer_s, 1e-9);
  ASSERT_EQ(t.bucket_s.size(), 2u);
  EXPECT_NEAR(t.bucket_s[1], 0.008, 1e-9);
  EXPECT_EQ(t.stragglers.size(), 1u);
}

TEST(AdviseTrace, MeasuredStepsBucketsAndStragglers) {
  const std::string path = ::testing::TempDir() + "advise_trace.json";
  std::ofstream(path) << synthetic_trace(6);
  const TraceReport t = read_trace(path);
  EXPECT_FALSE(t.pytorch);
  // The slowest rank's step: from one optimizer's end to the next, 100 ms; its compute 36 ms
  // (the nested layer span not counted again).
  expect_median(t, 0.100, 0.036, 0.010, 0.003, 0.030);
  ASSERT_EQ(t.stragglers.size(), 1u);
  EXPECT_NE(t.stragglers[0].find("rank 1 computes longest in 4 of 4 steps, 20% longer"),
            std::string::npos)
      << t.stragglers[0];

  std::ofstream(path) << synthetic_trace(2);
  expect_refusal([&] { read_trace(path); },  // every step but the warm-up ones
                 "holds 2 complete steps on every rank; at least 3 are needed");
  std::ofstream(path) << R"({"events": []})";
  expect_refusal([&] { read_trace(path); }, "trace " + path + ": ");  // no traceEvents
  std::remove(path.c_str());
}

TEST(AdviseTrace, PyTorchStepsFromDdpForwardToForward) {
  const std::string path = ::testing::TempDir() + "advise_torch_trace.json";
  std::ofstream(path) << synthetic_trace(6, true);
  const TraceReport t = read_trace(path);
  EXPECT_TRUE(t.pytorch);
  // Both ranks' steps last 100 ms: the slowest is the one that computed longest, rank 1
  // (forward 12 + backward 24 ms). Its all-reduces end at 48 ms, 12 ms after backward; the
  // remaining 52 ms are the optimizer and whatever precedes the next forward. Buckets are
  // the step's all-reduces in order.
  expect_median(t, 0.100, 0.036, 0.010, 0.012, 0.052);
  EXPECT_NEAR(t.bucket_s[0], 0.002, 1e-9);
  std::remove(path.c_str());
}

TEST(AdviseProfile, JsonRoundTripAndRefusals) {
  const Profile p = simple_profile();
  const std::string path = ::testing::TempDir() + "advise_profile.json";
  { std::ofstream(path) << profile_json(p); }
  const Profile back = load_profile(path);
  EXPECT_EQ(back.name, p.name);
  EXPECT_EQ(back.cores_per_host, p.cores_per_host);
  EXPECT_EQ(back.inter.alpha_us, p.inter.alpha_us);
  ASSERT_EQ(back.codecs.size(), p.codecs.size());
  EXPECT_EQ(back.codecs.at("topk").front().encode_gbps, 1);
  EXPECT_EQ(back.codecs.at("topk").front().decode_gbps, 20);
  { std::ofstream(path) << R"({"compute_gflops": -1})"; }
  expect_refusal([&] { load_profile(path); },
                 "profile " + path + ": every speed and cores_per_host must be above 0");
  { std::ofstream(path) << R"({"intra": {"alpha_us": "fast"}})"; }
  expect_refusal([&] { load_profile(path); }, "profile " + path + ": ");  // a string, not a number
  std::remove(path.c_str());
  expect_refusal([&] { load_profile(path); }, "profile " + path + ": cannot be opened");
}

TEST(AdviseCollective, ARingAtLargeSizesRunsAtTheLinksSpeed) {
  Profile p = simple_profile();
  p.shared_memory = false;  // a GPU's peers: no shared-memory all-reduce
  p.reduce_gbps = 1e9;      // reduction free,
  p.cache_mib = 1 << 20;    // and no memory traffic beyond the links':
  const auto c = predict_collective(p, "allreduce", 8, 1, std::size_t{1} << 30);
  EXPECT_EQ(c.algorithm, "ring");
  EXPECT_NEAR(c.busbw_gbps, p.intra.bandwidth_gbps, 0.01);  // nccl-tests' bus bandwidth
  EXPECT_NEAR(c.algbw_gbps * 2 * 7 / 8, c.busbw_gbps, 1e-9);
  const auto gather = predict_collective(p, "allgather", 8, 1, std::size_t{1} << 30);
  EXPECT_NEAR(gather.busbw_gbps, p.intra.bandwidth_gbps, 0.01);
  // Between hosts: hierarchical, the links between hosts the limit.
  const auto across = predict_collective(p, "allreduce", 16, 2, std::size_t{1} << 30);
  EXPECT_EQ(across.algorithm, "hier");
  EXPECT_LT(across.busbw_gbps, c.busbw_gbps);
  // Small messages: fixed costs, so a lower bus bandwidth.
  EXPECT_LT(predict_collective(p, "allreduce", 8, 1, 4096).busbw_gbps, 0.5 * c.busbw_gbps);
  expect_refusal([&] { predict_collective(p, "broadcast", 8, 1, 4096); }, "collective 'broadcast'");
  expect_refusal([&] { predict_collective(p, "allreduce", 6, 4, 4096); },
                 "ranks must be a multiple");
}

TEST(AdviseCollective, TimedCurvesRuleWhereTheProfileHasThem) {
  Profile p = simple_profile();
  p.timed = {{"allreduce", 2, 1, 4096, 10}, {"allreduce", 2, 1, 4096 * 16, 40}};
  const auto c = predict_collective(p, "allreduce", 2, 1, 4096 * 4);
  EXPECT_EQ(c.algorithm, "timed");
  EXPECT_NEAR(c.us, 20, 1e-9);  // log-log halfway between 10 and 40
  EXPECT_NE(predict_collective(p, "allreduce", 4, 1, 4096 * 4).algorithm, "timed");  // other shape
}

// Every shipped profile loads, cites its sources, and predicts a plausible step for a model
// on 2 hosts of its GPUs.
TEST(AdviseProfile, ShippedProfilesLoadAndCiteTheirSources) {
  int seen = 0;
  for (const auto& entry :
       std::filesystem::directory_iterator(gradsync::testing::source_dir() + "/profiles")) {
    if (entry.path().extension() != ".json") continue;
    ++seen;
    const Profile p = load_profile(entry.path().string());
    SCOPED_TRACE(entry.path().string());
    EXPECT_GE(p.sources.size(), 4u);
    EXPECT_FALSE(p.shared_memory);  // GPU machines
    EXPECT_GT(p.memory_bytes_per_rank, 0u);
    const auto step = predict(p, model_workload("mlp", 64, "sgd"),
                              Plan{.ranks = 16, .hosts = 2, .codec = "fp16"});
    EXPECT_GT(step.step_s, step.compute_s);
    EXPECT_LT(step.step_s, 1.0);
  }
  EXPECT_GE(seen, 8);
}

}  // namespace
}  // namespace gradsync::advise
