// Codecs inside the all-reduce, over world sizes: 16-bit wires with float32 additions, the
// quantised ring, gathered and factored codecs against "decode every payload and sum",
// bucket calls and their error-feedback state, non-finite gradients and mismatched codecs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "codec_inputs.h"
#include "gradsync/compress.h"
#include "gradsync/error.h"
#include "harness.h"
#include "kernels/kernels.h"

namespace gradsync {
namespace {

using compress::make_codec;
using compress::TensorSlice;
using testing::contains;
using testing::expect_error;
using testing::gradient;
using testing::state_entry;

// fp16/bf16 all-reduce: half the wire bytes of the float32 ring (transport counters), float32
// additions at every hop, so within a few rounding units of the exact sum; identical bits on
// every rank.
class HalfWireAllreduce : public ::testing::TestWithParam<int> {};

TEST_P(HalfWireAllreduce, HalfTheBytesWithinRoundingAndIdenticalEverywhere) {
  const int n = GetParam();
  for (const char* spec : {"fp16", "bf16"}) {
    const double unit = std::string(spec) == "bf16" ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, static_cast<std::size_t>(n + 2),
                              std::size_t{1031}, std::size_t{99991}}) {
      std::vector<std::vector<float>> results(static_cast<std::size_t>(n));
      std::vector<std::uint64_t> half_bytes(static_cast<std::size_t>(n)),
          full_bytes(results.size());
      std::vector<std::vector<float>> inputs;
      for (int k = 0; k < n; ++k) inputs.push_back(gradient(count, 50 + static_cast<unsigned>(k)));
      testing::run_inproc_contexts(n, [&](Context& ctx) {
        const int r = ctx.rank();
        auto codec = make_codec(spec);
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          std::vector<float> data = inputs[static_cast<std::size_t>(r)];
          const auto before = ctx.total_traffic().bytes_sent;
          compress::compressed_allreduce(ctx, data, *codec, "w", op);
          half_bytes[static_cast<std::size_t>(r)] = ctx.total_traffic().bytes_sent - before;
          if (op == ReduceOp::kSum) results[static_cast<std::size_t>(r)] = data;
          // Against the exact sum (double): one rounding per hop of a partial sum.
          for (std::size_t i = 0; i < count; i += 1 + i / 8) {
            double exact = 0, magnitude = 0;
            for (const auto& x : inputs) {
              exact += x[i];
              magnitude += std::fabs(x[i]);
            }
            if (op == ReduceOp::kAvg) {
              exact /= n;
              magnitude /= n;
            }
            const double bound = (n + 1) * unit * magnitude + 1e-7;
            ASSERT_LE(std::fabs(data[i] - exact), bound) << spec << " n=" << n << " i=" << i;
          }
        }
        std::vector<float> plain = inputs[static_cast<std::size_t>(r)];
        const auto before = ctx.total_traffic().bytes_sent;
        ctx.allreduce(plain.data(), plain.data(), count, DataType::kFloat32, ReduceOp::kSum,
                      {.algorithm = Algorithm::kRing});
        full_bytes[static_cast<std::size_t>(r)] = ctx.total_traffic().bytes_sent - before;
      });
      for (int r = 1; r < n; ++r) {
        ASSERT_EQ(results[static_cast<std::size_t>(r)], results[0]) << spec << " rank " << r;
      }
      if (count >= 1031 && n > 1) {
        for (int r = 0; r < n; ++r) {
          const double ratio = static_cast<double>(half_bytes[static_cast<std::size_t>(r)]) /
                               static_cast<double>(full_bytes[static_cast<std::size_t>(r)]);
          EXPECT_NEAR(ratio, 0.5, 0.01) << spec << " n=" << n << " count=" << count;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, HalfWireAllreduce, ::testing::Values(1, 2, 3, 4, 5, 8),
                         [](const auto& p) { return "n" + std::to_string(p.param); });

// Where every rank shares memory, fp16/bf16 sum in float32 through the shared-memory path and
// round once: exactly the float32 all-reduce's result, rounded, on every rank. The larger
// count spans many chunks and is past the size whose output streams past the cache.
TEST(CompressedAllreduce, HalfOnSharedMemoryIsTheFloat32SumRoundedOnce) {
  struct Case {
    const char* spec;
    int count, ranks;
  };
  // A struct, not a structured binding: the lambda captures the fields, and Debian 12's
  // clang 14 refuses to capture bindings.
  for (const Case c : {Case{"fp16", 300007, 4}, Case{"bf16", 300007, 4}, Case{"fp16", 2500011, 3},
                       Case{"bf16", 2500011, 2}}) {
    const char* spec = c.spec;
    const int count = c.count;
    testing::run_shm_contexts(c.ranks, [&](Context& ctx) {
      auto codec = make_codec(spec);
      std::vector<float> data = gradient(count, 90 + static_cast<unsigned>(ctx.rank()));
      std::vector<float> want = data;
      ctx.allreduce(want.data(), want.data(), count, DataType::kFloat32, ReduceOp::kSum);
      for (float& x : want) {
        x = std::string(spec) == "fp16" ? kernels::half_to_float(kernels::float_to_half(x))
                                        : kernels::bfloat16_to_float(kernels::float_to_bfloat16(x));
      }
      compress::compressed_allreduce(ctx, data, *codec, "w");
      EXPECT_EQ(0, std::memcmp(data.data(), want.data(), count * 4)) << spec << " " << count;
    });
  }
}

// A bucket call ranks the whole bucket: a small tensor of large gradients takes all of the k
// that 1% of each tensor would have spread. Its error-feedback state is the bucket's, kept under
// the bucket's name (or by the caller, as the reducer does): step after step, what was sent
// plus every rank's residual is what the ranks put in.
TEST(CompressedAllreduce, BucketCallsRankAcrossTensorsAndConserveTheBucket) {
  const std::size_t na = 37, nb = 1000;
  for (int ranks : {1, 2, 3, 4, 5, 8}) {
    std::vector<std::vector<float>> owed(static_cast<std::size_t>(ranks)), left(owed.size());
    std::vector<float> sent(na + nb, 0.0f);
    testing::run_inproc_contexts(ranks, [&](Context& ctx) {
      const auto r = static_cast<std::size_t>(ctx.rank());
      auto codec = make_codec("topk:ratio=0.02");  // k = 21 of 1037
      owed[r].assign(na + nb, 0.0f);
      const std::vector<TensorSlice> ab{{compress::Tensor("a"), 0, na}, {"b", na, nb}};
      for (unsigned step = 0; step < 3; ++step) {  // a (37, large) then b (1000, small)
        std::vector<float> g = gradient(na + nb, 700 + step + 10 * static_cast<unsigned>(r));
        for (std::size_t i = 0; i < na; ++i) g[i] = (i % 2 ? 1.0f : -1.0f) * (1.0f + g[i]);
        for (std::size_t i = 0; i < na + nb; ++i) owed[r][i] += g[i];
        compress::compressed_allreduce(ctx, g, *codec, "bucket 0 (a, b)", ab);
        if (step == 0) {
          for (std::size_t i = na; i < na + nb; ++i) ASSERT_EQ(g[i], 0.0f) << "b got k, i " << i;
        }
        if (r == 0) {
          for (std::size_t i = 0; i < g.size(); ++i) sent[i] += g[i];
        }
      }
      const std::vector<std::uint8_t> state = codec->save_state();
      EXPECT_TRUE(state_entry(state, "a").empty());
      left[r] = state_entry(state, "bucket 0 (a, b)");
      ASSERT_EQ(left[r].size(), na + nb);
    });
    for (std::size_t i = 0; i < na + nb; ++i) {
      double total_owed = 0, total_left = 0;
      for (std::size_t r = 0; r < owed.size(); ++r) {
        total_owed += owed[r][i];
        total_left += left[r][i];
      }
      ASSERT_NEAR(sent[i] + total_left, total_owed, 1e-4) << "ranks " << ranks << " i " << i;
    }
  }
}

// With momentum correction too, a bucket call is a call on the bucket as one tensor, step
// after step, and across a save and restore of the codec between steps.
TEST(CompressedAllreduce, BucketCallsMatchOneTensorWithMomentum) {
  testing::run_inproc_contexts(3, [&](Context& ctx) {
    auto parted = make_codec("topk:ratio=0.05,momentum=0.9,warmup=3");
    auto whole = make_codec("topk:ratio=0.05,momentum=0.9,warmup=3");
    const std::vector<TensorSlice> parts{{compress::Tensor("a", 5), 0, 300},
                                         {compress::Tensor("b"), 300, 77}};
    for (unsigned step = 0; step < 4; ++step) {
      std::vector<float> x = gradient(377, 800 + step + 10 * static_cast<unsigned>(ctx.rank()));
      std::vector<float> y = x;
      compress::compressed_allreduce(ctx, x, *parted, "ab", parts, ReduceOp::kAvg);
      compress::compressed_allreduce(ctx, y, *whole, "ab", ReduceOp::kAvg);
      ASSERT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * 4)) << "step " << step;
      if (step != 1) continue;
      // Saved under the bucket's name, and a codec restored from it continues as the original.
      const std::vector<std::uint8_t> state = parted->save_state();
      EXPECT_EQ(state_entry(state, "ab").size(), 377u);
      EXPECT_TRUE(state_entry(state, "a").empty());
      parted = make_codec("topk:ratio=0.05,momentum=0.9,warmup=3");
      parted->load_state(state);
    }
  });
}

// The reducer's buckets take turns on one codec, step after step, with a call on one tensor
// alone between them: each keeps its own state under its own name, and continues exactly as
// it would on a codec of its own, through a save and restore.
TEST(CompressedAllreduce, BucketsTakingTurnsMatchACodecEach) {
  testing::run_inproc_contexts(3, [&](Context& ctx) {
    const char* spec = "topk:ratio=0.05,momentum=0.9";
    auto shared = make_codec(spec), only_ab = make_codec(spec), only_cd = make_codec(spec);
    const std::vector<TensorSlice> ab{{compress::Tensor("a"), 0, 200}, {"b", 200, 37}};
    const std::vector<TensorSlice> cd{{compress::Tensor("c"), 0, 90}, {"d", 90, 310}};
    const auto seed = [&](unsigned step, unsigned bucket) {
      return 1000 + 10 * step + 3 * bucket + 100 * static_cast<unsigned>(ctx.rank());
    };
    for (unsigned step = 0; step < 5; ++step) {
      std::vector<float> x = gradient(237, seed(step, 0)), y = x;
      compress::compressed_allreduce(ctx, x, *shared, "ab", ab, ReduceOp::kAvg);
      compress::compressed_allreduce(ctx, y, *only_ab, "ab", ab, ReduceOp::kAvg);
      ASSERT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * 4)) << "ab, step " << step;
      x = gradient(400, seed(step, 1)), y = x;
      compress::compressed_allreduce(ctx, x, *shared, "cd", cd, ReduceOp::kAvg);
      compress::compressed_allreduce(ctx, y, *only_cd, "cd", cd, ReduceOp::kAvg);
      ASSERT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * 4)) << "cd, step " << step;
      if (step == 2) {  // c alone: a state of its own, the buckets' untouched
        x = gradient(90, seed(step, 2)), y = x;
        compress::compressed_allreduce(ctx, x, *shared, "c", ReduceOp::kAvg);
        compress::compressed_allreduce(ctx, y, *only_cd, "c", ReduceOp::kAvg);
        ASSERT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * 4)) << "c alone";
      }
      if (step == 3) {
        const std::vector<std::uint8_t> state = shared->save_state();
        ASSERT_EQ(state_entry(state, "ab").size(), 237u);
        ASSERT_EQ(state_entry(state, "cd").size(), 400u);
        ASSERT_EQ(state_entry(state, "c").size(), 90u);
        EXPECT_EQ(state_entry(state, "ab"), state_entry(only_ab->save_state(), "ab"));
        EXPECT_EQ(state_entry(state, "cd"), state_entry(only_cd->save_state(), "cd"));
        shared = make_codec(spec);
        shared->load_state(state);
      }
    }
  });
}

// PowerSGD's matrices are the tensors': a bucket call reduces part by part, exactly as calls
// on the tensors one by one.
TEST(CompressedAllreduce, PowerSgdBucketCallsGoPartByPart) {
  testing::run_inproc_contexts(3, [&](Context& ctx) {
    auto parted = make_codec("powersgd:rank=2"), single = make_codec("powersgd:rank=2");
    const compress::Tensor a("a", 20), b("b");
    const std::vector<TensorSlice> parts{{a, 0, 20 * 30}, {b, 600, 45}};
    for (unsigned step = 0; step < 3; ++step) {
      std::vector<float> x = gradient(645, 900 + step + 10 * static_cast<unsigned>(ctx.rank()));
      std::vector<float> ya(x.begin(), x.begin() + 600), yb(x.begin() + 600, x.end());
      compress::compressed_allreduce(ctx, x, *parted, "bucket 0 (a, b)", parts);
      compress::compressed_allreduce(ctx, ya, *single, a);
      compress::compressed_allreduce(ctx, yb, *single, b);
      ASSERT_EQ(0, std::memcmp(x.data(), ya.data(), 600 * 4)) << "step " << step;
      ASSERT_EQ(0, std::memcmp(x.data() + 600, yb.data(), 45 * 4)) << "step " << step;
    }
  });
}

// Parts that do not tile the bucket would lose a residual or feed one back twice.
TEST(CompressedAllreduce, BucketPartsMustTileTheBucket) {
  testing::run_inproc_contexts(1, [&](Context& ctx) {
    auto codec = make_codec("topk:ratio=0.1");
    std::vector<float> g(100, 1.0f);
    const compress::Tensor a("a"), b("b");
    const std::pair<std::vector<TensorSlice>, const char*> cases[] = {
        {{{a, 0, 60}, {b, 50, 50}}, "part 'b' at [50, 100) overlaps the part before it"},
        {{{a, 0, 40}, {b, 50, 50}}, "part 'b' at [50, 100) leaves a gap after 40"},
        {{{a, 0, 60}, {b, 60, 50}}, "part 'b' at [60, 110) ends past the bucket's 100 floats"},
        {{{a, 0, 60}, {b, 60, 30}}, "its parts cover 90 of its 100 floats"},
    };
    for (const auto& c : cases) {
      Error e = testing::expect_error(ErrorKind::kInvalidArgument, [&] {
        compress::compressed_allreduce(ctx, g, *codec, "bucket 7", c.first);
      });
      EXPECT_TRUE(contains(e.what(), "bucket 'bucket 7': ")) << e.what();
      EXPECT_TRUE(contains(e.what(), c.second)) << e.what();
    }
    EXPECT_EQ(g, std::vector<float>(100, 1.0f));  // refused before anything happened
  });
}

// Dense codecs keep their momentum (no masking), so over T steps what was sent plus the
// residual is the sum of the momentum sequence u_t = m u_(t-1) + g_t; through the all-reduce
// too (int8 re-quantised at every hop, summed over ranks).
TEST(ErrorFeedback, MomentumIsConservedByDenseCodecsAndTheQuantisedRing) {
  const std::size_t n = 999;
  const float m = 0.8f;
  for (const char* spec : {"sign:momentum=0.8", "int8:block=64,momentum=0.8"}) {
    for (int ranks : {1, 3}) {
      std::vector<std::vector<double>> sent(static_cast<std::size_t>(ranks)), owed(sent.size());
      std::vector<std::vector<float>> residuals(sent.size());
      testing::run_inproc_contexts(ranks, [&](Context& ctx) {
        const auto r = static_cast<std::size_t>(ctx.rank());
        auto codec = make_codec(spec);
        std::vector<float> u(n, 0.0f);
        sent[r].assign(n, 0.0);
        owed[r].assign(n, 0.0);
        for (unsigned step = 0; step < 12; ++step) {
          auto g = gradient(n, 600 + step + 100 * static_cast<unsigned>(r));
          for (std::size_t i = 0; i < n; ++i) {
            u[i] = m * u[i] + g[i];
            owed[r][i] += u[i];
          }
          compress::compressed_allreduce(ctx, g, *codec, "w");
          for (std::size_t i = 0; i < n; ++i) sent[r][i] += g[i];
        }
        residuals[r] = state_entry(codec->save_state(), "w");
      });
      for (std::size_t i = 0; i < n; ++i) {
        double total_owed = 0, total_residual = 0;
        for (std::size_t r = 0; r < sent.size(); ++r) {
          total_owed += owed[r][i];
          total_residual += residuals[r][i];
        }
        // Every rank holds the all-reduced sum: sent once, not once per rank.
        ASSERT_NEAR(sent[0][i] + total_residual, total_owed, 1e-3)
            << spec << " ranks " << ranks << " i " << i;
      }
    }
  }
}

// The ranks' inputs of one all-reduce test.
std::vector<std::vector<float>> inputs_of(int n, std::size_t count, unsigned seed) {
  std::vector<std::vector<float>> inputs;
  for (int r = 0; r < n; ++r) inputs.push_back(gradient(count, seed + static_cast<unsigned>(r)));
  return inputs;
}

// "Decode every rank's payload and sum in rank order", from fresh codecs (the first step of
// a codec with feedback encodes like one without).
std::vector<float> decode_and_sum(const std::string& spec,
                                  const std::vector<std::vector<float>>& inputs) {
  const std::size_t count = inputs[0].size();
  std::vector<float> sum(count, 0.0f);
  for (std::size_t r = 0; r < inputs.size(); ++r) {
    auto codec = make_codec(spec);
    codec->set_stream(r);
    std::vector<std::uint8_t> payload;
    codec->encode("w", inputs[r], payload);
    if (r == 0) {
      codec->decode(payload, sum);
    } else {
      codec->decode_add(payload, sum);
    }
  }
  return sum;
}

class CompressedAllreduceWorlds : public ::testing::TestWithParam<int> {};

// Codecs that all-gather payloads: exactly "decode every payload and sum", the same bits on
// every rank, and the bytes of a ring all-gather of the payloads ((N-1) payloads per rank,
// plus the 8-byte finiteness check). Tiny tensors may go dense (cheaper than the all-gather's
// steps): the same sum to rounding.
TEST_P(CompressedAllreduceWorlds, GatheredCodecsEqualDecodeEveryPayloadAndSum) {
  const int n = GetParam();
  for (const char* spec :
       {"topk:ratio=0.01", "topk:ratio=0.02,ef=0", "threshold:rel=0.3", "sign", "sign:ef=0"}) {
    for (std::size_t count : {std::size_t{1}, static_cast<std::size_t>(n + 2), std::size_t{4099}}) {
      const bool large = count == 4099;
      const auto inputs = inputs_of(n, count, 70);
      const auto want = decode_and_sum(spec, inputs);
      std::vector<std::vector<float>> results(static_cast<std::size_t>(n));
      testing::run_inproc_contexts(n, [&](Context& ctx) {
        auto codec = make_codec(spec);
        std::vector<float> data = inputs[static_cast<std::size_t>(ctx.rank())];
        std::vector<std::uint8_t> payload;
        make_codec(spec)->encode("w", data, payload);
        const auto before = ctx.total_traffic().bytes_sent;
        EXPECT_TRUE(compress::compressed_allreduce(ctx, data, *codec, "w"));
        const auto sent = ctx.total_traffic().bytes_sent - before;
        if (large && !codec->size_varies()) {
          EXPECT_EQ(sent, static_cast<std::uint64_t>(n - 1) * (payload.size() + 8)) << spec;
        }
        results[static_cast<std::size_t>(ctx.rank())] = data;
      });
      for (int r = 0; r < n; ++r) {
        const auto& got = results[static_cast<std::size_t>(r)];
        ASSERT_EQ(got, results[0]) << spec << " count " << count << " rank " << r;
        if (large) {
          ASSERT_EQ(0, std::memcmp(got.data(), want.data(), count * 4)) << spec << " rank " << r;
        }
        for (std::size_t i = 0; i < count; ++i) {
          ASSERT_NEAR(got[i], want[i], 1e-6f * (1 + std::fabs(want[i]))) << spec << " " << i;
        }
      }
    }
  }
}

// int8 and qsgd are quantised again at every hop: the result is within one quantisation step
// per hop of the exact sum, the same bits everywhere, at a quarter of the float32 ring's
// bytes plus the scales; with feedback, residuals + result = the sum of the inputs over all
// ranks.
TEST_P(CompressedAllreduceWorlds, QuantisedRingIsAQuarterOfTheBytesAndConservesMass) {
  const int n = GetParam();
  for (const char* spec : {"int8:block=64", "int8:ef=0,block=256", "qsgd:levels=127,block=64"}) {
    for (std::size_t count :
         {std::size_t{1}, static_cast<std::size_t>(n + 2), std::size_t{40009}}) {
      const auto inputs = inputs_of(n, count, 80);
      std::vector<std::vector<float>> results(static_cast<std::size_t>(n)),
          residuals(results.size());
      std::vector<double> ratio(results.size());
      testing::run_inproc_contexts(n, [&](Context& ctx) {
        const auto r = static_cast<std::size_t>(ctx.rank());
        auto codec = make_codec(spec);
        std::vector<float> data = inputs[r];
        auto before = ctx.total_traffic().bytes_sent;
        compress::compressed_allreduce(ctx, data, *codec, "w");
        const auto sent = ctx.total_traffic().bytes_sent - before;
        results[r] = data;
        residuals[r] = state_entry(codec->save_state(), "w");
        std::vector<float> plain = inputs[r];
        before = ctx.total_traffic().bytes_sent;
        ctx.allreduce(plain.data(), plain.data(), count, DataType::kFloat32, ReduceOp::kSum,
                      {.algorithm = Algorithm::kRing});
        ratio[r] = static_cast<double>(sent) / static_cast<double>(std::max<std::uint64_t>(
                                                   1, ctx.total_traffic().bytes_sent - before));
      });
      float peak = 0;
      for (const auto& x : inputs)
        for (float v : x) peak = std::max(peak, std::fabs(v));
      const bool feedback = contains(make_codec(spec)->spec(), "ef=1");
      for (std::size_t i = 0; i < count; ++i) {
        double exact = 0, conserved = 0;
        for (int r = 0; r < n; ++r) {
          exact += inputs[static_cast<std::size_t>(r)][i];
          if (feedback) conserved += residuals[static_cast<std::size_t>(r)][i];
        }
        // Every hop's partial sum is at most n peak: a step is that / 127 (qsgd: block norm,
        // at most sqrt(block) n peak, / levels), n encodings touch each element.
        const double hop_step =
            n * peak * (std::string(spec).rfind("qsgd", 0) == 0 ? 8.0 : 1.0) / 127;
        ASSERT_LE(std::fabs(results[0][i] - exact), n * hop_step) << spec << " i " << i;
        if (feedback) {
          ASSERT_NEAR(conserved + results[0][i], exact, 1e-5 * n * peak) << spec << " i " << i;
        }
      }
      for (int r = 1; r < n; ++r) {
        ASSERT_EQ(results[static_cast<std::size_t>(r)], results[0]) << spec << " rank " << r;
      }
      if (count == 40009 && n > 1) {
        const double block = std::string(spec).find("256") != std::string::npos ? 256 : 64;
        EXPECT_NEAR(ratio[0], (1 + 4 / block) / 4, 0.01) << spec << " n=" << n;
      }
    }
  }
}

// randomk all-reduces its k values (no indices travel); powersgd all-reduces P and Q. Both:
// the same bits everywhere, the bytes of those all-reduces.
TEST_P(CompressedAllreduceWorlds, RandomKAndPowerSgdAllreduceOnlyTheirFactors) {
  const int n = GetParam();
  const std::size_t count = 9000;
  const auto inputs = inputs_of(n, count, 90);
  const auto want = decode_and_sum("randomk:ratio=0.05", inputs);
  // PowerSGD on matrices that share a column space A (rows x 2): their sum has rank 2.
  const std::size_t rows = 90, cols = count / rows;
  std::vector<std::vector<float>> matrices;
  std::mt19937 rng(91);
  std::normal_distribution<float> normal;
  std::vector<float> a(rows * 2);
  for (float& x : a) x = normal(rng);
  std::vector<double> exact(count, 0.0);
  for (int r = 0; r < n; ++r) {
    std::vector<float> b(cols * 2), m(count, 0.0f);
    for (float& x : b) x = normal(rng);
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t c = 0; c < cols; ++c)
        for (std::size_t j = 0; j < 2; ++j) m[i * cols + c] += a[i * 2 + j] * b[c * 2 + j];
    for (std::size_t i = 0; i < count; ++i) exact[i] += m[i];
    matrices.push_back(m);
  }
  std::vector<std::vector<float>> random_results(static_cast<std::size_t>(n)),
      power_results(random_results.size());
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    const auto r = static_cast<std::size_t>(ctx.rank());
    auto randomk = make_codec("randomk:ratio=0.05");
    std::vector<float> data = inputs[r];
    compress::compressed_allreduce(ctx, data, *randomk, "w");
    random_results[r] = data;
    for (std::size_t i = 0; i < count; ++i) {
      ASSERT_NEAR(data[i], want[i], 1e-6f * (1 + std::fabs(want[i]))) << i;
    }
    auto power = make_codec("powersgd:rank=2");
    data = matrices[r];
    const auto before = ctx.total_traffic().bytes_sent;
    compress::compressed_allreduce(ctx, data, *power, compress::Tensor("m", rows), ReduceOp::kAvg);
    const auto sent = ctx.total_traffic().bytes_sent - before;
    power_results[r] = data;
    for (std::size_t i = 0; i < count; ++i) {
      ASSERT_NEAR(data[i], exact[i] / n, 1e-3 * (1 + std::fabs(exact[i]))) << i;
    }
    if (n > 1) {  // a ring all-reduce of (rows + cols) x 2 floats moves ~2 (N-1)/N of them
      const double factors = 4.0 * (rows + cols) * 2 * 2 * (n - 1) / n;
      EXPECT_LT(static_cast<double>(sent), factors * 1.5 + 4096);
    }
  });
  for (int r = 1; r < n; ++r) {
    ASSERT_EQ(random_results[static_cast<std::size_t>(r)], random_results[0]);
    ASSERT_EQ(power_results[static_cast<std::size_t>(r)], power_results[0]);
  }
}

// top-k with union=1: every rank's value at every index any rank picked, summed; the
// residuals keep the rest (so over two steps residuals + results = the inputs), the same
// bits everywhere, a fraction of a dense all-reduce's bytes.
TEST_P(CompressedAllreduceWorlds, TopKUnionSendsEveryRanksValueAtEveryPickedIndex) {
  const int n = GetParam();
  for (const char* spec : {"topk:ratio=0.01,union=1", "topk:ratio=0.02,union=1,momentum=0.9"}) {
    for (std::size_t count : {std::size_t{1}, static_cast<std::size_t>(n + 2), std::size_t{4099}}) {
      const auto first = inputs_of(n, count, 110), second = inputs_of(n, count, 120);
      // The first step owes exactly the input (no residual yet, and u = g): the union of what
      // plain top-k picks on each rank.
      std::vector<bool> picked(count, false);
      for (const auto& in : first) {
        std::vector<std::uint8_t> payload;
        make_codec("topk:ratio=" + std::string(contains(spec, "0.02") ? "0.02" : "0.01"))
            ->encode("w", in, payload);
        auto u32_at = [&](std::size_t at) {
          std::uint32_t v;
          std::memcpy(&v, payload.data() + at, 4);
          return v;
        };
        for (std::uint32_t j = 0, pairs = u32_at(4); j < pairs; ++j)
          picked[u32_at(8 + 4 * j)] = true;
      }
      std::vector<std::vector<float>> results(static_cast<std::size_t>(n)), later(results.size()),
          residuals(results.size());
      std::vector<std::uint64_t> sent(results.size());
      testing::run_inproc_contexts(n, [&](Context& ctx) {
        const auto r = static_cast<std::size_t>(ctx.rank());
        auto codec = make_codec(spec);
        std::vector<float> data = first[r];
        const auto before = ctx.total_traffic().bytes_sent;
        EXPECT_TRUE(compress::compressed_allreduce(ctx, data, *codec, "w"));
        sent[r] = ctx.total_traffic().bytes_sent - before;
        results[r] = data;
        data = second[r];
        compress::compressed_allreduce(ctx, data, *codec, "w");
        later[r] = data;
        residuals[r] = state_entry(codec->save_state(), "w");
      });
      for (std::size_t i = 0; i < count; ++i) {
        double sum = 0, fed = 0, kept = 0;
        for (std::size_t r = 0; r < first.size(); ++r) {
          sum += first[r][i];
          fed += first[r][i] + second[r][i];
          kept += residuals[r][i];
        }
        ASSERT_NEAR(results[0][i], picked[i] ? sum : 0.0, 1e-6 * (1 + std::fabs(sum)))
            << spec << " count " << count << " element " << i;
        if (!contains(spec, "momentum")) {  // with momentum what is owed is not the input
          ASSERT_NEAR(results[0][i] + later[0][i] + kept, fed, 1e-6 * (1 + std::fabs(fed)))
              << spec << " element " << i;
        }
      }
      for (int r = 1; r < n; ++r) {
        ASSERT_EQ(results[static_cast<std::size_t>(r)], results[0]) << spec << " rank " << r;
        ASSERT_EQ(later[static_cast<std::size_t>(r)], later[0]) << spec << " rank " << r;
      }
      if (count == 4099 && n > 1) {  // k indices and at most N k values, not 4099 floats
        EXPECT_LT(sent[0], count * 4 / 4) << spec << " n=" << n;
      }
    }
  }
  Error e = testing::expect_error(ErrorKind::kInvalidArgument,
                                  [] { make_codec("topk:ratio=0.01,union=1,ef=0"); });
  EXPECT_TRUE(contains(e.what(), "it needs ef=1")) << e.what();
  // Tensors of different sizes with the same k: every rank names the mismatch.
  if (n == 1) return;
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    auto codec = make_codec("topk:ratio=0.01,union=1");
    std::vector<float> data = gradient(ctx.rank() == n - 1 ? 999 : 1000, 130);
    Error m = testing::expect_error(
        ErrorKind::kMismatch, [&] { compress::compressed_allreduce(ctx, data, *codec, "w"); });
    const std::string want = ctx.rank() == n - 1 ? "has 1000 elements on rank 0 and 999 here"
                                                 : "has 999 elements on rank " +
                                                       std::to_string(n - 1) + " and 1000 here";
    EXPECT_TRUE(contains(m.what(), want)) << m.what();
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, CompressedAllreduceWorlds, ::testing::Values(1, 2, 3, 4, 5, 8),
                         [](const auto& p) { return "n" + std::to_string(p.param); });

// When the payloads together outweigh the tensor (top-k of everything), the cost model sends
// the decoded tensor through a float32 all-reduce instead: fewer bytes than the all-gather,
// the same sum to rounding, the same bits everywhere.
TEST(CompressedAllreduce, DenseUnionGoesThroughTheFloat32Allreduce) {
  const int n = 4;
  const std::size_t count = 20000;
  const auto inputs = inputs_of(n, count, 95);
  const auto want = decode_and_sum("topk:ratio=1,ef=0", inputs);
  std::vector<std::vector<float>> results(n);
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    auto codec = make_codec("topk:ratio=1,ef=0");
    std::vector<float> data = inputs[static_cast<std::size_t>(ctx.rank())];
    const auto before = ctx.total_traffic().bytes_sent;
    compress::compressed_allreduce(ctx, data, *codec, "w");
    const auto sent = ctx.total_traffic().bytes_sent - before;
    EXPECT_LT(sent, (n - 1) * (8 + 8 * count) / 2) << "the all-gather would send 3 payloads";
    for (std::size_t i = 0; i < count; ++i) ASSERT_NEAR(data[i], want[i], 1e-6f);
    results[static_cast<std::size_t>(ctx.rank())] = data;
  });
  for (int r = 1; r < n; ++r) EXPECT_EQ(results[static_cast<std::size_t>(r)], results[0]);
}

// NaN or Inf on one rank: every rank throws naming the tensor, the rank and the element
// (kThrow), or every rank skips the step with its data untouched (kSkip).
TEST(CompressedAllreduce, NonFiniteGradientsAreReportedOrSkippedOnEveryRank) {
  const int n = 3;
  const std::size_t count = 1000;
  for (const char* spec : {"none", "fp16", "int8", "topk:ratio=0.1", "powersgd:rank=2"}) {
    testing::run_inproc_contexts(n, [&](Context& ctx) {
      auto codec = make_codec(spec);
      std::vector<float> data = gradient(count, 3);
      if (ctx.rank() == 2) data[17] = std::numeric_limits<float>::quiet_NaN();
      if (ctx.rank() == 1) data[999] = -std::numeric_limits<float>::infinity();
      const auto original = data;
      Error e = expect_error(ErrorKind::kInvalidArgument, [&] {
        compress::compressed_allreduce(ctx, data, *codec, compress::Tensor("fc2.weight", 10));
      });
      EXPECT_TRUE(contains(e.what(),
                           "tensor 'fc2.weight' has Inf on rank 1 (element 999), NaN "
                           "on rank 2 (element 17)"))
          << e.what();
      EXPECT_FALSE(compress::compressed_allreduce(ctx, data, *codec,
                                                  compress::Tensor("fc2.weight", 10),
                                                  ReduceOp::kAvg, compress::NonFinite::kSkip));
      EXPECT_EQ(0, std::memcmp(data.data(), original.data(), count * 4)) << spec;
      // The context is still usable: a clean step goes through.
      std::vector<float> clean(count, 1.0f);
      EXPECT_TRUE(
          compress::compressed_allreduce(ctx, clean, *codec, compress::Tensor("fc2.weight", 10)));
    });
  }
}

// kPropagate skips the check, but codecs whose encoders refuse NaN (top-k, threshold, sign)
// are still checked on every rank: a refusal on one rank alone would leave the others
// waiting for its payload.
TEST(CompressedAllreduce, PropagateStillChecksCodecsThatRefuseNaN) {
  for (const char* spec : {"topk:ratio=0.1", "threshold:rel=0.5", "sign"}) {
    testing::run_inproc_contexts(3, [&](Context& ctx) {
      auto codec = make_codec(spec);
      std::vector<float> data = gradient(1000, 3);
      if (ctx.rank() == 1) data[42] = std::numeric_limits<float>::quiet_NaN();
      Error e = expect_error(ErrorKind::kInvalidArgument, [&] {
        compress::compressed_allreduce(ctx, data, *codec, "w", ReduceOp::kSum,
                                       compress::NonFinite::kPropagate);
      });
      EXPECT_TRUE(contains(e.what(), "tensor 'w' has NaN on rank 1 (element 42)")) << e.what();
    });
  }
}

// On the shared-memory path the sums are searched instead of the inputs: the same report
// (rank, element, NaN or Inf) on every rank, and finite inputs that overflow are named too.
TEST(CompressedAllreduce, NonFiniteOnSharedMemoryIsFoundInTheSums) {
  const std::size_t count = 1 << 20;
  for (const char* spec : {"none", "fp16", "bf16"}) {
    testing::run_shm_contexts(4, [&](Context& ctx) {
      ASSERT_EQ(ctx.choose_allreduce_algorithm(count * 4), Algorithm::kSharedMemory);
      auto codec = make_codec(spec);
      std::vector<float> data = gradient(count, 5);
      if (ctx.rank() == 3) data[count - 2] = std::numeric_limits<float>::quiet_NaN();
      if (ctx.rank() == 0) data[123457] = std::numeric_limits<float>::infinity();
      Error e = expect_error(ErrorKind::kInvalidArgument,
                             [&] { compress::compressed_allreduce(ctx, data, *codec, "emb"); });
      EXPECT_TRUE(contains(e.what(),
                           "tensor 'emb' has Inf on rank 0 (element 123457), NaN on "
                           "rank 3 (element " +
                               std::to_string(count - 2) + ")"))
          << e.what();
      std::vector<float> again = gradient(count, 5);
      if (ctx.rank() == 1) again[7] = -std::numeric_limits<float>::infinity();
      EXPECT_FALSE(compress::compressed_allreduce(ctx, again, *codec, "emb", ReduceOp::kSum,
                                                  compress::NonFinite::kSkip));
      std::vector<float> big(count, 1.0f);
      big[99] = 3e38f;  // finite everywhere, but four of them pass FLT_MAX
      e = expect_error(ErrorKind::kInvalidArgument,
                       [&] { compress::compressed_allreduce(ctx, big, *codec, "emb"); });
      EXPECT_TRUE(contains(e.what(), "Inf in the sum of finite values (element 99)")) << e.what();
      if (std::string(spec) == "fp16") {  // a sum past float16's 65504 is lost as well
        std::vector<float> wide(count, 1.0f);
        wide[5] = 40000.0f;
        e = expect_error(ErrorKind::kInvalidArgument,
                         [&] { compress::compressed_allreduce(ctx, wide, *codec, "emb"); });
        EXPECT_TRUE(contains(e.what(), "in the sum of finite values (element 5)")) << e.what();
      }
      std::vector<float> clean = gradient(count, 6);
      EXPECT_TRUE(compress::compressed_allreduce(ctx, clean, *codec, "emb"));
    });
  }
}

// Ranks that pass different codecs to the same call fail with a mismatch, not garbage: the
// rank that sees it first gets kMismatch, the other kAborted carrying that reason.
TEST(CompressedAllreduce, DifferentCodecsOnDifferentRanksAreAMismatch) {
  testing::run_inproc_contexts(2, [&](Context& ctx) {
    auto codec = make_codec(ctx.rank() == 0 ? "int8:block=256" : "int8:block=128");
    std::vector<float> data = gradient(4096, 4);
    try {
      compress::compressed_allreduce(ctx, data, *codec, "w");
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_TRUE(e.kind() == ErrorKind::kMismatch || e.kind() == ErrorKind::kAborted) << e.what();
      EXPECT_TRUE(contains(e.what(), "mismatched call in compressed_allreduce")) << e.what();
      EXPECT_TRUE(contains(e.what(), "codec#")) << e.what();
    }
  });
}

}  // namespace
}  // namespace gradsync
