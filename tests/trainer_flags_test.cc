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
  for (const char* zero : {"1", "3"}) {
    r = testing::run_shell(train + " --zero " + zero + " --codec topk:ratio=0.01 2>&1");
    EXPECT_EQ(r.exit_code(), 2) << r.output;
    EXPECT_TRUE(testing::contains(r.output,
                                  "--codec topk:ratio=0.01 compresses whole tensors, which a "
                                  "shard is not: use --zero 0"))
        << r.output;
  }
  r = testing::run_shell(train + " --lr-schedule linear 2>&1");
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "--lr-schedule is constant, cosine or poly")) << r.output;
  r = testing::run_shell(train + " --poly-power 2 --lr-schedule cosine 2>&1");
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_TRUE(
      testing::contains(r.output, "--poly-power is poly's: give it with --lr-schedule poly"))
      << r.output;
  r = testing::run_shell(train + " --beta2 0.99 2>&1");
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "--beta2 is Adam's: give it with --optimizer adamw"))
      << r.output;
  r = testing::run_shell(train + " --optimizer adamw --exclude-biases 2>&1");
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "--exclude-biases is for the trust ratios of"))
      << r.output;
  r = testing::run_shell(train + " --step-ahead yes 2>&1");
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "--step-ahead is 0 or 1")) << r.output;
  r = testing::run_shell(train + " --optimizer lamb --zero 2 2>&1");
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "ZeRO's shards cut tensors: use --zero 0")) << r.output;
  r = testing::run_shell(train + " --optimizer adam 2>&1");
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "--optimizer is sgd, adamw, lars or lamb")) << r.output;
  r = testing::run_shell(train + " --strategy fsdp 2>&1");
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "--strategy is ddp, zero1, zero2 or zero3")) << r.output;
  r = testing::run_shell(train + " --lr-scaling cubic 2>&1");
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "--lr-scaling is none, linear or sqrt")) << r.output;
}

// Every number is read whole and within its range, and refused before any rank starts with
// the flag, the value and the range: --lr -1 used to train (below 0 is the default's marker),
// --epochs 99999999999 to wrap around an int, --batch and --hidden to end in std::bad_alloc.
TEST(TrainerFlags, NumbersAreReadStrictlyAndInRange) {
  const std::string train = testing::build_dir() + "/examples/gradsync-train";
  const std::pair<const char*, const char*> cases[] = {
      {"--lr -1", "--lr: '-1' is not a number in (0, "},
      {"--lr 0", "--lr: '0' is not a number in (0, "},
      {"--lr nan", "--lr: 'nan' is not a number"},
      {"--lr inf", "--lr: 'inf' is not a number"},
      {"--epochs 99999999999", "--epochs: '99999999999' is not an integer in [1, "},
      {"--epochs 1e3", "--epochs: '1e3' is not an integer"},
      {"--batch 99999999999", "--batch: '99999999999' is not an integer in [1, "},
      {"--batch 0", "--batch: '0' is not an integer in [1, "},
      {"--hidden 99999999999", "--hidden: '99999999999' is not an integer in [1, "},
      {"--hidden 64,,64", "--hidden: '' is not an integer"},
      {"--max-steps 0", "--max-steps: '0' is not an integer in [1, "},
      {"--max-steps 99999999999999999999", "--max-steps: '99999999999999999999' is not"},
      {"--bucket-mb 1e300", "--bucket-mb: '1e300' is not a number in (0, "},
      {"--first-bucket-mb -1", "--first-bucket-mb: '-1' is not a number in (0, "},
      {"--accumulate 0", "--accumulate: '0' is not an integer in [1, "},
      {"--zero 4", "--zero: '4' is not an integer in [0, 3]"},
      {"--warmup-epochs -1", "--warmup-epochs: '-1' is not a number in [0, "},
      {"--base-batch 0", "--base-batch: '0' is not an integer in [1, "},
      {"--seed -1", "--seed: '-1' is not an integer in [0, "},
      {"--weight-decay -0.1", "--weight-decay: '-0.1' is not a number in [0, 1]"},
      {"--weight-decay 2", "--weight-decay: '2' is not a number in [0, 1]"},
      {"--optimizer lamb --beta2 1", "--beta2: '1' is not a number in (0, 1)"},
      {"--optimizer lamb --beta2 0", "--beta2: '0' is not a number in (0, "},
      {"--lr-schedule poly --poly-power 0", "--poly-power: '0' is not a number in (0, 16]"},
      {"--seed 0x10", "--seed: '0x10' is not an integer"},
  };
  for (auto [args, want] : cases) {
    auto r = testing::run_shell(train + " " + args + " 2>&1");
    EXPECT_EQ(r.exit_code(), 2) << args << ": " << r.output;
    EXPECT_TRUE(testing::contains(r.output, want)) << r.output;
  }
}

// A --json path rank 0 cannot write fails the run before its first step, on every rank, not
// after the whole run (whose report would then be lost).
// The schedule a run announces (and its checkpoints record): --lr scaled by the global batch
// over --base-batch, linearly or by the square root, with its warm-up in steps.
TEST(TrainerFlags, LearningRateScalingAndWarmUpAreAnnounced) {
  const std::string train = testing::build_dir() + "/examples/gradsync-train";
  const std::string run = " --model mlp --hidden 64 --batch 64 --max-steps 2 2>&1";
  auto r = testing::run_shell(train + " --optimizer lars --lr-scaling linear --base-batch 32 " +
                              "--warmup-epochs 1" + run);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(testing::contains(
      r.output, "lars lr 1 (constant, linear scaling to 2, warm-up over 937 steps)"))
      << r.output;
  r = testing::run_shell(train + " --optimizer lamb --lr-scaling sqrt --base-batch 16" + run);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "lamb lr 0.01 (constant, sqrt scaling to 0.02)"))
      << r.output;
  r = testing::run_shell(train + " --optimizer lamb --lr-schedule poly --poly-power 2" + run);
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "lamb lr 0.01 (poly (power 2) over 2 steps)"))
      << r.output;
}

TEST(TrainerFlags, AnUnwritableJsonPathFailsBeforeTraining) {
  const std::string train = testing::build_dir() + "/examples/gradsync-train";
  const std::string run = testing::build_dir() + "/tools/gradsync-run";
  auto r = testing::run_shell(run + " -n 2 -- " + train +
                              " --hidden 16 --max-steps 2 --quiet --json /proc/no/such.json 2>&1");
  EXPECT_NE(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "--json: cannot write /proc/no/such.json")) << r.output;
  EXPECT_FALSE(testing::contains(r.output, "steps in")) << "it trained first:\n" << r.output;
}

}  // namespace
}  // namespace gradsync
