// gradsync-train's flag checks: conflicts between two flags and unknown values, refused
// before any rank starts, with a message naming what to change (exit code 2, the usage
// text after it).
#include <gtest/gtest.h>

#include <string>

#include "harness.h"

namespace gradsync {
namespace {

TEST(TrainerFlags, ConflictsAndUnknownValuesAreRefused) {
  const std::string train = testing::build_dir() + "/examples/gradsync-train";
  auto r =
      testing::run_shell(train + " --optimizer adamw --codec topk:ratio=0.01,momentum=0.9 2>&1");
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_TRUE(testing::contains(r.output,
                                "a codec with momentum= takes the place of SGD's "
                                "momentum: use --optimizer sgd"))
      << r.output;
  r = testing::run_shell(train + " --zero 1 --codec fp16 2>&1");
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "--zero 1|2 reduce-scatters float32 gradients"))
      << r.output;
  r = testing::run_shell(train + " --lr-schedule linear 2>&1");
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "--lr-schedule is constant or cosine")) << r.output;
  r = testing::run_shell(train + " --step-ahead yes 2>&1");
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "--step-ahead is 0 or 1")) << r.output;
}

}  // namespace
}  // namespace gradsync
