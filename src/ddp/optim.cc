// SGD, AdamW, LARS, LAMB and ZeRO sharding (see optim.h).
#include "gradsync/optim.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <utility>

#include "gradsync/bytes.h"
#include "gradsync/error.h"

namespace gradsync::optim {

namespace {

void check_sizes(std::size_t count, std::span<float> params, std::span<const float> grads) {
  if (params.size() != count || grads.size() != count) {
    throw Error(ErrorKind::kInvalidArgument,
                "optimizer of " + std::to_string(count) + " parameters stepped with " +
                    std::to_string(params.size()) + " parameters and " +
                    std::to_string(grads.size()) + " gradients",
                Error::kUnknownRank, Error::kNoPeer, "optimizer step");
  }
}

// Bounds of step_pieces: rising from 0 to `count`.
void check_bounds(std::size_t count, std::span<const std::size_t> bounds) {
  bool covers = bounds.size() >= 2 && bounds.front() == 0 && bounds.back() == count;
  for (std::size_t k = 1; covers && k < bounds.size(); ++k) covers = bounds[k - 1] <= bounds[k];
  if (!covers) {
    throw Error(ErrorKind::kInvalidArgument,
                "step_pieces of " + std::to_string(count) + " parameters with " +
                    std::to_string(bounds.size()) +
                    " bounds that do not rise from 0 to the count",
                Error::kUnknownRank, Error::kNoPeer, "optimizer step");
  }
}

// State format (gradsync/bytes.h), version 1: u64 step, the floats (every per-element buffer).
constexpr std::uint32_t kStateVersion = 1;

std::vector<std::uint8_t> pack(const char magic[4], std::uint64_t step,
                               const std::vector<float>& floats) {
  ByteWriter w(std::string_view(magic, 4), kStateVersion);
  w.put(step);
  w.floats(floats);
  return w.take();
}

void unpack(const char magic[4], std::span<const std::uint8_t> s, std::uint64_t& step,
            std::vector<float>& floats) {
  ByteReader r(s, std::string_view(magic, 4), kStateVersion, "optimizer state");
  const auto loaded_step = r.get<std::uint64_t>();
  std::vector<float> loaded = r.floats();
  if (loaded.size() != floats.size()) {
    r.fail("holds " + std::to_string(loaded.size()) + " floats, this optimizer keeps " +
           std::to_string(floats.size()));
  }
  r.finish();
  step = loaded_step;
  floats = std::move(loaded);
}

[[noreturn]] void refuse_planes(const std::string& why) {
  throw Error(ErrorKind::kInvalidArgument, "load_planes: " + why, Error::kUnknownRank,
              Error::kNoPeer, "load_planes");
}

// An optimizer whose state is a step count and `planes` buffers of `count` floats back to
// back, saved as `magic`.
class BufferedOptimizer : public Optimizer {
 public:
  std::size_t state_bytes() const override { return state_.size() * sizeof(float); }
  std::vector<std::uint8_t> save_state() const override { return pack(magic_, steps_, state_); }
  void load_state(std::span<const std::uint8_t> s) override { unpack(magic_, s, steps_, state_); }
  std::optional<Planes> planes() const override {
    Planes out{steps_, {}};
    for (std::size_t k = 0; k < planes_; ++k) {
      const auto first = state_.begin() + static_cast<std::ptrdiff_t>(k * count_);
      out.planes.emplace_back(first, first + static_cast<std::ptrdiff_t>(count_));
    }
    return out;
  }
  void load_planes(const Planes& in) override {
    if (in.planes.size() != planes_) {
      refuse_planes(std::to_string(in.planes.size()) + " planes for an optimizer of " +
                    std::to_string(planes_));
    }
    for (std::size_t k = 0; k < planes_; ++k) {
      if (in.planes[k].size() != count_) {
        refuse_planes("a plane of " + std::to_string(in.planes[k].size()) +
                      " floats for an optimizer of " + std::to_string(count_) + " parameters");
      }
      std::copy(in.planes[k].begin(), in.planes[k].end(),
                state_.begin() + static_cast<std::ptrdiff_t>(k * count_));
    }
    steps_ = in.steps;
  }

 protected:
  BufferedOptimizer(const char* magic, std::size_t count, std::size_t planes)
      : magic_(magic), count_(count), planes_(planes), state_(count * planes) {}
  const char* magic_;
  std::size_t count_, planes_;
  std::vector<float> state_;
  std::uint64_t steps_ = 0;
};

// An optimizer whose update of an element reads only that element, its gradient and state and
// the step count: it can step any piece of its range on its own (step_pieces).
class ElementwiseOptimizer : public BufferedOptimizer {
 public:
  void step(std::span<float> p, std::span<const float> g) override {
    check_sizes(count_, p, g);
    update(0, count_, p.data(), g.data());
    ++steps_;
  }
  void step_pieces(std::span<float> p, std::span<const float> g,
                   std::span<const std::size_t> bounds,
                   const std::function<void(std::size_t)>& after) override {
    check_sizes(count_, p, g);
    check_bounds(count_, bounds);
    for (std::size_t k = 0; k + 1 < bounds.size(); ++k) {
      update(bounds[k], bounds[k + 1], p.data(), g.data());
      after(k);
    }
    ++steps_;
  }

 protected:
  using BufferedOptimizer::BufferedOptimizer;
  // Elements [from, to) of this step, the steps before it counted in steps_.
  virtual void update(std::size_t from, std::size_t to, float* p, const float* g) = 0;
};

std::size_t total_of(const std::vector<std::size_t>& sizes) {
  std::size_t total = 0;
  for (std::size_t n : sizes) total += n;
  return total;
}

class Sgd final : public ElementwiseOptimizer {
 public:
  Sgd(std::size_t count, SgdOptions o)
      : ElementwiseOptimizer("GSSG", count, o.momentum != 0 ? 1 : 0), o_(o) {}
  void set_lr(float lr) override { o_.lr = lr; }

 private:
  void update(std::size_t from, std::size_t to, float* p, const float* g) override {
    for (std::size_t i = from; i < to; ++i) {
      float d = g[i] + o_.weight_decay * p[i];
      if (o_.momentum != 0) {
        float& b = state_[i];  // the momentum buffer
        b = steps_ == 0 ? d : o_.momentum * b + d;
        d = o_.nesterov ? d + o_.momentum * b : b;
      }
      p[i] -= o_.lr * d;
    }
  }

  SgdOptions o_;
};

class AdamW final : public ElementwiseOptimizer {
 public:
  AdamW(std::size_t count, AdamWOptions o) : ElementwiseOptimizer("GSAW", count, 2), o_(o) {}
  void set_lr(float lr) override { o_.lr = lr; }

 private:
  void update(std::size_t from, std::size_t to, float* p, const float* g) override {
    const double t = static_cast<double>(steps_ + 1);
    const auto c1 = static_cast<float>(1.0 - std::pow(static_cast<double>(o_.beta1), t));
    const auto c2 = static_cast<float>(1.0 - std::pow(static_cast<double>(o_.beta2), t));
    float* m = state_.data();  // the moments: m then v
    float* v = state_.data() + count_;
    for (std::size_t i = from; i < to; ++i) {
      p[i] -= o_.lr * o_.weight_decay * p[i];
      m[i] = o_.beta1 * m[i] + (1 - o_.beta1) * g[i];
      v[i] = o_.beta2 * v[i] + (1 - o_.beta2) * g[i] * g[i];
      p[i] -= o_.lr * (m[i] / c1) / (std::sqrt(v[i] / c2) + o_.eps);
    }
  }

  AdamWOptions o_;
};

// Each tensor's range of a flat buffer, from the tensors' sizes, and whether it is excluded
// from weight decay and the trust ratio.
struct Tensors {
  Tensors(std::vector<std::size_t> sizes, std::vector<bool> excluded, const char* optimizer)
      : sizes_(std::move(sizes)), excluded_(std::move(excluded)) {
    for (std::size_t n : sizes_) count_ += n;
    if (!excluded_.empty() && excluded_.size() != sizes_.size()) {
      throw Error(ErrorKind::kInvalidArgument,
                  std::string(optimizer) + " over " + std::to_string(sizes_.size()) +
                      " tensors given " + std::to_string(excluded_.size()) +
                      " exclusion flags: one per tensor, or none",
                  Error::kUnknownRank, Error::kNoPeer, optimizer);
    }
  }
  std::size_t count() const { return count_; }
  // f(first, size, excluded) for each tensor in order.
  template <class F>
  void each(F f) const {
    std::size_t first = 0;
    for (std::size_t t = 0; t < sizes_.size(); ++t) {
      f(first, sizes_[t], !excluded_.empty() && excluded_[t]);
      first += sizes_[t];
    }
  }

 private:
  std::vector<std::size_t> sizes_;
  std::vector<bool> excluded_;
  std::size_t count_ = 0;
};

double norm(const float* x, std::size_t n) {
  double sum = 0;
  for (std::size_t i = 0; i < n; ++i) sum += static_cast<double>(x[i]) * x[i];
  return std::sqrt(sum);
}

// ||w|| / ||u||, or 1 where either is 0 (a tensor at zero, or one with nothing to do).
double trust_ratio(double numerator, double denominator) {
  return numerator > 0 && denominator > 0 ? numerator / denominator : 1.0;
}

class Lars final : public BufferedOptimizer {
 public:
  Lars(std::vector<std::size_t> tensors, LarsOptions o)
      : BufferedOptimizer("GSLR", total_of(tensors), 1),
        tensors_(std::move(tensors), o.excluded, "LARS"),
        o_(o) {}
  bool needs_whole_tensors() const override { return true; }
  void step(std::span<float> p, std::span<const float> g) override {
    check_sizes(tensors_.count(), p, g);
    tensors_.each([&](std::size_t first, std::size_t n, bool excluded) {
      float* w = p.data() + first;
      const float* grad = g.data() + first;
      float* b = state_.data() + first;  // momentum, holding lr: b = momentum b + lr ratio g
      const float decay = excluded ? 0.0f : o_.weight_decay;
      const double w_norm = norm(w, n);
      const double ratio =
          excluded ? 1.0 : trust_ratio(o_.trust * w_norm, norm(grad, n) + decay * w_norm);
      const auto scaled_lr = static_cast<float>(o_.lr * ratio);
      for (std::size_t i = 0; i < n; ++i) {
        b[i] = o_.momentum * b[i] + scaled_lr * (grad[i] + decay * w[i]);
        w[i] -= b[i];
      }
    });
    ++steps_;
  }
  void set_lr(float lr) override { o_.lr = lr; }

 private:
  Tensors tensors_;
  LarsOptions o_;
};

class Lamb final : public BufferedOptimizer {
 public:
  Lamb(std::vector<std::size_t> tensors, LambOptions o)
      : BufferedOptimizer("GSLB", total_of(tensors), 2),
        tensors_(std::move(tensors), o.excluded, "LAMB"),
        o_(o) {}
  bool needs_whole_tensors() const override { return true; }
  void step(std::span<float> p, std::span<const float> g) override {
    const std::size_t count = tensors_.count();
    check_sizes(count, p, g);
    ++steps_;
    const double t = static_cast<double>(steps_);
    const auto c1 = static_cast<float>(1.0 - std::pow(static_cast<double>(o_.beta1), t));
    const auto c2 = static_cast<float>(1.0 - std::pow(static_cast<double>(o_.beta2), t));
    update_.resize(count);
    tensors_.each([&](std::size_t first, std::size_t n, bool excluded) {
      float* w = p.data() + first;
      const float* grad = g.data() + first;
      float* m = state_.data() + first;  // the moments: m then v
      float* v = state_.data() + count + first;
      float* u = update_.data() + first;
      const float decay = excluded ? 0.0f : o_.weight_decay;
      for (std::size_t i = 0; i < n; ++i) {
        m[i] = o_.beta1 * m[i] + (1 - o_.beta1) * grad[i];
        v[i] = o_.beta2 * v[i] + (1 - o_.beta2) * grad[i] * grad[i];
        u[i] = (m[i] / c1) / (std::sqrt(v[i] / c2) + o_.eps) + decay * w[i];
      }
      const double ratio = excluded ? 1.0 : trust_ratio(norm(w, n), norm(u, n));
      const auto scaled_lr = static_cast<float>(o_.lr * ratio);
      for (std::size_t i = 0; i < n; ++i) w[i] -= scaled_lr * u[i];
    });
  }
  void set_lr(float lr) override { o_.lr = lr; }

 private:
  Tensors tensors_;
  LambOptions o_;
  std::vector<float> update_;  // scratch: this step's u
};

}  // namespace

void Optimizer::step_pieces(std::span<float> params, std::span<const float> grads,
                            std::span<const std::size_t> bounds,
                            const std::function<void(std::size_t)>& after) {
  check_bounds(params.size(), bounds);
  step(params, grads);
  for (std::size_t k = 0; k + 1 < bounds.size(); ++k) after(k);
}

void Optimizer::load_planes(const Planes&) {
  refuse_planes("this optimizer's state is not per-element planes");
}

std::unique_ptr<Optimizer> make_lars(std::vector<std::size_t> tensors, LarsOptions options) {
  return std::make_unique<Lars>(std::move(tensors), options);
}

std::unique_ptr<Optimizer> make_lamb(std::vector<std::size_t> tensors, LambOptions options) {
  return std::make_unique<Lamb>(std::move(tensors), options);
}

std::unique_ptr<Optimizer> make_sgd(std::size_t count, SgdOptions options) {
  return std::make_unique<Sgd>(count, options);
}

std::unique_ptr<Optimizer> make_adamw(std::size_t count, AdamWOptions options) {
  return std::make_unique<AdamW>(count, options);
}

LossScaler::LossScaler(LossScalerOptions options) : options_(options), scale_(options.init_scale) {
  if (!(options.init_scale > 0) || !(options.growth_factor >= 1) ||
      !(options.backoff_factor > 0 && options.backoff_factor < 1) || options.growth_interval < 1) {
    throw Error(ErrorKind::kInvalidArgument,
                "loss scaler: init_scale > 0, growth_factor >= 1, 0 < backoff_factor < 1 and "
                "growth_interval >= 1",
                Error::kUnknownRank, Error::kNoPeer, "LossScaler");
  }
}

bool LossScaler::unscale(Context& ctx, std::span<float> grads) {
  const float inverse = 1.0f / scale_;
  std::int32_t finite = 1;
  for (float& g : grads) {
    g *= inverse;
    if (!std::isfinite(g)) finite = 0;
  }
  ctx.allreduce(&finite, &finite, 1, DataType::kInt32, ReduceOp::kMin);
  if (!finite) {
    scale_ *= options_.backoff_factor;
    good_steps_ = 0;
    ++skipped_;
    return false;
  }
  if (++good_steps_ == options_.growth_interval) {
    scale_ *= options_.growth_factor;
    good_steps_ = 0;
  }
  return true;
}

// "GSLS" v1: f32 scale, i64 good steps in a row, u64 skipped steps.
std::vector<std::uint8_t> LossScaler::save_state() const {
  ByteWriter w("GSLS", kStateVersion);
  w.put(scale_);
  w.put(good_steps_);
  w.put(skipped_);
  return w.take();
}

void LossScaler::load_state(std::span<const std::uint8_t> state) {
  ByteReader r(state, "GSLS", kStateVersion, "loss scaler state");
  const auto scale = r.get<float>();
  const auto good = r.get<std::int64_t>();
  const auto skipped = r.get<std::uint64_t>();
  r.finish();
  if (!(scale > 0) || !std::isfinite(scale) || good < 0 || good >= options_.growth_interval) {
    r.fail("holds scale " + std::to_string(scale) + " after " + std::to_string(good) +
           " good steps");
  }
  scale_ = scale;
  good_steps_ = good;
  skipped_ = skipped;
}

}  // namespace gradsync::optim
