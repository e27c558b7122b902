// The bucketed reducer against a reference: after finish() every gradient is the average of
// the ranks' gradients, for any ready order, bucket size, overlap or not, codec, and with
// accumulation; unused parameters are an error on every rank or reduced as zeros; the bucket
// rebuild leaves every rank with rank 0's order.
#include "gradsync/reducer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

#include "gradsync/error.h"
#include "harness.h"

namespace gradsync {
namespace {

using testing::contains;

const std::vector<std::size_t> kSizes = {1, 7, 1000, 33, 4099, 2, 300};

// Rank r's gradient of parameter p at step s, element i: distinct everywhere, exact in float.
float grad_value(int r, std::size_t p, int s, std::size_t i) {
  return static_cast<float>(
             ((r + 1) * 7 + static_cast<int>(p) * 3 + s * 5 + static_cast<int>(i % 13)) % 17) -
         8.0f;
}

struct Model {
  std::vector<std::vector<float>> grads;
  std::vector<float> flat;  // or every gradient in one array, as a model's flat gradients
  std::vector<int> ids;
};

// Gradients in the caller's memory (`external`: one vector each, or with `flat` tiling one
// array, which buckets of neighbouring parameters reduce in place) or in bucket memory.
Model register_all(Reducer& reducer, bool external, bool flat = false) {
  Model m;
  m.flat.resize(std::accumulate(kSizes.begin(), kSizes.end(), std::size_t{0}));
  std::size_t at = 0;
  for (std::size_t p = 0; p < kSizes.size(); ++p) {
    m.grads.emplace_back(kSizes[p]);
    std::span<float> grad;
    if (external) grad = flat ? std::span<float>(m.flat).subspan(at, kSizes[p]) : m.grads.back();
    at += kSizes[p];
    m.ids.push_back(reducer.add_parameter("layer" + std::to_string(p), kSizes[p], grad));
  }
  return m;
}

// Writes step s's gradients and marks them ready in a per-rank shuffled order.
void backward(Reducer& reducer, Model& m, int rank, int step, unsigned seed,
              const std::vector<std::size_t>& skip = {}) {
  std::vector<std::size_t> order(kSizes.size());
  std::iota(order.begin(), order.end(), 0);
  std::mt19937 rng(seed + static_cast<unsigned>(rank) * 101 + static_cast<unsigned>(step));
  std::shuffle(order.begin(), order.end(), rng);
  for (std::size_t p : order) {
    if (std::find(skip.begin(), skip.end(), p) != skip.end()) continue;
    std::span<float> g = reducer.gradient(m.ids[p]);
    for (std::size_t i = 0; i < g.size(); ++i) g[i] = grad_value(rank, p, step, i);
    reducer.mark_ready(m.ids[p]);
  }
}

void expect_average(Reducer& reducer, const Model& m, int n, int step, const std::string& what,
                    double tolerance = 1e-6) {
  for (std::size_t p = 0; p < kSizes.size(); ++p) {
    std::span<float> g = reducer.gradient(m.ids[p]);
    for (std::size_t i = 0; i < g.size(); ++i) {
      double want = 0;
      for (int r = 0; r < n; ++r) want += grad_value(r, p, step, i);
      want /= n;
      ASSERT_NEAR(g[i], want, tolerance * (1 + std::fabs(want)))
          << what << " param " << p << " i " << i;
    }
  }
}

struct Case {
  std::size_t first_bucket, bucket;
  bool overlap, external, flat = false;
};

class ReducerWorlds : public ::testing::TestWithParam<int> {};

TEST_P(ReducerWorlds, EveryGradientIsTheAverageForAnyOrderBucketingAndOverlap) {
  const int n = GetParam();
  for (const Case c :
       {Case{64, 256, true, true}, Case{1 << 20, 25 << 20, true, false}, Case{4, 4, false, true},
        Case{4096, 8192, true, false}, Case{1, 1 << 20, false, false},
        Case{64, 256, true, true, true}, Case{1 << 20, 25 << 20, true, true, true},
        Case{40, 8000, false, true, true}}) {
    const std::string what = "first " + std::to_string(c.first_bucket) + " cap " +
                             std::to_string(c.bucket) + (c.overlap ? " overlap" : "") +
                             (c.external ? (c.flat ? " flat" : " external") : " bucket-view");
    std::vector<std::vector<std::vector<int>>> layouts(static_cast<std::size_t>(n));
    testing::run_inproc_contexts(n, [&](Context& ctx) {
      ReducerOptions o;
      o.first_bucket_bytes = c.first_bucket;
      o.bucket_bytes = c.bucket;
      o.overlap = c.overlap;
      Reducer reducer(ctx, o);
      Model m = register_all(reducer, c.external, c.flat);
      for (int step = 0; step < 3; ++step) {
        backward(reducer, m, ctx.rank(), step, 7);
        const StepStats stats = reducer.finish();
        EXPECT_TRUE(stats.communicated);
        EXPECT_EQ(stats.allreduce_calls, stats.buckets) << what;
        EXPECT_GE(stats.overlap_fraction, 0.0);
        EXPECT_LE(stats.overlap_fraction, 1.0);
        expect_average(reducer, m, n, step, what);
      }
      layouts[static_cast<std::size_t>(ctx.rank())] = reducer.buckets();
    });
    for (int r = 1; r < n; ++r) EXPECT_EQ(layouts[static_cast<std::size_t>(r)], layouts[0]) << what;
  }
}

// Ranks see different ready orders; after the first step every rank's buckets follow rank
// 0's order (so all launch the same buckets in the same order), first bucket small.
TEST_P(ReducerWorlds, RebuildAdoptsRankZerosReadyOrderOnEveryRank) {
  const int n = GetParam();
  std::vector<std::vector<std::vector<int>>> before(static_cast<std::size_t>(n)),
      after(before.size());
  std::vector<int> rank0_order;
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    ReducerOptions o;
    o.first_bucket_bytes = 40;  // 10 floats
    o.bucket_bytes = 5000;
    Reducer reducer(ctx, o);
    Model m = register_all(reducer, true);
    before[static_cast<std::size_t>(ctx.rank())] = reducer.buckets();
    backward(reducer, m, ctx.rank(), 0, 3);
    reducer.finish();
    after[static_cast<std::size_t>(ctx.rank())] = reducer.buckets();
    if (ctx.rank() == 0) {
      std::vector<std::size_t> order(kSizes.size());
      std::iota(order.begin(), order.end(), 0);
      std::mt19937 rng(3u);
      std::shuffle(order.begin(), order.end(), rng);
      for (std::size_t p : order) rank0_order.push_back(static_cast<int>(p));
    }
  });
  // Before: reverse registration order.
  std::vector<int> flat;
  for (const auto& b : before[0]) flat.insert(flat.end(), b.begin(), b.end());
  EXPECT_EQ(flat, (std::vector<int>{6, 5, 4, 3, 2, 1, 0}));
  flat.clear();
  for (const auto& b : after[0]) flat.insert(flat.end(), b.begin(), b.end());
  EXPECT_EQ(flat, rank0_order);
  EXPECT_LE(after[0][0].size(), 2u);  // the first bucket holds at most 10 floats' worth
  for (int r = 1; r < n; ++r) EXPECT_EQ(after[static_cast<std::size_t>(r)], after[0]);
}

INSTANTIATE_TEST_SUITE_P(Worlds, ReducerWorlds, ::testing::Values(1, 2, 3, 4, 5, 8),
                         [](const auto& p) { return "n" + std::to_string(p.param); });

// k micro-batches accumulated locally (no_sync, or accumulate_steps=k) reduce to the average
// of the summed gradients, with 1/k of the all-reduces.
// Buckets fill in reverse registration order up to the cap (the first one up to its own,
// smaller cap), and a parameter of at least half the cap travels alone: the MLP shape whose
// 16 MiB weight otherwise waited in one bucket for the next layer's backward.
TEST(Reducer, ALargeParameterGetsABucketOfItsOwn) {
  testing::run_inproc_contexts(1, [&](Context& ctx) {
    ReducerOptions o;
    o.first_bucket_bytes = 400;  // 100 floats
    o.bucket_bytes = 4000;       // 1000 floats; 500 or more is large
    Reducer reducer(ctx, o);
    // Registered input layer first, as a model does: backward produces them in reverse.
    const std::size_t sizes[] = {300, 10, 600, 10, 200, 150, 20, 10};
    std::vector<std::vector<float>> grads;
    for (std::size_t i = 0; i < std::size(sizes); ++i) {
      grads.emplace_back(sizes[i], 1.0f);
      reducer.add_parameter("p" + std::to_string(i), sizes[i], grads.back());
    }
    // Reverse order 7 6 5 4 | 3 2 | 1 0: p7+p6 fit the first bucket (30 floats), p5 does not;
    // p5 p4 p3 fill 360; p2 (600) is large: alone; then p1 p0.
    EXPECT_EQ(reducer.buckets(), (std::vector<std::vector<int>>{{7, 6}, {5, 4, 3}, {2}, {1, 0}}));
  });
}

TEST(Reducer, AccumulationCommunicatesOnceEveryKSteps) {
  const int n = 3, k = 4;
  for (bool guard : {true, false}) {
    testing::run_inproc_contexts(n, [&](Context& ctx) {
      ReducerOptions o;
      o.accumulate_steps = guard ? 1 : k;
      o.bucket_bytes = 4096;
      Reducer reducer(ctx, o);
      Model m = register_all(reducer, true);
      for (auto& g : m.grads) std::fill(g.begin(), g.end(), 0.0f);
      std::size_t calls = 0, communicated = 0;
      for (int micro = 0; micro < k; ++micro) {
        std::optional<Reducer::NoSync> no_sync;
        if (guard && micro < k - 1) no_sync.emplace(reducer);
        for (std::size_t p = 0; p < kSizes.size(); ++p) {  // accumulate, as backward does
          for (std::size_t i = 0; i < kSizes[p]; ++i) {
            m.grads[p][i] += grad_value(ctx.rank(), p, micro, i);
          }
          reducer.mark_ready(m.ids[p]);
        }
        const StepStats stats = reducer.finish();
        calls += stats.allreduce_calls;
        communicated += stats.communicated;
      }
      EXPECT_EQ(communicated, 1u);
      EXPECT_EQ(calls, reducer.buckets().size());
      for (std::size_t p = 0; p < kSizes.size(); ++p) {
        for (std::size_t i = 0; i < kSizes[p]; ++i) {
          double want = 0;
          for (int r = 0; r < n; ++r)
            for (int micro = 0; micro < k; ++micro) want += grad_value(r, p, micro, i);
          ASSERT_NEAR(m.grads[p][i], want / n, 1e-5) << p << " " << i;
        }
      }
    });
  }
}

// A parameter rank 1 never marks: an error on every rank (naming it where it happened), not
// a hang; with find_unused_parameters it counts as zeros.
TEST(Reducer, UnusedParametersAreAnErrorOnEveryRankOrZeros) {
  const int n = 3;
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    Reducer reducer(ctx);
    Model m = register_all(reducer, true);
    backward(reducer, m, ctx.rank(), 0, 5,
             ctx.rank() == 1 ? std::vector<std::size_t>{2} : std::vector<std::size_t>{});
    try {
      reducer.finish();
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      if (ctx.rank() == 1) {
        EXPECT_TRUE(contains(e.what(), "never marked ready this step: 'layer2'")) << e.what();
      } else {
        EXPECT_TRUE(contains(e.what(), "another rank left parameters unready")) << e.what();
      }
    }
    // The reducer is usable again: a full step goes through.
    backward(reducer, m, ctx.rank(), 1, 5);
    reducer.finish();
    expect_average(reducer, m, n, 1, "after the error");
  });
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    ReducerOptions o;
    o.find_unused_parameters = true;
    Reducer reducer(ctx, o);
    Model m = register_all(reducer, true);
    backward(reducer, m, ctx.rank(), 0, 5,
             ctx.rank() == 1 ? std::vector<std::size_t>{2} : std::vector<std::size_t>{});
    reducer.finish();
    for (std::size_t i = 0; i < kSizes[2]; ++i) {
      ASSERT_NEAR(m.grads[2][i], (grad_value(0, 2, 0, i) + grad_value(2, 2, 0, i)) / n, 1e-6);
    }
  });
}

// Codecs plug in: fp16 and top-k (with error feedback) reduce whole buckets, int8 one
// parameter at a time under its name; all near the average (top-k: within what it drops this
// step).
TEST(Reducer, CodecsReduceBucketsOrParameters) {
  const int n = 4;
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    ReducerOptions o;
    o.codec = "fp16";
    o.bucket_bytes = 8192;
    Reducer half(ctx, o);
    Model m = register_all(half, true);
    backward(half, m, ctx.rank(), 0, 9);
    const StepStats stats = half.finish();
    EXPECT_EQ(stats.allreduce_calls, stats.buckets);
    expect_average(half, m, n, 0, "fp16", 1e-3);

    o.codec = "topk:ratio=1";  // keeps everything: exact
    Reducer topk(ctx, o);
    Model t = register_all(topk, true);
    backward(topk, t, ctx.rank(), 0, 9);
    const StepStats s2 = topk.finish();
    EXPECT_EQ(s2.allreduce_calls, s2.buckets);
    expect_average(topk, t, n, 0, "topk");

    o.codec = "int8";
    Reducer int8(ctx, o);
    Model q = register_all(int8, true);
    backward(int8, q, ctx.rank(), 0, 9);
    const StepStats s3 = int8.finish();
    EXPECT_EQ(s3.allreduce_calls, kSizes.size());
    expect_average(int8, q, n, 0, "int8", 0.05);
  });
}

// A NaN or Inf in a gradient is named by its parameter and the element within it, whether the
// codec reduces the bucket whole (none, fp16, top-k) or parameter by parameter (int8).
TEST(Reducer, ANonFiniteGradientIsNamedByItsParameter) {
  const int n = 3;
  for (const std::string codec : {"none", "fp16", "topk:ratio=0.5", "int8"}) {
    testing::run_inproc_contexts(n, [&](Context& ctx) {
      ReducerOptions o;
      o.codec = codec;
      o.bucket_bytes = std::size_t{1} << 20;  // every parameter in one bucket
      o.first_bucket_bytes = o.bucket_bytes;
      Reducer reducer(ctx, o);
      Model m = register_all(reducer, true);
      std::vector<std::size_t> order(kSizes.size());
      std::iota(order.begin(), order.end(), 0);
      for (std::size_t p : order) {
        std::span<float> g = reducer.gradient(m.ids[p]);
        for (std::size_t i = 0; i < g.size(); ++i) g[i] = grad_value(ctx.rank(), p, 0, i);
        if (p == 4 && ctx.rank() == 1) g[17] = std::numeric_limits<float>::quiet_NaN();
        reducer.mark_ready(m.ids[p]);
      }
      try {
        reducer.finish();
        ADD_FAILURE() << codec << ": a NaN gradient was reduced";
      } catch (const Error& e) {
        EXPECT_TRUE(contains(e.what(), "'layer4'")) << codec << ": " << e.what();
        EXPECT_TRUE(contains(e.what(), "NaN on rank 1 (element 17")) << codec << ": " << e.what();
      }
    });
  }
}

// Error feedback loses nothing: what the steps delivered (the averages) plus what every rank
// still holds back is the average of every gradient computed. So held_back(id) must show each
// rank's residual of that parameter, also when top-k keeps it in a joined bucket whose
// layout the rebuild after the first step changes, and PowerSGD in its own state.
TEST(Reducer, HeldBackIsWhatTheWireHasNotCarriedYet) {
  const std::vector<std::size_t> rows = {0, 0, 20, 0, 0, 0, 15};  // 1000 = 20 x 50, 300 = 15 x 20
  for (const std::string codec :
       {"topk:ratio=0.05", "topk:ratio=0.05,union=1", "int8", "sign", "powersgd:rank=2"}) {
    for (int n : {1, 3, 4}) {
      const int steps = 3;
      // Per rank and parameter: the gradients it computed, what was delivered, what it holds.
      std::vector<std::vector<std::vector<double>>> computed(n), delivered(n), held(n);
      std::vector<int> held_nonzero(static_cast<std::size_t>(n), 0);
      testing::run_inproc_contexts(n, [&](Context& ctx) {
        ReducerOptions o;
        o.codec = codec;
        o.bucket_bytes = 8192;
        Reducer reducer(ctx, o);
        std::vector<int> ids;
        for (std::size_t p = 0; p < kSizes.size(); ++p) {
          ids.push_back(reducer.add_parameter("layer" + std::to_string(p), kSizes[p], {}, rows[p]));
        }
        const auto r = static_cast<std::size_t>(ctx.rank());
        for (auto* sums : {&computed[r], &delivered[r], &held[r]}) {
          for (std::size_t size : kSizes) sums->emplace_back(size, 0.0);
        }
        for (int step = 0; step < steps; ++step) {
          for (std::size_t p = 0; p < kSizes.size(); ++p) {
            std::span<float> g = reducer.gradient(ids[p]);
            for (std::size_t i = 0; i < g.size(); ++i) {
              g[i] = grad_value(ctx.rank(), p, step, i) * (1.0f + 0.1f * static_cast<float>(i % 5));
              computed[r][p][i] += g[i];
            }
            reducer.mark_ready(ids[p]);
          }
          reducer.finish();
          for (std::size_t p = 0; p < kSizes.size(); ++p) {
            std::span<float> g = reducer.gradient(ids[p]);
            for (std::size_t i = 0; i < g.size(); ++i) delivered[r][p][i] += g[i];
          }
        }
        for (std::size_t p = 0; p < kSizes.size(); ++p) {
          const std::span<const float> h = reducer.held_back(ids[p]);
          if (h.empty()) continue;  // nothing held back (a vector under PowerSGD)
          ASSERT_EQ(h.size(), kSizes[p]) << codec;
          for (std::size_t i = 0; i < h.size(); ++i) {
            held[r][p][i] = h[i];
            held_nonzero[r] += h[i] != 0;
          }
        }
      });
      for (int r = 0; r < n; ++r) EXPECT_GT(held_nonzero[r], 0) << codec << " rank " << r;
      for (std::size_t p = 0; p < kSizes.size(); ++p) {
        for (std::size_t i = 0; i < kSizes[p]; ++i) {
          double owed = 0;  // the average of what the ranks computed and did not hold back
          for (int r = 0; r < n; ++r) owed += computed[r][p][i] - held[r][p][i];
          owed /= n;
          for (int r = 0; r < n; ++r) {
            ASSERT_NEAR(delivered[r][p][i], owed, 1e-4 * (1 + std::fabs(owed)))
                << codec << " n " << n << " rank " << r << " param " << p << " i " << i;
          }
        }
      }
    }
  }
}

TEST(Reducer, MisuseIsAClearError) {
  testing::run_inproc_contexts(1, [&](Context& ctx) {
    Reducer reducer(ctx);
    std::vector<float> g(10);
    const int id = reducer.add_parameter("w", 10, g);
    testing::expect_error(ErrorKind::kInvalidArgument, [&] { reducer.add_parameter("w", 3); });
    testing::expect_error(ErrorKind::kInvalidArgument,
                          [&] { reducer.add_parameter("v", 3, std::span<float>(g)); });
    testing::expect_error(ErrorKind::kInvalidArgument, [&] { reducer.mark_ready(5); });
    reducer.mark_ready(id);
    Error e = testing::expect_error(ErrorKind::kInvalidArgument, [&] { reducer.mark_ready(id); });
    EXPECT_TRUE(contains(e.what(), "'w' marked ready twice")) << e.what();
    reducer.finish();
    testing::expect_error(ErrorKind::kInvalidArgument, [&] { reducer.add_parameter("late", 1); });
    EXPECT_TRUE(reducer.held_back(id).empty());  // float32 holds nothing back
    e = testing::expect_error(ErrorKind::kInvalidArgument, [&] { reducer.held_back(1); });
    EXPECT_TRUE(contains(e.what(), "held_back(1): no such parameter")) << e.what();
    reducer.mark_ready(id);
    e = testing::expect_error(ErrorKind::kInvalidArgument, [&] { reducer.held_back(id); });
    EXPECT_TRUE(contains(e.what(), "inside a step")) << e.what();
    reducer.finish();
    ReducerOptions bad;
    bad.accumulate_steps = 0;
    testing::expect_error(ErrorKind::kInvalidArgument, [&] { Reducer r(ctx, bad); });
    bad.accumulate_steps = 1;
    bad.codec = "zstd";
    testing::expect_error(ErrorKind::kInvalidArgument, [&] { Reducer r(ctx, bad); });
  });
}

}  // namespace
}  // namespace gradsync
