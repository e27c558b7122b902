// ShardedDataParallel::load_state_of_ranks: a ZeRO run saved at W ranks goes on at N (fewer,
// as an elastic job that lost ranks, or more) and follows the plain optimizer over the whole
// model, stepped with the mean gradient of W ranks before the change and of N after: every
// optimizer plane (SGD's momentum, AdamW's moments) and the step count reach the element they
// belong to whatever the two paddings, at every stage. What cannot be re-sharded is refused.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gradsync/error.h"
#include "gradsync/optim.h"
#include "gradsync/sharded.h"
#include "harness.h"

namespace gradsync {
namespace {

// Sizes that no world size here divides, so both layouts pad.
const std::vector<std::size_t> kUnits = {1, 7, 33, 1000, 2};
constexpr int kStepsBefore = 3, kStepsAfter = 3;

using Factory = ShardedDataParallel::OptimizerFactory;

Factory sgd() {
  return [](std::size_t n) { return optim::make_sgd(n, {.lr = 0.05f, .momentum = 0.9f}); };
}
Factory adamw() {
  return [](std::size_t n) { return optim::make_adamw(n, {.lr = 0.01f}); };
}

// Rank `rank`'s gradient of element k (all units back to back) at `step`; its magnitude stays
// in [0.25, 0.95], so AdamW's first steps (g / |g|) never hinge on a rounding.
float grad_of(int rank, int step, std::size_t k) {
  const float sign = (k * 5 + static_cast<std::size_t>(step)) % 3 == 0 ? -1.0f : 1.0f;
  return sign *
         (0.6f + 0.35f * std::sin(0.37f * static_cast<float>(k) + 1.3f * static_cast<float>(rank) +
                                  0.7f * static_cast<float>(step)));
}

std::vector<float> initial_values(float shift) {
  std::vector<float> values;
  for (std::size_t u = 0; u < kUnits.size(); ++u) {
    for (std::size_t i = 0; i < kUnits[u]; ++i) {
      values.push_back(0.5f * std::cos(0.11f * static_cast<float>(i) + 0.9f * u) + shift);
    }
  }
  return values;
}

std::unique_ptr<ShardedDataParallel> make(Context& ctx, ShardedOptions options,
                                          const Factory& factory, float shift = 0) {
  auto sharded = std::make_unique<ShardedDataParallel>(ctx, options);
  const std::vector<float> initial = initial_values(shift);
  std::size_t at = 0;
  for (std::size_t u = 0; u < kUnits.size(); ++u) {
    sharded->add_unit("unit" + std::to_string(u), std::span(initial).subspan(at, kUnits[u]));
    at += kUnits[u];
  }
  sharded->set_optimizer(factory);
  return sharded;
}

// Steps [first, last): forward and backward over every unit, this rank's gradients written.
void train(ShardedDataParallel& sharded, int rank, int first, int last) {
  for (int step = first; step < last; ++step) {
    for (std::size_t u = 0; u < kUnits.size(); ++u) {
      sharded.acquire(static_cast<int>(u), Pass::kForward);
      sharded.release(static_cast<int>(u), Pass::kForward);
    }
    std::size_t offset = 0;
    for (std::size_t u = 0; u < kUnits.size(); ++u) offset += kUnits[u];
    for (int u = static_cast<int>(kUnits.size()) - 1; u >= 0; --u) {
      offset -= kUnits[static_cast<std::size_t>(u)];
      sharded.acquire(u, Pass::kBackward);
      std::span<float> g = sharded.gradient(u);
      for (std::size_t i = 0; i < g.size(); ++i) g[i] = grad_of(rank, step, offset + i);
      sharded.mark_ready(u);
      sharded.release(u, Pass::kBackward);
    }
    sharded.finish();
    sharded.step();
  }
}

// The plain optimizer over the whole model, the mean over `before` ranks' gradients for the
// first steps and over `after` ranks' for the rest.
std::vector<float> reference(const Factory& factory, int before, int after) {
  std::vector<float> params = initial_values(0);
  auto optimizer = factory(params.size());
  std::vector<float> mean(params.size());
  for (int step = 0; step < kStepsBefore + kStepsAfter; ++step) {
    const int ranks = step < kStepsBefore ? before : after;
    for (std::size_t k = 0; k < params.size(); ++k) {
      double sum = 0;
      for (int r = 0; r < ranks; ++r) sum += grad_of(r, step, k);
      mean[k] = static_cast<float>(sum / ranks);
    }
    optimizer->step(params, mean);
  }
  return params;
}

Options bounded() {
  return Options{.timeout = std::chrono::seconds(60)};
}

struct Saved {
  std::vector<float> values;
  std::vector<std::vector<std::uint8_t>> states;
};

Saved train_and_save(int ranks, ShardedOptions options, const Factory& factory,
                     int steps = kStepsBefore) {
  Saved saved;
  saved.states.resize(static_cast<std::size_t>(ranks));
  testing::run_inproc_contexts(
      ranks,
      [&](Context& ctx) {
        auto sharded = make(ctx, options, factory);
        train(*sharded, ctx.rank(), 0, steps);
        const std::vector<float> values = sharded->gather_values();
        saved.states[static_cast<std::size_t>(ctx.rank())] = sharded->save_state();
        if (ctx.rank() == 0) saved.values = values;
      },
      bounded());
  return saved;
}

// Every rank's final values after resuming `saved` at `ranks` ranks.
std::vector<std::vector<float>> resume(const Saved& saved, int ranks, ShardedOptions options,
                                       const Factory& factory) {
  std::vector<std::vector<float>> finals(static_cast<std::size_t>(ranks));
  testing::run_inproc_contexts(
      ranks,
      [&](Context& ctx) {
        auto sharded = make(ctx, options, factory, /*shift=*/1.0f);  // loading must overwrite
        sharded->load_values(saved.values);
        sharded->load_state_of_ranks(saved.states);
        train(*sharded, ctx.rank(), kStepsBefore, kStepsBefore + kStepsAfter);
        finals[static_cast<std::size_t>(ctx.rank())] = sharded->gather_values();
      },
      bounded());
  return finals;
}

// The number of elements off by more than rel * |want| + abs, and where the first one is.
std::string mismatches(const std::vector<float>& got, const std::vector<float>& want, double rel,
                       double abs) {
  if (got.size() != want.size()) return std::to_string(got.size()) + " values";
  std::size_t bad = 0, first = 0;
  for (std::size_t k = 0; k < got.size(); ++k) {
    if (!(std::abs(static_cast<double>(got[k]) - want[k]) <= rel * std::abs(want[k]) + abs)) {
      if (bad++ == 0) first = k;
    }
  }
  if (bad == 0) return "";
  return std::to_string(bad) + " values off, first element " + std::to_string(first) + ": " +
         std::to_string(got[first]) + " want " + std::to_string(want[first]);
}

TEST(ShardedReshard, FollowsThePlainOptimizerAcrossAChangeOfRanks) {
  const std::pair<int, int> changes[] = {{3, 2}, {4, 2}, {5, 3}, {8, 5}, {2, 1}, {2, 3}, {3, 3}};
  for (const auto& [before, after] : changes) {
    for (int stage : {3, 2, 1}) {
      for (const auto& [name, factory] : {std::pair{"sgd", sgd()}, std::pair{"adamw", adamw()}}) {
        const std::string what = std::to_string(before) + " -> " + std::to_string(after) +
                                 " ranks, stage " + std::to_string(stage) + ", " + name;
        const ShardedOptions options{.stage = stage};
        const auto finals =
            resume(train_and_save(before, options, factory), after, options, factory);
        const std::vector<float> want = reference(factory, before, after);
        for (const auto& got : finals) EXPECT_EQ(mismatches(got, want, 1e-5, 1e-5), "") << what;
      }
    }
  }
}

// int8 gradients: close to the float32 trajectory across a change of ranks (each survivor
// keeps its own error feedback, moved to the new padding).
TEST(ShardedReshard, Int8GradientsStayCloseAcrossAChangeOfRanks) {
  const ShardedOptions options{.stage = 3, .gradient_wire = DataType::kInt8};
  for (const auto& [before, after] : {std::pair{3, 2}, std::pair{2, 4}}) {
    const auto finals = resume(train_and_save(before, options, adamw()), after, options, adamw());
    const std::vector<float> want = reference(adamw(), before, after);
    for (const auto& got : finals) EXPECT_EQ(mismatches(got, want, 2e-2, 2e-3), "") << before;
  }
}

// An optimizer whose state is no planes of floats cannot be re-sharded.
class Opaque final : public optim::Optimizer {
 public:
  void step(std::span<float>, std::span<const float>) override {}
  void set_lr(float) override {}
  std::size_t state_bytes() const override { return 0; }
  std::vector<std::uint8_t> save_state() const override { return {}; }
  void load_state(std::span<const std::uint8_t>) override {}
};

TEST(ShardedReshard, WhatCannotBeReshardedIsRefusedByName) {
  const ShardedOptions options{.stage = 3};
  const Saved saved = train_and_save(2, options, adamw());
  const std::vector<std::vector<std::uint8_t>> mixed = {
      saved.states[0], train_and_save(2, options, adamw(), kStepsBefore + 1).states[1]};
  testing::run_inproc_contexts(
      2,
      [&](Context& ctx) {
        auto opaque = make(ctx, options, [](std::size_t) { return std::make_unique<Opaque>(); });
        Error e = testing::expect_error(ErrorKind::kInvalidArgument,
                                        [&] { opaque->load_state_of_ranks(saved.states); });
        EXPECT_TRUE(testing::contains(e.detail(), "not per-element planes")) << e.what();
        EXPECT_EQ(e.op(), "load_state_of_ranks");

        // SGD's one plane is not AdamW's two: the state is of another optimizer.
        auto other = make(ctx, options, sgd());
        e = testing::expect_error(ErrorKind::kProtocol,
                                  [&] { other->load_state_of_ranks(saved.states); });
        EXPECT_TRUE(testing::contains(e.detail(), "sharded state of rank 0")) << e.what();

        // Another model's units: the old ranks' shards are not the size these units give.
        ShardedDataParallel smaller(ctx, options);
        smaller.add_unit("only", std::vector<float>(10, 0.0f));
        smaller.set_optimizer(adamw());
        e = testing::expect_error(ErrorKind::kProtocol,
                                  [&] { smaller.load_state_of_ranks(saved.states); });
        EXPECT_TRUE(testing::contains(e.detail(), "sharded state of rank 0")) << e.what();

        // States of two moments of a run: rank 1's a step later than rank 0's.
        auto fresh = make(ctx, options, adamw());
        e = testing::expect_error(ErrorKind::kProtocol, [&] { fresh->load_state_of_ranks(mixed); });
        EXPECT_TRUE(testing::contains(e.detail(), "took 4 steps where rank 0's took 3"))
            << e.what();

        e = testing::expect_error(ErrorKind::kInvalidArgument,
                                  [&] { opaque->load_state_of_ranks({}); });
        EXPECT_TRUE(testing::contains(e.detail(), "no states")) << e.what();
      },
      bounded());
}

}  // namespace
}  // namespace gradsync
