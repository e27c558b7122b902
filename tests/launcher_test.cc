// gradsync-run, driven as a user would drive it: environment of the ranks, prefixed output,
// the report of the first failed rank, teardown of the others, signal forwarding, shm cleanup.
// Ranks are small sh scripts, so these tests need nothing of the library. No test has a time
// limit of its own: every wait blocks until what it waits for happens, and a launcher that
// never finishes is ended by the test's CTest timeout, which it does not outlive (it gets
// SIGKILL when this process dies, PR_SET_PDEATHSIG, and its ranks die with it).
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "harness.h"

extern char** environ;

namespace {

using Clock = std::chrono::steady_clock;

std::string launcher_path() {
  auto exe = std::filesystem::read_symlink("/proc/self/exe");
  return (exe.parent_path() / ".." / "tools" / "gradsync-run").lexically_normal().string();
}

struct Result {
  int status = -1;  // wait status of the launcher
  std::string out, err;
  double seconds = 0;  // from start to exit: only a lower bound of it is ever asserted

  int exit_code() const { return WIFEXITED(status) ? WEXITSTATUS(status) : -1; }
};

struct RunSpec {
  std::vector<std::string> args;           // after "gradsync-run"
  std::map<std::string, std::string> env;  // set for the launcher ("" value: unset)
  // Called once, with the launcher's pid, when `ready(out)` first holds.
  std::function<bool(const std::string&)> ready;
  std::function<void(pid_t)> action;
};

Result run_launcher(const RunSpec& spec) {
  Result res;
  std::string exe = launcher_path();
  if (::access(exe.c_str(), X_OK) != 0) {
    ADD_FAILURE() << exe << " not found: build the gradsync-run target";
    return res;
  }
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    if (!spec.env.count(kv.substr(0, kv.find('=')))) env.push_back(kv);
  }
  for (const auto& [k, v] : spec.env) {
    if (!v.empty()) env.push_back(k + "=" + v);
  }
  std::vector<char*> envp, argv{exe.data()};
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = spec.args;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  int out[2], err[2];
  EXPECT_EQ(::pipe2(out, O_CLOEXEC), 0);
  EXPECT_EQ(::pipe2(err, O_CLOEXEC), 0);
  auto start = Clock::now();
  const pid_t test = ::getpid();
  pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != test) ::_exit(126);  // the test died before prctl took effect
    ::dup2(out[1], 1);
    ::dup2(err[1], 2);
    ::execve(argv[0], argv.data(), envp.data());
    ::_exit(126);
  }
  ::close(out[1]);
  ::close(err[1]);
  bool acted = false;
  int open_fds = 2;
  pollfd fds[2] = {{out[0], POLLIN, 0}, {err[0], POLLIN, 0}};
  while (open_fds > 0) {
    ::poll(fds, 2, -1);
    for (int k = 0; k < 2; ++k) {
      if (fds[k].fd < 0 || !fds[k].revents) continue;
      char buf[4096];
      ssize_t n = ::read(fds[k].fd, buf, sizeof buf);
      if (n > 0) {
        (k == 0 ? res.out : res.err).append(buf, static_cast<std::size_t>(n));
      } else {
        ::close(fds[k].fd);
        fds[k].fd = -1;
        --open_fds;
      }
    }
    if (!acted && spec.action && spec.ready(res.out)) {
      acted = true;
      spec.action(pid);
    }
  }
  for (auto& f : fds) {
    if (f.fd >= 0) ::close(f.fd);
  }
  ::waitpid(pid, &res.status, 0);
  res.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return res;
}

Result run_launcher(std::vector<std::string> args) {
  RunSpec spec;
  spec.args = std::move(args);
  return run_launcher(spec);
}

std::vector<std::string> lines(const std::string& s) {
  std::vector<std::string> v;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) v.push_back(l);
  return v;
}

using gradsync::testing::count_of;

// A TCP connection to 127.0.0.1:`port`, or -1.
int connect_local(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (fd >= 0 && ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) == 0) {
    return fd;
  }
  if (fd >= 0) ::close(fd);
  return -1;
}

// While one is alive, orphans of this process's descendants come back to it (it is their
// child subreaper) instead of going to init: processes the launcher was to stop then end as
// this process's children, so that a test can wait for them.
class AdoptOrphans {
 public:
  AdoptOrphans() { EXPECT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0) << std::strerror(errno); }
  ~AdoptOrphans() { ::prctl(PR_SET_CHILD_SUBREAPER, 0); }
  AdoptOrphans(const AdoptOrphans&) = delete;
  AdoptOrphans& operator=(const AdoptOrphans&) = delete;
};

// Waits, with no time limit, until `pid` has ended, and reaps it. Called once the launcher has
// exited, under AdoptOrphans: `pid` is then this process's child (adopted), or already reaped
// by its own parent. False if it is neither (a process this test cannot wait for is running).
// One that is never stopped blocks the test until its CTest timeout.
bool process_gone(pid_t pid) {
  pid_t got;
  while ((got = ::waitpid(pid, nullptr, 0)) < 0 && errno == EINTR) {
  }
  if (got == pid) return true;
  return ::kill(pid, 0) != 0 && errno == ESRCH;
}

// Every "sleeper=PID" a rank printed.
std::vector<pid_t> sleepers(const std::string& out) {
  std::vector<pid_t> v;
  const std::string key = "sleeper=";
  for (auto p = out.find(key); p != std::string::npos; p = out.find(key, p + 1)) {
    v.push_back(static_cast<pid_t>(std::atoi(out.c_str() + p + key.size())));
  }
  return v;
}

// The word after `key` in `line` (up to a space or the end).
std::string value_after(const std::string& line, const std::string& key) {
  auto p = line.find(key);
  if (p == std::string::npos) return "";
  p += key.size();
  return line.substr(p, line.find(' ', p) - p);
}

// True if `err` holds the launcher's report "gradsync-run: rank R (pid <digits>) <how>".
// (Parsed by hand: std::regex trips GCC 12's -Wmaybe-uninitialized in sanitizer builds.)
bool reports(const std::string& err, int rank, const std::string& how) {
  const std::string head = "gradsync-run: rank " + std::to_string(rank) + " (pid ";
  auto p = err.find(head);
  if (p == std::string::npos) return false;
  p += head.size();
  auto digits_end = err.find_first_not_of("0123456789", p);
  if (digits_end == p || digits_end == std::string::npos) return false;
  return err.compare(digits_end, 2 + how.size(), ") " + how) == 0;
}

TEST(Launcher, SetsEnvironmentAndPrefixesLines) {
  Result r = run_launcher(
      {"-n", "3", "--", "sh", "-c",
       "echo RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK "
       "LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT "
       "GRADSYNC_TOKEN=$GRADSYNC_TOKEN; echo to-stderr >&2"});
  EXPECT_EQ(r.exit_code(), 0) << r.err;
  auto out = lines(r.out);
  ASSERT_EQ(out.size(), 3u) << r.out;
  // Every rank sees the same port and token; the rest of each line follows from its rank.
  const std::string port = value_after(out[0], "MASTER_PORT=");
  const std::string token = value_after(out[0], "GRADSYNC_TOKEN=");
  EXPECT_GT(std::atoi(port.c_str()), 0) << out[0];
  EXPECT_EQ(token.size(), 32u) << out[0];
  EXPECT_EQ(token.find_first_not_of("0123456789abcdef"), std::string::npos) << token;
  std::set<std::string> got(out.begin(), out.end()), want;
  for (int k = 0; k < 3; ++k) {
    const std::string rk = std::to_string(k);
    want.insert("[rank " + rk + "] RANK=" + rk + " WORLD_SIZE=3 LOCAL_RANK=" + rk +
                " LOCAL_WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + port +
                " GRADSYNC_TOKEN=" + token);
  }
  EXPECT_EQ(got, want);
  // stderr stays stderr, prefixed too.
  auto err = lines(r.err);
  EXPECT_EQ(err.size(), 3u) << r.err;
  for (int k = 0; k < 3; ++k)
    EXPECT_EQ(count_of(r.err, "[rank " + std::to_string(k) + "] to-stderr\n"), 1);
}

TEST(Launcher, EachJobGetsItsOwnTokenUnlessOneIsGiven) {
  RunSpec spec;
  spec.args = {"-n", "1", "--", "sh", "-c", "echo $GRADSYNC_TOKEN"};
  spec.env["GRADSYNC_TOKEN"] = "";
  Result a = run_launcher(spec), b = run_launcher(spec);
  EXPECT_NE(a.out, b.out);
  spec.env["GRADSYNC_TOKEN"] = "sharedsecret42";
  Result c = run_launcher(spec);
  EXPECT_EQ(c.out, "[rank 0] sharedsecret42\n");
}

TEST(Launcher, MultiNodeRanksAndWarnsWithoutToken) {
  RunSpec spec;
  spec.args = {"--nnodes",
               "2",
               "--node-rank",
               "1",
               "-n",
               "2",
               "--master-addr",
               "10.1.2.3",
               "--",
               "sh",
               "-c",
               "echo $RANK/$WORLD_SIZE/$LOCAL_RANK $MASTER_ADDR:$MASTER_PORT"};
  spec.env["GRADSYNC_TOKEN"] = "";
  Result r = run_launcher(spec);
  EXPECT_EQ(r.exit_code(), 0) << r.err;
  EXPECT_EQ(count_of(r.out, "[rank 2] 2/4/0 10.1.2.3:29500\n"), 1) << r.out;
  EXPECT_EQ(count_of(r.out, "[rank 3] 3/4/1 10.1.2.3:29500\n"), 1) << r.out;
  EXPECT_NE(r.err.find("warning: GRADSYNC_TOKEN is not set"), std::string::npos) << r.err;
}

TEST(Launcher, PartialLineIsFlushedAndNoPrefixPassesOutputThrough) {
  Result r = run_launcher({"-n", "1", "--", "sh", "-c", "printf 'a\\nno newline'"});
  EXPECT_EQ(r.out, "[rank 0] a\n[rank 0] no newline\n");
  Result raw = run_launcher({"--no-prefix", "-n", "2", "--", "sh", "-c", "echo hi"});
  EXPECT_EQ(raw.out, "hi\nhi\n");
}

TEST(Launcher, SuccessfulRunExitsZero) {
  Result r = run_launcher({"-n", "4", "--", "true"});
  EXPECT_EQ(r.exit_code(), 0);
  EXPECT_EQ(r.err, "");
}

TEST(Launcher, FailingRankIsNamedAndOthersAreStopped) {
  // Rank 2 fails; the others would sleep for 1000 s (through a child process, which must be
  // stopped as well) unless the launcher stops them: that the launcher and the sleepers end
  // at all is the check.
  AdoptOrphans adopt;
  Result r = run_launcher(
      {"-n", "4", "--", "sh", "-c",
       "sleep 1000 & echo sleeper=$!; if [ $RANK = 2 ]; then sleep 0.2; exit 3; fi; wait"});
  EXPECT_EQ(r.exit_code(), 3);
  EXPECT_TRUE(reports(r.err, 2, "exited with code 3")) << r.err;
  auto pids = sleepers(r.out);
  EXPECT_EQ(pids.size(), 4u) << r.out;
  for (pid_t p : pids) EXPECT_TRUE(process_gone(p)) << "orphan " << p << " still running";
}

// --min-ranks: each failure costs the job the failed rank's slot. Three ranks; in the first
// attempt rank 1 fails, so the second runs with two (WORLD_SIZE 2), which succeed. A job that
// would drop below --min-ranks is not restarted and ends with the failure.
TEST(Launcher, MinRanksRestartsWithoutTheFailedRanksSlot) {
  Result r = run_launcher({"-n", "3", "--max-restarts", "2", "--min-ranks", "2", "--", "sh", "-c",
                           "echo \"world $WORLD_SIZE rank $RANK\"; "
                           "[ $WORLD_SIZE = 3 ] && [ $RANK = 1 ] && exit 5; exit 0"});
  EXPECT_EQ(r.exit_code(), 0) << r.err;
  EXPECT_TRUE(gradsync::testing::contains(r.err, "restarting every rank (restart 1 of 2, 2 ranks)"))
      << r.err;
  EXPECT_EQ(count_of(r.out, "world 2 rank "), 2) << r.out;
  EXPECT_GE(count_of(r.out, "world 3 rank "), 1) << r.out;  // the others may be stopped first

  r = run_launcher({"-n", "2", "--max-restarts", "3", "--min-ranks", "2", "--", "sh", "-c",
                    "[ $RANK = 0 ] && exit 3; sleep 60"});
  EXPECT_EQ(r.exit_code(), 3) << r.err;
  EXPECT_TRUE(gradsync::testing::contains(
      r.err, "not restarting: 1 rank(s) would be fewer than --min-ranks 2"))
      << r.err;
  EXPECT_FALSE(gradsync::testing::contains(r.err, "restarting every rank")) << r.err;
  // Shrinking needs restarts, and cannot start below its floor.
  EXPECT_EQ(run_launcher({"-n", "3", "--min-ranks", "2", "true"}).exit_code(), 2);
  EXPECT_EQ(
      run_launcher({"-n", "2", "--max-restarts", "1", "--min-ranks", "3", "true"}).exit_code(), 2);
}

// --max-restarts on several hosts: each host's launcher (here all on this host, as hosts 0,
// 1, ...) runs the attempt's ranks; host 0's holds the rendezvous on --master-port.
class TwoHosts {
 public:
  // One launcher of the job: its --nnodes and --node-rank, and its GRADSYNC_TOKEN.
  struct Host {
    int nnodes = 2, node_rank = 0;
    std::string token = "two-hosts";
  };
  // Runs both launchers at once with `flags`, host 1's with `host1_token`.
  std::vector<Result> run(const std::vector<std::string>& flags, const std::string& script,
                          const std::string& host1_token = "two-hosts") {
    return run_each({{.node_rank = 0}, {.node_rank = 1, .token = host1_token}}, flags, script);
  }
  // Runs a launcher for each of `hosts` at once, each with `flags`; `exited` is called with a
  // launcher's index and result as soon as it ends.
  std::vector<Result> run_each(const std::vector<Host>& hosts,
                               const std::vector<std::string>& flags, const std::string& script,
                               const std::function<void(std::size_t, const Result&)>& exited = {}) {
    std::vector<Result> results(hosts.size());
    std::vector<std::thread> threads;
    for (std::size_t h = 0; h < hosts.size(); ++h) {
      threads.emplace_back([&, h] {
        RunSpec spec;
        spec.args = {"--nnodes",
                     std::to_string(hosts[h].nnodes),
                     "--node-rank",
                     std::to_string(hosts[h].node_rank),
                     "-n",
                     "2",
                     "--master-port",
                     port_};
        spec.args.insert(spec.args.end(), flags.begin(), flags.end());
        spec.args.insert(spec.args.end(), {"--", "sh", "-c", script});
        spec.env["GRADSYNC_TOKEN"] = hosts[h].token;
        results[h] = run_launcher(spec);
        if (exited) exited(h, results[h]);
      });
    }
    for (auto& t : threads) t.join();
    return results;
  }
  // The port the ranks of attempt `round` are given: the rendezvous's + 1 + round.
  std::string store_port(int round) const { return std::to_string(std::stoi(port_) + 1 + round); }
  int rendezvous_port() const { return std::stoi(port_); }

 private:
  std::string port_ = std::to_string(gradsync::testing::free_port());
};

// Host 1's rank 3 fails in the first attempt: both launchers stop their ranks (the others
// would sleep a minute) and start them again together, the second attempt's ranks meeting at
// the next port. When every attempt fails, both end with the failed rank's code once the
// restarts are spent.
TEST(Launcher, RestartsAcrossHostsTogether) {
  using gradsync::testing::contains;
  TwoHosts hosts;
  auto r = hosts.run({"--max-restarts", "2", "--timeout-s", "120"},
                     "echo attempt $GRADSYNC_RESTART_COUNT rank $RANK of $WORLD_SIZE at "
                     "$MASTER_PORT; [ $GRADSYNC_RESTART_COUNT = 1 ] && exit 0; [ $RANK = 3 ] && "
                     "exit 5; sleep 60");
  for (const Result& x : r) {
    EXPECT_EQ(x.exit_code(), 0) << x.err;
    EXPECT_TRUE(contains(x.err, "exited with code 5 on host 1 (127.0.0.1); restarting every rank"))
        << x.err;
    EXPECT_TRUE(contains(x.err, "restart 1 of 2: 2 host(s), 4 ranks")) << x.err;
  }
  EXPECT_TRUE(contains(r[0].out, "[rank 1] attempt 1 rank 1 of 4 at " + hosts.store_port(1)))
      << r[0].out;
  EXPECT_TRUE(contains(r[1].out, "[rank 3] attempt 1 rank 3 of 4 at " + hosts.store_port(1)))
      << r[1].out;
  // (Rank 2 may be stopped before its first line: its attempt-0 output is not checked.)
  EXPECT_TRUE(contains(r[1].out, "[rank 3] attempt 0 rank 3 of 4 at " + hosts.store_port(0)))
      << r[1].out;

  r = hosts.run({"--max-restarts", "1", "--timeout-s", "120"}, "[ $RANK = 0 ] && exit 7; sleep 60");
  for (const Result& x : r) {
    EXPECT_EQ(x.exit_code(), 7) << x.err;
    EXPECT_TRUE(contains(x.err,
                         "exited with code 7 on host 0 (127.0.0.1); no restarts left "
                         "(--max-restarts 1)"))
        << x.err;
  }
}

// The rendezvous proves the token as the library's connections do: a launcher with another
// token is refused by name, and host 0's launcher, missing a host, ends at its --timeout-s.
TEST(Launcher, ALauncherOfAnotherJobIsRefusedByTheRendezvous) {
  using gradsync::testing::contains;
  auto r = TwoHosts().run({"--max-restarts", "1", "--timeout-s", "2"}, "true", "another-job");
  EXPECT_EQ(r[1].exit_code(), 1) << r[1].err;
  EXPECT_TRUE(contains(r[1].err, "refused this launcher: its GRADSYNC_TOKEN is not this job's"))
      << r[1].err;
  EXPECT_EQ(r[0].exit_code(), 1) << r[0].err;
  EXPECT_TRUE(contains(r[0].err, "refused a launcher at 127.0.0.1: wrong token")) << r[0].err;
  EXPECT_TRUE(contains(r[0].err, "host(s) 1 did not join within 2 s")) << r[0].err;
  // Shrinking across hosts needs restarts and cannot ask for more hosts than the job has;
  // --min-ranks is one host's.
  EXPECT_EQ(run_launcher({"--nnodes", "2", "--min-nodes", "1", "true"}).exit_code(), 2);
  EXPECT_EQ(run_launcher({"--nnodes", "2", "--max-restarts", "1", "--min-nodes", "3", "true"})
                .exit_code(),
            2);
  EXPECT_EQ(run_launcher({"--nnodes", "2", "--max-restarts", "1", "--min-ranks", "1", "true"})
                .exit_code(),
            2);
}

// Launchers whose flags disagree are refused by name: a host index past host 0's --nnodes,
// and a second launcher for a host that has joined; the job goes on with those that joined.
TEST(Launcher, TheRendezvousRefusesAHostPastNnodesAndAHostTwice) {
  using gradsync::testing::contains;
  TwoHosts job;
  auto r = job.run_each({{.node_rank = 0}, {.nnodes = 3, .node_rank = 2}},
                        {"--max-restarts", "1", "--timeout-s", "2"}, "true");
  EXPECT_EQ(r[1].exit_code(), 1) << r[1].err;
  EXPECT_TRUE(contains(r[1].err, "refused this launcher: --node-rank 2 is not below --nnodes 2"))
      << r[1].err;
  EXPECT_EQ(r[0].exit_code(), 1) << r[0].err;
  EXPECT_TRUE(contains(r[0].err, "host(s) 1 did not join within 2 s")) << r[0].err;

  // The ranks run until a launcher of host 1 has been refused: a launcher that comes after
  // the job has ended finds no rendezvous at all.
  const gradsync::testing::TempDir dir;
  const std::string refused_file = dir.path() + "/refused";
  r = job.run_each({{.node_rank = 0}, {.node_rank = 1}, {.node_rank = 1}},
                   {"--max-restarts", "1", "--timeout-s", "60"},
                   "while [ ! -e " + refused_file + " ]; do sleep 0.1; done",
                   [&](std::size_t h, const Result& x) {
                     if (h > 0 && x.exit_code() != 0) std::ofstream(refused_file) << "\n";
                   });
  EXPECT_EQ(r[0].exit_code(), 0) << r[0].err;
  // Either launcher of host 1 may come first.
  const bool second_refused = r[1].exit_code() == 0;
  const Result& joined = second_refused ? r[1] : r[2];
  const Result& refused = second_refused ? r[2] : r[1];
  EXPECT_EQ(joined.exit_code(), 0) << joined.err;
  EXPECT_EQ(refused.exit_code(), 1) << refused.err;
  EXPECT_TRUE(contains(refused.err, "refused this launcher: host 1 has already joined"))
      << refused.err;
}

// What is not a launcher's message at the rendezvous's port (a stranger's line, a line longer
// than any message) only closes that connection: the job goes on and loses no host.
TEST(Launcher, TheRendezvousClosesConnectionsThatSendJunk) {
  using gradsync::testing::contains;
  const gradsync::testing::TempDir dir;
  const std::string done = dir.path() + "/junk-sent";
  TwoHosts job;
  std::vector<std::string> answers;  // per junk: what came back before the connection closed
  std::thread stranger([&] {
    for (const std::string& junk :
         {std::string("GET / HTTP/1.0\r\n\r\n"), std::string(5000, 'x')}) {
      // The rendezvous listens once host 0's launcher has started: retry until it does.
      int fd = -1;
      for (int attempt = 0; attempt < 200 && fd < 0; ++attempt) {
        fd = connect_local(job.rendezvous_port());
        if (fd < 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      std::string got;
      if (fd >= 0) {
        char buf[512];
        // HELLO first, then nothing until the close that the junk earns.
        const auto n = ::read(fd, buf, sizeof buf);
        if (n > 0) got.assign(buf, static_cast<std::size_t>(n));
        (void)!::write(fd, junk.data(), junk.size());
        while (true) {
          const auto m = ::read(fd, buf, sizeof buf);
          if (m <= 0) break;
          got.append(buf, static_cast<std::size_t>(m));
        }
        ::close(fd);
      }
      answers.push_back(fd >= 0 ? got : "(no connection)");
    }
    std::ofstream(done) << "done\n";
  });
  auto r = job.run({"--max-restarts", "1", "--timeout-s", "60"},
                   "while [ ! -e " + done + " ]; do sleep 0.1; done");
  stranger.join();
  ASSERT_EQ(answers.size(), 2u);
  for (const std::string& a : answers) {
    EXPECT_TRUE(a.rfind("HELLO ", 0) == 0) << a;
    EXPECT_EQ(count_of(a, "\n"), 1) << "only the HELLO line before the close: " << a;
  }
  for (const Result& x : r) {
    EXPECT_EQ(x.exit_code(), 0) << x.err;
    EXPECT_FALSE(contains(x.err, "lost")) << x.err;
  }
}

TEST(Launcher, RankIgnoringSigtermIsKilledAfterGrace) {
  // Rank 0 fails only once rank 1 has armed its SIGTERM trap (it touches `armed`), so the
  // SIGTERM is surely ignored and only the SIGKILL after the grace period can end rank 1.
  std::string armed = "/tmp/gradsync-launcher-test-armed-" + std::to_string(::getpid());
  std::filesystem::remove(armed);
  Result r = run_launcher({"-n", "2", "--grace-s", "0.5", "--", "sh", "-c",
                           "if [ $RANK = 0 ]; then while [ ! -e " + armed +
                               " ]; do sleep 0.01; done; exit 5; fi; "
                               "trap '' TERM; touch " +
                               armed + "; while :; do sleep 1; done"});
  std::filesystem::remove(armed);
  EXPECT_EQ(r.exit_code(), 5);
  EXPECT_TRUE(reports(r.err, 0, "exited with code 5")) << r.err;
  EXPECT_NE(r.err.find("stopped 1 other rank(s)"), std::string::npos) << r.err;
  // The grace period was granted before SIGKILL: a lower bound, which no slow machine breaks.
  EXPECT_GE(r.seconds, 0.5);
}

TEST(Launcher, KillNineIsReportedAsSignal9) {
  Result r = run_launcher(
      {"-n", "3", "--", "sh", "-c", "if [ $RANK = 1 ]; then kill -9 $$; fi; sleep 1000"});
  EXPECT_EQ(r.exit_code(), 128 + 9);
  EXPECT_TRUE(reports(r.err, 1, "was killed by signal 9 (Killed)")) << r.err;
}

TEST(Launcher, SigtermIsForwardedToEveryRank) {
  RunSpec spec;
  spec.args = {"-n", "3",  "--",
               "sh", "-c", "trap 'echo got-term; exit 0' TERM; echo started; sleep 1000 & wait"};
  spec.ready = [](const std::string& out) { return count_of(out, "started") == 3; };
  spec.action = [](pid_t launcher) { ::kill(launcher, SIGTERM); };
  Result r = run_launcher(spec);
  EXPECT_EQ(count_of(r.out, "got-term"), 3) << r.out;
  EXPECT_NE(r.exit_code(), 0);
  EXPECT_EQ(r.exit_code(), 128 + SIGTERM);
  EXPECT_NE(r.err.find("received signal 15"), std::string::npos) << r.err;
}

TEST(Launcher, RanksDieWithAKilledLauncher) {
  AdoptOrphans adopt;
  RunSpec spec;
  spec.args = {"-n", "2", "--", "sh", "-c", "echo sleeper=$$; exec sleep 1000"};
  spec.ready = [](const std::string& out) { return count_of(out, "sleeper=") == 2; };
  spec.action = [](pid_t launcher) { ::kill(launcher, SIGKILL); };
  Result r = run_launcher(spec);
  EXPECT_TRUE(WIFSIGNALED(r.status));
  auto pids = sleepers(r.out);
  EXPECT_EQ(pids.size(), 2u) << r.out;
  for (pid_t p : pids) EXPECT_TRUE(process_gone(p)) << "rank " << p << " outlived the launcher";
}

TEST(Launcher, JobTimeoutStopsRanks) {
  Result r = run_launcher({"-n", "2", "--timeout-s", "0.3", "--", "sleep", "1000"});
  EXPECT_EQ(r.exit_code(), 124);
  EXPECT_NE(r.err.find("--timeout-s"), std::string::npos) << r.err;
}

TEST(Launcher, MissingProgramAndBadUsage) {
  Result r = run_launcher({"-n", "2", "--", "/nonexistent/prog"});
  EXPECT_EQ(r.exit_code(), 127);
  EXPECT_NE(r.err.find("cannot execute '/nonexistent/prog'"), std::string::npos) << r.err;
  EXPECT_EQ(run_launcher({"-n", "2"}).exit_code(), 2);
  EXPECT_EQ(run_launcher({"-n", "0", "true"}).exit_code(), 2);
  EXPECT_EQ(run_launcher({"--nnodes", "2", "--node-rank", "2", "true"}).exit_code(), 2);
}

TEST(Launcher, RemovesThisJobsShmSegmentsOnly) {
  // The token is fixed so the test knows the prefix; ours (and the unrelated one) are named
  // by the pid so parallel runs of this test do not collide.
  std::string token = "c0ffee" + std::to_string(::getpid() % 100) + "0000000000000000000000";
  token.resize(32, '0');
  std::string ours = "/dev/shm/gradsync-" + token.substr(0, 8) + "-seg";
  std::string other = "/dev/shm/gradsync-other" + std::to_string(::getpid());
  // Another job whose token shares the 8 characters: its segments carry their creator's pid.
  // One whose creator runs (this test) is kept; one whose creator has exited is stale.
  const pid_t exited = ::fork();
  if (exited == 0) ::_exit(0);
  ASSERT_GT(exited, 0);
  ASSERT_EQ(::waitpid(exited, nullptr, 0), exited);
  std::string running_job =
      "/dev/shm/gradsync-" + token.substr(0, 8) + "-k_a-p" + std::to_string(::getpid()) + "-r0-0";
  std::string exited_job =
      "/dev/shm/gradsync-" + token.substr(0, 8) + "-k_a-p" + std::to_string(exited) + "-r1-3";
  for (const auto& path : {other, running_job, exited_job}) std::ofstream(path) << "x";
  RunSpec spec;
  spec.args = {"-n", "2",  "--",
               "sh", "-c", "if [ $RANK = 0 ]; then touch " + ours + "; kill -9 $$; fi; sleep 1000"};
  spec.env["GRADSYNC_TOKEN"] = token;
  Result r = run_launcher(spec);
  EXPECT_EQ(r.exit_code(), 137) << r.err;
  EXPECT_FALSE(std::filesystem::exists(ours));
  EXPECT_TRUE(std::filesystem::exists(other));
  EXPECT_TRUE(std::filesystem::exists(running_job));
  EXPECT_FALSE(std::filesystem::exists(exited_job));
  std::filesystem::remove(other);
  std::filesystem::remove(running_job);
}

// Every number on the command line is read whole and within its range; anything else is
// refused before a rank starts, naming the flag, the value and the range, with exit code 2.
TEST(Launcher, NumbersAreReadStrictly) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"-n", "99999999999", "true"}, "--nproc-per-node: '99999999999' is not an integer in [1, "},
      {{"-n", " 2", "true"}, "--nproc-per-node: ' 2' is not an integer"},
      {{"-n", "0x2", "true"}, "--nproc-per-node: '0x2' is not an integer"},
      {{"--node-rank", "-1", "true"}, "--node-rank: '-1' is not an integer in [0, "},
      {{"--master-port", "0", "true"}, "--master-port: '0' is not an integer in [1, 65535]"},
      {{"--timeout-s", "inf", "true"}, "--timeout-s: 'inf' is not a number in [0, "},
      {{"--timeout-s", "1e999", "true"}, "--timeout-s: '1e999' is not a number"},
      {{"--grace-s", "-1", "true"}, "--grace-s: '-1' is not a number"},
      {{"--nnodes", "1048576", "-n", "2", "true"}, "2097152 ranks, more than the 1048576"},
  };
  for (const auto& [args, want] : cases) {
    Result r = run_launcher(args);
    EXPECT_EQ(r.exit_code(), 2) << want;
    EXPECT_NE(r.err.find(want), std::string::npos) << r.err;
  }
}

std::string bench_path() {
  return gradsync::testing::build_dir() + "/tools/gradsync-bench";
}

// gradsync-bench refuses sizes, counts and ranks it cannot honour before it allocates or
// starts (exit 2, naming the flag and its range), where it used to end in std::bad_alloc.
TEST(Bench, FlagsAreReadStrictlyAndUpFront) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--max-bytes 99999999999999", "--max-bytes: '99999999999999' is not a size in [0, "},
      {"--max-bytes 18446744073709551615G", "--max-bytes: '18446744073709551615G' is not a size"},
      {"--min-bytes -1", "--min-bytes: '-1' is not a size"},
      {"--min-bytes 4X", "--min-bytes: '4X' is not a size"},
      {"--iters 0", "--iters: '0' is not an integer in [1, 1000000]"},
      {"--iters 4294967297", "--iters: '4294967297' is not an integer in [1, 1000000]"},
      {"--warmup -1", "--warmup: '-1' is not an integer in [0, 1000000]"},
      {"--factor 1", "--factor: '1' is not an integer in [2, "},
      {"--factor 2.5", "--factor: '2.5' is not an integer"},
      {"--root nine", "--root: 'nine' is not an integer in [0, "},
  };
  for (const auto& [args, want] : cases) {
    auto r = gradsync::testing::run_shell(bench_path() + " allreduce " + args + " 2>&1");
    EXPECT_EQ(r.exit_code(), 2) << args << ": " << r.output;
    EXPECT_TRUE(gradsync::testing::contains(r.output, want)) << r.output;
  }
  auto r = gradsync::testing::run_shell(bench_path() +
                                        " broadcast --root 1 --min-bytes 1K --max-bytes 1K 2>&1");
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_TRUE(gradsync::testing::contains(r.output, "--root: '1' is not a rank in [0, 0]"))
      << r.output;
}

// The narrow integer and bool dtypes and the bitwise ops reduce exactly as --check computes
// them over 3 ranks (exit 0 means no wrong element); a bitwise op on a float dtype is a usage
// error naming both, before any rank starts.
TEST(Bench, NarrowIntegersBoolAndBitwiseOpsCheckExactly) {
  const std::vector<std::vector<std::string>> cases = {
      {"--dtype", "int8", "--op", "sum"},   {"--dtype", "int16", "--op", "avg"},
      {"--dtype", "bool", "--op", "prod"},  {"--dtype", "bool", "--op", "avg"},
      {"--dtype", "uint8", "--op", "bxor"}, {"--dtype", "int64", "--op", "band"},
      {"--dtype", "i16", "--op", "bor"},
  };
  for (const auto& flags : cases) {
    std::vector<std::string> args = {
        "-n", "3",           "--", bench_path(), "allreduce", "--check",  "--min-bytes",
        "1K", "--max-bytes", "4K", "--iters",    "1",         "--warmup", "0"};
    args.insert(args.end(), flags.begin(), flags.end());
    Result r = run_launcher(args);
    EXPECT_EQ(r.exit_code(), 0) << flags[1] << " " << flags[3] << ": " << r.out << r.err;
    EXPECT_NE(r.out.find("# out of bounds values: 0 OK"), std::string::npos) << r.out;
  }
  auto r = gradsync::testing::run_shell(bench_path() + " allreduce --dtype bf16 --op band 2>&1");
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_TRUE(gradsync::testing::contains(
      r.output, "--op band is bitwise: it takes an integer or bool --dtype, not bfloat16"))
      << r.output;
}

// A --json file that cannot be written fails the run before it starts (it used to be found
// out at the end, and the run still exited 0); one that can is written.
TEST(Bench, UnwritableJsonFailsBeforeTheRun) {
  gradsync::testing::TempDir dir;
  const std::string sweep = " allreduce --min-bytes 1K --max-bytes 1K --iters 2 --warmup 0 --json ";
  auto r = gradsync::testing::run_shell(bench_path() + sweep + dir.path() + "/no-such-dir/r.json" +
                                        " 2>&1");
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_TRUE(gradsync::testing::contains(
      r.output, "--json: cannot write " + dir.path() + "/no-such-dir/r.json: No such file"))
      << r.output;
  EXPECT_FALSE(gradsync::testing::contains(r.output, "avg bus bandwidth")) << "it ran";
  r = gradsync::testing::run_shell(bench_path() + sweep + dir.path() + "/r.json 2>&1");
  EXPECT_EQ(r.exit_code(), 0) << r.output;
  EXPECT_TRUE(gradsync::testing::contains(gradsync::testing::read_file(dir.path() + "/r.json"),
                                          "\"bytes\": 1024"));
}

// pingpong: what rank 1 echoes back is what rank 0 sent, byte for byte (--check on both), in
// the blocking and the async form, with a third rank idle; its flags are its own.
TEST(Bench, PingPongEchoesExactlyAndTakesOnlyItsFlags) {
  for (const std::string form : {"", "--async"}) {
    std::vector<std::string> args = {
        "-n",          "3",   "--",       bench_path(), "pingpong", "--check", "--min-bytes", "1",
        "--max-bytes", "64K", "--factor", "16",         "--iters",  "3",       "--warmup",    "1"};
    if (!form.empty()) args.push_back(form);
    Result r = run_launcher(args);
    EXPECT_EQ(r.exit_code(), 0) << form << ": " << r.out << r.err;
    EXPECT_NE(r.out.find("# out of bounds values: 0 OK"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(form.empty() ? "blocking" : "async"), std::string::npos) << r.out;
  }
  const std::vector<std::pair<std::string, std::string>> refused = {
      {" pingpong --dtype float32", "pingpong takes sizes, --iters"},
      {" pingpong --per-call", "pingpong takes sizes, --iters"},
      {" allreduce --async", "--async applies to pingpong only"},
      {" pingpong --min-bytes 8 --max-bytes 8", "pingpong needs 2 ranks or more"},
  };
  for (const auto& [args, want] : refused) {
    auto r = gradsync::testing::run_shell(bench_path() + args + " 2>&1");
    EXPECT_EQ(r.exit_code(), 2) << args << ": " << r.output;
    EXPECT_TRUE(gradsync::testing::contains(r.output, want)) << r.output;
  }
}

// --offset places both buffers past a page boundary; at 4080 every copy into shared memory
// takes the private-buffer path (transport::copy_to_shared), and results stay exact.
TEST(Bench, OffsetBuffersGiveExactResults) {
  for (const std::string algo : {"shm", "ring"}) {
    Result r = run_launcher(
        {"-n",       "2",  "--",       bench_path(), "allreduce",   "--check", "--transport", "shm",
         "--algo",   algo, "--offset", "4080",       "--min-bytes", "4K",      "--max-bytes", "1M",
         "--factor", "16", "--iters",  "3",          "--warmup",    "1"});
    EXPECT_EQ(r.exit_code(), 0) << algo << ": " << r.out << r.err;
    EXPECT_NE(r.out.find("# out of bounds values: 0 OK"), std::string::npos) << r.out;
  }
  auto r = gradsync::testing::run_shell(bench_path() + " allreduce --offset 4096 2>&1");
  EXPECT_EQ(r.exit_code(), 2) << r.output;
  EXPECT_TRUE(
      gradsync::testing::contains(r.output, "--offset: '4096' is not an integer in [0, 4095]"))
      << r.output;
}

// Before init() knows the rank, an error names none: not "rank -1".
TEST(Bench, ErrorsBeforeTheRankIsKnownNameNoRank) {
  for (const std::string env : {"GRADSYNC_ALGO=foo", "RANK=4294967296 WORLD_SIZE=1"}) {
    auto r = gradsync::testing::run_shell(env + " " + bench_path() + " allreduce 2>&1");
    EXPECT_EQ(r.exit_code(), 1) << env << ": " << r.output;
    EXPECT_FALSE(gradsync::testing::contains(r.output, "rank -1")) << r.output;
    EXPECT_TRUE(gradsync::testing::contains(r.output, env.substr(0, env.find('=')) + "='"))
        << r.output;
  }
}

}  // namespace
