// Collectives across real processes over shm and tcp: the full check run through the
// launcher, and kill -9 of a rank mid-collective (every survivor must fail naming the lost
// peer, and nothing may be left in /dev/shm);
// and ranks started by hand with mistakes the rendezvous must name on every rank at once
// (different WORLD_SIZEs, one RANK twice), where rank 0's store listens, its token warning.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <sstream>
#include <thread>

#include "harness.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;

using testing::build_dir;
using testing::count_of;
using testing::free_port;
using testing::listening_address;
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

#ifdef GRADSYNC_TEST_SANITIZED
// Each worker runs every collective at sizes up to 12 MiB, several times slower under a
// sanitizer: one world size there, odd (a ring and a halving that do not pair up evenly); the
// Release suite runs 2 and 4.
constexpr int kLauncherWorlds[] = {3};
#else
constexpr int kLauncherWorlds[] = {2, 4};
#endif

INSTANTIATE_TEST_SUITE_P(Transports, ThroughLauncher,
                         ::testing::Combine(::testing::ValuesIn(testing::process_transports()),
                                            ::testing::ValuesIn(kLauncherWorlds)),
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
      std::freopen(log.c_str(), "a", stdout);  // both streams append: neither overwrites
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

INSTANTIATE_TEST_SUITE_P(Transports, KillNine, ::testing::ValuesIn(testing::process_transports()),
                         [](const auto& p) { return p.param; });

// --- Rendezvous mistakes, with ranks started by hand ---------------------------------------

pid_t start_by_hand(const std::string& log, const std::map<std::string, std::string>& env) {
  return testing::start_worker_by_hand("check", log, env);
}

struct HandRank {
  int rank, world_size;
  std::string token = "handjob";
  std::string timeout_ms = "120000";
};

// Starts one worker per entry (rank 0 first), waits for all of them, and returns each one's
// pid and log. No time limit of its own: a rank that never learns of the mistake ends at
// GRADSYNC_TIMEOUT, and its log then names a timeout rather than the mistake.
std::vector<std::pair<pid_t, std::string>> run_by_hand(const std::vector<HandRank>& ranks,
                                                       const testing::TempDir& tmp) {
  const int port = free_port();
  std::vector<std::pair<pid_t, std::string>> out;
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    const std::string log = tmp.path() + "/rank" + std::to_string(i) + ".log";
    pid_t pid = start_by_hand(log, {{"RANK", std::to_string(ranks[i].rank)},
                                    {"WORLD_SIZE", std::to_string(ranks[i].world_size)},
                                    {"MASTER_ADDR", "127.0.0.1"},
                                    {"MASTER_PORT", std::to_string(port)},
                                    {"GRADSYNC_TOKEN", ranks[i].token},
                                    {"GRADSYNC_TIMEOUT", ranks[i].timeout_ms}});
    out.emplace_back(pid, log);
  }
  for (auto& [pid, log] : out) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0)
        << "status " << status << ": " << read_file(log);
    log = read_file(log);
  }
  return out;
}

// Every rank, the ones that wait for others included, fails naming both sides.
TEST(Rendezvous, RanksStartedWithDifferentWorldSizesAllNameTheMismatch) {
  testing::TempDir tmp;
  auto ranks = run_by_hand({{0, 3}, {1, 3}, {2, 4}}, tmp);
  const std::string odd = "rank 2 (pid " + std::to_string(ranks[2].first) + " on host ";
  for (const auto& [pid, log] : ranks) {
    EXPECT_TRUE(testing::contains(log, odd)) << log;
    EXPECT_TRUE(
        testing::contains(log, "was started with WORLD_SIZE=4 but rank 0 with WORLD_SIZE=3"))
        << log;
    EXPECT_FALSE(testing::contains(log, "GRADSYNC_TOKEN is not set")) << log;
  }
}

TEST(Rendezvous, TwoProcessesClaimingOneRankAreNamedOnEveryRank) {
  testing::TempDir tmp;
  auto ranks = run_by_hand({{0, 3}, {1, 3}, {1, 3}}, tmp);
  for (const auto& [pid, log] : ranks) {
    EXPECT_TRUE(testing::contains(log, "two processes claim rank 1: pid ")) << log;
    EXPECT_TRUE(testing::contains(log, "pid " + std::to_string(ranks[1].first) + " on host"))
        << log;
    EXPECT_TRUE(testing::contains(log, "pid " + std::to_string(ranks[2].first) + " on host"))
        << log;
  }
}

// A rank started with another GRADSYNC_TOKEN is refused at once; it cannot end the job (a
// stranger at the port could then end any job), so the others wait for it until their timeout,
// whose error then says why it never came.
TEST(Rendezvous, ARankWithAnotherTokenIsNamedInTheTimeoutOfTheOthers) {
  testing::TempDir tmp;
  auto ranks = run_by_hand({{0, 2, "handjob", "3000"}, {1, 2, "another", "3000"}}, tmp);
  EXPECT_TRUE(testing::contains(ranks[1].second, "wrong token")) << ranks[1].second;
  EXPECT_TRUE(testing::contains(ranks[0].second,
                                "rank 1 (pid " + std::to_string(ranks[1].first) + " on host"))
      << ranks[0].second;
  EXPECT_TRUE(testing::contains(ranks[0].second, "its GRADSYNC_TOKEN differs from this job's"))
      << ranks[0].second;
}

// Rank 0 of a job whose MASTER_ADDR is 127.0.0.1 serves the store there, not on every
// interface, and says (once) that it runs without a token.
TEST(Rendezvous, TheStoreListensWhereRanksDialItAndWarnsWithoutAToken) {
  testing::TempDir tmp;
  const int port = free_port();
  const std::string log = tmp.path() + "/rank0.log";
  pid_t pid = start_by_hand(log, {{"RANK", "0"},
                                  {"WORLD_SIZE", "2"},
                                  {"MASTER_ADDR", "127.0.0.1"},
                                  {"MASTER_PORT", std::to_string(port)},
                                  {"GRADSYNC_TIMEOUT", "120000"}});
  std::string address;
  int status = 0;
  // Until the store listens and the warning (written just after) is out, or the rank ended.
  while (((address = listening_address(port)).empty() ||
          count_of(read_file(log), "GRADSYNC_TOKEN is not set") == 0) &&
         ::waitpid(pid, &status, WNOHANG) == 0) {
    std::this_thread::sleep_for(10ms);
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  EXPECT_EQ(address, "0100007F") << "the store listens on " << address << " (hex), not 127.0.0.1";
  EXPECT_EQ(count_of(read_file(log), "GRADSYNC_TOKEN is not set"), 1) << read_file(log);
}

// GRADSYNC_STORE_BIND tells the store where to listen instead: here every interface.
TEST(Rendezvous, TheStoreListensWhereGradsyncStoreBindSays) {
  testing::TempDir tmp;
  const int port = free_port();
  pid_t pid = start_by_hand(tmp.path() + "/rank0.log", {{"RANK", "0"},
                                                        {"WORLD_SIZE", "2"},
                                                        {"MASTER_ADDR", "127.0.0.1"},
                                                        {"MASTER_PORT", std::to_string(port)},
                                                        {"GRADSYNC_STORE_BIND", "0.0.0.0"},
                                                        {"GRADSYNC_TOKEN", "bind"},
                                                        {"GRADSYNC_TIMEOUT", "120000"}});
  std::string address;
  int status = 0;
  while ((address = listening_address(port)).empty() && ::waitpid(pid, &status, WNOHANG) == 0) {
    std::this_thread::sleep_for(10ms);
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  EXPECT_EQ(address, "00000000") << "the store listens on " << address << " (hex), not 0.0.0.0";
}

// A second RANK=0 cannot host the store where the first does: it presents itself to the first
// one's store, which fails both, naming both processes (the first used to wait for the whole
// timeout for the rank 1 that never came).
TEST(Rendezvous, ASecondRankZeroIsNamedOnBothProcesses) {
  testing::TempDir tmp;
  const int port = free_port();
  const std::map<std::string, std::string> env = {{"RANK", "0"},
                                                  {"WORLD_SIZE", "2"},
                                                  {"MASTER_ADDR", "127.0.0.1"},
                                                  {"MASTER_PORT", std::to_string(port)},
                                                  {"GRADSYNC_TOKEN", "twice"},
                                                  {"GRADSYNC_TIMEOUT", "120000"}};
  pid_t first = start_by_hand(tmp.path() + "/first.log", env);
  int status = 0;
  while (listening_address(port).empty() && ::waitpid(first, &status, WNOHANG) == 0) {
    std::this_thread::sleep_for(10ms);
  }
  pid_t second = start_by_hand(tmp.path() + "/second.log", env);
  ::waitpid(second, &status, 0);
  int first_status = 0;
  ::waitpid(first, &first_status, 0);
  for (const auto& [log, exit_status] :
       {std::pair{read_file(tmp.path() + "/first.log"), first_status},
        std::pair{read_file(tmp.path() + "/second.log"), status}}) {
    EXPECT_TRUE(WIFEXITED(exit_status) && WEXITSTATUS(exit_status) != 0) << log;
    EXPECT_TRUE(testing::contains(log, "two processes claim rank 0")) << log;
    EXPECT_TRUE(testing::contains(log, "pid " + std::to_string(first) + " on host")) << log;
    EXPECT_TRUE(testing::contains(log, "pid " + std::to_string(second) + " on host")) << log;
  }
}

}  // namespace
}  // namespace gradsync
