// The trainer's models: every parameter's gradient against central differences of an
// independent double-precision forward (so the check is not limited by float rounding), the
// order and timing of the ready calls a Reducer relies on, gradient accumulation, seeding,
// parameter counts, a few SGD steps, and the gradient of the DDP comparison's full-size MLP.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>

#include "train/model.h"

namespace train {
namespace {

constexpr std::size_t kPixels = 784, kClasses = 10;

struct Batch {
  std::vector<float> images;
  std::vector<std::uint8_t> labels;
};

Batch random_batch(std::size_t batch, std::uint64_t seed) {
  std::mt19937_64 rng(seed);  // the engine's sequence is fixed by the standard
  Batch b;
  b.images.resize(batch * kPixels);
  for (float& p : b.images) p = static_cast<float>(rng() >> 40) / 16777216.0f;
  for (std::size_t i = 0; i < batch; ++i) b.labels.push_back(static_cast<std::uint8_t>(rng() % 10));
  return b;
}

// ---- The reference: the same networks in double, written the obvious way. ----

using Vec = std::vector<double>;

// x: batch x in; w: out x in at p[w_at]; bias at p[b_at].
Vec ref_linear(const Vec& x, std::size_t batch, std::size_t in, std::size_t out, const Vec& p,
               std::size_t w_at, std::size_t b_at) {
  Vec y(batch * out);
  for (std::size_t n = 0; n < batch; ++n) {
    for (std::size_t o = 0; o < out; ++o) {
      double s = p[b_at + o];
      for (std::size_t i = 0; i < in; ++i) s += x[n * in + i] * p[w_at + o * in + i];
      y[n * out + o] = s;
    }
  }
  return y;
}

Vec ref_relu(Vec x) {
  for (double& v : x) v = std::max(v, 0.0);
  return x;
}

// 5x5, padding 2, NCHW; weight oc x c x 5 x 5.
Vec ref_conv(const Vec& x, std::size_t batch, std::size_t c, std::size_t oc, std::size_t side,
             const Vec& p, std::size_t w_at, std::size_t b_at) {
  const auto s = static_cast<std::ptrdiff_t>(side);
  Vec y(batch * oc * side * side);
  for (std::size_t n = 0; n < batch; ++n) {
    for (std::size_t o = 0; o < oc; ++o) {
      for (std::ptrdiff_t yy = 0; yy < s; ++yy) {
        for (std::ptrdiff_t xx = 0; xx < s; ++xx) {
          double sum = p[b_at + o];
          for (std::size_t ci = 0; ci < c; ++ci) {
            for (std::ptrdiff_t ky = 0; ky < 5; ++ky) {
              for (std::ptrdiff_t kx = 0; kx < 5; ++kx) {
                const std::ptrdiff_t sy = yy + ky - 2, sx = xx + kx - 2;
                if (sy < 0 || sy >= s || sx < 0 || sx >= s) continue;
                sum += x[((n * c + ci) * side + static_cast<std::size_t>(sy)) * side +
                         static_cast<std::size_t>(sx)] *
                       p[w_at + ((o * c + ci) * 5 + static_cast<std::size_t>(ky)) * 5 +
                         static_cast<std::size_t>(kx)];
              }
            }
          }
          y[((n * oc + o) * side + static_cast<std::size_t>(yy)) * side +
            static_cast<std::size_t>(xx)] = sum;
        }
      }
    }
  }
  return y;
}

Vec ref_pool(const Vec& x, std::size_t planes, std::size_t side) {
  const std::size_t h = side / 2;
  Vec y(planes * h * h);
  for (std::size_t p = 0; p < planes; ++p) {
    for (std::size_t i = 0; i < h; ++i) {
      for (std::size_t j = 0; j < h; ++j) {
        const double* a = &x[(p * side + 2 * i) * side + 2 * j];
        y[(p * h + i) * h + j] = std::max({a[0], a[1], a[side], a[side + 1]});
      }
    }
  }
  return y;
}

double ref_cross_entropy(const Vec& logits, const std::vector<std::uint8_t>& labels) {
  double sum = 0;
  for (std::size_t n = 0; n < labels.size(); ++n) {
    const double* z = &logits[n * kClasses];
    const double m = *std::max_element(z, z + kClasses);
    double t = 0;
    for (std::size_t c = 0; c < kClasses; ++c) t += std::exp(z[c] - m);
    sum += std::log(t) + m - z[labels[n]];
  }
  return sum / static_cast<double>(labels.size());
}

// The mean loss of the model's architecture at parameters `p` (laid out as values()).
double ref_loss(bool cnn, const std::vector<Parameter>& params, const Vec& p, const Batch& b) {
  const std::size_t batch = b.labels.size();
  std::vector<std::size_t> at;  // each parameter's offset
  std::size_t offset = 0;
  for (const auto& q : params) {
    at.push_back(offset);
    offset += q.count;
  }
  Vec x(b.images.begin(), b.images.end());
  std::size_t first_fc = 0;
  if (cnn) {
    x = ref_pool(ref_relu(ref_conv(x, batch, 1, 16, 28, p, at[0], at[1])), batch * 16, 28);
    x = ref_pool(ref_relu(ref_conv(x, batch, 16, 32, 14, p, at[2], at[3])), batch * 32, 14);
    first_fc = 4;
  }
  std::size_t in = x.size() / batch;
  for (std::size_t k = first_fc; k < params.size(); k += 2) {
    const std::size_t out = params[k].rows;
    x = ref_linear(x, batch, in, out, p, at[k], at[k + 1]);
    if (k + 2 < params.size()) x = ref_relu(std::move(x));
    in = out;
  }
  return ref_cross_entropy(x, b.labels);
}

// Each parameter's gradient from backward against central differences of the double
// reference at a few elements: random ones, and the largest so a mostly-zero gradient (dead
// ReLUs, pooled-away pixels) is still checked where it matters. Gradients below
// kGradientFloor are held to an absolute error of 1e-2 * kGradientFloor instead, where a
// relative error means nothing (float rounding alone is that large there).
constexpr double kGradientFloor = 1e-5;

void check_gradients(const std::string& kind, const std::vector<std::size_t>& hidden,
                     std::size_t batch, std::size_t samples) {
  auto model = make_model(kind, 11, hidden);
  const Batch b = random_batch(batch, 5);
  model->forward(b.images, batch);
  model->backward(b.labels, false, {});
  const auto& params = model->parameters();
  const auto grads = model->grads();
  const auto values = model->values();
  Vec p(values.begin(), values.end());
  const double base = ref_loss(kind == "cnn", params, p, b);
  // The float forward agrees with the reference.
  EXPECT_NEAR(model->loss(b.labels, nullptr), base, 1e-5 * std::max(1.0, base));

  std::mt19937_64 rng(3);
  std::size_t offset = 0;
  double worst = 0;
  for (const auto& q : params) {
    std::vector<std::size_t> picks;
    for (std::size_t s = 0; s + 1 < samples; ++s) picks.push_back(rng() % q.count);
    picks.push_back(static_cast<std::size_t>(
        std::max_element(q.grad.begin(), q.grad.end(),
                         [](float x, float y) { return std::fabs(x) < std::fabs(y); }) -
        q.grad.begin()));
    for (std::size_t i : picks) {
      const std::size_t at = offset + i;
      const double h = 1e-6, saved = p[at];
      p[at] = saved + h;
      const double up = ref_loss(kind == "cnn", params, p, b);
      p[at] = saved - h;
      const double down = ref_loss(kind == "cnn", params, p, b);
      p[at] = saved;
      const double numeric = (up - down) / (2 * h);
      const double analytic = grads[at];
      const double relative = std::fabs(analytic - numeric) /
                              std::max({std::fabs(analytic), std::fabs(numeric), kGradientFloor});
      worst = std::max(worst, relative);
      EXPECT_LT(relative, 1e-2) << q.name << "[" << i << "]: backward " << analytic
                                << ", central difference " << numeric;
    }
    offset += q.count;
  }
  std::printf("[ info     ] %s: worst relative gradient error %.2e\n", kind.c_str(), worst);
}

TEST(TrainerModel, MlpGradientsMatchCentralDifferences) {
  check_gradients("mlp", {16, 8}, 4, 32);
}

TEST(TrainerModel, CnnGradientsMatchCentralDifferences) {
  check_gradients("cnn", {}, 3, 8);
}

// ready: once per parameter, a layer's weight then its bias, last layer first, and only once
// that gradient is final (its value at the call is its value after backward). Gradients start
// as NaN so one reported before it was written would show, as would an overwrite that reads
// the old value.
void check_ready(const std::string& kind, const std::vector<std::size_t>& hidden) {
  auto model = make_model(kind, 1, hidden);
  const Batch b = random_batch(3, 9);
  const auto& params = model->parameters();
  model->forward(b.images, 3);
  std::fill(model->grads().begin(), model->grads().end(), 0.0f);
  model->backward(b.labels, false, {});
  const std::vector<float> clean(model->grads().begin(), model->grads().end());

  std::fill(model->grads().begin(), model->grads().end(), std::numeric_limits<float>::quiet_NaN());
  std::vector<std::size_t> order;
  std::vector<std::vector<float>> at_call(params.size());
  model->backward(b.labels, false, [&](std::size_t k) {
    ASSERT_LT(k, params.size());
    order.push_back(k);
    at_call[k].assign(params[k].grad.begin(), params[k].grad.end());
  });
  std::vector<std::size_t> expected;
  for (std::size_t k = params.size(); k >= 2; k -= 2) {
    expected.push_back(k - 2);
    expected.push_back(k - 1);
  }
  EXPECT_EQ(order, expected);
  for (std::size_t k = 0; k < params.size(); ++k) {
    ASSERT_EQ(at_call[k].size(), params[k].count) << params[k].name;
    EXPECT_EQ(
        0, std::memcmp(at_call[k].data(), params[k].grad.data(), params[k].count * sizeof(float)))
        << params[k].name << " changed after its ready call";
  }
  EXPECT_EQ(0, std::memcmp(clean.data(), model->grads().data(), clean.size() * sizeof(float)))
      << "backward without accumulate did not overwrite every gradient";
}

TEST(TrainerModel, ReadyOncePerParameterLastLayerFirstWhenFinal) {
  check_ready("mlp", {16, 8});
  check_ready("cnn", {});
}

TEST(TrainerModel, AccumulateAddsIntoTheGradients) {
  for (const char* kind : {"mlp", "cnn"}) {
    auto model = make_model(
        kind, 2,
        kind == std::string("mlp") ? std::vector<std::size_t>{16, 8} : std::vector<std::size_t>{});
    const Batch b = random_batch(4, 4);
    model->forward(b.images, 4);
    model->backward(b.labels, false, {});
    const std::vector<float> once(model->grads().begin(), model->grads().end());
    std::size_t calls = 0;
    model->backward(b.labels, true, [&](std::size_t) { ++calls; });
    EXPECT_EQ(calls, model->parameters().size());
    const auto twice = model->grads();
    for (std::size_t i = 0; i < once.size(); ++i) {
      ASSERT_NEAR(twice[i], 2 * once[i], 1e-5f * std::fabs(once[i]) + 1e-9f) << kind << " " << i;
    }
  }
}

// A smaller batch after a larger one reuses the grown buffers and must not see their leftovers.
TEST(TrainerModel, SmallerBatchAfterLargerGivesTheSameGradients) {
  auto fresh = make_model("cnn", 6);
  auto used = make_model("cnn", 6);
  const Batch big = random_batch(5, 1), small = random_batch(2, 2);
  used->forward(big.images, 5);
  used->backward(big.labels, false, {});
  for (auto* m : {fresh.get(), used.get()}) {
    m->forward(small.images, 2);
    m->backward(small.labels, false, {});
  }
  EXPECT_EQ(fresh->loss(small.labels, nullptr), used->loss(small.labels, nullptr));
  EXPECT_EQ(0, std::memcmp(fresh->grads().data(), used->grads().data(),
                           fresh->grads().size() * sizeof(float)));
}

TEST(TrainerModel, SeedDecidesTheInitialParameters) {
  for (const char* kind : {"mlp", "cnn"}) {
    auto a = make_model(kind, 42), b = make_model(kind, 42), c = make_model(kind, 43);
    ASSERT_EQ(a->values().size(), b->values().size());
    EXPECT_EQ(
        0, std::memcmp(a->values().data(), b->values().data(), a->values().size() * sizeof(float)));
    EXPECT_NE(
        0, std::memcmp(a->values().data(), c->values().data(), a->values().size() * sizeof(float)));
  }
}

// PyTorch's defaults: weight and bias uniform in +-1/sqrt(fan_in), filling the range.
TEST(TrainerModel, InitialisationIsUniformInOneOverSqrtFanIn) {
  auto model = make_model("cnn", 3);
  const auto& params = model->parameters();
  for (std::size_t k = 0; k < params.size(); k += 2) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(params[k].count / params[k].rows));
    for (std::size_t j = k; j < k + 2; ++j) {
      double max = 0, mean = 0;
      for (float v : params[j].value) {
        max = std::max(max, static_cast<double>(std::fabs(v)));
        mean += v;
      }
      mean /= static_cast<double>(params[j].count);
      EXPECT_LE(max, bound) << params[j].name;
      if (params[j].count >= 100) {
        EXPECT_GT(max, 0.95 * bound) << params[j].name;
        EXPECT_LT(std::fabs(mean), 0.1 * bound) << params[j].name;
      }
    }
  }
}

TEST(TrainerModel, SgdStepsLowerTheLoss) {
  auto model = make_model("mlp", 8, {16, 8});
  const Batch b = random_batch(16, 12);
  float first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    model->forward(b.images, 16);
    last = model->loss(b.labels, nullptr);
    if (step == 0) first = last;
    model->backward(b.labels, false, {});
    auto v = model->values();
    auto g = model->grads();
    for (std::size_t i = 0; i < v.size(); ++i) v[i] -= 0.1f * g[i];
  }
  std::printf("[ info     ] loss %.4f -> %.4f over 30 SGD steps\n", first, last);
  EXPECT_LT(last, 0.8f * first);
}

TEST(TrainerModel, ParameterLayoutAndCounts) {
  auto mlp = make_model("mlp", 0);
  const std::size_t expected = 784 * 2048 + 2048 + 3 * (2048 * 2048 + 2048) + 2048 * 10 + 10;
  EXPECT_EQ(mlp->values().size(), expected);
  EXPECT_EQ(mlp->grads().size(), expected);
  EXPECT_NE(mlp->describe().find("784-2048-2048-2048-2048-10"), std::string::npos);
  EXPECT_NE(mlp->describe().find("14.2 M"), std::string::npos) << mlp->describe();
  const auto& params = mlp->parameters();
  ASSERT_EQ(params.size(), 10u);
  std::size_t offset = 0;
  for (std::size_t k = 0; k < params.size(); ++k) {
    const auto& q = params[k];
    EXPECT_EQ(q.name, "fc" + std::to_string(k / 2 + 1) + (k % 2 ? ".bias" : ".weight"));
    EXPECT_EQ(q.value.data(), mlp->values().data() + offset) << q.name;
    EXPECT_EQ(q.grad.data(), mlp->grads().data() + offset) << q.name;
    EXPECT_EQ(q.value.size(), q.count);
    EXPECT_EQ(q.grad.size(), q.count);
    offset += q.count;
  }
  EXPECT_EQ(offset, expected);
  EXPECT_EQ(params[0].rows, 2048u);  // out features
  EXPECT_EQ(params[0].count, 2048u * 784);
  EXPECT_EQ(params[1].rows, 0u);
  EXPECT_EQ(params[8].rows, 10u);

  auto cnn = make_model("cnn", 0);
  EXPECT_EQ(cnn->values().size(), 16u * 25 + 16 + 32 * 16 * 25 + 32 + 1568 * 128 + 128 + 1290);
  std::vector<std::string> names;
  std::vector<std::size_t> rows;
  for (const auto& q : cnn->parameters()) {
    names.push_back(q.name);
    rows.push_back(q.rows);
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{"conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                                      "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}));
  EXPECT_EQ(rows, (std::vector<std::size_t>{16, 0, 32, 0, 128, 0, 10, 0}));
  std::printf("[ info     ] %s\n[ info     ] %s\n", mlp->describe().c_str(),
              cnn->describe().c_str());
}

TEST(TrainerModel, BadArgumentsThrow) {
  try {
    make_model("resnet50", 0);
    FAIL() << "no exception";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("resnet50"), std::string::npos) << e.what();
  }
  EXPECT_THROW(make_model("cnn", 0, {64}), std::invalid_argument);
  EXPECT_THROW(make_model("mlp", 0, {16, 0}), std::invalid_argument);
  auto model = make_model("mlp", 0, {8});
  const Batch b = random_batch(2, 0);
  EXPECT_THROW(model->loss(b.labels, nullptr), std::logic_error);
  EXPECT_THROW(model->forward(b.images, 3), std::invalid_argument);
  EXPECT_THROW(model->forward({}, 0), std::invalid_argument);
  model->forward(b.images, 2);
  const std::vector<std::uint8_t> bad = {1, 10};
  EXPECT_THROW(model->backward(bad, false, {}), std::invalid_argument);
  EXPECT_THROW(model->loss(std::span(b.labels).first(1), nullptr), std::invalid_argument);
  std::size_t correct = 99;
  const float loss = model->loss(b.labels, &correct);
  EXPECT_LE(correct, 2u);
  EXPECT_GT(loss, 0.0f);
}

// The DDP comparison's MLP at its real size (14.2 M parameters, batch 64), where the small
// networks of the central-difference tests cannot reach: every parameter gets a finite,
// non-zero gradient, and a step along it lowers the batch's loss by what the gradient
// predicts. A layer whose gradient went missing, stale or mis-scaled at this size fails.
TEST(TrainerModel, DefaultMlpGradientIsFiniteEverywhereAndPredictsTheLossDrop) {
  auto model = make_model("mlp", 0);
  const Batch b = random_batch(64, 7);
  model->forward(b.images, 64);
  const float loss_before = model->loss(b.labels, nullptr);
  model->backward(b.labels, false, {});
  double squared_norm = 0;
  for (const Parameter& p : model->parameters()) {
    double largest = 0;
    for (float g : p.grad) {
      ASSERT_TRUE(std::isfinite(g)) << p.name;
      largest = std::max(largest, static_cast<double>(std::fabs(g)));
      squared_norm += static_cast<double>(g) * g;
    }
    EXPECT_GT(largest, 0.0) << p.name;
  }
  ASSERT_GT(squared_norm, 0.0);
  // A step of length lr * |g| lowers the loss by about lr * |g|^2 to first order; lr is chosen
  // so that drop is 0.01, far above float32 rounding of a loss near 2.3 and small enough for
  // the curvature to stay a small correction.
  const double predicted_drop = 0.01;
  const auto lr = static_cast<float>(predicted_drop / squared_norm);
  const std::span<float> values = model->values(), grads = model->grads();
  for (std::size_t i = 0; i < values.size(); ++i) values[i] -= lr * grads[i];
  model->forward(b.images, 64);
  const double drop = loss_before - model->loss(b.labels, nullptr);
  std::printf("[ info     ] loss %.6f, |g|^2 %.4g, drop %.6f for a predicted %.6f\n",
              static_cast<double>(loss_before), squared_norm, drop, predicted_drop);
  EXPECT_GT(drop, 0.8 * predicted_drop);
  EXPECT_LT(drop, 1.2 * predicted_drop);
}

}  // namespace
}  // namespace train
