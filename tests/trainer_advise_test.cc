// gradsync-probe and gradsync-advise as a user runs them: a profile probed by two ranks loads
// and describes them, the advisor prints and writes its prediction from it, and bad flags or
// an unreadable profile are refused with exit code 2 and the reason.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gradsync/advise.h"
#include "gradsync/compress.h"
#include "harness.h"

namespace gradsync {
namespace {

std::string tool(const std::string& path) {
  return testing::build_dir() + path;
}

class TrainerAdvise : public ::testing::Test {
 protected:
  // Under CTest every case reads the one profile its fixture TrainerAdvise.ProbeTheProfile
  // probed (tests/CMakeLists.txt): each case is a process of its own, and a probe takes longer
  // than most cases. Run by hand, the suite probes into a file of its own and removes it.
  static void SetUpTestSuite() {
    if (const char* shared = std::getenv("GRADSYNC_TEST_ADVISE_PROFILE")) {
      profile_ = shared;
      ASSERT_TRUE(std::filesystem::exists(profile_)) << profile_ << ": run its CTest fixture";
      return;
    }
    profile_ = ::testing::TempDir() + testing::unique_name("trainer_advise_profile") + ".json";
    owned_ = true;
    const auto r = testing::run_shell(tool("/tools/gradsync-run") + " -n 2 -- " +
                                      tool("/examples/gradsync-probe") +
                                      " --model cnn --repeats 3 --json " + profile_ + " 2>&1");
    ASSERT_EQ(r.exit_code(), 0) << r.output;
  }
  static void TearDownTestSuite() {
    if (owned_) std::remove(profile_.c_str());
  }
  static std::string profile_;
  static bool owned_;
};
std::string TrainerAdvise::profile_;
bool TrainerAdvise::owned_ = false;

TEST_F(TrainerAdvise, ProbedProfileDescribesTheRanks) {
  const advise::Profile p = advise::load_profile(profile_);
  EXPECT_GT(p.compute_gflops, 0);
  EXPECT_GT(p.optimizer_gbps, 0);
  EXPECT_GT(p.copy_gbps, 0);
  EXPECT_GT(p.intra.bandwidth_gbps, 0);
  for (double speed : {p.overlap_compute_speed, p.overlap_comm_speed, p.overlap_codec_compute_speed,
                       p.overlap_codec_speed}) {
    EXPECT_GT(speed, 0);
    EXPECT_LE(speed, 1);
  }
  ASSERT_FALSE(p.timed.empty());
  for (const char* collective : {"allreduce", "reduce_scatter", "allgather"}) {
    EXPECT_TRUE(std::any_of(p.timed.begin(), p.timed.end(), [&](const auto& t) {
      return t.collective == collective;
    })) << collective;
  }
  for (const auto& t : p.timed) {
    EXPECT_EQ(t.ranks, 2);
    EXPECT_EQ(t.hosts, 1);
    EXPECT_GT(t.us, 0);
  }
  for (const auto& name : compress::codec_names()) {
    ASSERT_EQ(p.codecs.count(name), 1u) << name;
    EXPECT_EQ(p.codecs.at(name).size(), 2u) << name;  // two tensor sizes
    for (const auto& at : p.codecs.at(name)) EXPECT_GT(at.encode_gbps, 0) << name;
  }
}

TEST_F(TrainerAdvise, AdvisorPrintsAndWritesItsPrediction) {
  const std::string json = ::testing::TempDir() + "trainer_advise.json";
  const auto r =
      testing::run_shell(tool("/tools/gradsync-advise") + " --profile " + profile_ +
                         " --model cnn --ranks 2 --bucket-mb 0.01 --json " + json + " 2>&1");
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "bottleneck: ")) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "predicted step ")) << r.output;
  std::ifstream in(json);
  std::stringstream text;
  text << in.rdbuf();
  for (const char* key :
       {"\"predicted\"", "\"step_s\"", "\"compute_s\"", "\"comm_s\"", "\"exposed_comm_s\"",
        "\"memory_per_rank_bytes\"", "\"bottleneck\"", "\"recommendations\""}) {
    EXPECT_TRUE(testing::contains(text.str(), key)) << key << " in " << text.str();
  }
  std::remove(json.c_str());

  // --plot draws the plan and each change (gnuplot, which scripts/install-deps.sh installs).
  const std::string png = ::testing::TempDir() + "trainer_advise.png";
  const auto drawn =
      testing::run_shell(tool("/tools/gradsync-advise") + " --profile " + profile_ +
                         " --model cnn --ranks 2 --bucket-mb 0.01 --plot " + png + " 2>&1");
  ASSERT_EQ(drawn.exit_code(), 0) << drawn.output;
  std::ifstream image(png, std::ios::binary);
  char magic[4] = {};
  image.read(magic, 4);
  EXPECT_EQ(std::string(magic + 1, 3), "PNG");
  std::remove(png.c_str());
}

// A real trace: two ranks of gradsync-train with GRADSYNC_TIMELINE, then the advisor reads it
// alone, and beside a prediction.
TEST_F(TrainerAdvise, ReadsATraceOfATrainingRun) {
  const std::string trace = ::testing::TempDir() + "trainer_advise_trace.json";
  auto r = testing::run_shell("GRADSYNC_TIMELINE=" + trace + " " + tool("/tools/gradsync-run") +
                              " -n 2 -- " + tool("/examples/gradsync-train") +
                              " --model cnn --max-steps 6 --quiet 2>&1");
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  r = testing::run_shell(tool("/tools/gradsync-advise") + " --trace " + trace + " 2>&1");
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(
      testing::contains(r.output, "measured (" + trace + ", gradsync-train, 2 ranks, 6 steps"))
      << r.output;
  EXPECT_TRUE(testing::contains(r.output, "buckets (median all-reduce): #0 ")) << r.output;
  r = testing::run_shell(tool("/tools/gradsync-advise") + " --trace " + trace + " --profile " +
                         profile_ + " --model cnn 2>&1");
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "predicted step ")) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "2 ranks on 1 hosts")) << r.output;  // the trace's
  std::remove(trace.c_str());
}

// --confirm runs the plan and the top changes with gradsync-train here, and prints both.
TEST_F(TrainerAdvise, ConfirmRunsTheCandidates) {
  const auto r = testing::run_shell(tool("/tools/gradsync-advise") + " --profile " + profile_ +
                                    " --model cnn --ranks 2 --confirm 3 2>&1");
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "confirmed on this host (gradsync-train, 3 steps"))
      << r.output;
  EXPECT_TRUE(testing::contains(r.output, "\nnow ")) << r.output;
  EXPECT_FALSE(testing::contains(r.output, "(run failed)")) << r.output;
}

// A shipped GPU profile, as nccl-tests would be read: one size, a given algorithm, as JSON.
TEST(AdviseCollectiveTool, PredictsNcclTestsStyleBusBandwidth) {
  const std::string json = ::testing::TempDir() + "advise_collective.json";
  const auto r =
      testing::run_shell(tool("/tools/gradsync-advise") + " --profile " + testing::source_dir() +
                         "/profiles/dgx-h100-8xndr.json --collective allreduce --ranks "
                         "8 --bytes 4294967296 --algo ring --json " +
                         json + " 2>&1");
  ASSERT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(testing::contains(r.output, "allreduce, 8 ranks on 1 hosts")) << r.output;
  std::stringstream text;
  text << std::ifstream(json).rdbuf();
  EXPECT_TRUE(testing::contains(text.str(), "\"bytes\": 4294967296")) << text.str();
  EXPECT_TRUE(testing::contains(text.str(), "\"algorithm\": \"ring\"")) << text.str();
  // The profile's NVLink rate is its ring's bus bandwidth: the reduction rides the transfer.
  const auto p = advise::load_profile(testing::source_dir() + "/profiles/dgx-h100-8xndr.json");
  const auto c =
      advise::predict_collective(p, "allreduce", 8, 1, std::size_t{1} << 32, Algorithm::kRing);
  EXPECT_NEAR(c.busbw_gbps, p.intra.bandwidth_gbps, 0.01 * p.intra.bandwidth_gbps);
  std::remove(json.c_str());
}

TEST_F(TrainerAdvise, BadFlagsAndProfilesAreRefused) {
  const std::string advise = tool("/tools/gradsync-advise");
  const std::pair<std::string, const char*> cases[] = {
      {"--model cnn", "--profile FILE (see gradsync-probe) or --trace FILE is needed"},
      {"--trace /nonexistent.json", "trace /nonexistent.json: cannot be opened"},
      {"--profile " + profile_ + " --ranks 4 --hosts 2 --confirm 5",
       "--confirm on several hosts needs --launcher"},
      {"--profile " + profile_ + " --zero 4", "--zero: '4' is not an integer in [0, 3]"},
      {"--profile " + profile_ + " --model resnet", "model 'resnet'"},
      {"--profile " + profile_ + " --model cnn --hidden 64", "--hidden is for --model mlp"},
      {"--profile " + profile_ + " --ranks 3 --hosts 2", "ranks must be a multiple of hosts"},
      {"--profile /nonexistent/profile.json", "profile /nonexistent/profile.json: cannot be"},
      {"--profile " + profile_ + " --bucket-mb 0", "--bucket-mb: '0' is not a number in (0, "},
      {"--profile " + profile_ + " --layers x.json --model cnn", "--layers FILE or --model"},
      {"--profile " + profile_ + " --layers /nonexistent.json", "workload /nonexistent.json"},
      {"--profile " + profile_ + " --collective bcast", "--collective: 'bcast' is not"},
      {"--profile " + profile_ + " --bytes 4096", "--bytes goes with --collective"},
      {"--profile " + profile_ + " --collective allreduce --algo tree", "unknown algorithm 'tree'"},
      {"--collective allreduce", "--profile FILE"},
  };
  for (const auto& [args, want] : cases) {
    const auto r = testing::run_shell(advise + " " + args + " 2>&1");
    EXPECT_EQ(r.exit_code(), 2) << args << ": " << r.output;
    EXPECT_TRUE(testing::contains(r.output, want)) << args << ": " << r.output;
  }
}

}  // namespace
}  // namespace gradsync
