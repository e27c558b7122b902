// What gradsync-train tells about its run: the progress line while it trains, and at the end
// the summary line and the --json report (metrics, per-step curves, configuration).
#pragma once

#include <gradsync/reducer.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "train/flags.h"

namespace train {

// What steps took, in seconds: summed over steps, or one step's.
struct StepTimes {
  double compute_s = 0, communication_s = 0, exposed_s = 0, step_s = 0;
  double gather_s = 0, exposed_gather_s = 0;  // ZeRO 3's parameter gathers, within the above
  StepTimes& operator+=(const StepTimes& other);
};

// Sums over the steps a run took, for the progress line, the summary and the JSON. The times
// leave out the process's first step, as a benchmark leaves out its warm-up: it connects the
// ranks, faults in every buffer and makes the optimizer's state, and in a short run would
// weigh as much as the rest (its time is kept apart); a run of one step has only that one.
struct Totals {
  StepTimes first_step, later_steps;
  std::uint64_t bytes_sent = 0, raw_bytes = 0;
  std::size_t allreduce_calls = 0, steps = 0, samples = 0;
  float last_loss = 0;

  void add_step(const gradsync::StepStats& stats, double seconds, std::size_t step_samples,
                float loss);
  // The timed steps' sums: those after the first, or the first alone.
  const StepTimes& timed() const;
  std::size_t timed_steps() const;
  // Of the step time, the part the gradients' collectives ran.
  double communication_fraction() const;
  // Of the communication, the part hidden behind compute.
  double overlap_fraction() const;
  // Bytes sent over the float32 gradients' bytes.
  double compression_ratio() const;
  // A timed sum over the timed steps (0 before any).
  double per_timed_step(double timed_total) const;
};

// Rank 0's loss, training-batch accuracy and wall time at every step, and the test accuracy
// after each epoch.
struct Curves {
  std::vector<float> losses, train_accuracies;
  std::vector<double> wall_at_step, test_accuracies;
};

// What the run did and what it ran with, beyond the flags.
struct RunReport {
  int epochs_done = 0;
  double wall_s = 0;
  Totals totals;
  Curves curves;
  std::string model;  // Model::describe()
  std::string codec;  // as the reducer spells it, with its defaults filled in
  int ranks = 0;
  bool step_ahead = false;  // in effect, not just asked for
  std::string amp = "none";
  std::uint64_t skipped_steps = 0;  // --amp fp16: steps whose gradients overflowed
  double loss_scale = 1;            // --amp fp16: at the end
  bool shared_memory_only = false;  // every peer through shm: the arenas' bytes go uncounted
  std::size_t optimizer_state_bytes = 0, reduced_gradient_bytes = 0;  // per rank
  // Per rank: the parameters and the gradients kept between steps (whole, except the shards of
  // ZeRO 2 and 3), the buffers ZeRO 2 and 3 gather layers and gradients into as they run, and
  // the process's peak resident set.
  std::size_t parameter_bytes = 0, gradient_bytes = 0, working_bytes = 0, peak_rss_bytes = 0;
  std::size_t error_feedback_bytes = 0;  // ZeRO 2 and 3 with int8 gradients

  double test_accuracy() const;  // after the last epoch (0 if none ran)
};

// Overwrites the progress line on stderr: where the run is and how fast it goes.
void print_progress(const Config& c, int epoch, std::size_t step, std::size_t steps, float loss,
                    double accuracy, double samples_per_s, const Totals& t);

// The run's one-line summary on stdout.
void print_summary(const RunReport& r);

// The --json report; false (after saying so on stderr) if `path` cannot be written.
bool write_json_report(const std::string& path, const RunReport& r, const Config& c);

}  // namespace train
