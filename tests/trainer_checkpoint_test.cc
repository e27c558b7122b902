// Checkpoints that lose nothing: the trainer killed in the middle of a save leaves the
// previous checkpoint loadable, and a run resumed from it produces, bit for bit, the losses
// of a run that was never interrupted (model, optimizer, codec state and data position all
// restored). And step-ahead error feedback, loss for loss against a run without it. Runs the
// real gradsync-train under gradsync-run on Fashion-MNIST.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <sstream>
#include <utility>
#include <vector>

#include "harness.h"

namespace gradsync {
namespace {

using testing::contains;
using testing::losses_of;

TEST(TrainerCheckpoint, ResumeAfterACrashInTheMiddleOfASaveRepeatsTheLossesBitForBit) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist")) GTEST_SKIP() << "no data";
  const std::string dir = testing::build_dir() + "/train_checkpoint_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  // The interrupted runs choose their algorithms with a cost model unlike this machine's; the
  // resumed run is not told, and must take it from the checkpoint: measuring the machine again
  // would pick other algorithms, whose float32 sums of three ranks round differently.
  const std::string pinned =
      "GRADSYNC_COST_MODEL=alpha_us=500,bandwidth_gbps=0.5,reduce_gbps=1,shm_call_us=100000 ";
  const std::string run = testing::build_dir() + "/tools/gradsync-run -n 3 --no-prefix -- " +
                          testing::build_dir() +
                          "/examples/gradsync-train --hidden 32 --max-steps 24 --quiet "
                          "--checkpoint-every 8 --lr-schedule cosine ";
  // Plain, a codec with residuals, ZeRO 3, whose checkpoint gathers the shards, and float16
  // training, whose loss scale is part of the state.
  const std::vector<std::pair<std::string, std::string>> variants = {{"plain", "none"},
                                                                     {"topk", "topk:ratio=0.1"},
                                                                     {"zero3", "bf16 --zero 3"},
                                                                     {"fp16", "none --amp fp16"}};
  for (const auto& [name, codec] : variants) {
    const std::string base = dir + "/" + name;
    auto r = testing::run_shell(pinned + run + "--codec " + codec + " --checkpoint " + base +
                                "-full --json " + base + "-full.json 2>&1");
    ASSERT_EQ(r.status, 0) << r.output;
    // Rank 0 aborts after writing its second checkpoint's temporary file, before the rename.
    r = testing::run_shell("GRADSYNC_TRAIN_CRASH_AT_SAVE=2 " + pinned + run + "--codec " + codec +
                           " --checkpoint " + base + "-crash 2>&1");
    ASSERT_NE(r.status, 0) << r.output;
    EXPECT_EQ(testing::read_file(base + "-crash/LATEST"), "8\n");
    EXPECT_TRUE(contains(testing::read_file(base + "-crash/COST_MODEL"), "alpha_us=500,"));
    r = testing::run_shell(run + "--codec " + codec + " --checkpoint " + base +
                           "-crash --resume --json " + base + "-resumed.json 2>&1");
    ASSERT_EQ(r.status, 0) << r.output;
    const auto full = losses_of(base + "-full.json"), resumed = losses_of(base + "-resumed.json");
    ASSERT_EQ(full.size(), 24u) << codec;
    ASSERT_EQ(resumed.size(), 16u) << codec;
    for (std::size_t i = 0; i < resumed.size(); ++i) {
      EXPECT_EQ(resumed[i], full[8 + i]) << codec << " step " << 8 + i;
    }
  }
  // A checkpoint of another model is refused, naming the file and the flag.
  auto r = testing::run_shell(testing::build_dir() + "/tools/gradsync-run -n 2 --no-prefix -- " +
                              testing::build_dir() +
                              "/examples/gradsync-train --hidden 16 --max-steps 24 --quiet "
                              "--checkpoint " +
                              dir + "/plain-full --resume 2>&1");
  EXPECT_NE(r.status, 0);
  EXPECT_TRUE(contains(r.output, "plain-full/step-24.rank-")) << r.output;
  // Another number of ranks alone is no mismatch (gradsync-run --min-ranks resumes that way).
  EXPECT_FALSE(contains(r.output, "gradsync-run -n")) << r.output;
  EXPECT_TRUE(contains(r.output, "written with --hidden 32; this run has --hidden 16")) << r.output;
  std::filesystem::remove_all(dir);
}

// gradsync-run --max-restarts 1: rank 0 fails in the middle of its second save; the launcher
// stops the other ranks and starts all three again, and the trainer, seeing
// GRADSYNC_RESTART_COUNT=1, resumes from the checkpoint of step 8 on its own. The steps after
// it repeat the uninterrupted run's losses bit for bit (ZeRO 1, so sharded optimizer state
// is restored too). A failure in every attempt ends the job after the restarts with the
// failing rank's code.
TEST(TrainerRestart, MaxRestartsResumesFromTheLatestCheckpointBitForBit) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist")) GTEST_SKIP() << "no data";
  const std::string dir = testing::build_dir() + "/train_restart_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const std::string pinned =
      "GRADSYNC_COST_MODEL=alpha_us=500,bandwidth_gbps=0.5,reduce_gbps=1,shm_call_us=100000 ";
  const std::string train = testing::build_dir() +
                            "/examples/gradsync-train --hidden 32 --max-steps 24 --quiet "
                            "--checkpoint-every 8 --zero 1 --optimizer adamw ";
  const std::string launcher = testing::build_dir() + "/tools/gradsync-run -n 3 --no-prefix ";
  auto r = testing::run_shell(pinned + launcher + "-- " + train + "--checkpoint " + dir +
                              "/full --json " + dir + "/full.json 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  // Only the first attempt fails.
  const std::string crash_once =
      "sh -c 'if [ \"$GRADSYNC_RESTART_COUNT\" = 0 ]; then export GRADSYNC_TRAIN_CRASH_AT_SAVE=2; "
      "fi; exec \"$@\"' sh ";
  r = testing::run_shell(pinned + launcher + "--max-restarts 1 -- " + crash_once + train +
                         "--checkpoint " + dir + "/restarted --json " + dir +
                         "/restarted.json 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "restarting every rank (restart 1 of 1, 3 ranks)")) << r.output;
  const auto full = losses_of(dir + "/full.json"), resumed = losses_of(dir + "/restarted.json");
  ASSERT_EQ(full.size(), 24u);
  ASSERT_EQ(resumed.size(), 16u) << r.output;
  for (std::size_t i = 0; i < resumed.size(); ++i) {
    EXPECT_EQ(resumed[i], full[8 + i]) << "step " << 8 + i;
  }
  EXPECT_EQ(testing::read_file(dir + "/restarted/LATEST"), "24\n");
  // Every attempt fails: two restarts, then the job ends with rank 0's failure.
  r = testing::run_shell(launcher +
                         "--max-restarts 2 -- sh -c '[ $RANK = 0 ] && exit 7; sleep 60' 2>&1");
  EXPECT_EQ(r.exit_code(), 7) << r.output;
  EXPECT_EQ(testing::count_of(r.output, "restarting every rank"), 2) << r.output;
  std::filesystem::remove_all(dir);
}

// gradsync-run --min-ranks 2: rank 0 of 3 fails in the middle of its second save; the job
// goes on with 2 ranks, which resume the 3 ranks' checkpoint of step 8 where their samples
// end (step 12 of the 2-rank epoch), with the learning rate scaled for the smaller batch. The
// losses are, bit for bit, those of a 2-rank run resumed by hand from the same checkpoint, and
// no file of the lost rank is left. ZeRO's sharded state is re-sharded at the smaller size.
TEST(TrainerRestart, MinRanksResumesTheCheckpointAtTheSmallerSize) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist")) GTEST_SKIP() << "no data";
  const std::string dir = testing::build_dir() + "/train_shrink_" + std::to_string(::getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string pinned =
      "GRADSYNC_COST_MODEL=alpha_us=500,bandwidth_gbps=0.5,reduce_gbps=1,shm_call_us=100000 ";
  const std::string launcher = testing::build_dir() + "/tools/gradsync-run --no-prefix ";
  const std::string train = testing::build_dir() +
                            "/examples/gradsync-train --hidden 32 --max-steps 24 --quiet "
                            "--checkpoint-every 8 --lr-scaling linear --codec topk:ratio=0.1 ";
  // By hand: 3 ranks fail at the second save; 2 ranks resume.
  auto r = testing::run_shell("GRADSYNC_TRAIN_CRASH_AT_SAVE=2 " + pinned + launcher + "-n 3 -- " +
                              train + "--checkpoint " + dir + "/by-hand 2>&1");
  ASSERT_NE(r.status, 0) << r.output;
  r = testing::run_shell(launcher + "-n 2 -- " + train + "--checkpoint " + dir +
                         "/by-hand --resume --json " + dir + "/by-hand.json 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  // By the launcher.
  const std::string crash_once =
      "sh -c 'if [ \"$GRADSYNC_RESTART_COUNT\" = 0 ]; then export GRADSYNC_TRAIN_CRASH_AT_SAVE=2; "
      "fi; exec \"$@\"' sh ";
  r = testing::run_shell(pinned + launcher + "-n 3 --max-restarts 1 --min-ranks 2 -- " +
                         crash_once + train + "--checkpoint " + dir + "/shrunk --json " + dir +
                         "/shrunk.json 2>&1");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "restarting every rank (restart 1 of 1, 2 ranks)")) << r.output;
  const auto by_hand = losses_of(dir + "/by-hand.json"), shrunk = losses_of(dir + "/shrunk.json");
  ASSERT_EQ(by_hand.size(), 12u);  // steps 12..23: 8 steps of 3 ranks are 12 of 2
  ASSERT_EQ(shrunk.size(), 12u) << r.output;
  EXPECT_EQ(shrunk, by_hand);
  EXPECT_EQ(testing::read_file(dir + "/shrunk/LATEST"), "24\n");
  for (const auto& entry : std::filesystem::directory_iterator(dir + "/shrunk")) {
    EXPECT_FALSE(contains(entry.path().filename().string(), ".rank-2.")) << entry.path();
  }
  // ZeRO 3 with AdamW, resumed by hand at 2 ranks: its shards and moments re-sharded, it
  // follows DDP resumed the same way (as ZeRO follows DDP, TrainerStrategies).
  const std::string adamw = "--codec none --optimizer adamw --checkpoint " + dir;
  std::vector<std::string> resumed[2];
  for (int zero : {0, 3}) {
    const std::string flags =
        adamw + "/zero" + std::to_string(zero) + " --zero " + std::to_string(zero);
    r = testing::run_shell("GRADSYNC_TRAIN_CRASH_AT_SAVE=2 " + pinned + launcher + "-n 3 -- " +
                           train + flags + " 2>&1");
    ASSERT_NE(r.status, 0) << r.output;
    const std::string json = dir + "/zero" + std::to_string(zero) + ".json";
    r = testing::run_shell(launcher + "-n 2 -- " + train + flags + " --resume --json " + json +
                           " 2>&1");
    ASSERT_EQ(r.status, 0) << r.output;
    resumed[zero / 3] = losses_of(json);
  }
  ASSERT_EQ(resumed[0].size(), 12u);
  ASSERT_EQ(resumed[1].size(), 12u);
  for (std::size_t i = 0; i < 12; ++i) {
    const double ddp = std::stod(resumed[0][i]);
    EXPECT_NEAR(std::stod(resumed[1][i]), ddp, 1e-4 * std::abs(ddp)) << "step " << 12 + i;
  }
  std::filesystem::remove_all(dir);
}

// Step-ahead error feedback moves where the gradient is computed by what the codec holds
// back: nothing for float32 (the same losses with it on or off), and for top-k nothing at
// the first step (nothing held back yet) and something at every later one.
TEST(TrainerStepAhead, MovesTheGradientOnlyByWhatTheCodecHoldsBack) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist")) GTEST_SKIP() << "no data";
  const std::string dir = testing::build_dir() + "/train_step_ahead_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const std::string run = testing::build_dir() + "/tools/gradsync-run -n 2 --no-prefix -- " +
                          testing::build_dir() +
                          "/examples/gradsync-train --hidden 32 --max-steps 6 --quiet ";
  for (const std::string codec : {"none", "topk:ratio=0.1"}) {
    std::vector<std::string> trajectory[2];
    for (int ahead : {0, 1}) {
      const std::string json = dir + "/" + std::to_string(ahead) + ".json";
      const auto r = testing::run_shell(run + "--codec " + codec + " --step-ahead " +
                                        std::to_string(ahead) + " --json " + json + " 2>&1");
      ASSERT_EQ(r.status, 0) << r.output;
      trajectory[ahead] = losses_of(json);
      EXPECT_TRUE(contains(testing::read_file(json),
                           std::string("\"step_ahead\": ") + (ahead ? "true" : "false")))
          << codec << " --step-ahead " << ahead;
    }
    ASSERT_EQ(trajectory[0].size(), 6u);
    ASSERT_EQ(trajectory[1].size(), 6u);
    EXPECT_EQ(trajectory[0][0], trajectory[1][0]) << codec;
    for (std::size_t step = 1; step < 6; ++step) {
      EXPECT_EQ(trajectory[0][step] == trajectory[1][step], codec == "none")
          << codec << " step " << step;
    }
  }
  std::filesystem::remove_all(dir);
}

// The loss as a number, from its text in the --json file.
std::vector<double> loss_values(const std::string& json_path) {
  std::vector<double> out;
  for (const std::string& text : losses_of(json_path)) out.push_back(std::stod(text));
  return out;
}

// ZeRO 1, 2 and 3 shard the same training DDP does: the same losses step for step, to the
// order of float32 sums (a reduce-scatter and a gather add in another order than an
// all-reduce), at 3 ranks whose shards cut the layers unevenly; ZeRO 3 keeps 1/3 of the
// parameters. With the bf16 wire the losses stay close. Accumulating 2 micro-batches, ZeRO 1
// (which sends their sum once) follows DDP accumulating alike.
TEST(TrainerStrategies, ZeroStagesFollowDdpsLosses) {
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist")) GTEST_SKIP() << "no data";
  const std::string dir = testing::build_dir() + "/train_strategies_" + std::to_string(::getpid());
  std::filesystem::create_directories(dir);
  const std::string run = testing::build_dir() + "/tools/gradsync-run -n 3 --no-prefix -- " +
                          testing::build_dir() +
                          "/examples/gradsync-train --hidden 40,24 --max-steps 12 --quiet "
                          "--optimizer adamw ";
  struct Variant {
    std::string flags;
    std::size_t reference;  // the trajectory it must follow
    double tolerance;       // relative
  };
  const std::vector<Variant> variants = {{"--zero 0", 0, 0},
                                         {"--zero 1", 0, 1e-4},
                                         {"--zero 2", 0, 1e-4},
                                         {"--zero 3", 0, 1e-4},
                                         {"--zero 3 --codec bf16", 0, 2e-2},
                                         {"--zero 0 --accumulate 2", 5, 0},
                                         {"--zero 1 --accumulate 2", 5, 1e-4}};
  std::vector<std::vector<double>> trajectories;
  for (const auto& [flags, reference, tolerance] : variants) {
    const std::string json = dir + "/" + std::to_string(trajectories.size()) + ".json";
    const auto r = testing::run_shell(run + flags + " --json " + json + " 2>&1");
    ASSERT_EQ(r.status, 0) << flags << "\n" << r.output;
    trajectories.push_back(loss_values(json));
    ASSERT_EQ(trajectories.back().size(), 12u) << flags;
    if (flags == "--zero 3") {
      // 784*40+40 + 40*24+24 + 24*10+10 = 32634 parameters in units of 31400, 984 and 250.
      const std::size_t shard = (31400 + 2) / 3 + 984 / 3 + (250 + 2) / 3;
      EXPECT_TRUE(contains(testing::read_file(json),
                           "\"parameter_bytes_per_rank\": " + std::to_string(4 * shard)))
          << testing::read_file(json);
    }
  }
  for (std::size_t t = 0; t < trajectories.size(); ++t) {
    const Variant& v = variants[t];
    for (std::size_t step = 0; step < 12; ++step) {
      EXPECT_NEAR(trajectories[t][step], trajectories[v.reference][step],
                  v.tolerance * std::abs(trajectories[v.reference][step]))
          << v.flags << " step " << step;
    }
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace gradsync
