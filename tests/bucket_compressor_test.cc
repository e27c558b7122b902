// BucketCompressor (torch DDP's comm hooks): error feedback's state follows each parameter
// when the buckets are regrouped and across a checkpoint, and bad input is named.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "gradsync/compress.h"
#include "gradsync/error.h"
#include "harness.h"

namespace gradsync {
namespace {

using compress::BucketCompressor;
using compress::TensorSlice;

std::vector<float> gradient(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist;
  std::vector<float> g(n);
  for (float& x : g) x = dist(gen);
  return g;
}

std::vector<float> held(const BucketCompressor& c, const std::string& name, std::size_t n) {
  auto h = c.held_back(name);
  return h.empty() ? std::vector<float>(n, 0.0f) : std::vector<float>(h.begin(), h.end());
}

// One rank: what is sent plus what is held back after a step equals the gradient plus what
// was held back before it, element for element (up to the rounding of the codec's
// subtraction; the residuals are of order 1). A regrouping that dropped the state would
// break it for the second step.
TEST(BucketCompressor, ErrorFeedbackFollowsEachParameterWhenBucketsAreRegrouped) {
  for (const char* spec : {"topk:ratio=0.1", "int8", "sign", "topk:ratio=0.1,momentum=0.9"}) {
    SCOPED_TRACE(spec);
    testing::run_inproc_contexts(1, [&](Context& ctx) {
      BucketCompressor c(spec);
      const std::size_t na = 300, nb = 120;
      // Step 1: one bucket [a b].
      auto a1 = gradient(na, 1), b1 = gradient(nb, 2);
      std::vector<float> bucket(a1);
      bucket.insert(bucket.end(), b1.begin(), b1.end());
      std::vector<TensorSlice> parts{{"a", 0, na}, {"b", na, nb}};
      c.allreduce_async(ctx, bucket, parts).wait();
      ASSERT_FALSE(c.held_back("a").empty());
      // Step 2: regrouped as [b] then [a], as DDP's rebuild may.
      auto ra = held(c, "a", na), rb = held(c, "b", nb);
      auto a2 = gradient(na, 3), b2 = gradient(nb, 4);
      auto sent_a = a2, sent_b = b2;
      std::vector<TensorSlice> only_b{{"b", 0, nb}}, only_a{{"a", 0, na}};
      c.allreduce_async(ctx, sent_b, only_b);
      c.allreduce_async(ctx, sent_a, only_a).wait();
      auto ra2 = held(c, "a", na), rb2 = held(c, "b", nb);
      if (std::string(spec).find("momentum") == std::string::npos) {
        for (std::size_t i = 0; i < na; ++i) {
          ASSERT_NEAR(sent_a[i] + ra2[i], a2[i] + ra[i], 1e-5) << "a[" << i << "]";
        }
        for (std::size_t i = 0; i < nb; ++i) {
          ASSERT_NEAR(sent_b[i] + rb2[i], b2[i] + rb[i], 1e-5) << "b[" << i << "]";
        }
      }
    });
  }
}

// A checkpoint taken between steps gives a fresh compressor the same next step.
TEST(BucketCompressor, SavedStateContinuesTheSameAndRefusesAnotherCodecs) {
  testing::run_inproc_contexts(2, [&](Context& ctx) {
    const std::size_t n = 500;
    std::vector<TensorSlice> parts{{"w", 0, 400}, {"bias", 400, 100}};
    BucketCompressor first("topk:ratio=0.05");
    auto g = gradient(n, 10 + static_cast<unsigned>(ctx.rank()));
    first.allreduce_async(ctx, g, parts).wait();
    const auto saved = first.save_state();
    BucketCompressor second("topk:ratio=0.05");
    second.load_state(saved);
    auto g1 = gradient(n, 20 + static_cast<unsigned>(ctx.rank())), g2 = g1;
    first.allreduce_async(ctx, g1, parts).wait();
    second.allreduce_async(ctx, g2, parts).wait();
    EXPECT_EQ(g1, g2);
    BucketCompressor other("int8");
    testing::expect_error(ErrorKind::kProtocol, [&] { other.load_state(saved); });
  });
}

TEST(BucketCompressor, PartsThatDoNotTileTheBucketAreNamed) {
  testing::run_inproc_contexts(1, [&](Context& ctx) {
    BucketCompressor c("fp16");
    std::vector<float> data(10, 1.0f);
    std::vector<TensorSlice> gap{{"a", 0, 4}, {"b", 5, 5}};
    const Error e = testing::expect_error(ErrorKind::kInvalidArgument,
                                          [&] { c.allreduce_async(ctx, data, gap); });
    EXPECT_TRUE(testing::contains(e.what(), "'b' starts at float 5")) << e.what();
    std::vector<TensorSlice> short_parts{{"a", 0, 4}};
    testing::expect_error(ErrorKind::kInvalidArgument,
                          [&] { c.allreduce_async(ctx, data, short_parts); });
  });
}

}  // namespace
}  // namespace gradsync
