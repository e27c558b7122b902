// A frozen rank (SIGSTOPped: alive to the kernel, which keeps ACKing its TCP connections,
// but running nothing) is named by every other rank when their calls time out, over tcp as
// over shm, rather than the peers each rank happened to wait for.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/store.h"
#include "harness.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using testing::contains;

constexpr int kRanks = 4;
constexpr int kFrozen = 2;

// One job of kRanks processes over `transport`: a few all-reduces that succeed, then rank
// kFrozen stops itself and the others go on calling all-reduce until it fails. Each
// survivor writes its error's kind, peer and message to <dir>/error<rank>; rank 0 kills the
// frozen rank once every survivor has written.
void run_job_with_a_frozen_rank(const std::string& transport, const std::string& dir) {
  auto status = testing::run_processes(
      kRanks,
      [&](int rank) -> int {
        Options o;
        o.rank = rank;
        o.size = kRanks;
        o.store = make_file_store(dir);
        o.transport = transport;
        o.cost_model = "alpha_us=5,bandwidth_gbps=5,reduce_gbps=5";  // no calibration
        // Long enough that only the timeout ends the survivors' call, however loaded the
        // machine: the frozen rank never moves again.
        o.timeout = 8s;
        auto ctx = init(o);
        std::vector<float> data(4096);
        for (int i = 0; i < 3; ++i) {
          std::fill(data.begin(), data.end(), 1.0f);
          ctx->allreduce(data.data(), data.data(), data.size(), DataType::kFloat32, ReduceOp::kSum);
          if (data[0] != static_cast<float>(kRanks)) return 20;
        }
        if (rank == kFrozen) {
          std::string pid = std::to_string(::getpid());
          o.store->set("frozen_pid", Bytes(pid.begin(), pid.end()));
          ::raise(SIGSTOP);
          return 0;  // only once rank 0 let it go on, which it never does: it kills it
        }
        std::string line;
        try {
          for (;;) {
            ctx->allreduce(data.data(), data.data(), data.size(), DataType::kFloat32,
                           ReduceOp::kSum);
          }
        } catch (const Error& e) {
          line = std::string(to_string(e.kind())) + " peer=" + std::to_string(e.peer()) + " " +
                 e.what();
        }
        o.store->set("error" + std::to_string(rank), Bytes(line.begin(), line.end()));
        if (rank == 0) {
          for (int r = 1; r < kRanks; ++r) {
            if (r != kFrozen) o.store->get("error" + std::to_string(r), 60000ms);
          }
          Bytes pid = o.store->get("frozen_pid", 1000ms);
          ::kill(std::stoi(std::string(pid.begin(), pid.end())), SIGKILL);
        }
        return 0;
      },
      120);
  for (int r = 0; r < kRanks; ++r) {
    const int st = status[static_cast<std::size_t>(r)];
    if (r == kFrozen) {
      EXPECT_TRUE(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) << st;
    } else {
      EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "rank " << r << ": " << st;
    }
  }
}

class FrozenRank : public ::testing::TestWithParam<std::string> {};

TEST_P(FrozenRank, EveryRankNamesTheStoppedOneWhenItsCallTimesOut) {
  testing::TempDir dir;
  run_job_with_a_frozen_rank(GetParam(), dir.path());
  auto store = make_file_store(dir.path());
  // tcp: the frozen rank does not answer the probe the others send on a timeout, though
  // its connections look alive; shm: its process state says it is stopped.
  const std::string named = GetParam() == "tcp" ? "rank 2 at " : "rank 2 (process ";
  const std::string why = GetParam() == "tcp" ? "does not answer" : "is stopped";
  bool timeout_names_it = false;
  for (int r = 0; r < kRanks; ++r) {
    if (r == kFrozen) continue;
    Bytes b = store->get("error" + std::to_string(r), 1000ms);
    const std::string line(b.begin(), b.end());
    // Its own timeout, or the abort of the rank whose timeout came first: either way, the
    // message names the frozen rank, not only whichever peer this rank waited for.
    EXPECT_TRUE(contains(line, "timeout") || contains(line, "aborted")) << line;
    EXPECT_TRUE(contains(line, named) && contains(line, why)) << "rank " << r << ": " << line;
    timeout_names_it |= contains(line, "timeout peer=2 ");
  }
  EXPECT_TRUE(timeout_names_it) << "no rank's timeout has the frozen rank as its peer";
}

INSTANTIATE_TEST_SUITE_P(Transports, FrozenRank, ::testing::Values("tcp", "shm"),
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

}  // namespace
}  // namespace gradsync
