// gradsync-train's --json report and the JSON writer under it (tools/json_writer.h, which
// gradsync-bench and the peer benchmarks use too): the layout scripts and tests grep (one
// member a line, everything inside on that line), escaping, numbers that read back to the
// same bits, and calls out of order refused.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "harness.h"
#include "json_writer.h"
#include "train/report.h"

namespace train {
namespace {

using gradsync::testing::contains;
namespace json = gradsync::json;

TEST(TrainerReport, OutermostMembersOneALineEverythingInsideOnThatLine) {
  std::ostringstream out;
  json::Writer w(out);
  w.begin_object()
      .field("name", "run")
      .field("losses", std::vector<float>{0.5f, 0.25f})
      .key("config")
      .begin_object()
      .field("ok", true)
      .field("none", std::vector<int>{})
      .end_object()
      .end_object();
  EXPECT_EQ(out.str(),
            "{\n"
            "  \"name\": \"run\",\n"
            "  \"losses\": [0.5, 0.25],\n"
            "  \"config\": {\"ok\": true, \"none\": []}\n"
            "}\n");
  std::ostringstream empty;
  json::Writer(empty).begin_array().end_array();
  EXPECT_EQ(empty.str(), "[]\n");
}

TEST(TrainerReport, StringsAreEscaped) {
  EXPECT_EQ(json::escape("plain"), "plain");
  EXPECT_EQ(json::escape("say \"hi\"\\"), "say \\\"hi\\\"\\\\");
  EXPECT_EQ(json::escape("a\nb\tc\rd"), "a\\nb\\tc\\rd");
  EXPECT_EQ(json::escape(std::string("\x01\x1f", 2)), "\\u0001\\u001f");
  EXPECT_EQ(json::escape("caf\xc3\xa9"), "caf\xc3\xa9");  // UTF-8 passes through
}

TEST(TrainerReport, NumbersReadBackToTheSameBits) {
  const double doubles[] = {0.1,
                            1.0 / 3,
                            12.989999999999998,
                            -0.0,
                            1e-300,
                            std::numeric_limits<double>::denorm_min(),
                            std::numeric_limits<double>::max()};
  for (const double x : doubles) {
    const std::string text = json::number(x);
    const double back = std::strtod(text.c_str(), nullptr);
    EXPECT_EQ(std::memcmp(&back, &x, sizeof x), 0) << text;
  }
  const float floats[] = {2.0960338f, 0.1f, 1.0f / 3, std::numeric_limits<float>::denorm_min(),
                          std::numeric_limits<float>::max()};
  for (const float x : floats) {
    const std::string text = json::number(x);
    const float back = std::strtof(text.c_str(), nullptr);
    EXPECT_EQ(std::memcmp(&back, &x, sizeof x), 0) << text;
  }
  // A float printed as itself, not as the double it widens to (0.100000001490116...).
  EXPECT_EQ(json::number(0.1f), "0.1");
  EXPECT_EQ(json::number(25.0), "25");
  EXPECT_EQ(json::number(std::numeric_limits<std::int64_t>::min()), "-9223372036854775808");
  EXPECT_EQ(json::number(std::numeric_limits<std::uint64_t>::max()), "18446744073709551615");
  // JSON has no NaN or infinity.
  EXPECT_EQ(json::number(std::nan("")), "null");
  EXPECT_EQ(json::number(-std::numeric_limits<float>::infinity()), "null");
}

TEST(TrainerReport, CallsOutOfOrderAreRefused) {
  std::ostringstream out;
  json::Writer array(out);
  array.begin_array();
  EXPECT_THROW(array.key("x"), std::logic_error);
  EXPECT_THROW(array.end_object(), std::logic_error);
  json::Writer object(out);
  object.begin_object();
  EXPECT_THROW(object.value(1), std::logic_error);
  object.key("x");
  EXPECT_THROW(object.key("y"), std::logic_error);
  EXPECT_THROW(object.end_object(), std::logic_error);
  object.value(1).end_object();
  EXPECT_THROW(object.begin_array(), std::logic_error);  // a second document
}

// The first step (connections, first-touch buffers, the optimizer's state) is timed apart, as
// a benchmark's warm-up; bytes and calls count every step.
TEST(TrainerReport, TimesLeaveOutTheFirstStepUnlessItIsTheOnlyOne) {
  Totals t;
  gradsync::StepStats warm_up;
  warm_up.communication_s = 0.9;
  warm_up.exposed_s = 0.9;
  warm_up.bytes_sent = 100;
  t.add_step(warm_up, 1.0, 64, 3.0f);
  EXPECT_EQ(t.timed_steps(), 1u);
  EXPECT_DOUBLE_EQ(t.per_timed_step(t.timed().step_s), 1.0);
  EXPECT_DOUBLE_EQ(t.overlap_fraction(), 0.0);
  gradsync::StepStats steady;
  steady.communication_s = 0.2;
  steady.exposed_s = 0.05;
  steady.bytes_sent = 100;
  t.add_step(steady, 0.4, 64, 2.0f);
  t.add_step(steady, 0.2, 64, 1.0f);
  EXPECT_EQ(t.steps, 3u);
  EXPECT_EQ(t.timed_steps(), 2u);
  EXPECT_DOUBLE_EQ(t.per_timed_step(t.timed().step_s), 0.3);
  EXPECT_DOUBLE_EQ(t.first_step.step_s, 1.0);
  EXPECT_DOUBLE_EQ(t.communication_fraction(), 0.4 / 0.6);
  EXPECT_DOUBLE_EQ(t.overlap_fraction(), 0.75);
  EXPECT_EQ(t.bytes_sent, 300u);
  EXPECT_EQ(t.samples, 192u);
}

TEST(TrainerReport, JsonReportHasEveryKeyTheScriptsRead) {
  const gradsync::testing::TempDir dir;
  RunReport r;
  r.epochs_done = 1;
  r.wall_s = 2;
  r.totals.steps = 2;
  r.totals.samples = 256;
  r.totals.first_step = {.communication_s = 2, .step_s = 3};  // left out of the timed figures
  r.totals.later_steps = {.communication_s = 0.5, .exposed_s = 0.125, .step_s = 1};
  r.totals.bytes_sent = 300;
  r.totals.raw_bytes = 1200;
  r.totals.last_loss = 2.0960338f;
  r.curves = {{2.3532581f, 2.0960338f}, {0.015625f, 0.09375f}, {0.5, 1}, {0.3224}};
  r.model = "mlp 784-32-10";
  r.codec = "odd\"codec";
  r.ranks = 2;
  Config c;
  c.lr = 0.05;
  const std::string path = dir.path() + "/run.json";
  ASSERT_TRUE(write_json_report(path, r, c));
  const std::string text = gradsync::testing::read_file(path);
  EXPECT_TRUE(contains(text, "\n  \"losses\": [2.3532581, 2.0960338],\n")) << text;
  EXPECT_TRUE(contains(text, "\n  \"final_loss\": 2.0960338,\n")) << text;
  EXPECT_TRUE(contains(text, "\n  \"test_accuracy\": 0.3224,\n")) << text;
  EXPECT_TRUE(contains(text, "\n  \"samples_per_s\": 128,\n")) << text;
  EXPECT_TRUE(contains(text, "\n  \"step_s\": 1,\n")) << text;
  EXPECT_TRUE(contains(text, "\n  \"first_step_s\": 3,\n")) << text;
  EXPECT_TRUE(contains(text, "\n  \"timed_steps\": 1,\n")) << text;
  EXPECT_TRUE(contains(text, "\n  \"comm_fraction\": 0.5,\n")) << text;
  EXPECT_TRUE(contains(text, "\n  \"overlap_fraction\": 0.75,\n")) << text;
  EXPECT_TRUE(contains(text, "\n  \"compression_ratio\": 0.25,\n")) << text;
  EXPECT_TRUE(contains(text, "\"codec\": \"odd\\\"codec\"")) << text;
  EXPECT_TRUE(contains(text, "\"step_ahead\": false")) << text;
  EXPECT_TRUE(contains(text, "\"strategy\": \"ddp\"")) << text;
  for (const char* key : {"epochs",
                          "steps",
                          "wall_s",
                          "step_s",
                          "communication_s_per_step",
                          "exposed_s_per_step",
                          "bytes_sent_per_rank",
                          "allreduce_calls",
                          "optimizer_state_bytes_per_rank",
                          "reduced_gradient_bytes_per_rank",
                          "train_accuracy",
                          "wall_at_step",
                          "test_accuracy_per_epoch",
                          "config",
                          "lr_schedule",
                          "accumulate",
                          "max_steps",
                          "parameter_bytes_per_rank",
                          "gradient_bytes_per_rank",
                          "peak_rss_bytes",
                          "strategy",
                          "lr_scaling",
                          "base_batch",
                          "warmup_epochs",
                          "poly_power",
                          "weight_decay",
                          "exclude_biases",
                          "beta2"}) {
    EXPECT_TRUE(contains(text, std::string("\"") + key + "\": ")) << key;
  }
  EXPECT_FALSE(write_json_report(dir.path() + "/no/such/dir/run.json", r, c));
}

// A report that opens but cannot be written (a full disk) is a failure too, not a success
// with the file lost.
TEST(TrainerReport, JsonReportToAFullDiskFails) {
  if (::access("/dev/full", W_OK) != 0) GTEST_SKIP() << "no /dev/full";
  RunReport r;
  r.wall_s = 1;
  EXPECT_FALSE(write_json_report("/dev/full", r, Config{}));
}

}  // namespace
}  // namespace train
