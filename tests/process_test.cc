// Collectives across real processes over shm and tcp: the full check run through the
// launcher, and kill -9 of a rank mid-collective (every survivor must name the lost peer
// within 2 s and nothing may be left in /dev/shm).
#include <gtest/gtest.h>
#include <signal.h>
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
// survivors' logs.
std::vector<std::string> kill_one_rank(const std::string& transport, int n, int victim,
                                       const testing::TempDir& tmp) {
  const std::string worker = build_dir() + "/tests/collective_worker";
  const int port = 20000 + static_cast<int>(::getpid() % 20000);
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    pid_t pid = ::fork();
    if (pid == 0) {
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
  // Wait until every rank is inside the all-reduce loop.
  auto deadline = std::chrono::steady_clock::now() + 30s;
  for (int r = 0; r < n; ++r) {
    while (read_file(tmp.path() + "/rank" + std::to_string(r) + ".log").find("looping") ==
               std::string::npos &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(10ms);
    }
  }
  std::this_thread::sleep_for(200ms);  // let a few all-reduces run
  ::kill(pids[static_cast<std::size_t>(victim)], SIGKILL);
  std::vector<std::string> logs;
  for (int r = 0; r < n; ++r) {
    int status = 0;
    // Survivors must exit by themselves (exit code 4 = error detected); kill stragglers
    // after 10 s so a hang fails the test instead of the suite.
    auto until = std::chrono::steady_clock::now() + 10s;
    pid_t got = 0;
    while ((got = ::waitpid(pids[static_cast<std::size_t>(r)], &status, WNOHANG)) == 0 &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(5ms);
    }
    if (got == 0) {
      ::kill(pids[static_cast<std::size_t>(r)], SIGKILL);
      ::waitpid(pids[static_cast<std::size_t>(r)], &status, 0);
      ADD_FAILURE() << "rank " << r << " hung after the kill";
    }
    if (r != victim) {
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 4)
          << "rank " << r << " status " << status;
      logs.push_back(read_file(tmp.path() + "/rank" + std::to_string(r) + ".log"));
    }
  }
  return logs;
}

class KillNine : public ::testing::TestWithParam<std::string> {};

TEST_P(KillNine, SurvivorsNameTheLostPeerWithinTwoSeconds) {
  testing::TempDir tmp;
  const int n = 4, victim = 2;
  auto logs = kill_one_rank(GetParam(), n, victim, tmp);
  for (const auto& log : logs) {
    EXPECT_NE(log.find("peer 2"), std::string::npos) << log;
    auto at = log.find("detected after ");
    ASSERT_NE(at, std::string::npos) << log;
    long ms = std::stol(log.substr(at + 15));
    EXPECT_LT(ms, 2000) << log;
  }
  // This job's segments only (its token is "killtest"): tests running alongside have theirs.
  EXPECT_TRUE(testing::segments_left("gradsync-killtest").empty())
      << "left in /dev/shm: " << testing::segments_left("gradsync-killtest")[0];
}

INSTANTIATE_TEST_SUITE_P(Transports, KillNine, ::testing::Values("shm", "tcp"),
                         [](const auto& p) { return p.param; });

}  // namespace
}  // namespace gradsync
