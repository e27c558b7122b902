// Across hosts: each "host" is a network namespace of scripts/netns-cluster.sh, and each runs
// its own launcher (or, as under mpirun/srun, its own ranks), exactly as on real machines.
// Needs root to create namespaces; without it every test here is skipped, saying why.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <thread>
#include <tuple>

#include "harness.h"

namespace gradsync {
namespace {

using testing::contains;
using testing::count_of;
using testing::read_file;
using testing::run_shell;
using testing::ShellResult;

std::string script() {
  return testing::source_dir() + "/scripts/netns-cluster.sh";
}

// H hosts up for the lifetime of the object, under a prefix no other test process uses.
class Cluster {
 public:
  explicit Cluster(int hosts, const std::string& rate = "none") : hosts_(hosts) {
    static std::atomic<int> serial{0};
    prefix_ = "gt" + std::to_string(::getpid() % 100000) + std::to_string(serial++ % 10);
    if (::geteuid() != 0) {
      skip_reason_ = "needs root to create network namespaces (ip netns, veth, tc)";
      return;
    }
    ShellResult r = run_shell(script() + " up --prefix " + prefix_ + " --hosts " +
                              std::to_string(hosts) + " --rate " + rate);
    if (r.status != 0) skip_reason_ = "cannot create network namespaces here: " + r.output;
  }
  ~Cluster() {
    if (::geteuid() == 0) run_shell(script() + " down --prefix " + prefix_);
  }
  const std::string& skip_reason() const { return skip_reason_; }
  int hosts() const { return hosts_; }
  std::string addr(int host) const { return "10.77.0." + std::to_string(10 + host); }
  // `cmd` run as a shell command on `host`.
  std::string on(int host, const std::string& cmd) const {
    return script() + " exec --prefix " + prefix_ + " " + std::to_string(host) + " sh -c '" + cmd +
           "'";
  }
  std::string ns(int host) const { return prefix_ + "-h" + std::to_string(host); }
  // A launcher prefix for tools that start a command on each host ({host}: its index).
  std::string launcher() const { return script() + " exec --prefix " + prefix_ + " {host}"; }

 private:
  int hosts_;
  std::string prefix_;
  std::string skip_reason_;
};

#define SKIP_UNLESS_UP(cluster) \
  if (!(cluster).skip_reason().empty()) GTEST_SKIP() << (cluster).skip_reason()

// Runs the commands at once; one result each.
std::vector<ShellResult> run_all(const std::vector<std::string>& cmds) {
  std::vector<ShellResult> results(cmds.size());
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < cmds.size(); ++i) {
    threads.emplace_back([&, i] { results[i] = run_shell(cmds[i]); });
  }
  for (auto& t : threads) t.join();
  return results;
}

std::string all_output(const std::vector<ShellResult>& results) {
  std::string s;
  for (std::size_t i = 0; i < results.size(); ++i) {
    s += "--- command " + std::to_string(i) + " (status " + std::to_string(results[i].status) +
         "):\n" + results[i].output;
  }
  return s;
}

// The cluster script itself: `up` makes the switch and the hosts with their shaped links and
// addresses, `down` removes every namespace it made (and is safe to repeat).
TEST(NetnsCluster, UpShapesEveryLinkAndDownLeavesNothing) {
  std::string prefix;
  {
    Cluster cluster(2, "100mbit");
    SKIP_UNLESS_UP(cluster);
    prefix = cluster.ns(0).substr(0, cluster.ns(0).size() - 3);  // strip "-h0"
    ShellResult list = run_shell(script() + " list --prefix " + prefix);
    EXPECT_EQ(count_of(list.output, prefix + "-"), 3) << list.output;  // switch + 2 hosts
    for (int h = 0; h < 2; ++h) {
      ShellResult qdisc = run_shell("ip netns exec " + cluster.ns(h) + " tc qdisc show dev eth0");
      EXPECT_TRUE(contains(qdisc.output, "tbf") && contains(qdisc.output, "rate 100Mbit"))
          << qdisc.output;
      ShellResult addr = run_shell("ip -n " + cluster.ns(h) + " -4 addr show dev eth0");
      EXPECT_TRUE(contains(addr.output, cluster.addr(h) + "/24")) << addr.output;
    }
    ShellResult sw = run_shell("ip netns exec " + prefix + "-sw tc qdisc show");
    EXPECT_EQ(count_of(sw.output, "tbf"), 2) << "the switch side of each link: " << sw.output;
  }
  ShellResult after = run_shell("ip netns list");
  EXPECT_FALSE(contains(after.output, prefix + "-")) << after.output;
  EXPECT_EQ(run_shell(script() + " down --prefix " + prefix).status, 0);
}

// The job token's first 8 characters name the job's shared-memory segments, and a launcher
// removes every segment of that prefix when its job ends; /dev/shm is one for all the
// namespaces. So tests that run at once (ctest -j) must differ there: with "multihost<pid>"
// one test's launchers deleted another's segments before its ranks had opened them.
std::string own_token() {
  std::string pid = std::to_string(::getpid());
  return std::string(pid.size() < 8 ? 8 - pid.size() : 0, '0') + pid + "-multihost";
}
const std::string kEnv = "GRADSYNC_TOKEN=" + own_token() + " GRADSYNC_TIMEOUT=60000 ";

class AcrossHosts : public ::testing::TestWithParam<std::tuple<int, int>> {};

// One launcher per host, --nnodes/--node-rank/--master-addr as on real machines: every
// collective equals the reference and is bitwise identical everywhere; ranks on one host use
// shared memory, ranks on different hosts tcp.
TEST_P(AcrossHosts, EveryCollectiveMatchesReferenceThroughOneLauncherPerHost) {
  const auto [hosts, per_host] = GetParam();
  Cluster cluster(hosts);
  SKIP_UNLESS_UP(cluster);
  const std::string dir = testing::build_dir();
  std::vector<std::string> cmds;
  for (int h = 0; h < hosts; ++h) {
    cmds.push_back(cluster.on(h, kEnv + dir + "/tools/gradsync-run --nnodes " +
                                     std::to_string(hosts) + " --node-rank " + std::to_string(h) +
                                     " -n " + std::to_string(per_host) + " --master-addr " +
                                     cluster.addr(0) + " --master-port 29500 --timeout-s 240 -- " +
                                     dir + "/tests/collective_worker check"));
  }
  auto results = run_all(cmds);
  const std::string out = all_output(results);
  for (const auto& r : results) EXPECT_EQ(r.status, 0) << out;
  const int n = hosts * per_host;
  EXPECT_EQ(count_of(out, "all checks passed"), n) << out;
  // Rank r's successor r + 1 is on the same host unless r is the last of its host.
  EXPECT_EQ(count_of(out, ": shm\n"), hosts * (per_host - 1)) << out;
  EXPECT_EQ(count_of(out, ": tcp\n"), hosts) << out;
}

#ifdef GRADSYNC_TEST_SANITIZED
// Every process of a job runs several times slower under a sanitizer: two shapes, several
// ranks on each of two hosts and one rank on each of three, take the launcher-per-host path
// through its threads and memory; the Release suite runs the whole grid.
INSTANTIATE_TEST_SUITE_P(HostsByRanks, AcrossHosts,
                         ::testing::Values(std::tuple{2, 2}, std::tuple{3, 1}), [](const auto& p) {
                           return std::to_string(std::get<0>(p.param)) + "hosts_x" +
                                  std::to_string(std::get<1>(p.param));
                         });
#else
INSTANTIATE_TEST_SUITE_P(HostsByRanks, AcrossHosts,
                         ::testing::Combine(::testing::Values(2, 3, 4), ::testing::Values(1, 2)),
                         [](const auto& p) {
                           return std::to_string(std::get<0>(p.param)) + "hosts_x" +
                                  std::to_string(std::get<1>(p.param));
                         });
#endif

#if GRADSYNC_HAVE_UCX
// GRADSYNC_TRANSPORT=shm+ucx: the same collectives with UCX (over its tcp, on the hosts'
// eth0) between hosts and shm within them.
TEST(AcrossHostsOverUcx, EveryCollectiveMatchesReferenceWithShmWithinAndUcxAcross) {
  const int hosts = 2, per_host = 2;
  Cluster cluster(hosts);
  SKIP_UNLESS_UP(cluster);
  const std::string dir = testing::build_dir();
  std::vector<std::string> cmds;
  for (int h = 0; h < hosts; ++h) {
    cmds.push_back(cluster.on(
        h, kEnv + "GRADSYNC_TRANSPORT=shm+ucx UCX_TLS=tcp UCX_NET_DEVICES=eth0 " + dir +
               "/tools/gradsync-run --nnodes " + std::to_string(hosts) + " --node-rank " +
               std::to_string(h) + " -n " + std::to_string(per_host) + " --master-addr " +
               cluster.addr(0) + " --master-port 29500 --timeout-s 240 -- " + dir +
               "/tests/collective_worker check"));
  }
  auto results = run_all(cmds);
  const std::string out = all_output(results);
  for (const auto& r : results) EXPECT_EQ(r.status, 0) << out;
  EXPECT_EQ(count_of(out, "all checks passed"), hosts * per_host) << out;
  EXPECT_EQ(count_of(out, ": shm\n"), hosts * (per_host - 1)) << out;
  EXPECT_EQ(count_of(out, ": ucx\n"), hosts) << out;
}
#endif

// Ranks placed round-robin over the hosts, started the way mpirun and srun start them (no
// gradsync launcher: the ranks read OMPI_COMM_WORLD_* or SLURM_* themselves). The context finds
// which ranks share a host and keeps them together in the ring.
TEST(AcrossHostsLaunchedByOthers, MpirunAndSrunEnvironmentsWithRoundRobinPlacement) {
  GRADSYNC_SKIP_UNDER_TSAN("HostsByRanks/AcrossHosts (the same ranks, started by a launcher)");
  const int hosts = 2, n = 4;
  Cluster cluster(hosts);
  SKIP_UNLESS_UP(cluster);
  const std::string worker = testing::build_dir() + "/tests/collective_worker check";
  for (const std::string style : {"mpirun", "srun"}) {
    std::vector<std::string> cmds;
    for (int r = 0; r < n; ++r) {
      const int host = r % hosts, local = r / hosts;
      std::string env = kEnv + "MASTER_ADDR=" + cluster.addr(0) + " MASTER_PORT=29501 ";
      if (style == "mpirun") {
        env += "OMPI_COMM_WORLD_RANK=" + std::to_string(r) +
               " OMPI_COMM_WORLD_SIZE=" + std::to_string(n) +
               " OMPI_COMM_WORLD_LOCAL_RANK=" + std::to_string(local) +
               " OMPI_COMM_WORLD_LOCAL_SIZE=2 ";
      } else {
        env += "SLURM_PROCID=" + std::to_string(r) + " SLURM_NTASKS=" + std::to_string(n) +
               " SLURM_LOCALID=" + std::to_string(local) + " ";
      }
      cmds.push_back(cluster.on(host, env + worker));
    }
    auto results = run_all(cmds);
    const std::string out = all_output(results);
    for (const auto& r : results) EXPECT_EQ(r.status, 0) << style << "\n" << out;
    EXPECT_EQ(count_of(out, "all checks passed"), n) << out;
    EXPECT_TRUE(contains(out, "topology: 2 hosts: [0 2] [1 3]")) << out;
    // Rank r's successor r + 1 is always on the other host: every one of them is tcp.
    EXPECT_EQ(count_of(out, ": tcp\n"), n) << out;
  }
}

// A rank whose token differs from the job's cannot join it, and the job goes on.
TEST(AcrossHostsFailures, RankOfAnotherJobIsRefused) {
  Cluster cluster(2);
  SKIP_UNLESS_UP(cluster);
  const std::string dir = testing::build_dir();
  const std::string job = " --nnodes 2 -n 1 --master-addr " + cluster.addr(0) +
                          " --master-port 29502 --timeout-s 120 -- " + dir +
                          "/tests/collective_worker check";
  std::vector<std::string> cmds = {
      cluster.on(0, kEnv + dir + "/tools/gradsync-run --node-rank 0" + job),
      cluster.on(1, kEnv + dir + "/tools/gradsync-run --node-rank 1" + job),
      // The intruder: another job's token, claiming rank 1, with a short timeout.
      cluster.on(1,
                 "GRADSYNC_TOKEN=otherjob GRADSYNC_TIMEOUT=3000 RANK=1 WORLD_SIZE=2 "
                 "MASTER_ADDR=" +
                     cluster.addr(0) + " MASTER_PORT=29502 " + dir +
                     "/tests/collective_worker check"),
  };
  auto results = run_all(cmds);
  const std::string out = all_output(results);
  EXPECT_EQ(results[0].status, 0) << out;
  EXPECT_EQ(results[1].status, 0) << out;
  EXPECT_NE(results[2].status, 0) << out;
  EXPECT_TRUE(contains(results[2].output, "token")) << results[2].output;
}

// Cutting a host off mid-collective, by taking its link down (no FIN or RST ever arrives:
// the kernel's liveness checks must notice) or by killing its launcher with SIGKILL (its
// ranks die with it): every other rank fails naming the lost peer and its host, and the
// launchers on the surviving hosts exit non-zero. No hang.
class CutOff : public ::testing::TestWithParam<std::string> {};

TEST_P(CutOff, EveryOtherRankNamesTheLostHost) {
  const std::string how = GetParam();
  Cluster cluster(3);
  SKIP_UNLESS_UP(cluster);
  testing::TempDir tmp;
  const std::string dir = testing::build_dir();
  std::vector<ShellResult> results(3);
  std::vector<std::thread> hosts;
  for (int h = 0; h < 3; ++h) {
    const std::string log = tmp.path() + "/host" + std::to_string(h) + ".log";
    const std::string cmd = cluster.on(
        h, "echo $$ > " + tmp.path() + "/pid" + std::to_string(h) + "; exec env " + kEnv +
               "GRADSYNC_TCP_LIVENESS_S=3 " + dir + "/tools/gradsync-run --nnodes 3 --node-rank " +
               std::to_string(h) + " -n 1 --master-addr " + cluster.addr(0) +
               " --master-port 29505 --timeout-s 90 -- " + dir +
               "/tests/collective_worker loop > " + log + " 2>&1");
    hosts.emplace_back(
        [&results, cmd, h] { results[static_cast<std::size_t>(h)] = run_shell(cmd); });
  }
  auto log_of = [&](int h) { return read_file(tmp.path() + "/host" + std::to_string(h) + ".log"); };
  const auto setup_deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (int h = 0; h < 3; ++h) {
    while (!contains(log_of(h), "looping") && std::chrono::steady_clock::now() < setup_deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // a few all-reduces
  if (how == "link_down") {
    ShellResult r = run_shell("ip -n " + cluster.ns(2) + " link set eth0 down");
    EXPECT_EQ(r.status, 0) << r.output;
  } else {
    ShellResult r = run_shell("kill -9 $(cat " + tmp.path() + "/pid2)");
    EXPECT_EQ(r.status, 0) << r.output;
  }
  // Liveness 3 s; the launchers' own limit (90 s) would only end a hang, killing the ranks
  // before any of them could name the lost host, which the checks below then miss.
  for (auto& t : hosts) t.join();
  for (int h = 0; h < 2; ++h) {
    const std::string log = log_of(h);
    EXPECT_NE(results[static_cast<std::size_t>(h)].status, 0) << log;
    EXPECT_TRUE(contains(log, "rank 2 at " + cluster.addr(2) + ":"))
        << how << ", host " << h << ":\n"
        << log;
    EXPECT_TRUE(contains(log, "gradsync-run: ")) << log;  // the launcher names the failed rank
  }
}

INSTANTIATE_TEST_SUITE_P(Ways, CutOff, ::testing::Values("link_down", "launcher_killed"));

// A rendezvous host nobody listens on: a clear error naming host and port (the 2 s timeout
// ends the wait; a hang would run into CTest's).
TEST(AcrossHostsFailures, UnreachableRendezvousHostIsNamedWithinTheTimeout) {
  Cluster cluster(2);
  SKIP_UNLESS_UP(cluster);
  ShellResult r = run_shell(cluster.on(
      1,
      "GRADSYNC_TOKEN=x GRADSYNC_TIMEOUT=2000 RANK=1 WORLD_SIZE=2 MASTER_ADDR=" + cluster.addr(0) +
          " MASTER_PORT=29503 " + testing::build_dir() + "/tests/collective_worker check"));
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, cluster.addr(0) + ":29503")) << r.output;
}

// GRADSYNC_SOCKET_IFNAME pins the sockets to one interface; a wrong name is a clear error
// listing the interfaces there are.
TEST(AcrossHostsFailures, SocketInterfaceIsChosenByName) {
  Cluster cluster(2);
  SKIP_UNLESS_UP(cluster);
  const std::string dir = testing::build_dir();
  auto job = [&](const std::string& ifname) {
    std::vector<std::string> cmds;
    for (int h = 0; h < 2; ++h) {
      cmds.push_back(cluster.on(
          h, kEnv + "GRADSYNC_SOCKET_IFNAME=" + ifname + " " + dir +
                 "/tools/gradsync-run --nnodes 2 --node-rank " + std::to_string(h) +
                 " -n 1 --master-addr " + cluster.addr(0) +
                 " --master-port 29504 --timeout-s 60 -- " + dir +
                 "/tools/gradsync-bench allreduce --min-bytes 4K --max-bytes 1M --factor 16 "
                 "--iters 3 --check"));
    }
    return run_all(cmds);
  };
  auto good = job("eth0");
  EXPECT_EQ(good[0].status, 0) << all_output(good);
  EXPECT_EQ(good[1].status, 0) << all_output(good);
  EXPECT_TRUE(contains(good[0].output, "out of bounds values: 0 OK")) << all_output(good);

  auto bad = job("nosuch0");
  for (const auto& r : bad) {
    EXPECT_NE(r.status, 0) << r.output;
    EXPECT_TRUE(contains(r.output, "GRADSYNC_SOCKET_IFNAME='nosuch0'") &&
                contains(r.output, "eth0="))
        << r.output;
  }
}

// gradsync-advise --confirm across hosts: one gradsync-run per host through the launcher,
// every candidate measured (its trace gathered on host 0) beside its prediction.
TEST(AdviseAcrossHosts, ConfirmRunsEveryCandidateOnEveryHost) {
  GRADSYNC_SKIP_UNDER_TSAN("HostsByRanks/AcrossHosts (gradsync-run per host) and the reducer's");
  Cluster cluster(2);
  SKIP_UNLESS_UP(cluster);
  const std::string profile = ::testing::TempDir() + "advise_hosts_profile.json";
  std::ofstream(profile) << R"({"name": "two hosts", "cores_per_host": 1,
      "intra": {"alpha_us": 5, "bandwidth_gbps": 5}, "inter": {"alpha_us": 50,
      "bandwidth_gbps": 1}, "compute_gflops": 5})";
  const ShellResult r =
      run_shell(testing::build_dir() + "/tools/gradsync-advise --profile " + profile +
                " --model cnn --ranks 4 --hosts 2 --confirm 3 --launcher '" + cluster.launcher() +
                "' --master-addr " + cluster.addr(0) + " --master-port 29560 2>&1");
  std::remove(profile.c_str());
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "confirmed on 2 hosts (gradsync-train, 3 steps each")) << r.output;
  EXPECT_TRUE(contains(r.output, "\nnow ")) << r.output;
  EXPECT_FALSE(contains(r.output, "(run failed)")) << r.output;
}

}  // namespace
}  // namespace gradsync
