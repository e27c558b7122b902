// ShardedDataParallel (ZeRO stages 1, 2 and 3 with overlapped gathers and reduce-scatters)
// against a plain single-process optimizer over the whole flat parameter vector, stepped with
// the mean of every rank's gradient: the parameters acquire() hands forward at every step and
// gather_values() at the end, over world sizes 1-8, every stage, prefetch on and off, units
// whose sizes do not divide by the world size, 16-bit wire dtypes and micro-batches (stage 1
// communicating once a step); ranks
// that acquire different units fail with kMismatch instead of hanging or combining the wrong
// data; optimizers that need whole tensors are refused; memory() counts shards; values and
// optimizer state restore a trajectory bit for bit; bad unit ids are refused.
#include "gradsync/sharded.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/error.h"
#include "gradsync/optim.h"
#include "harness.h"

namespace gradsync {
namespace {

using Units = std::vector<std::size_t>;

// Sizes that no world size of the grid divides (except 1), a single element among them.
const Units kAwkward = {1, 7, 1000, 33, 4099, 2};

enum class Opt { kSgd, kAdamW };

const char* name_of(Opt opt) {
  return opt == Opt::kSgd ? "sgd" : "adamw";
}

ShardedDataParallel::OptimizerFactory factory(Opt opt) {
  if (opt == Opt::kSgd) {
    return [](std::size_t c) { return optim::make_sgd(c, {.lr = 0.05f, .momentum = 0.9f}); };
  }
  return [](std::size_t c) { return optim::make_adamw(c, {.lr = 0.01f}); };
}

// A schedule's change of rate before this step: set_lr must reach the shards' optimizers.
constexpr int kLrChangeStep = 2;
float later_lr(Opt opt) {
  return opt == Opt::kSgd ? 0.02f : 0.004f;
}

float initial_of(std::size_t unit, std::size_t i) {
  return 0.5f * std::cos(0.11f * static_cast<float>(i) + 0.9f * static_cast<float>(unit)) +
         ((i + unit) % 2 != 0 ? 0.3f : -0.3f);
}

// Each rank's own gradient, for each draw (step and micro-batch). The magnitude stays in
// [0.25, 0.95] and the rank only moves it within that, so the mean over ranks is never near
// zero: AdamW's first steps are g / |g|, which float summation order would otherwise flip.
float grad_of(int rank, int draw, std::size_t unit, std::size_t i) {
  const float sign = (i * 7 + unit + static_cast<std::size_t>(draw)) % 3 == 0 ? -1.0f : 1.0f;
  return sign *
         (0.6f +
          0.35f * std::sin(0.37f * static_cast<float>(i) + 1.3f * static_cast<float>(rank) +
                           0.7f * static_cast<float>(draw) + 0.21f * static_cast<float>(unit)));
}

int draw_of(int step, int micro_batch, int micro_batches) {
  return step * micro_batches + micro_batch;
}

std::size_t offset_of(const Units& sizes, std::size_t unit) {
  std::size_t offset = 0;
  for (std::size_t u = 0; u < unit; ++u) offset += sizes[u];
  return offset;
}

// Floats of this rank's shard of every unit: each unit is cut into n equal shards, the last
// ones padded.
std::size_t shard_floats(const Units& sizes, int n) {
  std::size_t floats = 0;
  for (std::size_t s : sizes) floats += (s + static_cast<std::size_t>(n) - 1) / n;
  return floats;
}

std::vector<float> initial_values(const Units& sizes) {
  std::vector<float> values;
  for (std::size_t u = 0; u < sizes.size(); ++u) {
    for (std::size_t i = 0; i < sizes[u]; ++i) values.push_back(initial_of(u, i));
  }
  return values;
}

struct Config {
  int n = 2;
  ShardedOptions options{};
  Opt opt = Opt::kAdamW;
  Units sizes = kAwkward;
  int steps = 3;
  int micro_batches = 1;
  // Other collectives on the context between the class's calls.
  bool interleave = false;

  std::string describe() const {
    return "n=" + std::to_string(n) + " stage=" + std::to_string(options.stage) +
           " wire=" + to_string(options.wire) +
           " prefetch_depth=" + std::to_string(options.prefetch_depth) + " " + name_of(opt) +
           " micro_batches=" + std::to_string(micro_batches);
  }
};

// The trajectory of the plain optimizer over the whole model: [s] the parameters before step
// s, [steps] after the last.
std::vector<std::vector<float>> reference_trajectory(const Config& c) {
  std::vector<float> params = initial_values(c.sizes);
  auto optimizer = factory(c.opt)(params.size());
  std::vector<std::vector<float>> trajectory = {params};
  std::vector<float> mean(params.size());
  for (int step = 0; step < c.steps; ++step) {
    if (step == kLrChangeStep) optimizer->set_lr(later_lr(c.opt));
    std::size_t k = 0;
    for (std::size_t u = 0; u < c.sizes.size(); ++u) {
      for (std::size_t i = 0; i < c.sizes[u]; ++i, ++k) {
        double sum = 0;
        for (int r = 0; r < c.n; ++r) {
          for (int mb = 0; mb < c.micro_batches; ++mb) {
            sum += grad_of(r, draw_of(step, mb, c.micro_batches), u, i);
          }
        }
        mean[k] = static_cast<float>(sum / (c.n * c.micro_batches));
      }
    }
    optimizer->step(params, mean);
    trajectory.push_back(params);
  }
  return trajectory;
}

// What one rank saw.
struct RankRun {
  // forward[step][micro_batch]: every unit's acquire() in forward, back to back.
  std::vector<std::vector<std::vector<float>>> forward;
  // Units whose backward acquire() differed (bitwise) from the forward one of that pass.
  int backward_mismatches = 0;
  // Other collectives between the class's calls that returned a wrong result.
  int interleave_errors = 0;
  std::vector<StepStats> stats;
  std::vector<float> final;
  ShardedDataParallel::Memory memory;
};

// Fails the rank at once (run_threads reports it) rather than reading past a short span.
void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

std::unique_ptr<ShardedDataParallel> make_sharded(Context& ctx, const Config& c,
                                                  float initial_shift = 0) {
  auto sharded = std::make_unique<ShardedDataParallel>(ctx, c.options);
  for (std::size_t u = 0; u < c.sizes.size(); ++u) {
    std::vector<float> initial(c.sizes[u]);
    for (std::size_t i = 0; i < initial.size(); ++i) initial[i] = initial_of(u, i) + initial_shift;
    EXPECT_EQ(sharded->add_unit("unit" + std::to_string(u), initial), static_cast<int>(u));
  }
  EXPECT_EQ(sharded->units(), c.sizes.size());
  for (std::size_t u = 0; u < c.sizes.size(); ++u) {
    EXPECT_EQ(sharded->unit_size(static_cast<int>(u)), c.sizes[u]);
  }
  sharded->set_optimizer(factory(c.opt));
  return sharded;
}

void other_collective(Context& ctx, RankRun& out) {
  const std::int32_t mine = ctx.rank() + 1;
  std::int32_t sum = 0;
  ctx.allreduce(&mine, &sum, 1, DataType::kInt32, ReduceOp::kSum);
  if (sum != ctx.size() * (ctx.size() + 1) / 2) ++out.interleave_errors;
}

bool bitwise_equal(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Steps [first, last) as the header's example trains: forward acquires and releases each unit
// in order, backward in reverse writes each unit's whole gradient, then finish() and step().
void train(ShardedDataParallel& sharded, Context& ctx, const Config& c, int first, int last,
           RankRun& out) {
  const int units = static_cast<int>(c.sizes.size());
  for (int step = first; step < last; ++step) {
    if (step == kLrChangeStep) sharded.set_lr(later_lr(c.opt));
    out.forward.emplace_back();
    for (int mb = 0; mb < c.micro_batches; ++mb) {
      std::vector<float> seen;
      for (int u = 0; u < units; ++u) {
        const auto values = sharded.acquire(u, Pass::kForward);
        require(values.size() == c.sizes[static_cast<std::size_t>(u)],
                "forward acquire of unit " + std::to_string(u) + " has " +
                    std::to_string(values.size()) + " values");
        seen.insert(seen.end(), values.begin(), values.end());
        if (c.interleave) other_collective(ctx, out);
        sharded.release(u, Pass::kForward);
      }
      for (int u = units - 1; u >= 0; --u) {
        const auto size = c.sizes[static_cast<std::size_t>(u)];
        const auto values = sharded.acquire(u, Pass::kBackward);
        require(values.size() == size, "backward acquire of unit " + std::to_string(u) + " has " +
                                           std::to_string(values.size()) + " values");
        // The parameters do not change between a pass's forward and backward.
        const std::span<const float> forward(seen.data() + offset_of(c.sizes, u), size);
        if (!bitwise_equal(values, forward)) ++out.backward_mismatches;
        const auto grad = sharded.gradient(u);
        require(grad.size() == size, "gradient of unit " + std::to_string(u) + " has " +
                                         std::to_string(grad.size()) + " elements");
        for (std::size_t i = 0; i < size; ++i) {
          grad[i] = grad_of(ctx.rank(), draw_of(step, mb, c.micro_batches),
                            static_cast<std::size_t>(u), i);
        }
        sharded.mark_ready(u);
        if (c.interleave) other_collective(ctx, out);
        sharded.release(u, Pass::kBackward);
      }
      out.stats.push_back(sharded.finish());
      out.forward.back().push_back(std::move(seen));
    }
    sharded.step();
  }
}

// A hang shows as kTimeout within a minute rather than the default five.
Options bounded() {
  return Options{.timeout = std::chrono::seconds(60)};
}

std::vector<RankRun> run(const Config& c) {
  std::vector<RankRun> runs(static_cast<std::size_t>(c.n));
  testing::run_inproc_contexts(
      c.n,
      [&](Context& ctx) {
        auto& out = runs[static_cast<std::size_t>(ctx.rank())];
        auto sharded = make_sharded(ctx, c);
        train(*sharded, ctx, c, 0, c.steps, out);
        out.final = sharded->gather_values();
        out.memory = sharded->memory();
      },
      bounded());
  return runs;
}

std::string where(const Units& sizes, std::size_t k) {
  std::size_t u = 0;
  while (u + 1 < sizes.size() && k >= sizes[u]) k -= sizes[u++];
  return "unit " + std::to_string(u) + " element " + std::to_string(k);
}

// Every element within rel * |want| + abs; reports how many are not and the first of them.
::testing::AssertionResult near(const std::vector<float>& got, const std::vector<float>& want,
                                const Units& sizes, double rel, double abs) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << got.size() << " values, want " << want.size();
  }
  std::size_t bad = 0, first = 0;
  for (std::size_t k = 0; k < got.size(); ++k) {
    const double err = std::abs(static_cast<double>(got[k]) - want[k]);
    if (!(err <= rel * std::abs(want[k]) + abs)) {
      if (bad++ == 0) first = k;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << got.size() << " values off; first at " << where(sizes, first) << ": "
         << got[first] << ", want " << want[first];
}

// The checks every training run gets: forward's parameters at each step and the final values
// follow the reference, and every rank holds the same bits.
void expect_follows_reference(const Config& c, const std::vector<RankRun>& runs, double rel,
                              double abs) {
  const auto reference = reference_trajectory(c);
  const auto what = c.describe();
  for (int r = 0; r < c.n; ++r) {
    const auto& run = runs[static_cast<std::size_t>(r)];
    const auto rank = " rank " + std::to_string(r);
    ASSERT_EQ(run.forward.size(), static_cast<std::size_t>(c.steps)) << what << rank;
    for (int s = 0; s < c.steps; ++s) {
      const auto& step = run.forward[static_cast<std::size_t>(s)];
      ASSERT_EQ(step.size(), static_cast<std::size_t>(c.micro_batches)) << what << rank;
      for (int mb = 0; mb < c.micro_batches; ++mb) {
        const auto at = what + rank + " step " + std::to_string(s) + " micro-batch " +
                        std::to_string(mb) + " forward";
        const auto& seen = step[static_cast<std::size_t>(mb)];
        EXPECT_TRUE(near(seen, reference[static_cast<std::size_t>(s)], c.sizes, rel, abs)) << at;
        EXPECT_TRUE(bitwise_equal(
            seen, runs[0].forward[static_cast<std::size_t>(s)][static_cast<std::size_t>(mb)]))
            << at << ": differs from rank 0's";
      }
    }
    EXPECT_EQ(run.backward_mismatches, 0) << what << rank << ": backward saw other values";
    EXPECT_EQ(run.interleave_errors, 0) << what << rank;
    EXPECT_TRUE(near(run.final, reference.back(), c.sizes, rel, abs))
        << what << rank << " gather_values";
    EXPECT_TRUE(bitwise_equal(run.final, runs[0].final))
        << what << rank << " gather_values differs from rank 0's";
  }
}

// float32 on the wire: the shards step as the whole model would, to summation order.
constexpr double kRel32 = 1e-5, kAbs32 = 1e-5;
// int8 gradients: one rounding per element (1/254 of its block's largest), fed back.
constexpr double kRel8 = 2e-2, kAbs8 = 2e-3;

TEST(ShardedDataParallel, FollowsThePlainOptimizerOverWorldSizesStagesAndPrefetch) {
  for (int n : {1, 2, 3, 4, 5, 8}) {
    for (int stage : {3, 2, 1}) {
      // Only stage 3 prefetches; 7 is past the units of the model: all of them at once.
      for (int depth : stage == 3 ? std::vector<int>{2, 1, 0, 7} : std::vector<int>{1}) {
        for (Opt opt : {Opt::kSgd, Opt::kAdamW}) {
          const Config c{.n = n, .options = {.stage = stage, .prefetch_depth = depth}, .opt = opt};
          expect_follows_reference(c, run(c), kRel32, kAbs32);
        }
      }
    }
  }
}

// The header lets other collectives share the context between the class's calls: they queue
// behind the prefetches and reduce-scatters alike on every rank and neither side's data mixes.
TEST(ShardedDataParallel, OtherCollectivesMayRunBetweenItsCalls) {
  for (int stage : {3, 2, 1}) {
    const Config c{.n = 3, .options = {.stage = stage}, .interleave = true};
    expect_follows_reference(c, run(c), kRel32, kAbs32);
  }
}

// bits of a float that the wire dtype represents exactly (the gathered parameters are rounded
// to it).
bool exact_in(DataType wire, float f) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &f, sizeof bits);
  if (wire == DataType::kBFloat16) return (bits & 0xFFFFu) == 0;
  const float a = std::abs(f);
  if (a == 0) return true;
  if (a > 65504.0f) return false;
  if (a >= 0x1p-14f) return (bits & 0x1FFFu) == 0;  // normal: 10 mantissa bits
  const float scaled = a * 0x1p24f;                 // subnormal: multiples of 2^-24
  return scaled == std::floor(scaled);
}

// 16-bit wire: gathered parameters rounded to it (8 or 11 significant bits), gradients
// rounded on the way; the float32 master shards keep the trajectory close to float32's, and
// every rank acquires the same rounded values.
TEST(ShardedDataParallel, SixteenBitWireStaysCloseAndIdenticalOnEveryRank) {
  for (DataType wire : {DataType::kBFloat16, DataType::kFloat16}) {
    for (int n : {2, 3}) {
      for (int stage : {3, 2, 1}) {
        const Opt opt = n == 2 ? Opt::kAdamW : Opt::kSgd;
        const Config c{.n = n, .options = {.stage = stage, .wire = wire}, .opt = opt};
        const auto runs = run(c);
        const double rel = wire == DataType::kBFloat16 ? 1e-2 : 2e-3;
        expect_follows_reference(c, runs, rel, 2e-3);
        // Stage 2 starts from the initial values, whole on every rank, so only what was
        // gathered (stage 3 always, stage 2 after a step) need be rounded.
        for (int s = stage == 3 ? 0 : 1; s < c.steps; ++s) {
          const auto& seen = runs[0].forward[static_cast<std::size_t>(s)][0];
          std::size_t inexact = 0;
          for (float v : seen) inexact += exact_in(wire, v) ? 0 : 1;
          EXPECT_EQ(inexact, 0u) << c.describe() << " step " << s
                                 << ": acquired values not rounded to the wire dtype";
        }
      }
    }
  }
}

// Two micro-batches, each with forward, backward and finish(), then one step(): the step
// uses the mean over the ranks and both micro-batches, and the second forward sees the same
// parameters as the first.
TEST(ShardedDataParallel, MicroBatchesAccumulateUntilStep) {
  for (int n : {2, 3}) {
    for (int stage : {3, 2, 1}) {
      for (Opt opt : {Opt::kSgd, Opt::kAdamW}) {
        const Config c{
            .n = n, .options = {.stage = stage}, .opt = opt, .steps = 3, .micro_batches = 2};
        const auto runs = run(c);
        expect_follows_reference(c, runs, kRel32, kAbs32);
        for (const auto& r : runs) {
          for (const auto& step : r.forward) {
            ASSERT_EQ(step.size(), 2u);
            EXPECT_TRUE(bitwise_equal(step[0], step[1])) << c.describe();
          }
          for (const auto& stats : r.stats) EXPECT_TRUE(stats.communicated) << c.describe();
        }
      }
    }
  }
}

// Stage 1 accumulating 3 micro-batches a step: the first two send nothing (their gradients
// add up on each rank), the third reduce-scatters the sum, and the steps follow the mean over
// ranks and micro-batches; stepping after 2 of the 3 is refused, naming the counts.
TEST(ShardedDataParallel, StageOneCommunicatesOnceAStep) {
  for (int n : {1, 2, 3, 5}) {
    for (DataType wire : {DataType::kFloat32, DataType::kBFloat16}) {
      const Config c{.n = n,
                     .options = {.stage = 1, .accumulate_steps = 3, .wire = wire},
                     .opt = Opt::kAdamW,
                     .steps = 3,
                     .micro_batches = 3};
      const auto runs = run(c);
      if (wire == DataType::kFloat32) {
        expect_follows_reference(c, runs, kRel32, kAbs32);
      } else {  // one bf16 rounding of the summed gradient and of each gathered parameter
        expect_follows_reference(c, runs, 2e-2, 2e-2);
      }
      for (const auto& r : runs) {
        ASSERT_EQ(r.stats.size(), 9u) << c.describe();
        for (std::size_t i = 0; i < r.stats.size(); ++i) {
          const bool last = i % 3 == 2;
          EXPECT_EQ(r.stats[i].communicated, last) << c.describe() << " micro-batch " << i;
          EXPECT_EQ(r.stats[i].buckets, last ? kAwkward.size() : 0u) << c.describe();
          // The first micro-batch's forward waits for the gathers queued by the last step.
          if (i % 3 == 1) {
            EXPECT_EQ(r.stats[i].bytes_sent, 0u) << c.describe();
          }
        }
      }
    }
  }
  testing::run_inproc_contexts(
      2,
      [&](Context& ctx) {
        const Config c{.n = 2,
                       .options = {.stage = 1, .accumulate_steps = 3},
                       .sizes = {5, 9},
                       .steps = 1,
                       .micro_batches = 2};
        auto sharded = make_sharded(ctx, c);
        RankRun out;
        const Error e = testing::expect_error(ErrorKind::kInvalidArgument,
                                              [&] { train(*sharded, ctx, c, 0, 1, out); });
        EXPECT_EQ(e.detail(),
                  "step after 2 micro-batches, with 3 a step (the gradients go out with the last)");
        EXPECT_EQ(e.op(), "step");
        EXPECT_EQ(out.stats.size(), 2u);
      },
      bounded());
  for (int stage : {2, 3}) {
    testing::run_inproc_contexts(1, [&](Context& ctx) {
      const Error e = testing::expect_error(ErrorKind::kInvalidArgument, [&] {
        ShardedDataParallel bad(ctx, {.stage = stage, .accumulate_steps = 2});
      });
      EXPECT_TRUE(testing::contains(e.detail(), "reduce-scatter every micro-batch")) << e.what();
    });
  }
}

TEST(ShardedDataParallel, RefusesANegativePrefetchDepthByName) {
  testing::run_inproc_contexts(1, [&](Context& ctx) {
    const Error e = testing::expect_error(ErrorKind::kInvalidArgument, [&] {
      ShardedDataParallel bad(ctx, {.stage = 3, .prefetch_depth = -1});
    });
    EXPECT_EQ(e.detail(), "prefetch_depth -1 (0 or more)");
    EXPECT_EQ(e.op(), "ShardedDataParallel");
  });
}

// Rank 1 runs its units in another order than its peers (forward 1, 0, 2): the first unit it
// acquires is not theirs. With sizes that differ the gathers' counts differ; with equal sizes
// only the unit's identity does, and the header promises kMismatch all the same ("never
// combines the wrong data"). Every rank must end with an error, none by timeout. Stage 2's
// acquire has nothing to gather at the first step, so its mismatch shows at the
// reduce-scatters, which run in another order too.
TEST(ShardedDataParallel, ARankAcquiringAnotherUnitFailsWithMismatch) {
  for (int stage : {3, 2, 1}) {
    for (bool equal_sizes : {false, true}) {
      const int n = 3;
      const Config c{.n = n,
                     .options = {.stage = stage},
                     .sizes = equal_sizes ? Units{64, 64, 64} : Units{10, 200, 33}};
      const std::string what =
          "stage " + std::to_string(stage) + (equal_sizes ? " equal sizes" : " unequal sizes");
      std::vector<std::optional<ErrorKind>> kinds(n);
      std::vector<std::string> messages(n);
      testing::run_inproc_contexts(
          n,
          [&](Context& ctx) {
            const auto rank = static_cast<std::size_t>(ctx.rank());
            const std::vector<int> order =
                ctx.rank() == 1 ? std::vector<int>{1, 0, 2} : std::vector<int>{0, 1, 2};
            try {
              auto sharded = make_sharded(ctx, c);
              for (int u : order) {
                sharded->acquire(u, Pass::kForward);
                sharded->release(u, Pass::kForward);
              }
              for (auto it = order.rbegin(); it != order.rend(); ++it) {
                sharded->acquire(*it, Pass::kBackward);
                for (float& g : sharded->gradient(*it)) g = 1.0f;
                sharded->mark_ready(*it);
                sharded->release(*it, Pass::kBackward);
              }
              sharded->finish();
              sharded->step();
              sharded->gather_values();
            } catch (const Error& e) {
              kinds[rank] = e.kind();
              messages[rank] = e.what();
            }
          },
          Options{.timeout = std::chrono::seconds(20)});
      int mismatches = 0;
      for (int r = 0; r < n; ++r) {
        const auto& kind = kinds[static_cast<std::size_t>(r)];
        if (!kind) {
          ADD_FAILURE() << what << ": rank " << r << " threw nothing";
          continue;
        }
        // The rank that finds the mismatch aborts the communicator: its peers may see that.
        EXPECT_TRUE(*kind == ErrorKind::kMismatch || *kind == ErrorKind::kAborted ||
                    *kind == ErrorKind::kPeerLost)
            << what << ": rank " << r << ": " << messages[static_cast<std::size_t>(r)];
        if (*kind == ErrorKind::kMismatch) ++mismatches;
      }
      EXPECT_GE(mismatches, 1) << what << ": no rank reported kMismatch; rank 0: " << messages[0];
    }
  }
}

// A shard cuts tensors anywhere: LARS and LAMB, whose steps use each tensor's norm, are
// refused, and the refusal leaves the class ready for an optimizer it can step.
TEST(ShardedDataParallel, RefusesOptimizersThatNeedWholeTensors) {
  for (int stage : {3, 2, 1}) {
    const Config c{.n = 2, .options = {.stage = stage}, .steps = 1};
    std::vector<RankRun> runs(2);
    testing::run_inproc_contexts(
        2,
        [&](Context& ctx) {
          ShardedDataParallel sharded(ctx, c.options);
          for (std::size_t u = 0; u < c.sizes.size(); ++u) {
            std::vector<float> initial(c.sizes[u]);
            for (std::size_t i = 0; i < initial.size(); ++i) initial[i] = initial_of(u, i);
            sharded.add_unit("unit" + std::to_string(u), initial);
          }
          for (const auto& make : {ShardedDataParallel::OptimizerFactory(
                                       [](std::size_t n) { return optim::make_lars({n}); }),
                                   ShardedDataParallel::OptimizerFactory(
                                       [](std::size_t n) { return optim::make_lamb({n}); })}) {
            const Error e = testing::expect_error(ErrorKind::kInvalidArgument,
                                                  [&] { sharded.set_optimizer(make); });
            EXPECT_TRUE(testing::contains(e.detail(), "needs each tensor whole")) << e.what();
            EXPECT_EQ(e.op(), "set_optimizer");
          }
          sharded.set_optimizer(factory(c.opt));
          train(sharded, ctx, c, 0, c.steps, runs[static_cast<std::size_t>(ctx.rank())]);
          runs[static_cast<std::size_t>(ctx.rank())].final = sharded.gather_values();
        },
        bounded());
    expect_follows_reference(c, runs, kRel32, kAbs32);
  }
}

// Stage 3 keeps 1/N of the parameters (each unit's shard, padded), stages 1 and 2 that master
// shard and the whole model (each unit padded to a multiple of N); all keep 1/N of the reduced
// gradient and AdamW's two moments of it, and stage 1 accumulating the whole gradient too.
TEST(ShardedDataParallel, MemoryCountsThisRanksShards) {
  const int n = 3;
  const std::size_t shard_bytes = shard_floats(kAwkward, n) * 4;
  const std::size_t whole_bytes = shard_bytes * n + shard_bytes;
  for (int stage : {3, 2, 1}) {
    const Config c{.n = n, .options = {.stage = stage}, .opt = Opt::kAdamW, .steps = 1};
    const auto runs = run(c);
    for (int r = 0; r < n; ++r) {
      const auto& m = runs[static_cast<std::size_t>(r)].memory;
      const auto what = "stage " + std::to_string(stage) + " rank " + std::to_string(r);
      EXPECT_EQ(m.parameter_bytes, stage == 3 ? shard_bytes : whole_bytes) << what;
      EXPECT_EQ(m.gradient_bytes, shard_bytes) << what;
      EXPECT_EQ(m.optimizer_state_bytes, 2 * shard_bytes) << what;
      EXPECT_GT(m.working_bytes, 0u) << what;
    }
  }
  const Config accumulating{.n = n,
                            .options = {.stage = 1, .accumulate_steps = 2},
                            .opt = Opt::kAdamW,
                            .steps = 1,
                            .micro_batches = 2};
  for (const auto& r : run(accumulating)) {
    EXPECT_EQ(r.memory.gradient_bytes, shard_bytes + shard_bytes * n) << accumulating.describe();
  }
  // Many equal units: stage 3 holds a few whole units at once (the one in use, those
  // prefetched, gradients on their way), never the whole model.
  const Units many(16, 1000);
  for (int depth : {0, 1, 2, 3}) {
    const Config c{
        .n = 4, .options = {.stage = 3, .prefetch_depth = depth}, .sizes = many, .steps = 2};
    const auto runs = run(c);
    for (int r = 0; r < c.n; ++r) {
      const auto& m = runs[static_cast<std::size_t>(r)].memory;
      EXPECT_EQ(m.parameter_bytes, 16u * 250 * 4);
      // The unit in use and `depth` prefetched, its gradient and `depth` more on their way
      // (as many reduce-scatters stay in flight); with no prefetch, one unit and two gradients.
      const std::size_t units_held = depth == 0 ? 3 : 2 + 2 * static_cast<std::size_t>(depth);
      EXPECT_EQ(m.working_bytes, units_held * 1000 * 4)
          << "prefetch_depth " << depth << " rank " << r;
    }
  }
}

// gather_values and load_values round trip; a second instance loaded with the first's values
// and optimizer state after two steps (its own initial values were other ones) continues
// exactly as the first does: the same parameters, bit for bit, at every later step.
TEST(ShardedDataParallel, ValuesAndStateRestoreTheTrajectoryBitForBit) {
  // int8 gradients: the error-feedback residuals are part of the state.
  for (const auto& [stage, gradient_wire] :
       {std::pair{3, DataType::kFloat32}, std::pair{2, DataType::kFloat32},
        std::pair{3, DataType::kInt8}}) {
    for (Opt opt : {Opt::kAdamW, Opt::kSgd}) {
      const Config c{.n = 3,
                     .options = {.stage = stage, .gradient_wire = gradient_wire},
                     .opt = opt,
                     .steps = 4};
      const double rel = gradient_wire == DataType::kInt8 ? kRel8 : kRel32;
      const double abs = gradient_wire == DataType::kInt8 ? kAbs8 : kAbs32;
      std::vector<RankRun> first(3), second(3);
      testing::run_inproc_contexts(
          c.n,
          [&](Context& ctx) {
            const auto rank = static_cast<std::size_t>(ctx.rank());
            auto a = make_sharded(ctx, c);
            RankRun before;
            train(*a, ctx, c, 0, 2, before);
            const auto values = a->gather_values();
            const auto state = a->save_state();
            a->load_values(values);
            EXPECT_TRUE(bitwise_equal(a->gather_values(), values)) << c.describe();
            auto b = make_sharded(ctx, c, /*initial_shift=*/1.0f);
            b->load_values(values);
            b->load_state(state);
            train(*a, ctx, c, 2, 4, first[rank]);
            first[rank].final = a->gather_values();
            train(*b, ctx, c, 2, 4, second[rank]);
            second[rank].final = b->gather_values();
          },
          bounded());
      const auto reference = reference_trajectory(c);
      for (std::size_t r = 0; r < 3; ++r) {
        const auto what = c.describe() + " rank " + std::to_string(r);
        ASSERT_EQ(first[r].forward.size(), 2u) << what;
        ASSERT_EQ(second[r].forward.size(), 2u) << what;
        for (std::size_t s = 0; s < 2; ++s) {
          EXPECT_TRUE(bitwise_equal(first[r].forward[s][0], second[r].forward[s][0]))
              << what << " step " << s + 2;
          EXPECT_TRUE(near(first[r].forward[s][0], reference[s + 2], c.sizes, rel, abs))
              << what << " step " << s + 2;
        }
        EXPECT_TRUE(bitwise_equal(first[r].final, second[r].final)) << what;
        EXPECT_TRUE(near(first[r].final, reference.back(), c.sizes, rel, abs)) << what;
      }
    }
  }
}

// finish() reports a backward that communicated (reduce-scatters ran on every pass); the
// times are measurements, so only their signs and the overlap's range are checked.
TEST(ShardedDataParallel, FinishReportsTheBackwardsCommunication) {
  for (int stage : {3, 2, 1}) {
    const Config c{.n = 2, .options = {.stage = stage}};
    const auto runs = run(c);
    for (const auto& r : runs) {
      ASSERT_EQ(r.stats.size(), static_cast<std::size_t>(c.steps));
      for (const auto& s : r.stats) {
        EXPECT_TRUE(s.communicated);
        EXPECT_GE(s.compute_s, 0);
        EXPECT_GE(s.communication_s, 0);
        EXPECT_GE(s.exposed_s, 0);
        EXPECT_GE(s.overlap_fraction, 0);
        EXPECT_LE(s.overlap_fraction, 1);
      }
    }
  }
}

// Unknown unit ids are the caller's mistake, refused before anything is queued: the same
// instance then trains as if they had never been made.
TEST(ShardedDataParallel, UnknownUnitsAreRefused) {
  for (int stage : {3, 2, 1}) {
    const Config c{.n = 2, .options = {.stage = stage}, .sizes = {5, 9}, .steps = 2};
    std::vector<RankRun> runs(2);
    testing::run_inproc_contexts(
        c.n,
        [&](Context& ctx) {
          auto sharded = make_sharded(ctx, c);
          for (int bad : {-1, 2, 1000}) {
            testing::expect_error(ErrorKind::kInvalidArgument,
                                  [&] { sharded->acquire(bad, Pass::kForward); });
            testing::expect_error(ErrorKind::kInvalidArgument,
                                  [&] { sharded->acquire(bad, Pass::kBackward); });
            testing::expect_error(ErrorKind::kInvalidArgument, [&] { sharded->gradient(bad); });
            const Error e = testing::expect_error(ErrorKind::kInvalidArgument,
                                                  [&] { sharded->mark_ready(bad); });
            EXPECT_EQ(e.detail(), "no unit " + std::to_string(bad) + " (2 registered)");
            EXPECT_EQ(e.op(), "mark_ready");
            EXPECT_EQ(e.rank(), ctx.rank());
          }
          auto& out = runs[static_cast<std::size_t>(ctx.rank())];
          train(*sharded, ctx, c, 0, c.steps, out);
          out.final = sharded->gather_values();
        },
        bounded());
    expect_follows_reference(c, runs, kRel32, kAbs32);
  }
}

// "Every rank registers the same units in the same order, before set_optimizer": the
// optimizer is sized for the shards of the units it saw, so a later unit is refused.
TEST(ShardedDataParallel, AddUnitAfterSetOptimizerIsRefused) {
  testing::run_inproc_contexts(
      2,
      [&](Context& ctx) {
        const Config c{.n = 2, .sizes = {5, 9}};
        auto sharded = make_sharded(ctx, c);
        const std::vector<float> late(4, 1.0f);
        const Error e = testing::expect_error(ErrorKind::kInvalidArgument,
                                              [&] { sharded->add_unit("late", late); });
        EXPECT_EQ(e.detail(), "add_unit after set_optimizer");
        EXPECT_EQ(sharded->units(), 2u);
      },
      bounded());
}

// float16 training: an Inf in one rank's gradient (a loss scale too large) makes step() skip
// on every rank, leaving the parameters as they were and halving the scale; the next step,
// finite everywhere, unscales and goes on as the plain optimizer would.
TEST(ShardedDataParallel, ALossScalerOverflowOnOneRankSkipsTheStepOnEvery) {
  for (int stage : {3, 2, 1}) {
    testing::run_inproc_contexts(
        3,
        [&](Context& ctx) {
          ShardedDataParallel sharded(ctx, {.stage = stage});
          const std::vector<float> initial = {1, 2, 3, 4, 5};
          sharded.add_unit("fc", initial);
          sharded.set_optimizer([](std::size_t n) { return optim::make_sgd(n, {.lr = 1}); });
          optim::LossScaler scaler({.init_scale = 8, .growth_interval = 100});
          const auto backward = [&](float value) {
            sharded.acquire(0, Pass::kForward);
            sharded.release(0, Pass::kForward);
            sharded.acquire(0, Pass::kBackward);
            std::span<float> g = sharded.gradient(0);
            std::fill(g.begin(), g.end(), value * scaler.scale());
            sharded.mark_ready(0);
            sharded.release(0, Pass::kBackward);
            sharded.finish();
          };
          backward(ctx.rank() == 1 ? INFINITY : 0.5f);
          EXPECT_FALSE(sharded.step(&scaler));
          EXPECT_EQ(scaler.scale(), 4.0f);
          EXPECT_EQ(scaler.skipped_steps(), 1u);
          EXPECT_EQ(sharded.gather_values(), initial);
          backward(0.5f);
          EXPECT_TRUE(sharded.step(&scaler));
          const std::vector<float> want = {0.5f, 1.5f, 2.5f, 3.5f, 4.5f};
          EXPECT_EQ(sharded.gather_values(), want);
        },
        bounded());
  }
}

// int8 reduce-scatter with error feedback, over world sizes and both stages: close to the
// float32 trajectory, identical on every rank, the residual (one float per parameter a rank)
// counted in memory(); the parameters still travel in float32.
TEST(ShardedDataParallel, Int8GradientsFollowThePlainOptimizerClosely) {
  for (int n : {1, 2, 3, 5}) {
    for (int stage : {3, 2, 1}) {
      const Config c{.n = n, .options = {.stage = stage, .gradient_wire = DataType::kInt8}};
      const auto runs = run(c);
      expect_follows_reference(c, runs, kRel8, kAbs8);
      for (const auto& r : runs) {
        EXPECT_EQ(r.memory.error_feedback_bytes,
                  shard_floats(kAwkward, n) * static_cast<std::size_t>(n) * 4)
            << c.describe();
      }
    }
  }
  testing::run_inproc_contexts(2, [](Context& ctx) {
    const Error e = testing::expect_error(ErrorKind::kInvalidArgument, [&] {
      ShardedDataParallel bad(ctx, {.gradient_wire = DataType::kFloat16});
    });
    EXPECT_TRUE(testing::contains(e.detail(), "gradient wire dtype float16")) << e.what();
  });
}

// Error feedback at work: the same gradients step after step, whose int8 rounding is biased
// the same way every time. Without feedback the bias would add up over 50 steps (up to 50 x
// 2.9e-4 here); with it, what rounding held back is sent later, so plain SGD ends within
// one rounding of the float32 result.
TEST(ShardedDataParallel, Int8ErrorFeedbackKeepsTheRoundingFromAddingUp) {
  constexpr int kSteps = 50;
  constexpr std::size_t kCount = 1000;
  const auto grad_of = [](int rank, std::size_t i) {
    return 0.01f * static_cast<float>(i % 7 + 1) + 0.0031f * static_cast<float>(rank);
  };
  testing::run_inproc_contexts(
      2,
      [&](Context& ctx) {
        ShardedDataParallel sharded(ctx, {.stage = 3, .gradient_wire = DataType::kInt8});
        sharded.add_unit("fc", std::vector<float>(kCount, 0.0f));
        sharded.set_optimizer([](std::size_t n) { return optim::make_sgd(n, {.lr = 1}); });
        for (int step = 0; step < kSteps; ++step) {
          sharded.acquire(0, Pass::kForward);
          sharded.release(0, Pass::kForward);
          sharded.acquire(0, Pass::kBackward);
          std::span<float> g = sharded.gradient(0);
          for (std::size_t i = 0; i < kCount; ++i) g[i] = grad_of(ctx.rank(), i);
          sharded.mark_ready(0);
          sharded.release(0, Pass::kBackward);
          sharded.finish();
          sharded.step();
        }
        const std::vector<float> values = sharded.gather_values();
        double worst = 0;
        for (std::size_t i = 0; i < kCount; ++i) {
          const double want = -kSteps * 0.5 * (grad_of(0, i) + grad_of(1, i));
          worst = std::max(worst, std::abs(values[i] - want));
        }
        EXPECT_LT(worst, 5e-4);
      },
      bounded());
}

}  // namespace
}  // namespace gradsync
