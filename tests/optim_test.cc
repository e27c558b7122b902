// Optimizers against their formulas, their state saved and restored, and the loss scaler's
// collective skip. ZeRO's sharded steps are sharded_test's.
#include "gradsync/optim.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "gradsync/error.h"
#include "harness.h"

namespace gradsync {
namespace {

TEST(Optimizers, SgdAndAdamWFollowTheirFormulas) {
  std::vector<float> p = {1.0f, -2.0f}, g = {0.5f, 0.25f};
  auto sgd =
      optim::make_sgd(2, {.lr = 0.1f, .momentum = 0.9f, .weight_decay = 0.01f, .nesterov = true});
  sgd->step(p, g);
  // d = g + wd p; b = d; nesterov: d + m b = 1.9 d
  EXPECT_FLOAT_EQ(p[0], 1.0f - 0.1f * 1.9f * (0.5f + 0.01f));
  sgd->step(p, g);  // b = 0.9 b + d'
  EXPECT_EQ(sgd->state_bytes(), 8u);

  std::vector<float> q = {1.0f}, h = {0.5f};
  auto adam = optim::make_adamw(1, {.lr = 0.01f, .weight_decay = 0.1f});
  adam->step(q, h);
  // First step: m^ = g, v^ = g^2, so the update is lr * g / (|g| + eps) = lr.
  EXPECT_NEAR(q[0], 1.0f - 0.01f * 0.1f - 0.01f, 1e-6);
  EXPECT_EQ(adam->state_bytes(), 8u);
  auto copy = optim::make_adamw(1, {.lr = 0.01f, .weight_decay = 0.1f});
  copy->load_state(adam->save_state());
  std::vector<float> q2 = q;
  adam->step(q, h);
  copy->step(q2, h);
  EXPECT_EQ(q, q2);
  testing::expect_error(ErrorKind::kProtocol, [&] { copy->load_state(sgd->save_state()); });
  testing::expect_error(ErrorKind::kInvalidArgument, [&] { adam->step(p, g); });
}

double l2(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += v * v;
  return std::sqrt(s);
}

// LARS and LAMB stepped in double precision, tensor by tensor, as optim.h states them; an
// excluded tensor takes no weight decay and ratio 1, as does one with a zero norm.
struct ReferenceLarsLamb {
  std::vector<double> lars_w, lars_b, lamb_w, m, v;

  explicit ReferenceLarsLamb(const std::vector<float>& w0)
      : lars_w(w0.begin(), w0.end()),
        lars_b(w0.size(), 0.0),
        lamb_w(w0.begin(), w0.end()),
        m(w0.size(), 0.0),
        v(w0.size(), 0.0) {}

  void step(int step, const std::vector<float>& g, const std::vector<std::size_t>& sizes,
            const optim::LarsOptions& lo, const optim::LambOptions& bo) {
    std::size_t first = 0;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      const std::size_t n = sizes[t];
      const bool lars_out = !lo.excluded.empty() && lo.excluded[t];
      const bool lamb_out = !bo.excluded.empty() && bo.excluded[t];
      std::vector<double> w(lars_w.begin() + first, lars_w.begin() + first + n), gt(n);
      for (std::size_t i = 0; i < n; ++i) gt[i] = g[first + i];
      const double wn = l2(w), gn = l2(gt);
      const double ratio =
          lars_out || !(wn > 0 && gn > 0) ? 1 : lo.trust * wn / (gn + lo.weight_decay * wn);
      const double lars_decay = lars_out ? 0 : lo.weight_decay;
      for (std::size_t i = 0; i < n; ++i) {
        auto& b = lars_b[first + i];
        b = lo.momentum * b + lo.lr * ratio * (gt[i] + lars_decay * w[i]);
        lars_w[first + i] -= b;
      }
      std::vector<double> u(n), lw(lamb_w.begin() + first, lamb_w.begin() + first + n);
      const double lamb_decay = lamb_out ? 0 : bo.weight_decay;
      for (std::size_t i = 0; i < n; ++i) {
        auto& mi = m[first + i];
        auto& vi = v[first + i];
        mi = bo.beta1 * mi + (1 - bo.beta1) * gt[i];
        vi = bo.beta2 * vi + (1 - bo.beta2) * gt[i] * gt[i];
        u[i] = mi / (1 - std::pow(bo.beta1, step)) /
                   (std::sqrt(vi / (1 - std::pow(bo.beta2, step))) + bo.eps) +
               lamb_decay * lw[i];
      }
      const double lwn = l2(lw), un = l2(u);
      const double r = lamb_out || !(lwn > 0 && un > 0) ? 1 : lwn / un;
      for (std::size_t i = 0; i < n; ++i) lamb_w[first + i] -= bo.lr * r * u[i];
      first += n;
    }
  }

  // Both optimizers' parameters within float precision of the reference's.
  void expect_near(const std::vector<float>& lars_p, const std::vector<float>& lamb_p,
                   int step) const {
    for (std::size_t i = 0; i < lars_w.size(); ++i) {
      EXPECT_NEAR(lars_p[i], lars_w[i], 1e-5 * (1 + std::abs(lars_w[i]))) << step << " " << i;
      EXPECT_NEAR(lamb_p[i], lamb_w[i], 1e-5 * (1 + std::abs(lamb_w[i]))) << step << " " << i;
    }
  }
};

// LARS and LAMB against their formulas: two tensors whose norms differ by 100x get steps
// scaled by their own trust ratios, and a tensor at zero steps as plain SGD or Adam (ratio 1).
// Planes: SGD's momentum (none without), AdamW's and LAMB's two moments, LARS's momentum,
// each as long as the parameters; loaded into another optimizer of the kind, the steps that
// follow are the same bit for bit; planes of another count or length are refused.
TEST(Optimizers, PlanesCarryTheStateOfEveryElement) {
  using Make = std::function<std::unique_ptr<optim::Optimizer>()>;
  const std::pair<Make, std::size_t> kinds[] = {
      {[] { return optim::make_sgd(3, {.lr = 0.1f}); }, 0},
      {[] { return optim::make_sgd(3, {.lr = 0.1f, .momentum = 0.9f}); }, 1},
      {[] { return optim::make_adamw(3, {.lr = 0.01f}); }, 2},
      {[] {
         return optim::make_lars({2, 1}, {.lr = 0.1f});
       },
       1},
      {[] {
         return optim::make_lamb({2, 1}, {.lr = 0.01f});
       },
       2},
  };
  for (const auto& [make, count] : kinds) {
    std::vector<float> p = {1.0f, -2.0f, 0.5f}, g = {0.5f, 0.25f, -0.75f};
    auto a = make(), b = make();
    a->step(p, g);
    a->step(p, g);
    const std::optional<optim::Optimizer::Planes> planes = a->planes();
    ASSERT_TRUE(planes.has_value());
    EXPECT_EQ(planes->steps, 2u);
    ASSERT_EQ(planes->planes.size(), count);
    for (const auto& plane : planes->planes) EXPECT_EQ(plane.size(), 3u);
    b->load_planes(*planes);
    std::vector<float> q = p;
    a->step(p, g);
    b->step(q, g);
    EXPECT_EQ(p, q) << count << " planes";

    optim::Optimizer::Planes wrong = *planes;
    wrong.planes.emplace_back(3, 0.0f);
    testing::expect_error(ErrorKind::kInvalidArgument, [&] { b->load_planes(wrong); });
    if (count > 0) {
      wrong = *planes;
      wrong.planes[0].pop_back();
      const Error e =
          testing::expect_error(ErrorKind::kInvalidArgument, [&] { b->load_planes(wrong); });
      EXPECT_TRUE(testing::contains(e.detail(), "a plane of 2 floats")) << e.what();
    }
  }
}

TEST(Optimizers, LarsAndLambScaleEachTensorByItsTrustRatio) {
  const std::vector<std::size_t> sizes = {3, 2, 2};
  const std::vector<float> w0 = {10.0f, -20.0f, 5.0f, 0.1f, -0.2f, 0.0f, 0.0f};
  const std::vector<float> g = {0.5f, 0.25f, -1.0f, 0.03f, 0.01f, 0.2f, -0.1f};
  const optim::LarsOptions lo{.lr = 0.5f, .momentum = 0.9f, .weight_decay = 0.01f, .trust = 0.02f};
  const optim::LambOptions bo{.lr = 0.01f, .weight_decay = 0.1f};
  ReferenceLarsLamb reference(w0);
  auto lars = optim::make_lars(sizes, lo);
  auto lamb = optim::make_lamb(sizes, bo);
  std::vector<float> lars_p = w0, lamb_p = w0;
  for (int step = 1; step <= 3; ++step) {
    lars->step(lars_p, g);
    lamb->step(lamb_p, g);
    reference.step(step, g, sizes, lo, bo);
    reference.expect_near(lars_p, lamb_p, step);
  }
  // The large tensor moved by about its own scale times the rate, the small one likewise:
  // LAMB's step is lr x ||w|| whatever the gradient's size.
  EXPECT_NEAR(std::abs(lamb_p[0] - w0[0]) / std::abs(lamb_p[3] - w0[3]), 100, 50);
  EXPECT_EQ(lars->state_bytes(), 7u * 4);
  EXPECT_EQ(lamb->state_bytes(), 14u * 4);
  EXPECT_TRUE(lamb->needs_whole_tensors());
  // State round trips; another optimizer's is refused.
  auto copy = optim::make_lamb(sizes, bo);
  copy->load_state(lamb->save_state());
  std::vector<float> a = lamb_p, c = lamb_p;
  lamb->step(a, g);
  copy->step(c, g);
  EXPECT_EQ(a, c);
  testing::expect_error(ErrorKind::kProtocol, [&] { copy->load_state(lars->save_state()); });
  testing::expect_error(ErrorKind::kInvalidArgument, [&] {
    std::vector<float> short_p(3);
    lars->step(short_p, std::span<const float>(g.data(), 3));
  });
}

// A tensor excluded (a bias) steps as plain SGD with momentum (LARS) or Adam (LAMB): no
// weight decay, ratio 1; the others keep both. Against the formulas in double precision.
TEST(Optimizers, LarsAndLambStepExcludedTensorsWithoutDecayOrTrustRatio) {
  const std::vector<std::size_t> sizes = {3, 2};
  const std::vector<bool> excluded = {false, true};
  const std::vector<float> w0 = {10.0f, -20.0f, 5.0f, 0.1f, -0.2f};
  const std::vector<float> g = {0.5f, 0.25f, -1.0f, 0.03f, 0.01f};
  const optim::LarsOptions lo{
      .lr = 0.5f, .momentum = 0.9f, .weight_decay = 0.01f, .trust = 0.02f, .excluded = excluded};
  const optim::LambOptions bo{.lr = 0.01f, .weight_decay = 0.1f, .excluded = excluded};
  ReferenceLarsLamb reference(w0);
  auto lars = optim::make_lars(sizes, lo);
  auto lamb = optim::make_lamb(sizes, bo);
  std::vector<float> lars_p = w0, lamb_p = w0;
  for (int step = 1; step <= 3; ++step) {
    lars->step(lars_p, g);
    lamb->step(lamb_p, g);
    reference.step(step, g, sizes, lo, bo);
    reference.expect_near(lars_p, lamb_p, step);
  }
  // The excluded tensor's Adam step is about lr per element, not lr x its small norm.
  EXPECT_NEAR(std::abs(lamb_p[3] - w0[3]), 3 * bo.lr, 1e-4);
  // One flag per tensor, or none.
  const Error e = testing::expect_error(ErrorKind::kInvalidArgument,
                                        [&] { optim::make_lamb(sizes, {.excluded = {true}}); });
  EXPECT_NE(std::string(e.what()).find("LAMB over 2 tensors given 1 exclusion flags"),
            std::string::npos)
      << e.what();
  testing::expect_error(ErrorKind::kInvalidArgument, [&] {
    optim::make_lars(sizes, {.excluded = {true, false, true}});
  });
}

// A schedule sets the rate before each step: the next steps use it, the state is untouched.
TEST(Optimizers, SetLrScalesTheStepsThatFollow) {
  std::vector<float> p = {1.0f}, g = {0.5f};
  auto sgd = optim::make_sgd(1, {.lr = 0.1f});
  sgd->step(p, g);
  EXPECT_FLOAT_EQ(p[0], 1.0f - 0.05f);
  sgd->set_lr(0.02f);
  sgd->step(p, g);
  EXPECT_FLOAT_EQ(p[0], 1.0f - 0.05f - 0.01f);
  auto adam = optim::make_adamw(1, {.lr = 0.01f, .weight_decay = 0});
  adam->set_lr(0.03f);
  std::vector<float> q = {1.0f};
  adam->step(q, g);  // first step: the update is lr
  EXPECT_NEAR(q[0], 1.0f - 0.03f, 1e-6);
}

// A step in pieces is the whole step, bit for bit, over several steps (so the momentum and the
// moments carry), and after(k) sees piece k stepped and the pieces after it not yet: SGD and
// AdamW step piece by piece; LAMB, whose trust ratio needs whole tensors, steps the whole
// range first. Bounds that do not cover the range are refused.
TEST(Optimizers, StepPiecesIsTheWholeStepWithEachPieceReadyInTurn) {
  const std::vector<std::size_t> bounds = {0, 3, 3, 7, 10};
  std::vector<float> p0(10), g(10);
  for (std::size_t i = 0; i < p0.size(); ++i) {
    p0[i] = 0.3f * static_cast<float>(i) - 1.0f;
    g[i] = 0.7f - 0.11f * static_cast<float>(i * i % 5);
  }
  const std::vector<std::function<std::unique_ptr<optim::Optimizer>()>> makes = {
      [] { return optim::make_sgd(10, {.lr = 0.1f, .momentum = 0.9f, .nesterov = true}); },
      [] { return optim::make_adamw(10, {.lr = 0.01f, .weight_decay = 0.1f}); },
      [] {
        return optim::make_lamb({4, 6}, {.lr = 0.01f});
      }};
  for (std::size_t which = 0; which < makes.size(); ++which) {
    SCOPED_TRACE(which);
    const bool piecewise = which < 2;
    auto whole = makes[which](), pieces = makes[which]();
    std::vector<float> expected = p0, p = p0;
    for (int step = 0; step < 3; ++step) {
      const std::vector<float> before = p;
      whole->step(expected, g);
      std::vector<std::size_t> seen;
      pieces->step_pieces(p, g, bounds, [&](std::size_t k) {
        seen.push_back(k);
        for (std::size_t i = bounds[k]; i < bounds[k + 1]; ++i) EXPECT_EQ(p[i], expected[i]) << i;
        for (std::size_t i = bounds[k + 1]; piecewise && i < p.size(); ++i) {
          EXPECT_EQ(p[i], before[i]) << i;
        }
      });
      EXPECT_EQ(seen, (std::vector<std::size_t>{0, 1, 2, 3}));
      EXPECT_EQ(p, expected);
    }
    const auto refuse = [&](std::vector<std::size_t> bad) {
      const Error e = testing::expect_error(ErrorKind::kInvalidArgument, [&] {
        pieces->step_pieces(p, g, bad, [](std::size_t) { ADD_FAILURE() << "stepped"; });
      });
      EXPECT_NE(std::string(e.what()).find("step_pieces of 10 parameters with " +
                                           std::to_string(bad.size()) +
                                           " bounds that do not rise from 0 to the count"),
                std::string::npos)
          << e.what();
    };
    refuse({0, 9});
    refuse({1, 10});
    refuse({0, 6, 4, 10});
    refuse({10});
    EXPECT_EQ(p, expected);
  }
}

// GradScaler's rule: a NaN or Inf on any one rank skips the step on every rank and halves the
// scale; growth_interval good steps in a row double it; the unscaled gradients are divided by
// the scale; the state survives a save and load, and foreign bytes are refused.
TEST(LossScaler, SkipsOnEveryRankWhenAnyOverflowsAndGrowsAfterGoodSteps) {
  testing::run_inproc_contexts(3, [](Context& ctx) {
    optim::LossScaler scaler({.init_scale = 1024, .growth_interval = 3});
    std::vector<float> grads = {2048.0f, -512.0f};
    EXPECT_TRUE(scaler.unscale(ctx, grads));
    EXPECT_EQ(grads, (std::vector<float>{2.0f, -0.5f}));
    grads = {1.0f, ctx.rank() == 2 ? NAN : 1.0f};
    EXPECT_FALSE(scaler.unscale(ctx, grads));  // rank 2's NaN, seen by all
    EXPECT_EQ(scaler.scale(), 512.0f);
    EXPECT_EQ(scaler.skipped_steps(), 1u);
    for (int good = 0; good < 3; ++good) {
      grads = {1.0f, ctx.rank() == 0 && good == 0 ? -1.0f : 1.0f};
      EXPECT_TRUE(scaler.unscale(ctx, grads));
    }
    EXPECT_EQ(scaler.scale(), 1024.0f);  // three good steps in a row after the skip
    grads = {INFINITY, 0.0f};
    EXPECT_FALSE(scaler.unscale(ctx, grads));
    optim::LossScaler restored({.init_scale = 1, .growth_interval = 3});
    restored.load_state(scaler.save_state());
    EXPECT_EQ(restored.scale(), 512.0f);
    EXPECT_EQ(restored.skipped_steps(), 2u);
    const std::vector<std::uint8_t> foreign = optim::make_sgd(1)->save_state();
    const Error e =
        testing::expect_error(ErrorKind::kProtocol, [&] { restored.load_state(foreign); });
    EXPECT_TRUE(testing::contains(e.what(), "loss scaler state")) << e.what();
  });
  const Error e = testing::expect_error(ErrorKind::kInvalidArgument,
                                        [] { optim::LossScaler bad({.backoff_factor = 1.5f}); });
  EXPECT_TRUE(testing::contains(e.detail(), "0 < backoff_factor < 1")) << e.what();
}

}  // namespace
}  // namespace gradsync
