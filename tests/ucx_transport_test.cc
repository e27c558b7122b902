// UCX transport: the shared conformance suite over UCX's own TCP and its shared memory (the
// transports this machine has; RDMA devices take the same path through UCX), then what only
// the UCX transport has: a peer process killed mid-wait, setup that names a silent rank.
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <sstream>

#if GRADSYNC_HAVE_UCX  // the whole file: a build without UCX has no ucx transport to test

#include "gradsync/store.h"
#include "harness.h"
#include "transport/ucx.h"
#include "transport_conformance.h"

namespace gradsync::transport {
namespace {

using namespace std::chrono_literals;
using conformance::contains;
using conformance::expect_error;
using conformance::first_pattern_error;
using conformance::pattern;
using conformance::tag_of;
using testing::all_ranks;

constexpr auto kSetupTimeout = 30s;

// UCX over its tcp transport on the loopback device, or over its shared memory.
UcxOptions over(const std::string& tls) {
  UcxOptions ucx;
  ucx.config.emplace_back("TLS", tls);
  if (tls == "tcp") ucx.config.emplace_back("NET_DEVICES", "lo");
  return ucx;
}

void run_ucx_group(int n, const TransportOptions& options, const RankBody& body,
                   const UcxOptions& ucx) {
  auto store = make_inproc_store();
  const std::string prefix = testing::unique_name("ucx");
  std::vector<std::unique_ptr<Transport>> transports(static_cast<std::size_t>(n));
  testing::run_threads(n, [&](int r) {
    transports[static_cast<std::size_t>(r)] =
        make_ucx_transport(*store, prefix, r, n, all_ranks(n), options, ucx, kSetupTimeout);
  });
  testing::run_threads(n, [&](int r) { body(r, *transports[static_cast<std::size_t>(r)]); });
}

bool ucx_is_loaded() {
  std::ifstream maps("/proc/self/maps");
  std::stringstream text;
  text << maps.rdbuf();
  return contains(text.str(), "/libucs.so");
}

void on_hangup(int) {}

// The library does not link UCX: the first ucx transport loads it, and loading it does not
// take SIGHUP from the program (libucs's constructor makes it UCX's debug signal).
TEST(UcxLibrary, OnlyTheFirstUcxTransportLoadsUcxAndSighupKeepsItsHandler) {
  // ctest runs each case in a process of its own, where UCX must not be loaded yet.
  if (::testing::UnitTest::GetInstance()->test_to_run_count() > 1 && ucx_is_loaded()) {
    GTEST_SKIP() << "an earlier test of this process loaded UCX";
  }
  ASSERT_FALSE(ucx_is_loaded()) << "the library links UCX instead of loading it";
  struct sigaction mine {};
  mine.sa_handler = &on_hangup;
  struct sigaction previous {};
  ASSERT_EQ(::sigaction(SIGHUP, &mine, &previous), 0);
  run_ucx_group(
      2, {}, [](int, Transport&) {}, over("sm"));
  EXPECT_TRUE(ucx_is_loaded());
  struct sigaction now {};
  ::sigaction(SIGHUP, nullptr, &now);
  EXPECT_EQ(now.sa_handler, &on_hangup);
  ::sigaction(SIGHUP, &previous, nullptr);
}

// Where UCX cannot be loaded (not installed; here GRADSYNC_UCX_LIBRARY names a library that
// does not exist), the ucx transport fails at setup naming the library and the package.
TEST(UcxLibrary, AMissingUcxIsNamedWithItsPackage) {
  if (ucx_is_loaded()) GTEST_SKIP() << "an earlier test of this process loaded UCX";
  ::setenv("GRADSYNC_UCX_LIBRARY", "libgradsync-no-such-ucp.so.0", 1);
  const Error e = testing::expect_error(ErrorKind::kSystem, [] {
    run_ucx_group(
        2, {}, [](int, Transport&) {}, over("sm"));
  });
  ::unsetenv("GRADSYNC_UCX_LIBRARY");
  EXPECT_TRUE(contains(e.detail(),
                       "the ucx transport needs UCX (libgradsync-no-such-ucp.so.0, "
                       "Debian package libucx0)"))
      << e.what();
  EXPECT_FALSE(ucx_is_loaded());
}

INSTANTIATE_TEST_SUITE_P(
    Ucx, TransportConformance,
    ::testing::Values(
        TransportFactory{"ucx_tcp", [](int n, const TransportOptions& o,
                                       const RankBody& b) { run_ucx_group(n, o, b, over("tcp")); }},
        TransportFactory{"ucx_sm", [](int n, const TransportOptions& o,
                                      const RankBody& b) { run_ucx_group(n, o, b, over("sm")); }}),
    TransportFactoryName);

// Only where UCX may use TCP alone does the transport add RNDV_THRESH=inf, and never over a
// value the caller or the environment gave.
TEST(UcxTransport, SettingsAddEagerMessagesOnlyWhereTcpIsTheOnlyTransport) {
  using Settings = std::vector<std::pair<std::string, std::string>>;
  const auto settings = [](const Settings& config, std::map<std::string, std::string> env) {
    return ucx_settings(UcxOptions{config},
                        [&](const std::string& name) -> std::optional<std::string> {
                          const auto it = env.find(name);
                          if (it == env.end()) return std::nullopt;
                          return it->second;
                        });
  };
  const Settings eager = {{"RNDV_THRESH", "inf"}};
  EXPECT_EQ(settings({}, {{"TLS", "tcp"}}), eager);
  EXPECT_EQ(settings({}, {{"TLS", "tcp,self"}}), eager);
  EXPECT_EQ(settings({{"TLS", "tcp"}}, {{"TLS", "rc,sm"}}), (Settings{{"TLS", "tcp"}, eager[0]}));
  EXPECT_EQ(settings({}, {}), Settings{});
  EXPECT_EQ(settings({}, {{"TLS", "tcp,sm"}}), Settings{});
  EXPECT_EQ(settings({}, {{"TLS", "rc,tcp"}}), Settings{});
  EXPECT_EQ(settings({}, {{"TLS", "self"}}), Settings{});
  EXPECT_EQ(settings({{"TLS", "sm"}}, {{"TLS", "tcp"}}), (Settings{{"TLS", "sm"}}));
  EXPECT_EQ(settings({}, {{"TLS", "tcp"}, {"RNDV_THRESH", "8k"}}), Settings{});
  EXPECT_EQ(settings({{"RNDV_THRESH", "64k"}}, {{"TLS", "tcp"}}),
            (Settings{{"RNDV_THRESH", "64k"}}));
}

TEST(UcxTransport, SetupNamesTheRankThatNeverCame) {
  auto store = make_inproc_store();
  const std::string prefix = testing::unique_name("ucx-missing");
  // Rank 2 of 3 never starts.
  testing::run_threads(2, [&](int r) {
    Error e = expect_error(ErrorKind::kTimeout, [&] {
      make_ucx_transport(*store, prefix, r, 3, all_ranks(3), {}, over("tcp"), 300ms);
    });
    EXPECT_TRUE(contains(e.what(), "rank 2")) << e.what();
  });
}

// The arena (tested with shm's in shared_memory_test.cc) is offered where UCX maps every
// rank's memory into every other (its shared memory), and by no rank where it cannot (UCX over
// TCP alone) or where the transport reaches only some of the world (shm+ucx routes the rest).
TEST(UcxTransport, OffersTheSharedArenaOnlyOverSharedMemoryToTheWholeWorld) {
  run_ucx_group(
      3, {}, [](int, Transport& t) { EXPECT_NE(t.shared_arena(), nullptr); }, over("sm"));
  run_ucx_group(
      3, {}, [](int, Transport& t) { EXPECT_EQ(t.shared_arena(), nullptr); }, over("tcp"));
  auto store = make_inproc_store();
  const std::string prefix = testing::unique_name("ucx-part");
  testing::run_threads(2, [&](int r) {
    // Ranks 0 and 1 of a world of 3 (rank 2 routed elsewhere).
    auto t = make_ucx_transport(*store, prefix, r, 3, {0, 1}, {}, over("sm"), kSetupTimeout);
    EXPECT_EQ(t->shared_arena(), nullptr);
  });
}

// A peer process killed while this rank waits on a receive from it: kPeerLost naming it, not
// a hang until the deadline.
TEST(UcxTransport, AKilledPeerProcessFailsTheWaitingReceive) {
  for (const std::string tls : {"tcp", "sm"}) {
    SCOPED_TRACE(tls);
    testing::TempDir dir;
    auto store = make_file_store(dir.path());
    const std::string prefix = "job";
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      try {
        auto t = make_ucx_transport(*store, prefix, 1, 2, {0, 1}, {}, over(tls), kSetupTimeout);
        pause();  // until killed
      } catch (...) {
      }
      _exit(3);
    }
    auto t = make_ucx_transport(*store, prefix, 0, 2, {0, 1}, {}, over(tls), kSetupTimeout);
    char buf[64];
    auto receive = t->irecv(1, tag_of(1), buf, sizeof buf);
    kill(child, SIGKILL);
    int status = 0;
    waitpid(child, &status, 0);
    Error e = expect_error(ErrorKind::kPeerLost, [&] { receive->wait(Clock::now() + 60s); });
    EXPECT_EQ(e.peer(), 1);
    EXPECT_TRUE(contains(e.what(), "rank 1")) << e.what();
  }
}

// A rank that ends right after its sends completed (the last rank out of a job) still
// delivers them: closing its endpoints must not drop what a peer has yet to read. (Small
// messages, which UCX sends eagerly: a large one completes only once its receive is posted.)
TEST(UcxTransport, SendsCompletedBeforeTheSenderEndsAreStillDelivered) {
  const std::vector<std::size_t> sizes = {1000, 4000, 0, 5};
  for (const std::string tls : {"tcp", "sm"}) {
    SCOPED_TRACE(tls);
    testing::TempDir dir;
    auto store = make_file_store(dir.path());
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      int code = 0;
      try {
        auto t = make_ucx_transport(*store, "job", 1, 2, {0, 1}, {}, over(tls), kSetupTimeout);
        std::vector<std::vector<unsigned char>> payloads;
        std::vector<RequestPtr> sends;
        for (std::size_t i = 0; i < sizes.size(); ++i) payloads.push_back(pattern(i, sizes[i]));
        for (std::size_t i = 0; i < sizes.size(); ++i) {
          sends.push_back(t->isend(0, tag_of(i), payloads[i].data(), sizes[i]));
        }
        for (auto& s : sends) s->wait(Clock::now() + 60s);
      } catch (...) {
        code = 3;
      }
      _exit(code);
    }
    auto t = make_ucx_transport(*store, "job", 0, 2, {0, 1}, {}, over(tls), kSetupTimeout);
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);  // the sender is gone before any receive
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      std::vector<unsigned char> got(sizes[i]);
      t->irecv(1, tag_of(i), got.data(), sizes[i])->wait(Clock::now() + 60s);
      EXPECT_EQ(first_pattern_error(got, i), sizes[i]) << "message " << i;
    }
  }
}

}  // namespace
}  // namespace gradsync::transport

#endif  // GRADSYNC_HAVE_UCX
