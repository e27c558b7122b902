// gradsync-train's training loop: each optimizer step runs K micro-batches forward and
// backward while the reducer averages the gradients across ranks, then the optimizer (or
// ZeRO, which reduces the gradients itself) updates every rank's model the same way.
#include "train/training.h"

#include <gradsync/gradsync.h>
#include <gradsync/optim.h>
#include <gradsync/reducer.h>
#include <gradsync/sharded.h>
#include <gradsync/timeline.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <numbers>
#include <optional>
#include <span>
#include <stdexcept>
#include <vector>

#include "flag_numbers.h"
#include "train/checkpoint.h"
#include "train/fashion_mnist.h"
#include "train/model.h"
#include "train/report.h"

namespace train {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Step-ahead error feedback (Xu et al., AAAI 2021): the residual this rank holds back is
// gradient the model will still move by, about lr * residual, once the wire carries it. A
// gradient computed where the model stands lags that move; computed at value - lr * residual
// it is one for where the model is headed. On the Fashion-MNIST MLP this closes most of the
// gap between top-k at 1% and float32 under a cosine schedule (BENCHMARKS.md, step-ahead error
// feedback). The training loss reported is the one there too. Keeps every value in `saved`
// for look_back; false (nothing moved) when nothing is held back.
bool look_ahead(const gradsync::Reducer& reducer, Model& model, float lr,
                std::vector<float>& saved) {
  saved.clear();
  std::vector<Parameter>& params = model.parameters();
  for (std::size_t id = 0; id < params.size(); ++id) {
    const std::span<const float> held = reducer.held_back(static_cast<int>(id));
    if (held.empty()) continue;
    if (saved.empty()) saved.assign(model.values().begin(), model.values().end());
    std::span<float> value = params[id].value;
    for (std::size_t i = 0; i < value.size(); ++i) value[i] -= lr * held[i];
  }
  return !saved.empty();
}

// Puts back the values look_ahead moved, bit for bit: each rank moved them by its own
// residual, and every rank must take the optimizer step from the same values.
void look_back(Model& model, const std::vector<float>& saved) {
  std::memcpy(model.values().data(), saved.data(), saved.size() * sizeof(float));
}

// Test accuracy: each rank scores a contiguous share of the test set; the counts are summed.
// A sharded model's forward gathers every layer with the other ranks, so there every rank
// runs as many forwards as the largest share takes, one of an image it does not count past
// the end of its own.
double evaluate(gradsync::Context& ctx, Model& model, const Dataset& test, std::size_t batch,
                bool sharded) {
  const auto n = static_cast<std::size_t>(ctx.size()), r = static_cast<std::size_t>(ctx.rank());
  const std::size_t first = test.count * r / n, last = test.count * (r + 1) / n;
  std::int64_t counts[2] = {0, static_cast<std::int64_t>(last - first)};
  const std::size_t pixels = test.pixels_per_image();
  const std::size_t largest_share = (test.count + n - 1) / n;
  const std::size_t forwards = sharded ? (largest_share + batch - 1) / batch : 0;
  std::vector<float> images(batch * pixels);
  std::size_t done = 0;
  for (std::size_t at = first; at < last; at += batch, ++done) {
    const std::size_t b = std::min(batch, last - at);
    for (std::size_t i = 0; i < b; ++i) test.image_into(at + i, images.data() + i * pixels);
    model.forward({images.data(), b * pixels}, b);
    std::size_t correct = 0;
    model.loss({test.labels.data() + at, b}, &correct);
    counts[0] += static_cast<std::int64_t>(correct);
  }
  test.image_into(0, images.data());
  for (; done < forwards; ++done) model.forward({images.data(), pixels}, 1);
  ctx.allreduce(counts, counts, 2, gradsync::DataType::kInt64, gradsync::ReduceOp::kSum);
  return counts[1] ? static_cast<double>(counts[0]) / static_cast<double>(counts[1]) : 0.0;
}

// The learning rate of optimizer step `step` (0-based): a function of the step alone, so a
// resumed run continues the schedule without saving it. --lr, scaled by the global batch
// where asked, rises linearly over the warm-up steps, then stays or follows the cosine or the
// polynomial over the steps left.
class LearningRate {
 public:
  LearningRate(const Config& c, std::size_t steps_per_epoch, int world)
      : peak_(c.lr * scale(c, world)),
        schedule_(c.lr_schedule),
        power_(c.poly_power),
        warmup_steps_(std::lround(c.warmup_epochs * static_cast<double>(steps_per_epoch))),
        total_steps_(static_cast<long>(steps_per_epoch) * c.epochs),
        scaling_(c.lr_scaling) {
    if (c.max_steps >= 0) total_steps_ = std::min(total_steps_, c.max_steps);
  }
  // For the checkpoint's identity: a resumed run must continue the same schedule.
  std::string describe() const {
    std::string d = schedule_;
    if (schedule_ == "poly") {
      char power[32];
      std::snprintf(power, sizeof power, "%g", power_);
      d += std::string(" (power ") + power + ")";
    }
    if (schedule_ != "constant") d += " over " + std::to_string(total_steps_) + " steps";
    if (scaling_ != "none") {
      char peak[32];
      std::snprintf(peak, sizeof peak, "%g", peak_);
      d += ", " + scaling_ + " scaling to " + peak;
    }
    if (warmup_steps_ > 0) d += ", warm-up over " + std::to_string(warmup_steps_) + " steps";
    return d;
  }
  float at(long step) const {
    if (step < warmup_steps_) {
      return static_cast<float>(peak_ * static_cast<double>(step + 1) /
                                static_cast<double>(warmup_steps_));
    }
    if (schedule_ == "constant") return static_cast<float>(peak_);
    const double t = static_cast<double>(step - warmup_steps_);
    const double span = static_cast<double>(std::max(total_steps_ - warmup_steps_, 1L));
    if (schedule_ == "poly") return static_cast<float>(peak_ * std::pow(1 - t / span, power_));
    return static_cast<float>(peak_ * 0.5 * (1 + std::cos(std::numbers::pi * t / span)));
  }

 private:
  // The global batch over --base-batch, linearly or by its square root.
  static double scale(const Config& c, int world) {
    const double ratio =
        static_cast<double>(c.batch) * world * c.accumulate / static_cast<double>(c.base_batch);
    if (c.lr_scaling == "linear") return ratio;
    if (c.lr_scaling == "sqrt") return std::sqrt(ratio);
    return 1;
  }

  double peak_;
  std::string schedule_;
  double power_;
  long warmup_steps_;
  long total_steps_;
  std::string scaling_;
};

gradsync::ReducerOptions reducer_options(const Config& c) {
  gradsync::ReducerOptions ro;
  ro.codec = c.codec;
  ro.bucket_bytes = static_cast<std::size_t>(c.bucket_mb * (1 << 20));
  ro.first_bucket_bytes = static_cast<std::size_t>(c.first_bucket_mb * (1 << 20));
  ro.overlap = c.overlap;
  ro.accumulate_steps = c.accumulate;
  // A float16 overflow reaches every rank, whose loss scaler then skips the step alike.
  if (c.amp == "fp16") ro.non_finite = gradsync::compress::NonFinite::kPropagate;
  return ro;
}

// Over the parameter tensors of these sizes (LARS and LAMB scale each one by its norms), of
// which `biases` flags the 1-D ones (empty: none known, as for a ZeRO shard).
std::unique_ptr<gradsync::optim::Optimizer> make_optimizer(const Config& c,
                                                           std::vector<std::size_t> tensors,
                                                           std::vector<bool> biases = {}) {
  const auto lr = static_cast<float>(c.lr);
  const auto decay = static_cast<float>(c.weight_decay);
  const auto beta2 = static_cast<float>(c.beta2);
  std::vector<bool> excluded = c.exclude_biases ? std::move(biases) : std::vector<bool>{};
  if (c.optimizer == "lars") {
    return gradsync::optim::make_lars(std::move(tensors),
                                      {.lr = lr, .weight_decay = decay, .excluded = excluded});
  }
  if (c.optimizer == "lamb") {
    return gradsync::optim::make_lamb(
        std::move(tensors),
        {.lr = lr, .beta2 = beta2, .weight_decay = decay, .excluded = excluded});
  }
  std::size_t count = 0;
  for (std::size_t n : tensors) count += n;
  if (c.optimizer == "adamw") {
    return gradsync::optim::make_adamw(count, {.lr = lr, .beta2 = beta2, .weight_decay = decay});
  }
  return gradsync::optim::make_sgd(
      count,
      {.lr = lr, .momentum = codec_has_momentum(c.codec) ? 0.0f : 0.9f, .weight_decay = decay});
}

// What one optimizer step did, for the totals, the curves and the progress line.
struct StepResult {
  float loss = 0;           // the mean over the micro-batches
  std::size_t correct = 0;  // of this rank's samples of the step
  gradsync::StepStats stats;
  double seconds = 0;
};

// One rank's training: built in the same order on every rank (the reducer and ZeRO agree on
// their collectives), then stepped through the epochs.
class Trainer {
 public:
  Trainer(const Config& c, const gradsync::Options& options);
  Position resume() {
    const RunShape shape{[this](int world) { return identity(world); },
                         [this](int world) {
                           return Bounds{c_.epochs, steps_per_epoch_at(world)};
                         }};
    return load_checkpoint(c_.checkpoint, state(), shape, talk_);
  }
  // A new run (no --resume) starts only where it would delete no other run's checkpoints,
  // unless --overwrite.
  void check_checkpoint_dir() {
    if (!c_.checkpoint.empty() && !c_.resume && !c_.overwrite) {
      refuse_existing_checkpoints(*ctx_, c_.checkpoint);
    }
  }
  // Rank 0 writes --json at the end: it tries the path first, so a long run does not learn at
  // its end that its report is lost, and every rank fails together if it cannot.
  void check_json_path() {
    if (c_.json.empty()) return;
    const std::string why = rank_ == 0 ? gradsync::flags::cannot_write(c_.json) : "";
    std::int32_t writable = why.empty() ? 1 : 0;
    ctx_->broadcast(&writable, 1, gradsync::DataType::kInt32, 0);
    if (!writable) {
      throw std::runtime_error("--json: cannot write " + c_.json +
                               (why.empty() ? " (on rank 0)" : ": " + why));
    }
  }
  void announce() const;
  void train_from(const Position& start);
  int report();

 private:
  RankState state();
  // The checkpoint identity of this run's flags at `world` ranks (see RunShape).
  Identity identity(int world) const;
  // The optimizer steps of an epoch at `world` ranks (this run's: steps_per_epoch_).
  std::size_t steps_per_epoch_at(int world) const {
    return ShardedSampler(train_set_.count, 0, world, c_.batch, c_.seed).steps_per_epoch() /
           static_cast<std::size_t>(c_.accumulate);
  }
  bool reached_max_steps() const { return c_.max_steps >= 0 && steps_done_ >= c_.max_steps; }
  std::size_t samples_per_step() const {
    return c_.batch * static_cast<std::size_t>(c_.accumulate * world_);
  }
  std::size_t run_epoch(int epoch, std::size_t first_step);
  void finish_epoch(int epoch, std::size_t next_step);
  StepResult train_step(int epoch, std::size_t step);
  void run_micro_batch(int epoch, std::size_t step, int micro, StepResult& result);
  void load_batch(const std::vector<std::size_t>& samples);
  void backward(bool accumulate, gradsync::StepStats& stats);
  void average_micro_batch_gradients();
  void optimizer_step();
  void record(const StepResult& result);
  double batch_accuracy(const StepResult& result) const;
  bool checkpoint_due() const;
  Position position_after(int epoch, std::size_t step) const;
  void save(const Position& at) {
    save_checkpoint(c_.checkpoint, state(), identity(world_), at, ++saves_);
  }
  RunReport summarize() const;

  const Config& c_;
  std::unique_ptr<gradsync::Context> ctx_;
  int rank_, world_;
  bool talk_;  // rank 0 prints progress unless --quiet
  Dataset train_set_, test_set_;
  std::unique_ptr<Model> model_;
  std::optional<gradsync::Reducer> reducer_;  // without ZeRO
  // Without ZeRO the gradients arrive averaged and every rank updates everything.
  std::unique_ptr<gradsync::optim::Optimizer> optimizer_;
  // ZeRO: the model's layers are its units, gathered and reduced as they run.
  std::optional<gradsync::ShardedDataParallel> sharded_;
  gradsync::DataType precision_ = gradsync::DataType::kFloat32;  // --amp
  std::optional<gradsync::optim::LossScaler> scaler_;            // --amp fp16
  ShardedSampler sampler_;
  std::size_t steps_per_epoch_;
  LearningRate lr_;
  bool step_ahead_ = false;
  // GRADSYNC_TRAIN_KILL_AT_STEP=RANK:STEP (scripts/chaos_train.py): this rank dies of SIGKILL
  // as step STEP begins, as from kill -9, at a step a seed chose. -1: never.
  long kill_at_step_ = -1;
  std::vector<float> saved_;  // the values before look_ahead
  std::vector<float> images_;
  std::vector<std::uint8_t> labels_;

  Clock::time_point started_;
  long steps_done_ = 0;
  int epochs_done_ = 0;
  int saves_ = 0;
  double wall_s_ = 0;
  Totals totals_;
  Curves curves_;
};

Trainer::Trainer(const Config& c, const gradsync::Options& options)
    : c_(c),
      ctx_(gradsync::init(options)),
      rank_(ctx_->rank()),
      world_(ctx_->size()),
      talk_(rank_ == 0 && !c.quiet),
      train_set_(load_fashion_mnist(c.data, true)),
      test_set_(load_fashion_mnist(c.data, false)),
      model_(make_model(c.model, c.seed, c.hidden)),
      sampler_(train_set_.count, rank_, world_, c.batch, c.seed),
      steps_per_epoch_(steps_per_epoch_at(world_)),
      lr_(c, steps_per_epoch_, world_),
      images_(c.batch * train_set_.rows * train_set_.cols),
      labels_(c.batch) {
  // DDP averages the gradients through the Reducer, bucket by bucket while backward runs
  // (through the codec); ZeRO reduce-scatters each layer's as backward has it.
  if (c.zero == 0) {
    reducer_.emplace(*ctx_, reducer_options(c));
    std::vector<std::size_t> tensors;
    std::vector<bool> biases;
    for (auto& p : model_->parameters()) {
      reducer_->add_parameter(p.name, p.count, p.grad, p.rows);
      tensors.push_back(p.count);
      biases.push_back(p.rows == 0);
    }
    optimizer_ = make_optimizer(c, std::move(tensors), std::move(biases));
  } else {
    const gradsync::DataType wire = c.codec == "fp16"   ? gradsync::DataType::kFloat16
                                    : c.codec == "bf16" ? gradsync::DataType::kBFloat16
                                                        : gradsync::DataType::kFloat32;
    sharded_.emplace(*ctx_, gradsync::ShardedOptions{
                                .stage = c.zero,
                                .accumulate_steps = c.zero == 1 ? c.accumulate : 1,
                                .wire = wire,
                                .gradient_wire = c.codec == "int8" ? gradsync::DataType::kInt8
                                                                   : gradsync::DataType::kFloat32,
                                .prefetch_depth = c.overlap ? c.prefetch : 0});
    model_->shard(*sharded_);
    sharded_->set_optimizer([&c](std::size_t count) { return make_optimizer(c, {count}); });
  }
  if (c.amp != "none") {
    precision_ = c.amp == "fp16" ? gradsync::DataType::kFloat16 : gradsync::DataType::kBFloat16;
    model_->set_precision({precision_, 1});
  }
  if (c.amp == "fp16") scaler_.emplace();
  if (steps_per_epoch_ == 0) throw std::runtime_error("an epoch holds no full step: lower --batch");
  // lr * residual is how far plain SGD (with or without momentum) will still move; AdamW
  // scales each element by its own statistics, so the move is unknown.
  step_ahead_ = reducer_ && c.step_ahead && c.optimizer == "sgd";
  if (const char* kill = std::getenv("GRADSYNC_TRAIN_KILL_AT_STEP")) {
    int rank = -1;
    long step = -1;
    if (std::sscanf(kill, "%d:%ld", &rank, &step) == 2 && rank == rank_) kill_at_step_ = step;
  }
}

RankState Trainer::state() {
  return {*ctx_,
          *model_,
          optimizer_.get(),
          reducer_ ? &*reducer_ : nullptr,
          sharded_ ? &*sharded_ : nullptr,
          scaler_ ? &*scaler_ : nullptr};
}

// The flags a checkpoint's state depends on, as the user gives them: a resumed run must give
// the same (--hidden's parameters per tensor too, should the model's code change).
Identity Trainer::identity(int world) const {
  std::string hidden, tensors;
  for (const std::size_t w : c_.hidden) hidden += (hidden.empty() ? "" : ",") + std::to_string(w);
  for (const Parameter& p : model_->parameters()) {
    tensors += (tensors.empty() ? "" : ",") + p.name + ":" + std::to_string(p.count);
  }
  const auto text = [](double x) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.17g", x);
    return std::string(buf);
  };
  Identity identity{
      {"gradsync-run -n", std::to_string(world)},
      {"--model", c_.model},
      {"--hidden", hidden.empty() ? "(the default)" : hidden},
      {"parameters", tensors},
      {"--codec", reducer_ ? reducer_->codec_spec() : c_.codec},
      {"--bucket-mb", text(c_.bucket_mb)},
      {"--first-bucket-mb", text(c_.first_bucket_mb)},
      {"--step-ahead", c_.step_ahead ? "1" : "0"},
      {"--optimizer", c_.optimizer},
      {"--lr", text(c_.lr)},
      {"--lr-schedule", LearningRate(c_, steps_per_epoch_at(world), world).describe()},
      {"--batch", std::to_string(c_.batch)},
      {"--accumulate", std::to_string(c_.accumulate)},
      {"--zero", std::to_string(c_.zero)},
      {"--seed", std::to_string(c_.seed)}};
  // Only where used or set away from the optimizer's default, so that the checkpoints from
  // before these flags (format 3 before --amp) still read as the defaults.
  if (c_.amp != "none") identity.emplace_back("--amp", c_.amp);
  if (c_.weight_decay != default_weight_decay(c_.optimizer)) {
    identity.emplace_back("--weight-decay", text(c_.weight_decay));
  }
  if (c_.beta2 != 0.999) identity.emplace_back("--beta2", text(c_.beta2));
  if (c_.exclude_biases) identity.emplace_back("--exclude-biases", "given");
  return identity;
}

void Trainer::announce() const {
  if (!talk_) return;
  std::fprintf(stderr,
               "gradsync-train: %s; %d ranks x batch %zu x %d micro-batches; %zu steps per "
               "epoch; codec %s; zero %d; %s lr %g (%s); %s\n",
               model_->describe().c_str(), world_, c_.batch, c_.accumulate, steps_per_epoch_,
               reducer_ ? reducer_->codec_spec().c_str() : c_.codec.c_str(), c_.zero,
               c_.optimizer.c_str(), c_.lr, lr_.describe().c_str(),
               c_.overlap ? "overlap" : "no overlap");
}

void Trainer::train_from(const Position& start) {
  started_ = Clock::now();
  steps_done_ = start.steps_done;
  epochs_done_ = start.epoch;
  for (int epoch = start.epoch; epoch < c_.epochs && !reached_max_steps(); ++epoch) {
    const std::size_t next_step = run_epoch(epoch, epoch == start.epoch ? start.step : 0);
    finish_epoch(epoch, next_step);
  }
  // Resumed with nothing left to train (a smaller job resuming a checkpoint past its
  // --max-steps): the report still gives the model's accuracy.
  if (curves_.test_accuracies.empty()) {
    curves_.test_accuracies.push_back(evaluate(*ctx_, *model_, test_set_, 256, c_.zero == 3));
  }
  wall_s_ = seconds_since(started_);
}

// Returns the step it stopped before: steps_per_epoch_, unless --max-steps stopped it.
std::size_t Trainer::run_epoch(int epoch, std::size_t first_step) {
  const auto epoch_start = Clock::now();
  std::size_t epoch_samples = 0, step = first_step;
  for (; step < steps_per_epoch_ && !reached_max_steps(); ++step) {
    if (steps_done_ == kill_at_step_) ::kill(::getpid(), SIGKILL);
    const StepResult result = train_step(epoch, step);
    record(result);
    epoch_samples += samples_per_step();
    if (checkpoint_due()) save(position_after(epoch, step));
    if (talk_ && (step % 10 == 0 || step + 1 == steps_per_epoch_)) {
      const double samples_per_s =
          static_cast<double>(epoch_samples) / std::max(seconds_since(epoch_start), 1e-9);
      print_progress(c_, epoch, step, steps_per_epoch_, result.loss, batch_accuracy(result),
                     samples_per_s, totals_);
    }
  }
  return step;
}

// An epoch ends (or --max-steps stops it) with a checkpoint unless --checkpoint-every sets
// their own pace, and the test accuracy. Stopped before `next_step`: a run resumed with more
// --max-steps goes on from there, not from the next epoch.
void Trainer::finish_epoch(int epoch, std::size_t next_step) {
  ++epochs_done_;
  if (!c_.checkpoint.empty() && c_.checkpoint_every == 0) {
    save(next_step == steps_per_epoch_ ? Position{steps_done_, epoch + 1, 0}
                                       : Position{steps_done_, epoch, next_step});
  }
  const double test_accuracy = evaluate(*ctx_, *model_, test_set_, 256, c_.zero == 3);
  if (talk_) std::fprintf(stderr, "  test accuracy %.2f%%\n", 100 * test_accuracy);
  curves_.test_accuracies.push_back(test_accuracy);
}

StepResult Trainer::train_step(int epoch, std::size_t step) {
  const auto step_start = Clock::now();
  StepResult result;
  // Once per optimizer step: the residuals change only when the step communicates.
  const bool ahead = step_ahead_ && look_ahead(*reducer_, *model_, lr_.at(steps_done_), saved_);
  if (scaler_) model_->set_precision({precision_, scaler_->scale()});
  for (int micro = 0; micro < c_.accumulate; ++micro) run_micro_batch(epoch, step, micro, result);
  if (ahead) look_back(*model_, saved_);
  average_micro_batch_gradients();
  optimizer_step();
  result.seconds = seconds_since(step_start);
  return result;
}

void Trainer::run_micro_batch(int epoch, std::size_t step, int micro, StepResult& result) {
  const std::vector<std::size_t> samples = sampler_.batch(
      static_cast<std::size_t>(epoch),
      step * static_cast<std::size_t>(c_.accumulate) + static_cast<std::size_t>(micro));
  load_batch(samples);
  {
    gradsync::timeline::Span span("forward", "compute");
    model_->forward(images_, samples.size());
  }
  std::size_t right = 0;
  result.loss += model_->loss(labels_, &right) / static_cast<float>(c_.accumulate);
  result.correct += right;
  backward(micro > 0, result.stats);
}

void Trainer::load_batch(const std::vector<std::size_t>& samples) {
  const std::size_t pixels = train_set_.pixels_per_image();
  for (std::size_t i = 0; i < samples.size(); ++i) {
    train_set_.image_into(samples[i], images_.data() + i * pixels);
    labels_[i] = train_set_.labels[samples[i]];
  }
}

// With the reducer, each gradient starts on its way the moment backward has it; `stats` keeps
// the micro-batch that communicated (the last of the step).
void Trainer::backward(bool accumulate, gradsync::StepStats& stats) {
  if (sharded_) {  // the step's statistics add up those of its micro-batches
    {
      gradsync::timeline::Span span("backward", "compute");
      model_->backward(labels_, accumulate, {});
    }
    const gradsync::StepStats s = sharded_->finish();
    stats.communicated = stats.communicated || s.communicated;
    stats.compute_s += s.compute_s;
    stats.communication_s += s.communication_s;
    stats.exposed_s += s.exposed_s;
    stats.gather_s += s.gather_s;
    stats.exposed_gather_s += s.exposed_gather_s;
    stats.bytes_sent += s.bytes_sent;
    stats.raw_bytes += s.raw_bytes;
    stats.allreduce_calls += s.allreduce_calls;
    stats.buckets += s.buckets;
    return;
  }
  if (!reducer_) {
    gradsync::timeline::Span span("backward", "compute");
    model_->backward(labels_, accumulate, [](std::size_t) {});
    return;
  }
  {
    gradsync::timeline::Span span("backward", "compute");
    model_->backward(labels_, accumulate,
                     [&](std::size_t i) { reducer_->mark_ready(static_cast<int>(i)); });
  }
  const gradsync::StepStats s = reducer_->finish();
  if (s.communicated) stats = s;
}

// The micro-batches' gradients were summed: the step takes their mean.
void Trainer::average_micro_batch_gradients() {
  if (c_.accumulate == 1) return;
  for (float& g : model_->grads()) g /= static_cast<float>(c_.accumulate);
}

// ZeRO 1 and 2 queue the parameters' gathers in their step, each waited for by the next
// forward (the statistics count them there).
void Trainer::optimizer_step() {
  gradsync::timeline::Span span(sharded_ ? "zero step" : "optimizer", "optimizer");
  const float lr = lr_.at(steps_done_);
  if (sharded_) {
    sharded_->set_lr(lr);
    sharded_->step(scaler_ ? &*scaler_ : nullptr);
    return;
  }
  // The gradients are averaged and whole on every rank: each unscales and checks its own.
  if (scaler_ && !scaler_->unscale(*ctx_, model_->grads())) return;
  optimizer_->set_lr(lr);
  optimizer_->step(model_->values(), model_->grads());
}

void Trainer::record(const StepResult& result) {
  totals_.add_step(result.stats, result.seconds, samples_per_step(), result.loss);
  curves_.losses.push_back(result.loss);
  curves_.train_accuracies.push_back(static_cast<float>(batch_accuracy(result)));
  curves_.wall_at_step.push_back(seconds_since(started_));
  ++steps_done_;
}

double Trainer::batch_accuracy(const StepResult& result) const {
  return static_cast<double>(result.correct) /
         static_cast<double>(c_.batch * static_cast<std::size_t>(c_.accumulate));
}

bool Trainer::checkpoint_due() const {
  return !c_.checkpoint.empty() && c_.checkpoint_every > 0 &&
         steps_done_ % c_.checkpoint_every == 0;
}

// Where training stands once `step` of `epoch` is done: the next step to run.
Position Trainer::position_after(int epoch, std::size_t step) const {
  if (step + 1 == steps_per_epoch_) return {steps_done_, epoch + 1, 0};
  return {steps_done_, epoch, step + 1};
}

RunReport Trainer::summarize() const {
  RunReport r;
  r.epochs_done = epochs_done_;
  r.wall_s = wall_s_;
  r.totals = totals_;
  r.curves = curves_;
  r.model = model_->describe();
  r.codec = reducer_ ? reducer_->codec_spec() : c_.codec;
  r.ranks = world_;
  r.step_ahead = step_ahead_;
  r.amp = c_.amp;
  if (scaler_) {
    r.skipped_steps = scaler_->skipped_steps();
    r.loss_scale = scaler_->scale();
  }
  // Where every peer is reached through shared memory, most bytes move through the arena,
  // which the transport counters do not see.
  r.shared_memory_only = world_ > 1;
  for (int peer = 0; peer < world_; ++peer) {
    if (peer != rank_ && ctx_->transport_name(peer) != "shm") r.shared_memory_only = false;
  }
  if (sharded_) {
    const gradsync::ShardedDataParallel::Memory m = sharded_->memory();
    r.optimizer_state_bytes = m.optimizer_state_bytes;
    r.reduced_gradient_bytes = r.gradient_bytes = m.gradient_bytes;
    r.parameter_bytes = m.parameter_bytes;
    r.working_bytes = m.working_bytes;
    r.error_feedback_bytes = m.error_feedback_bytes;
  } else {
    r.optimizer_state_bytes = optimizer_->state_bytes();
    r.reduced_gradient_bytes = model_->values().size() * sizeof(float);
    r.parameter_bytes = model_->values().size() * sizeof(float);
    r.gradient_bytes = model_->grads().size() * sizeof(float);
  }
  rusage usage{};
  if (::getrusage(RUSAGE_SELF, &usage) == 0) {
    r.peak_rss_bytes = static_cast<std::size_t>(usage.ru_maxrss) * 1024;  // Linux: KiB
  }
  return r;
}

int Trainer::report() {
  if (const std::size_t events = gradsync::timeline::write(*ctx_); events && rank_ == 0) {
    std::fprintf(stderr, "gradsync-train: timeline of %zu events written\n", events);
  }
  const RunReport r = summarize();
  if (rank_ == 0) print_summary(r);
  if (rank_ == 0 && !c_.json.empty() && !write_json_report(c_.json, r, c_)) return 1;
  return 0;
}

}  // namespace

int run_training(Config c) {
  // Started again by gradsync-run --max-restarts after a rank failed: go on from this run's
  // latest checkpoint, or, where it failed before its first, start over what it left.
  const char* restart = std::getenv("GRADSYNC_RESTART_COUNT");
  if (restart && *restart && std::string(restart) != "0" && !c.checkpoint.empty() && !c.resume) {
    if (std::filesystem::exists(c.checkpoint + "/LATEST")) {
      c.resume = true;
      c.overwrite = false;
    } else {
      c.overwrite = true;
    }
  }
  // A resumed run chooses its algorithms by the cost model the checkpoint's run chose by
  // (unless the environment sets one).
  gradsync::Options options;
  if (c.resume && !std::getenv("GRADSYNC_COST_MODEL") &&
      std::filesystem::exists(cost_model_file(c.checkpoint))) {
    const auto saved = read_file(cost_model_file(c.checkpoint));
    options.cost_model.assign(saved.begin(), saved.end());
  }
  Trainer trainer(c, options);
  trainer.check_json_path();
  trainer.check_checkpoint_dir();
  const Position start = c.resume ? trainer.resume() : Position{};
  trainer.announce();
  trainer.train_from(start);
  return trainer.report();
}

}  // namespace train
