// The context's engine: every collective's async form runs in issue order on the worker and
// gives the blocking form's result; Work's wait(timeout), test(), error() and skipped(); per-call
// options; composite calls (the compressed all-reduce) queued between plain ones.
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <mutex>
#include <numeric>
#include <vector>

#include "gradsync/compress.h"
#include "harness.h"

namespace gradsync {
namespace {

using testing::contains;

// Integer-valued inputs: every sum is exact, so every rank's result is known.
std::vector<float> ramp(std::size_t n, int rank) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>((i % 17) + 3 * rank);
  return v;
}

class EngineWorlds : public ::testing::TestWithParam<int> {};

// Every async form, issued back to back with a compressed all-reduce among them, then waited
// for in reverse: each result is the reference's.
TEST_P(EngineWorlds, EveryAsyncFormRunsInIssueOrderAndMatchesTheReference) {
  const int n = GetParam();
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    const int r = ctx.rank();
    const std::size_t count = 1001;  // not divisible by any world size here
    std::vector<float> sum = ramp(count, r);
    std::vector<float> gathered(count * static_cast<std::size_t>(n));
    std::vector<std::size_t> counts(static_cast<std::size_t>(n));
    for (int p = 0; p < n; ++p)
      counts[static_cast<std::size_t>(p)] = 3 + static_cast<std::size_t>(p);
    std::vector<float> mine(counts[static_cast<std::size_t>(r)], static_cast<float>(r));
    std::vector<float> packed(std::accumulate(counts.begin(), counts.end(), std::size_t{0}));
    std::vector<float> reduced(count, -1.0f);
    const std::vector<float> reduce_in = ramp(count, r);
    std::vector<float> bcast = r == n - 1 ? ramp(count, 7) : std::vector<float>(count, 0.0f);
    std::vector<float> compressed = ramp(count, r);
    auto codec = compress::make_codec("none");
    const std::vector<float> send = ramp(count, r);

    std::vector<Work> works;
    works.push_back(
        ctx.allreduce_async(sum.data(), sum.data(), count, DataType::kFloat32, ReduceOp::kSum));
    works.push_back(ctx.allgather_async(send.data(), gathered.data(), count, DataType::kFloat32));
    works.push_back(ctx.allgatherv_async(mine.data(), packed.data(), counts, DataType::kFloat32));
    works.push_back(ctx.reduce_async(reduce_in.data(), r == 0 ? reduced.data() : nullptr, count,
                                     DataType::kFloat32, ReduceOp::kMax, 0));
    works.push_back(
        compress::compressed_allreduce_async(ctx, compressed, *codec, "t", ReduceOp::kSum));
    works.push_back(ctx.broadcast_async(bcast.data(), count, DataType::kFloat32, n - 1));
    works.push_back(ctx.barrier_async());
    counts.assign(counts.size(), 0);  // allgatherv_async copied them
    for (auto it = works.rbegin(); it != works.rend(); ++it) it->wait();

    for (std::size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int p = 0; p < n; ++p) want += static_cast<float>((i % 17) + 3 * p);
      ASSERT_EQ(sum[i], want) << "allreduce, i " << i;
      ASSERT_EQ(compressed[i], want) << "compressed, i " << i;
      ASSERT_EQ(bcast[i], static_cast<float>((i % 17) + 21)) << "broadcast, i " << i;
      if (r == 0) {
        ASSERT_EQ(reduced[i], static_cast<float>((i % 17) + 3 * (n - 1))) << "reduce, i " << i;
      }
      for (int p = 0; p < n; ++p) {
        ASSERT_EQ(gathered[static_cast<std::size_t>(p) * count + i],
                  static_cast<float>((i % 17) + 3 * p));
      }
    }
    std::size_t at = 0;
    for (int p = 0; p < n; ++p) {
      for (std::size_t j = 0; j < 3 + static_cast<std::size_t>(p); ++j) {
        ASSERT_EQ(packed[at++], static_cast<float>(p)) << "allgatherv, rank " << p;
      }
    }
    for (const Work& w : works) {
      EXPECT_TRUE(w.test());
      EXPECT_FALSE(w.error());
    }
  });
}

// Waiting for each call as soon as it is issued, and for a run of them in issue order: where
// a waiting thread runs the next call itself (ranks no more than cores), the calls still run
// one at a time in issue order on every rank, whichever thread runs each.
TEST_P(EngineWorlds, CallsWaitedForInIssueOrderRunInIssueOrder) {
  const int n = GetParam();
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    const int r = ctx.rank();
    std::vector<std::vector<float>> data;
    std::vector<Work> works;
    for (std::size_t k = 0; k < 24; ++k) {
      data.push_back(ramp(100 + 37 * k, r));  // a different count each: a reordered call fails
      auto& d = data.back();
      const Algorithm algorithm = k % 3 == 0 ? Algorithm::kRing : Algorithm::kAuto;
      works.push_back(ctx.allreduce_async(d.data(), d.data(), d.size(), DataType::kFloat32,
                                          ReduceOp::kSum, {.algorithm = algorithm}));
      // At once, often before the worker has it, and with the next call queued behind it.
      if (k % 3 == 1) works[k - 1].wait();
    }
    for (Work& w : works) w.wait();
    for (const auto& d : data) {
      for (std::size_t i = 0; i < d.size(); ++i) {
        float want = 0;
        for (int p = 0; p < n; ++p) want += static_cast<float>((i % 17) + 3 * p);
        ASSERT_EQ(d[i], want) << "count " << d.size() << ", i " << i;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, EngineWorlds, ::testing::Values(1, 2, 3, 4, 5, 8),
                         [](const auto& p) { return "n" + std::to_string(p.param); });

// A call waiting for a peer that has not issued it yet: wait(timeout) gives up without
// throwing and the call goes on; once the peer joins, it completes.
TEST(Work, WaitWithATimeoutReturnsFalseWhileThePeerHasNotJoined) {
  std::atomic<bool> gave_up{false};
  testing::run_inproc_contexts(2, [&](Context& ctx) {
    std::vector<float> v(64, 1.0f);
    if (ctx.rank() == 0) {
      Work w =
          ctx.allreduce_async(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
      EXPECT_FALSE(w.wait(std::chrono::milliseconds(50)));
      EXPECT_FALSE(w.test());
      EXPECT_FALSE(w.error());
      gave_up = true;
      gave_up.notify_all();
      w.wait();
    } else {
      gave_up.wait(false);  // rank 1 issues its call only once rank 0 has given up waiting
      ctx.allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
    }
    EXPECT_EQ(v[0], 2.0f);
  });
}

// The stored error: error() after the call failed, and every wait() throws it again.
TEST(Work, KeepsTheCallsErrorForEveryWait) {
  testing::run_inproc_contexts(2, [&](Context& ctx) {
    auto codec = compress::make_codec("none");
    std::vector<float> v(100, 1.0f);
    if (ctx.rank() == 1) v[5] = std::numeric_limits<float>::quiet_NaN();
    Work w = compress::compressed_allreduce_async(ctx, v, *codec, "grad");
    for (int attempt = 0; attempt < 2; ++attempt) {
      const Error e = testing::expect_error(ErrorKind::kInvalidArgument, [&] { w.wait(); });
      EXPECT_TRUE(contains(e.what(), "tensor 'grad' has NaN on rank 1 (element 5)")) << e.what();
    }
    ASSERT_TRUE(w.error());
    EXPECT_THROW(std::rethrow_exception(w.error()), Error);
    // Every rank settled on that error together: the communicator goes on.
    std::vector<float> clean(100, 1.0f);
    Work skip = compress::compressed_allreduce_async(ctx, v, *codec, "grad", ReduceOp::kSum,
                                                     compress::NonFinite::kSkip);
    EXPECT_TRUE(skip.skipped());
    Work fine = compress::compressed_allreduce_async(ctx, clean, *codec, "grad");
    EXPECT_FALSE(fine.skipped());
    EXPECT_EQ(clean[0], 2.0f);
  });
}

// on_done: a callback given while the call runs fires once it is done, after the result is
// in place; one given later fires at once; a callback may issue the next async call (what a
// torch future's continuation does).
TEST(Work, OnDoneRunsOnceTheCallIsDoneAndMayIssueTheNextCall) {
  testing::run_inproc_contexts(3, [&](Context& ctx) {
    std::vector<float> v(1000, 1.0f);
    std::vector<float> doubled(1000, 0.0f);
    std::atomic<int> fired{0};
    std::atomic<float> seen{0.0f};
    Work second;
    std::mutex second_mu;
    std::condition_variable second_cv;
    bool second_ready = false;
    Work first =
        ctx.allreduce_async(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
    first.on_done([&] {
      seen = v[999];
      ++fired;
      Work next = ctx.allreduce_async(v.data(), doubled.data(), v.size(), DataType::kFloat32,
                                      ReduceOp::kSum);
      std::lock_guard lock(second_mu);
      second = next;
      second_ready = true;
      second_cv.notify_all();
    });
    first.wait();
    {
      std::unique_lock lock(second_mu);
      second_cv.wait(lock, [&] { return second_ready; });
    }
    second.wait();
    EXPECT_EQ(fired.load(), 1);
    EXPECT_EQ(seen.load(), 3.0f);
    EXPECT_EQ(doubled[0], 9.0f);
    bool at_once = false;
    first.on_done([&] { at_once = true; });
    EXPECT_TRUE(at_once);
    Work().on_done([&] { ++fired; });
    EXPECT_EQ(fired.load(), 2);
  });
}

// Contexts that meet over one store agree on their keys whatever other contexts each process
// made before on other stores (torch builds one per subgroup, and only the members do).
TEST(Init, ContextsOverOneStoreMeetWhateverEachRankBuiltElsewhere) {
  auto shared = make_inproc_store();
  testing::run_threads(2, [&](int rank) {
    if (rank == 0) {
      auto alone = init({.rank = 0, .size = 1, .store = make_inproc_store()});
      EXPECT_EQ(alone->size(), 1);
    }
    auto ctx = init({.rank = rank, .size = 2, .store = shared});
    int v = rank + 1;
    ctx->allreduce(&v, &v, 1, DataType::kInt32, ReduceOp::kSum);
    EXPECT_EQ(v, 3);
  });
}

// A context timeout far beyond any call of these tests (a designated initializer naming one
// field: every Options field has an initializer, so -Wmissing-field-initializers is quiet).
Options patient() {
  return Options{.timeout = std::chrono::milliseconds(600000)};
}

// CallOptions: a per-call timeout shorter than the context's fails that call with kTimeout;
// the algorithm is honoured.
TEST(CallOptions, TimeoutAndAlgorithmApplyToTheOneCall) {
  std::atomic<bool> timed_out{false};
  testing::run_inproc_contexts(
      2,
      [&](Context& ctx) {
        std::vector<float> v(300, 1.0f);
        ctx.allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum,
                      {.algorithm = Algorithm::kRecursiveDoubling});
        EXPECT_EQ(v[0], 2.0f);
        if (ctx.rank() == 1) {  // never joins the next call; stays until rank 0 gave up
          timed_out.wait(false);
          return;
        }
        const Error e = testing::expect_error(ErrorKind::kTimeout, [&] {
          ctx.allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum,
                        {.timeout = std::chrono::milliseconds(100)});
        });
        EXPECT_TRUE(contains(e.what(), "allreduce #2")) << e.what();
        timed_out = true;
        timed_out.notify_all();
      },
      patient());
}

}  // namespace
}  // namespace gradsync
