// Checkpoints that are never lost or loaded wrong: a new run refuses a directory of another
// run's checkpoints (unless --overwrite); a resume refuses, naming the cause, a damaged file
// (checksum), a format it does not know, another run's flags, a LATEST or a position that is
// not one, a NaN weight, ranks that loaded different positions or weights; and a save that
// fails on one rank leaves the last complete set named and whole. Every refusal is an error
// exit before any rank trains or deletes anything. Runs the real gradsync-train under
// gradsync-run on Fashion-MNIST.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include "gradsync/optim.h"
#include "harness.h"
#include "train/checkpoint.h"

namespace gradsync {
namespace {

using testing::contains;

bool have_data() {
  return std::filesystem::exists("/usr/share/datasets/fashion-mnist");
}

// A small, fast run: 2 ranks (unless told), 60 steps per epoch. The cost model is pinned so
// that ranks reading no COST_MODEL file (their own directories) still choose alike.
std::string trainer(const std::string& flags, int ranks = 2) {
  return "GRADSYNC_COST_MODEL=alpha_us=500,bandwidth_gbps=0.5,reduce_gbps=1,shm_call_us=100000 " +
         testing::build_dir() + "/tools/gradsync-run -n " + std::to_string(ranks) +
         " --no-prefix -- " + testing::build_dir() +
         "/examples/gradsync-train --hidden 32 --batch 500 --quiet " + flags + " 2>&1";
}

std::string file_of(const std::string& dir, int step, int rank) {
  return dir + "/step-" + std::to_string(step) + ".rank-" + std::to_string(rank) + ".ckpt";
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// Rewrites a rank's file with `change` applied and a checksum that matches again: what a
// file that was written so would hold.
template <typename Change>
void rewrite(const std::string& path, Change change) {
  const std::string bytes = testing::read_file(path);
  train::CheckpointFile f = train::decode_checkpoint(
      {reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()}, path);
  change(f);
  const std::vector<std::uint8_t> out = train::encode_checkpoint(f);
  write_file(path, std::string(out.begin(), out.end()));
}

// A directory with the checkpoint of step 4 of a 2-rank run (LATEST = 4), and a refused run
// must leave it so.
class TrainerCheckpointSafety : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_data()) GTEST_SKIP() << "no data";
    const auto r =
        testing::run_shell(trainer("--max-steps 4 --checkpoint-every 2 --checkpoint " + dir()));
    ASSERT_EQ(r.status, 0) << r.output;
    ASSERT_EQ(testing::read_file(dir() + "/LATEST"), "4\n");
    saved_ = testing::read_file(file_of(dir(), 4, 0));
  }
  const std::string& dir() const { return tmp_.path(); }
  std::string resume(const std::string& flags, int ranks = 2) const {
    return trainer(
        "--max-steps 8 --checkpoint-every 2 --checkpoint " + dir() + " --resume " + flags, ranks);
  }
  // Refused: an error exit that names `why`, with the set of step 4 still named and whole.
  void expect_refused(const testing::ShellResult& r, const std::string& why) const {
    EXPECT_EQ(r.exit_code(), 1) << r.output;
    EXPECT_TRUE(contains(r.output, why)) << "wanted: " << why << "\n" << r.output;
    EXPECT_EQ(testing::read_file(dir() + "/LATEST"), "4\n");
    EXPECT_TRUE(testing::read_file(file_of(dir(), 4, 0)) == saved_) << "rank 0's file changed";
    EXPECT_TRUE(std::filesystem::exists(file_of(dir(), 4, 1)));
    EXPECT_FALSE(std::filesystem::exists(file_of(dir(), 6, 0))) << "a refused run trained";
  }

  testing::TempDir tmp_;
  std::string saved_;  // rank 0's file of step 4
};

TEST_F(TrainerCheckpointSafety, ANewRunRefusesADirectoryOfCheckpointsUnlessOverwrite) {
  expect_refused(
      testing::run_shell(trainer("--max-steps 8 --checkpoint-every 2 --checkpoint " + dir())),
      "holds checkpoints of another run (");
  auto r = testing::run_shell(trainer("--resume --overwrite --checkpoint " + dir()));
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  // --overwrite: the new run's set replaces the old one once it is complete.
  r = testing::run_shell(trainer("--max-steps 2 --checkpoint " + dir() + " --overwrite"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(testing::read_file(dir() + "/LATEST"), "2\n");
  EXPECT_FALSE(std::filesystem::exists(file_of(dir(), 4, 0)));
  EXPECT_TRUE(std::filesystem::exists(file_of(dir(), 2, 1)));
}

TEST_F(TrainerCheckpointSafety, AResumeWithOtherFlagsIsRefusedNamingEach) {
  expect_refused(testing::run_shell(resume("--batch 250")),
                 "written with --batch 500; this run has --batch 250");
  expect_refused(testing::run_shell(resume("--seed 2")),
                 "written with --seed 1; this run has --seed 2");
  expect_refused(testing::run_shell(resume("--codec topk:ratio=0.01")),
                 "written with --codec none; this run has --codec topk:ratio=0.01");
  expect_refused(testing::run_shell(resume("--optimizer adamw")),
                 "written with --optimizer sgd; this run has --optimizer adamw");
  // Recorded only where set away from the default: the file has none, this run one.
  expect_refused(testing::run_shell(resume("--weight-decay 0.1")),
                 "written with --weight-decay (not recorded); this run has --weight-decay 0.1");
  // Two differences at once: both named.
  const auto r = testing::run_shell(resume("--accumulate 2 --zero 1"));
  expect_refused(r, "written with --accumulate 1; this run has --accumulate 2");
  EXPECT_TRUE(contains(r.output, "written with --zero 0; this run has --zero 1")) << r.output;
  // Fewer ranks may resume (gradsync-run --min-ranks); more may not.
  expect_refused(testing::run_shell(resume("", 3)),
                 "written by 2 ranks; this run has 3: a checkpoint resumes on as many ranks or "
                 "fewer");
  // And the other way: a flag the files record that this run does not give.
  for (int rank : {0, 1}) {
    rewrite(file_of(dir(), 4, rank),
            [](train::CheckpointFile& f) { f.identity.emplace_back("--amp", "fp16"); });
  }
  saved_ = testing::read_file(file_of(dir(), 4, 0));
  expect_refused(testing::run_shell(resume("")),
                 "written with --amp fp16; this run has --amp (not given)");
}

TEST_F(TrainerCheckpointSafety, AChangedByteIsRefusedByTheChecksum) {
  std::string bytes = testing::read_file(file_of(dir(), 4, 1));
  bytes[bytes.size() / 3] ^= 1;  // the low bit of a weight: still a finite number
  write_file(file_of(dir(), 4, 1), bytes);
  expect_refused(testing::run_shell(resume("")),
                 "rank 1: checkpoint " + file_of(dir(), 4, 1) + ": checksum mismatch");
}

TEST_F(TrainerCheckpointSafety, AFormatItDoesNotKnowIsNamed) {
  std::string bytes = testing::read_file(file_of(dir(), 4, 0));
  bytes[4] = 7;  // the version field after "GSTC"
  write_file(file_of(dir(), 4, 0), bytes);
  saved_ = bytes;
  expect_refused(testing::run_shell(resume("")),
                 "written by checkpoint format v7; this build reads v3 and v4");
}

TEST_F(TrainerCheckpointSafety, ALatestThatIsNotAStepNumberIsRefusedNamingIt) {
  for (const std::string latest : {"abc\n", "-4\n", "4x\n", ""}) {
    write_file(dir() + "/LATEST", latest);
    const auto r = testing::run_shell(resume(""));
    EXPECT_EQ(r.exit_code(), 1) << r.output;
    EXPECT_TRUE(contains(r.output, dir() + "/LATEST holds '")) << r.output;
    EXPECT_TRUE(contains(r.output, "not the step number of a checkpoint")) << r.output;
    EXPECT_FALSE(std::filesystem::exists(file_of(dir(), 6, 0))) << "a refused run trained";
  }
}

TEST_F(TrainerCheckpointSafety, APositionOutOfRangeIsRefusedByName) {
  const std::string path = file_of(dir(), 4, 0);
  rewrite(path, [](train::CheckpointFile& f) { f.epoch = -2147483648LL; });
  saved_ = testing::read_file(path);
  expect_refused(testing::run_shell(resume("")), "position out of range");
  rewrite(path, [](train::CheckpointFile& f) {
    f.epoch = 0;
    f.step = 60;
  });
  saved_ = testing::read_file(path);
  expect_refused(testing::run_shell(resume("")),
                 "position out of range: step 60 of an epoch of 60 steps");
  rewrite(path, [](train::CheckpointFile& f) {
    f.epoch = 5;
    f.step = 0;
  });
  saved_ = testing::read_file(path);
  expect_refused(testing::run_shell(resume("")),
                 "position out of range: epoch 6 is beyond this run's --epochs 1");
  rewrite(path, [](train::CheckpointFile& f) {
    f.epoch = 0;
    f.step = 4;
    f.steps_done = 8;
  });
  saved_ = testing::read_file(path);
  expect_refused(testing::run_shell(resume("")), "holds step 8 where LATEST names 4");
}

// A run saved at the end of its 2 epochs resumed with --epochs 1: not a run of no steps.
TEST(TrainerCheckpointPosition, AnEpochBeyondEpochsIsRefused) {
  if (!have_data()) GTEST_SKIP() << "no data";
  testing::TempDir tmp;
  auto r = testing::run_shell(trainer("--epochs 2 --checkpoint " + tmp.path()));
  ASSERT_EQ(r.status, 0) << r.output;
  ASSERT_EQ(testing::read_file(tmp.path() + "/LATEST"), "120\n");
  r = testing::run_shell(trainer("--epochs 1 --resume --checkpoint " + tmp.path()));
  EXPECT_EQ(r.exit_code(), 1) << r.output;
  EXPECT_TRUE(contains(r.output, "position out of range: epoch 3 is beyond this run's --epochs 1"))
      << r.output;
}

TEST_F(TrainerCheckpointSafety, ANaNWeightIsRefusedNamingItsTensor) {
  const std::string path = file_of(dir(), 4, 1);
  rewrite(path, [](train::CheckpointFile& f) {
    f.values[784 * 32 + 3] = std::numeric_limits<float>::quiet_NaN();  // fc1.bias[3]
  });
  expect_refused(testing::run_shell(resume("")),
                 "rank 1: checkpoint " + path + ": fc1.bias holds NaN at element 3");
}

// Each file valid on its own, but rank 2's weights are not rank 0's and 1's: the replicas
// would train apart.
TEST(TrainerCheckpointReplicas, WeightsThatDifferAcrossRanksAreRefusedNamingTheRanks) {
  if (!have_data()) GTEST_SKIP() << "no data";
  testing::TempDir tmp;
  auto r = testing::run_shell(trainer("--max-steps 2 --checkpoint " + tmp.path(), 3));
  ASSERT_EQ(r.status, 0) << r.output;
  rewrite(file_of(tmp.path(), 2, 2),
          [](train::CheckpointFile& f) { f.values[100] = std::nextafter(f.values[100], 1.0f); });
  r = testing::run_shell(trainer("--max-steps 4 --resume --checkpoint " + tmp.path(), 3));
  EXPECT_EQ(r.exit_code(), 1) << r.output;
  EXPECT_TRUE(contains(r.output, "the weights rank(s) 2 loaded differ from those of rank(s) 0, 1"))
      << r.output;
  EXPECT_EQ(testing::read_file(tmp.path() + "/LATEST"), "2\n");
  EXPECT_FALSE(std::filesystem::exists(file_of(tmp.path(), 4, 0)));
}

// A run that --max-steps stops in the middle of an epoch saves where it stopped, and a resume
// with more --max-steps goes on from there instead of skipping the rest of the epoch.
TEST(TrainerCheckpointPosition, AStopByMaxStepsIsSavedWhereItStopped) {
  if (!have_data()) GTEST_SKIP() << "no data";
  testing::TempDir tmp;
  auto r = testing::run_shell(trainer("--max-steps 2 --checkpoint " + tmp.path()));
  ASSERT_EQ(r.status, 0) << r.output;
  const std::string bytes = testing::read_file(file_of(tmp.path(), 2, 0));
  const train::CheckpointFile f = train::decode_checkpoint(
      {reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()}, "step 2");
  EXPECT_EQ(f.epoch, 0);
  EXPECT_EQ(f.step, 2);
  r = testing::run_shell(trainer("--max-steps 5 --resume --checkpoint " + tmp.path()));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "1 epochs, 3 steps")) << r.output;
  EXPECT_EQ(testing::read_file(tmp.path() + "/LATEST"), "5\n");
}

// Each rank its own directory (as on hosts with local disks), one of them a save behind: the
// ranks are refused before either trains, and the newer set is kept.
TEST(TrainerCheckpointReplicas, RanksAtDifferentPositionsAreRefusedBeforeAnySave) {
  if (!have_data()) GTEST_SKIP() << "no data";
  testing::TempDir tmp;
  const std::string base = tmp.path();
  // gradsync-run sets RANK: each rank's --checkpoint is base/r<RANK>, through a shell.
  const auto run = [&](const std::string& flags) {
    return testing::run_shell(
        "GRADSYNC_COST_MODEL=alpha_us=500,bandwidth_gbps=0.5,reduce_gbps=1,shm_call_us=100000 " +
        testing::build_dir() + "/tools/gradsync-run -n 2 --no-prefix -- sh -c 'exec " +
        testing::build_dir() + "/examples/gradsync-train --hidden 32 --batch 500 --quiet " +
        "--checkpoint-every 4 --checkpoint " + base + "/r$RANK " + flags + "' 2>&1");
  };
  const auto sh = [](const std::string& cmd) { ASSERT_EQ(testing::run_shell(cmd).status, 0); };
  auto r = run("--max-steps 4");
  ASSERT_EQ(r.status, 0) << r.output;
  sh("cp " + base + "/r0/LATEST " + base + "/r1/ && cp -r " + base + "/r1 " + base + "/r1-at4");
  r = run("--max-steps 8 --resume");
  ASSERT_EQ(r.status, 0) << r.output;
  sh("rm -r " + base + "/r1 && mv " + base + "/r1-at4 " + base + "/r1");
  r = run("--max-steps 12 --resume");
  EXPECT_EQ(r.exit_code(), 1) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "the ranks stand at different positions: rank 0 at step 8 "
                       "(epoch 1, step 8), rank 1 at step 4 (epoch 1, step 4)"))
      << r.output;
  EXPECT_EQ(testing::read_file(base + "/r0/LATEST"), "8\n");
  EXPECT_TRUE(std::filesystem::exists(file_of(base + "/r0", 8, 0)));
  EXPECT_FALSE(std::filesystem::exists(file_of(base + "/r0", 12, 0)));
}

// Rank 1 cannot write its file of step 4: every rank fails, naming it, and LATEST still names
// step 2, whose files are all there.
TEST(TrainerCheckpointSave, AFailedWriteOnOneRankKeepsTheLastCompleteSet) {
  if (!have_data()) GTEST_SKIP() << "no data";
  testing::TempDir tmp;
  auto r =
      testing::run_shell(trainer("--max-steps 2 --checkpoint-every 2 --checkpoint " + tmp.path()));
  ASSERT_EQ(r.status, 0) << r.output;
  std::filesystem::create_directory(file_of(tmp.path(), 4, 1) + ".tmp");  // open() fails
  r = testing::run_shell(
      trainer("--max-steps 4 --checkpoint-every 2 --resume --checkpoint " + tmp.path()));
  EXPECT_EQ(r.exit_code(), 1) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "checkpoint of step 4 not saved (LATEST still names the previous "
                       "one): rank 1: cannot write " +
                           file_of(tmp.path(), 4, 1) + ".tmp"))
      << r.output;
  EXPECT_EQ(testing::read_file(tmp.path() + "/LATEST"), "2\n");
  EXPECT_TRUE(std::filesystem::exists(file_of(tmp.path(), 2, 0)));
  EXPECT_TRUE(std::filesystem::exists(file_of(tmp.path(), 2, 1)));
}

}  // namespace
// A run whose weights went NaN or infinite saves nothing: the last good set stays named and
// whole, and the error names the tensor (a resume would refuse such weights anyway).
TEST(TrainerCheckpointSave, NonFiniteWeightsDoNotReplaceTheLastGoodSet) {
  testing::TempDir tmp;
  const std::string dir = tmp.path() + "/ckpt";
  gradsync::Options options;
  options.size = 1;
  options.rank = 0;
  auto ctx = gradsync::init(options);
  auto model = train::make_model("mlp", 1, {8});
  auto optimizer = gradsync::optim::make_sgd(model->values().size());
  const train::RankState state{*ctx, *model, optimizer.get(), nullptr, nullptr, nullptr};
  const train::Identity identity = {{"--model", "mlp"}};
  train::save_checkpoint(dir, state, identity, {1, 0, 1}, 1);
  const std::string latest = testing::read_file(dir + "/LATEST");
  model->values()[model->values().size() - 2] = std::numeric_limits<float>::quiet_NaN();
  try {
    train::save_checkpoint(dir, state, identity, {2, 0, 2}, 2);
    ADD_FAILURE() << "NaN weights were saved";
  } catch (const std::runtime_error& e) {
    EXPECT_TRUE(contains(e.what(), "holds NaN at element")) << e.what();
    EXPECT_TRUE(contains(e.what(), "LATEST still names the previous one")) << e.what();
  }
  EXPECT_EQ(testing::read_file(dir + "/LATEST"), latest);
  EXPECT_TRUE(std::filesystem::exists(dir + "/step-1.rank-0.ckpt"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/step-2.rank-0.ckpt"));
}

}  // namespace gradsync
