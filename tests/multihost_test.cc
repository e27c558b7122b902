// Across hosts: each "host" is a network namespace of scripts/netns-cluster.sh, and each runs
// its own launcher (or, as under mpirun/srun, its own ranks), exactly as on real machines.
// Needs root to create namespaces; without it every test here is skipped, saying why.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
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
      // CUBIC whatever this machine's own default (a namespace inherits the root's).
      ShellResult congestion = run_shell("ip netns exec " + cluster.ns(h) +
                                         " sysctl -n net.ipv4.tcp_congestion_control");
      EXPECT_EQ(congestion.output, "cubic\n");
    }
    ShellResult sw = run_shell("ip netns exec " + prefix + "-sw tc qdisc show");
    EXPECT_EQ(count_of(sw.output, "tbf"), 2) << "the switch side of each link: " << sw.output;
  }
  ShellResult after = run_shell("ip netns list");
  EXPECT_FALSE(contains(after.output, prefix + "-")) << after.output;
  EXPECT_EQ(run_shell(script() + " down --prefix " + prefix).status, 0);
  // A congestion control the kernel lacks is named, and nothing is left behind.
  ShellResult unknown =
      run_shell(script() + " up --hosts 2 --prefix " + prefix + " --congestion nosuch");
  EXPECT_NE(unknown.status, 0);
  EXPECT_TRUE(contains(unknown.output, "--congestion nosuch: this kernel has no such"))
      << unknown.output;
  EXPECT_FALSE(contains(run_shell("ip netns list").output, prefix + "-"));
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
  if (per_host == 1) {
    GRADSYNC_SKIP_UNDER_TSAN(
        "2hosts_x2 (the launcher per host) and Transports/ThroughLauncher "
        "tcp_n3 (tcp between processes)");
  }
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
  GRADSYNC_SKIP_UNDER_TSAN(
      "HostsByRanks/AcrossHosts/2hosts_x2 (shm within hosts and a network "
      "transport across) and Transports/ThroughLauncher ucx_n3 (ucx)");
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

// gradsync-train on three hosts, one rank each, under --max-restarts: the launchers restart
// together through host 0's rendezvous.
class TrainingAcrossHosts {
 public:
  explicit TrainingAcrossHosts(const Cluster& cluster)
      : cluster_(cluster),
        dir_(testing::build_dir() + "/train_hosts_" + std::to_string(::getpid())) {
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  ~TrainingAcrossHosts() { std::filesystem::remove_all(dir_); }
  const std::string& dir() const { return dir_; }

  // One command per host: `launcher_flags` to gradsync-run, `train_flags` to gradsync-train
  // (checkpoints and --json under dir()/name), `wrap` before the trainer on `wrapped_host`.
  std::vector<std::string> commands(const std::string& name, const std::string& launcher_flags,
                                    const std::string& train_flags, int wrapped_host = -1,
                                    const std::string& wrap = "") const {
    const std::string build = testing::build_dir();
    std::vector<std::string> cmds;
    for (int h = 0; h < cluster_.hosts(); ++h) {
      cmds.push_back(cluster_.on(
          h, kEnv + kPinned + "GRADSYNC_TCP_LIVENESS_S=3 " + build +
                 "/tools/gradsync-run --no-prefix --nnodes " + std::to_string(cluster_.hosts()) +
                 " --node-rank " + std::to_string(h) + " -n 1 --master-addr " + cluster_.addr(0) +
                 " --master-port 29570 --timeout-s 240 " + launcher_flags + " -- " +
                 (h == wrapped_host ? wrap : "") + build +
                 "/examples/gradsync-train --hidden 32 --quiet " + train_flags + " --checkpoint " +
                 dir_ + "/" + name + " --json " + dir_ + "/" + name + ".json 2>&1"));
    }
    return cmds;
  }

 private:
  // The attempts after a failure choose their algorithms as the first did (the checkpoint's
  // cost model), whose float32 sums then round alike.
  static constexpr const char* kPinned =
      "GRADSYNC_COST_MODEL=alpha_us=500,bandwidth_gbps=0.5,reduce_gbps=1,shm_call_us=100000 ";
  const Cluster& cluster_;
  std::string dir_;
};

// A rank killed (SIGKILL) on host 2 at step 12: every host's launcher stops its rank and
// starts it again, and the trainers resume from the checkpoint of step 8; the steps after it
// repeat an uninterrupted run's losses bit for bit.
TEST(RestartAcrossHosts, AKilledRankRestartsEveryHostFromTheCheckpoint) {
  GRADSYNC_SKIP_UNDER_TSAN("Launcher.RestartsAcrossHostsTogether (the rendezvous's thread)");
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist")) GTEST_SKIP() << "no data";
  Cluster cluster(3);
  SKIP_UNLESS_UP(cluster);
  TrainingAcrossHosts job(cluster);
  const std::string train = "--max-steps 24 --checkpoint-every 8";
  auto results = run_all(job.commands("full", "", train));
  for (const auto& r : results) ASSERT_EQ(r.status, 0) << all_output(results);
  // Inside the single quotes of Cluster::on: '\'' is a quote.
  const std::string kill_once = R"(sh -c '\''if [ "$GRADSYNC_RESTART_COUNT" = 0 ]; then export )"
                                R"(GRADSYNC_TRAIN_KILL_AT_STEP=2:12; fi; exec "$@"'\'' sh )";
  results = run_all(job.commands("restarted", "--max-restarts 1", train, 2, kill_once));
  const std::string out = all_output(results);
  for (const auto& r : results) EXPECT_EQ(r.status, 0) << out;
  // Host 2's launcher names the kill; the rendezvous stops every host for the first failure it
  // hears of (the kill, or a rank that lost rank 2 and failed in turn).
  EXPECT_TRUE(contains(results[2].output, "rank 2 (pid ") &&
              contains(results[2].output, "was killed by signal 9 (Killed)"))
      << out;
  EXPECT_EQ(count_of(out, "; restarting every rank"), 3) << out;
  EXPECT_EQ(count_of(out, "restart 1 of 1: 3 host(s), 3 ranks"), 3) << out;
  const auto full = testing::losses_of(job.dir() + "/full.json");
  const auto resumed = testing::losses_of(job.dir() + "/restarted.json");
  ASSERT_EQ(full.size(), 24u) << out;
  ASSERT_EQ(resumed.size(), 16u) << out;
  for (std::size_t i = 0; i < resumed.size(); ++i) {
    EXPECT_EQ(resumed[i], full[8 + i]) << "step " << 8 + i;
  }
}

// Host 2 goes quiet (its link down: nothing more arrives from it, not even a reset). The other
// ranks lose it within GRADSYNC_TCP_LIVENESS_S, the rendezvous loses its launcher as fast, and
// with --min-nodes 2 the two hosts left resume the checkpoint at two ranks and finish; host 2's
// launcher, cut off from the rendezvous, ends with an error naming it.
TEST(RestartAcrossHosts, AQuietHostIsLostAndTheOthersGoOnWithoutIt) {
  GRADSYNC_SKIP_UNDER_TSAN("Launcher.RestartsAcrossHostsTogether (the rendezvous's thread)");
  if (!std::filesystem::exists("/usr/share/datasets/fashion-mnist")) GTEST_SKIP() << "no data";
  Cluster cluster(3);
  SKIP_UNLESS_UP(cluster);
  TrainingAcrossHosts job(cluster);
  const auto cmds = job.commands("shrunk", "--max-restarts 1 --min-nodes 2",
                                 "--epochs 4 --max-steps 900 --checkpoint-every 20");
  std::vector<ShellResult> results(3);
  std::vector<std::thread> hosts;
  for (std::size_t h = 0; h < 3; ++h) {
    hosts.emplace_back([&results, &cmds, h] { results[h] = run_shell(cmds[h]); });
  }
  // Cut once the first checkpoint is there, so that there is one to resume.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!std::filesystem::exists(job.dir() + "/shrunk/LATEST") &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ShellResult cut = run_shell("ip -n " + cluster.ns(2) + " link set eth0 down");
  EXPECT_EQ(cut.status, 0) << cut.output;
  for (auto& t : hosts) t.join();
  const std::string out = all_output(results);
  EXPECT_EQ(results[0].status, 0) << out;
  EXPECT_EQ(results[1].status, 0) << out;
  EXPECT_NE(results[2].status, 0) << out;
  EXPECT_TRUE(contains(results[0].output, "host 2 (" + cluster.addr(2) + ") lost")) << out;
  EXPECT_TRUE(contains(results[0].output, "restart 1 of 1: 2 host(s), 2 ranks")) << out;
  EXPECT_TRUE(contains(results[2].output, "lost the rendezvous at " + cluster.addr(0) + ":29570"))
      << out;
  EXPECT_EQ(testing::read_file(job.dir() + "/shrunk/LATEST"), "900\n") << out;
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
