// Collectives across real processes over shm and tcp: the full check run through the
// launcher, and kill -9 of a rank mid-collective (every survivor must fail naming the lost
// peer, and nothing may be left in /dev/shm).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "harness.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;

using testing::build_dir;
using testing::count_of;
using testing::read_file;
using testing::run_shell;

class ThroughLauncher : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(ThroughLauncher, EveryCollectiveMatchesReference) {
  const auto [transport, n] = GetParam();
  const std::string dir = build_dir();
  testing::ShellResult r =
      run_shell("GRADSYNC_TRANSPORT=" + transport + " GRADSYNC_TIMEOUT=60000 " + dir +
                "/tools/gradsync-run -n " + std::to_string(n) + " -- " + dir +
                "/tests/collective_worker check");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "all checks passed, transport to rank"), n) << r.output;
  EXPECT_EQ(count_of(r.output, ": " + transport + "\n"), n) << r.output;
}

INSTANTIATE_TEST_SUITE_P(Transports, ThroughLauncher,
                         ::testing::Combine(::testing::Values("shm", "tcp"),
                                            ::testing::Values(2, 4)),
                         [](const auto& p) {
                           return std::get<0>(p.param) + "_n" +
                                  std::to_string(std::get<1>(p.param));
                         });

// Starts `n` workers directly (no launcher, so nobody stops the survivors for us), each
// with its own log file, kills `victim` with SIGKILL once all are looping, and returns the
// survivors' logs. No time limit of its own: a survivor that does not notice the loss ends at
// its GRADSYNC_TIMEOUT (and the test fails on its timeout error); one that hangs regardless
// is ended by the test's CTest timeout, and then dies with this process (PR_SET_PDEATHSIG).
std::vector<std::string> kill_one_rank(const std::string& transport, int n, int victim,
                                       const testing::TempDir& tmp) {
  const std::string worker = build_dir() + "/tests/collective_worker";
  const int port = 20000 + static_cast<int>(::getpid() % 20000);
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      std::string log = tmp.path() + "/rank" + std::to_string(r) + ".log";
      std::freopen(log.c_str(), "w", stdout);
      std::freopen(log.c_str(), "a", stderr);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(n).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("GRADSYNC_TRANSPORT", transport.c_str(), 1);
      ::setenv("GRADSYNC_TOKEN", "killtest", 1);
      ::setenv("GRADSYNC_TIMEOUT", "30000", 1);
      ::execl(worker.c_str(), worker.c_str(), "loop", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  // Wait until every rank is inside the all-reduce loop (or one failed before it: setup ends
  // at GRADSYNC_TIMEOUT at the latest).
  for (int r = 0; r < n; ++r) {
    while (read_file(tmp.path() + "/rank" + std::to_string(r) + ".log").find("looping") ==
           std::string::npos) {
      int status = 0;
      if (::waitpid(pids[static_cast<std::size_t>(r)], &status, WNOHANG) != 0) {
        ADD_FAILURE() << "rank " << r << " ended before looping: "
                      << read_file(tmp.path() + "/rank" + std::to_string(r) + ".log");
        for (pid_t pid : pids) ::kill(pid, SIGKILL);
        for (pid_t pid : pids) ::waitpid(pid, &status, 0);
        return {};
      }
      std::this_thread::sleep_for(10ms);
    }
  }
  std::this_thread::sleep_for(200ms);  // let a few all-reduces run
  ::kill(pids[static_cast<std::size_t>(victim)], SIGKILL);
  std::vector<std::string> logs;
  for (int r = 0; r < n; ++r) {
    int status = 0;
    // Survivors must exit by themselves (exit code 4 = error detected).
    ::waitpid(pids[static_cast<std::size_t>(r)], &status, 0);
    if (r != victim) {
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 4)
          << "rank " << r << " status " << status;
      logs.push_back(read_file(tmp.path() + "/rank" + std::to_string(r) + ".log"));
    }
  }
  return logs;
}

class KillNine : public ::testing::TestWithParam<std::string> {};

// Every survivor fails with the loss of rank 2: its own kPeerLost naming peer 2, or the abort
// of a rank that saw it first, whose reason quotes that error. Not a timeout: the workers'
// GRADSYNC_TIMEOUT is what a survivor that missed the death would run into.
TEST_P(KillNine, SurvivorsNameTheLostPeer) {
  testing::TempDir tmp;
  const int n = 4, victim = 2;
  auto logs = kill_one_rank(GetParam(), n, victim, tmp);
  EXPECT_EQ(logs.size(), static_cast<std::size_t>(n - 1));
  for (const auto& log : logs) {
    const auto error = log.find("detected after ");
    ASSERT_NE(error, std::string::npos) << log;
    EXPECT_NE(log.find("peer lost", error), std::string::npos) << log;
    EXPECT_NE(log.find("(peer 2)", error), std::string::npos) << log;
    EXPECT_EQ(log.find("timeout", error), std::string::npos) << log;
  }
  // This job's segments only (its token is "killtest"): tests running alongside have theirs.
  EXPECT_TRUE(testing::segments_left("gradsync-killtest").empty())
      << "left in /dev/shm: " << testing::segments_left("gradsync-killtest")[0];
}

INSTANTIATE_TEST_SUITE_P(Transports, KillNine, ::testing::Values("shm", "tcp"),
                         [](const auto& p) { return p.param; });

}  // namespace
}  // namespace gradsync
