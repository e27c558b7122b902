// gradsync-train's reports: the progress line, the summary and the --json file, whose keys
// bench/train/*.sh, bench/peers/ddp_compare.sh, bench/netns/cluster_bench.sh,
// examples/train/plot_curves.sh and the trainer tests read.
#include "train/report.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include "json_writer.h"

namespace train {

StepTimes& StepTimes::operator+=(const StepTimes& other) {
  compute_s += other.compute_s;
  communication_s += other.communication_s;
  exposed_s += other.exposed_s;
  step_s += other.step_s;
  gather_s += other.gather_s;
  exposed_gather_s += other.exposed_gather_s;
  return *this;
}

void Totals::add_step(const gradsync::StepStats& stats, double seconds, std::size_t step_samples,
                      float loss) {
  const StepTimes times{stats.compute_s, stats.communication_s, stats.exposed_s,
                        seconds,         stats.gather_s,        stats.exposed_gather_s};
  (steps == 0 ? first_step : later_steps) += times;
  bytes_sent += stats.bytes_sent;
  raw_bytes += stats.raw_bytes;
  allreduce_calls += stats.allreduce_calls;
  steps += 1;
  samples += step_samples;
  last_loss = loss;
}

const StepTimes& Totals::timed() const {
  return steps > 1 ? later_steps : first_step;
}

std::size_t Totals::timed_steps() const {
  return steps > 1 ? steps - 1 : steps;
}

double Totals::communication_fraction() const {
  return timed().step_s > 0 ? timed().communication_s / timed().step_s : 0;
}

double Totals::overlap_fraction() const {
  const StepTimes& t = timed();
  return t.communication_s > 0 ? std::max(0.0, 1.0 - t.exposed_s / t.communication_s) : 0;
}

double Totals::compression_ratio() const {
  return raw_bytes ? static_cast<double>(bytes_sent) / static_cast<double>(raw_bytes) : 0.0;
}

double Totals::per_timed_step(double timed_total) const {
  return timed_steps() ? timed_total / static_cast<double>(timed_steps()) : 0;
}

double RunReport::test_accuracy() const {
  return curves.test_accuracies.empty() ? 0.0 : curves.test_accuracies.back();
}

void print_progress(const Config& c, int epoch, std::size_t step, std::size_t steps, float loss,
                    double accuracy, double samples_per_s, const Totals& t) {
  constexpr int kWidth = 24;
  const int filled = static_cast<int>(kWidth * (step + 1) / std::max<std::size_t>(1, steps));
  std::fprintf(stderr,
               "\repoch %d/%d [%s%s] step %zu/%zu loss %.4f acc %5.1f%% %7.0f samples/s "
               "comm %3.0f%% overlap %3.0f%%",
               epoch + 1, c.epochs, std::string(static_cast<std::size_t>(filled), '#').c_str(),
               std::string(static_cast<std::size_t>(kWidth - filled), '.').c_str(), step + 1, steps,
               static_cast<double>(loss), 100 * accuracy, samples_per_s,
               100 * t.communication_fraction(), 100 * t.overlap_fraction());
}

void print_summary(const RunReport& r) {
  const Totals& t = r.totals;
  std::printf(
      "gradsync-train: %d epochs, %zu steps in %.1f s: %.0f samples/s, final loss %.4f, test "
      "accuracy %.2f%%; communication %.0f%% of the step time, %.0f%% of it overlapped; "
      "%.1f MB sent per rank%s (%.3f of the float32 gradients), %zu all-reduce calls\n",
      r.epochs_done, t.steps, r.wall_s, static_cast<double>(t.samples) / r.wall_s,
      static_cast<double>(t.last_loss), 100 * r.test_accuracy(), 100 * t.communication_fraction(),
      100 * t.overlap_fraction(), static_cast<double>(t.bytes_sent) / 1e6,
      r.shared_memory_only ? " through the transports (shared-memory arenas not counted)" : "",
      t.compression_ratio(), t.allreduce_calls);
}

namespace {

void write_metrics(gradsync::json::Writer& w, const RunReport& r) {
  const Totals& t = r.totals;
  w.field("test_accuracy", r.test_accuracy())
      .field("final_loss", t.last_loss)
      .field("epochs", r.epochs_done)
      .field("steps", t.steps)
      .field("wall_s", r.wall_s)
      .field("samples_per_s", static_cast<double>(t.samples) / r.wall_s)
      .field("step_s", t.per_timed_step(t.timed().step_s))
      .field("first_step_s", t.first_step.step_s)
      .field("timed_steps", t.timed_steps())
      .field("communication_s_per_step", t.per_timed_step(t.timed().communication_s))
      .field("exposed_s_per_step", t.per_timed_step(t.timed().exposed_s))
      .field("gather_s_per_step", t.per_timed_step(t.timed().gather_s))
      .field("exposed_gather_s_per_step", t.per_timed_step(t.timed().exposed_gather_s))
      .field("comm_fraction", t.communication_fraction())
      .field("overlap_fraction", t.overlap_fraction())
      .field("bytes_sent_per_rank", t.bytes_sent)
      .field("compression_ratio", t.compression_ratio())
      .field("allreduce_calls", t.allreduce_calls)
      .field("optimizer_state_bytes_per_rank", r.optimizer_state_bytes)
      .field("reduced_gradient_bytes_per_rank", r.reduced_gradient_bytes)
      .field("parameter_bytes_per_rank", r.parameter_bytes)
      .field("gradient_bytes_per_rank", r.gradient_bytes)
      .field("working_bytes_per_rank", r.working_bytes)
      .field("error_feedback_bytes_per_rank", r.error_feedback_bytes)
      .field("peak_rss_bytes", r.peak_rss_bytes)
      .field("skipped_steps", r.skipped_steps)
      .field("loss_scale", r.loss_scale);
}

void write_curves(gradsync::json::Writer& w, const Curves& curves) {
  w.field("losses", curves.losses)
      .field("train_accuracy", curves.train_accuracies)
      .field("wall_at_step", curves.wall_at_step)
      .field("test_accuracy_per_epoch", curves.test_accuracies);
}

void write_config(gradsync::json::Writer& w, const RunReport& r, const Config& c) {
  w.key("config")
      .begin_object()
      .field("model", r.model)
      .field("ranks", r.ranks)
      .field("batch", c.batch)
      .field("lr", c.lr)
      .field("lr_schedule", c.lr_schedule)
      .field("poly_power", c.poly_power)
      .field("optimizer", c.optimizer)
      .field("weight_decay", c.weight_decay)
      .field("exclude_biases", c.exclude_biases)
      .field("beta2", c.beta2)
      .field("seed", c.seed)
      .field("codec", r.codec)
      .field("bucket_mb", c.bucket_mb)
      .field("first_bucket_mb", c.first_bucket_mb)
      .field("overlap", c.overlap)
      .field("step_ahead", r.step_ahead)
      .field("accumulate", c.accumulate)
      .field("zero", c.zero)
      .field("prefetch", c.overlap ? c.prefetch : 0)
      .field("amp", r.amp)
      .field("strategy", c.zero == 0 ? "ddp" : "zero" + std::to_string(c.zero))
      .field("lr_scaling", c.lr_scaling)
      .field("base_batch", c.base_batch)
      .field("warmup_epochs", c.warmup_epochs)
      .field("epochs", c.epochs)
      .field("max_steps", c.max_steps)
      .end_object();
}

}  // namespace

bool write_json_report(const std::string& path, const RunReport& r, const Config& c) {
  const auto cannot_write = [&path] {
    std::fprintf(stderr, "gradsync-train: cannot write %s: %s\n", path.c_str(),
                 std::strerror(errno));
    return false;
  };
  std::ofstream f(path);
  if (!f) return cannot_write();
  gradsync::json::Writer w(f);
  w.begin_object();
  write_metrics(w, r);
  write_curves(w, r.curves);
  write_config(w, r, c);
  w.end_object();
  f.flush();  // a full disk shows here, not at open
  return f ? true : cannot_write();
}

}  // namespace train
