// SGD, AdamW, LARS, LAMB and ZeRO sharding (see optim.h).
#include "gradsync/optim.h"

#include <cmath>
#include <cstring>
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

// An optimizer whose state is one float buffer and a step count, saved as `magic`.
class BufferedOptimizer : public Optimizer {
 public:
  std::size_t state_bytes() const override { return state_.size() * sizeof(float); }
  std::vector<std::uint8_t> save_state() const override { return pack(magic_, steps_, state_); }
  void load_state(std::span<const std::uint8_t> s) override { unpack(magic_, s, steps_, state_); }

 protected:
  BufferedOptimizer(const char* magic, std::size_t floats) : magic_(magic), state_(floats) {}
  const char* magic_;
  std::vector<float> state_;
  std::uint64_t steps_ = 0;
};

class Sgd final : public BufferedOptimizer {
 public:
  Sgd(std::size_t count, SgdOptions o)
      : BufferedOptimizer("GSSG", o.momentum != 0 ? count : 0), count_(count), o_(o) {}
  void step(std::span<float> p, std::span<const float> g) override {
    check_sizes(count_, p, g);
    for (std::size_t i = 0; i < count_; ++i) {
      float d = g[i] + o_.weight_decay * p[i];
      if (o_.momentum != 0) {
        float& b = state_[i];  // the momentum buffer
        b = steps_ == 0 ? d : o_.momentum * b + d;
        d = o_.nesterov ? d + o_.momentum * b : b;
      }
      p[i] -= o_.lr * d;
    }
    ++steps_;
  }
  void set_lr(float lr) override { o_.lr = lr; }

 private:
  std::size_t count_;
  SgdOptions o_;
};

class AdamW final : public BufferedOptimizer {
 public:
  AdamW(std::size_t count, AdamWOptions o)
      : BufferedOptimizer("GSAW", 2 * count), count_(count), o_(o) {}
  void step(std::span<float> p, std::span<const float> g) override {
    check_sizes(count_, p, g);
    ++steps_;
    const double t = static_cast<double>(steps_);
    const auto c1 = static_cast<float>(1.0 - std::pow(static_cast<double>(o_.beta1), t));
    const auto c2 = static_cast<float>(1.0 - std::pow(static_cast<double>(o_.beta2), t));
    float* m = state_.data();  // the moments: m then v
    float* v = state_.data() + count_;
    for (std::size_t i = 0; i < count_; ++i) {
      p[i] -= o_.lr * o_.weight_decay * p[i];
      m[i] = o_.beta1 * m[i] + (1 - o_.beta1) * g[i];
      v[i] = o_.beta2 * v[i] + (1 - o_.beta2) * g[i] * g[i];
      p[i] -= o_.lr * (m[i] / c1) / (std::sqrt(v[i] / c2) + o_.eps);
    }
  }
  void set_lr(float lr) override { o_.lr = lr; }

 private:
  std::size_t count_;
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
      : BufferedOptimizer("GSLR", 0), tensors_(std::move(tensors), o.excluded, "LARS"), o_(o) {
    state_.resize(tensors_.count());
  }
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
      : BufferedOptimizer("GSLB", 0), tensors_(std::move(tensors), o.excluded, "LAMB"), o_(o) {
    state_.resize(2 * tensors_.count());
  }
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

ZeroOptimizer::ZeroOptimizer(Context& ctx, std::size_t count, int stage, const Factory& make)
    : ctx_(ctx), count_(count), stage_(stage) {
  if (stage < 0 || stage > 2) {
    throw Error(ErrorKind::kInvalidArgument, "ZeRO stage " + std::to_string(stage) + ": 0, 1 or 2",
                ctx.rank(), Error::kNoPeer, "ZeroOptimizer");
  }
  const auto n = static_cast<std::size_t>(ctx.size());
  if (stage == 0) {
    shard_ = count;
    main_ = make(count);
    return;
  }
  shard_ = count / n;
  first_ = static_cast<std::size_t>(ctx.rank()) * shard_;
  tail_ = count - n * shard_;
  main_ = make(shard_);
  tail_opt_ = make(tail_);
  if (main_->needs_whole_tensors()) {
    throw Error(ErrorKind::kInvalidArgument,
                "ZeRO stage " + std::to_string(stage) +
                    " with an optimizer that scales each tensor by its norms (LARS, LAMB): "
                    "shards cut tensors, so only stage 0 can step it",
                ctx.rank(), Error::kNoPeer, "ZeroOptimizer");
  }
  if (stage == 2) reduced_.resize(shard_);
}

void ZeroOptimizer::step(std::span<float> params, std::span<float> grads) {
  if (params.size() != count_ || grads.size() != count_) {
    throw Error(ErrorKind::kInvalidArgument,
                "ZeRO optimizer of " + std::to_string(count_) + " parameters stepped with " +
                    std::to_string(params.size()) + " parameters and " +
                    std::to_string(grads.size()) + " gradients",
                ctx_.rank(), Error::kNoPeer, "ZeroOptimizer step");
  }
  if (stage_ < 2) {  // the whole reduced gradient, of which stage 1 uses its shard
    ctx_.allreduce(grads.data(), grads.data(), count_, DataType::kFloat32, ReduceOp::kAvg);
    step_reduced(params, grads);
    return;
  }
  // Only this rank's shard of the reduced gradient, and the tail.
  const std::size_t body = static_cast<std::size_t>(ctx_.size()) * shard_;
  if (shard_) {
    ctx_.reduce_scatter(grads.data(), reduced_.data(), shard_, DataType::kFloat32, ReduceOp::kAvg);
  }
  if (tail_) {
    ctx_.allreduce(grads.data() + body, grads.data() + body, tail_, DataType::kFloat32,
                   ReduceOp::kAvg);
  }
  update_shard_and_gather(params, reduced_, grads.subspan(body, tail_));
}

void ZeroOptimizer::step_reduced(std::span<float> params, std::span<const float> reduced_grads) {
  if (params.size() != count_ || reduced_grads.size() != count_ || stage_ == 2) {
    throw Error(ErrorKind::kInvalidArgument,
                stage_ == 2
                    ? "ZeRO stage 2 keeps only its shard of the reduced gradient: step "
                      "it with step(), which reduce-scatters"
                    : "ZeRO optimizer of " + std::to_string(count_) + " parameters stepped with " +
                          std::to_string(params.size()) + " parameters and " +
                          std::to_string(reduced_grads.size()) + " gradients",
                ctx_.rank(), Error::kNoPeer, "ZeroOptimizer step");
  }
  if (stage_ == 0) {
    main_->step(params, reduced_grads);
    return;
  }
  const std::size_t body = static_cast<std::size_t>(ctx_.size()) * shard_;
  update_shard_and_gather(params, reduced_grads.subspan(first_, shard_),
                          reduced_grads.subspan(body, tail_));
}

void ZeroOptimizer::update_shard_and_gather(std::span<float> params,
                                            std::span<const float> shard_grads,
                                            std::span<const float> tail_grads) {
  const std::size_t body = static_cast<std::size_t>(ctx_.size()) * shard_;
  main_->step(params.subspan(first_, shard_), shard_grads);
  tail_opt_->step(params.subspan(body, tail_), tail_grads);
  if (shard_) {
    ctx_.allgather(params.data() + first_, params.data(), shard_, DataType::kFloat32);
  }
}

void ZeroOptimizer::set_lr(float lr) {
  main_->set_lr(lr);
  if (tail_opt_) tail_opt_->set_lr(lr);
}

ZeroOptimizer::Memory ZeroOptimizer::memory() const {
  Memory m;
  m.optimizer_state_bytes = main_->state_bytes() + (tail_opt_ ? tail_opt_->state_bytes() : 0);
  m.reduced_gradient_bytes = (stage_ == 2 ? shard_ + tail_ : count_) * sizeof(float);
  return m;
}

// "GSZO" v1: the main shard's optimizer state, then the tail's (empty without a tail).
std::vector<std::uint8_t> ZeroOptimizer::save_state() const {
  ByteWriter w("GSZO", kStateVersion);
  w.bytes(main_->save_state());
  w.bytes(tail_opt_ ? tail_opt_->save_state() : std::vector<std::uint8_t>{});
  return w.take();
}

void ZeroOptimizer::load_state(std::span<const std::uint8_t> state) {
  ByteReader r(state, "GSZO", kStateVersion, "ZeRO optimizer state");
  const auto main_state = r.bytes();
  const auto tail_state = r.bytes();
  r.finish();
  if (!tail_opt_ && !tail_state.empty()) r.fail("holds a tail this optimizer does not have");
  main_->load_state(main_state);
  if (tail_opt_) tail_opt_->load_state(tail_state);
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
