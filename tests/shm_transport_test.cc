// Shared-memory transport: the conformance suite over threads, then what only real processes
// show (data between processes, kill -9, unreaped zombies, nothing left in /dev/shm), and the
// segment names the launcher's clean-up relies on.
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>

#include "gradsync/shm_segments.h"
#include "gradsync/store.h"
#include "harness.h"
#include "rendezvous/store_util.h"
#include "transport/shm.h"
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
using testing::segments_left;

constexpr auto kSetupTimeout = 30s;

// Builds the transports of one group on n threads, runs body on n threads, then destroys them.
void run_shm_threads(int n, const TransportOptions& options, const RankBody& body) {
  auto store = make_inproc_store();
  std::string prefix = testing::unique_name("shm-threads");
  std::vector<std::unique_ptr<Transport>> transports(static_cast<std::size_t>(n));
  testing::run_threads(n, [&](int r) {
    transports[static_cast<std::size_t>(r)] =
        make_shm_transport(*store, prefix, r, n, all_ranks(n), options, kSetupTimeout);
  });
  testing::run_threads(n, [&](int r) { body(r, *transports[static_cast<std::size_t>(r)]); });
}

INSTANTIATE_TEST_SUITE_P(Shm, TransportConformance,
                         ::testing::Values(TransportFactory{"shm", run_shm_threads}),
                         TransportFactoryName);

// gtest assertions in a forked child would be lost with it: children check with `require`
// and report through their exit status instead.
void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

// The state letter from a /proc/.../stat file ('R', 'S', 'Z'...), or '?' if unreadable.
char state_in_stat_file(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  auto close_paren = line.rfind(')');
  return close_paren != std::string::npos && close_paren + 2 < line.size() ? line[close_paren + 2]
                                                                           : '?';
}

char process_state(pid_t pid) {
  return state_in_stat_file("/proc/" + std::to_string(pid) + "/stat");
}

// True while thread `tid` of this process sleeps in a futex wait: state 'S' and, where /proc
// shows it, the system call it is blocked in is futex(2). A thread that spins is 'R'.
bool asleep_in_futex(pid_t tid) {
  const std::string task = "/proc/self/task/" + std::to_string(tid);
  if (state_in_stat_file(task + "/stat") != 'S') return false;
  std::ifstream in(task + "/syscall");  // "<number> <args>...", or "running"
  long number = -1;
  if (!(in >> number)) return true;  // not shown here (kernel option): the state must do
  return number == SYS_futex;
}

bool exited_cleanly(int status) {
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

TEST(ShmTransport, ProcessesExchangeData) {
  for (int n : {2, 4}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    testing::TempDir dir;
    std::string prefix = testing::unique_name("shm-exchange");
    auto statuses = testing::run_processes(n, [&](int rank) {
      auto store = make_file_store(dir.path());
      auto t = make_shm_transport(*store, prefix, rank, n, all_ranks(n), {}, kSetupTimeout);
      require(segments_left(prefix).empty(), "segments unlinked right after setup");
      // A ring of large messages (copying receive), then the same ring the other way round
      // with a consuming receive, so every ordered neighbour pair carries data.
      int next = (rank + 1) % n, prev = (rank + n - 1) % n;
      auto bytes_from = [](int src) {
        return (std::size_t{8} << 20) + static_cast<std::size_t>(src);
      };
      auto out = pattern(static_cast<std::uint64_t>(rank), bytes_from(rank));
      std::vector<unsigned char> in(bytes_from(prev));
      auto receive = t->irecv(prev, tag_of(1), in.data(), in.size());
      auto send = t->isend(next, tag_of(1), out.data(), out.size());
      receive->wait(Clock::now() + 60s);
      send->wait(Clock::now() + 60s);
      require(first_pattern_error(in, static_cast<std::uint64_t>(prev)) == in.size(),
              "ring data from rank " + std::to_string(prev));

      std::vector<unsigned char> consumed;
      auto consume = [&](const void* data, std::size_t, std::size_t len) {
        auto* p = static_cast<const unsigned char*>(data);
        consumed.insert(consumed.end(), p, p + len);
      };
      receive = t->irecv_consume(next, tag_of(2), bytes_from(next), consume);
      send = t->isend(prev, tag_of(2), out.data(), out.size());
      receive->wait(Clock::now() + 60s);
      send->wait(Clock::now() + 60s);
      require(first_pattern_error(consumed, static_cast<std::uint64_t>(next)) == consumed.size() &&
                  consumed.size() == bytes_from(next),
              "consumed data from rank " + std::to_string(next));
      return 0;
    });
    for (int r = 0; r < n; ++r)
      EXPECT_TRUE(exited_cleanly(statuses[static_cast<std::size_t>(r)])) << "rank " << r;
    EXPECT_EQ(segments_left(prefix), std::vector<std::string>{});
  }
}

// Rank 2 dies by SIGKILL halfway through sending 64 MiB to rank 0, while rank 1 is blocked
// sending 64 MiB to it. Both survivors must fail with kPeerLost naming rank 2 and its pid,
// not run into their deadline (which would be kTimeout): nobody rings the doorbell of a
// sleeping survivor, so only its periodic liveness check can notice the death.
TEST(ShmTransport, KilledPeerIsReported) {
  constexpr int kRanks = 3;
  constexpr std::size_t kBytes = std::size_t{64} << 20;
  testing::TempDir dir;
  std::string prefix = testing::unique_name("shm-kill");
  auto statuses = testing::run_processes(kRanks, [&](int rank) {
    auto store = make_file_store(dir.path());
    auto t = make_shm_transport(*store, prefix, rank, kRanks, all_ranks(kRanks), {}, kSetupTimeout);
    std::vector<unsigned char> buf(kBytes);
    if (rank == 2) {
      store->set("victim_pid", to_bytes(std::to_string(::getpid())));
      auto send = t->isend(0, tag_of(1), buf.data(), kBytes);
      while (t->traffic(0).bytes_sent < kBytes / 4) send->test();
      ::raise(SIGKILL);
    }
    auto request = rank == 0 ? t->irecv(2, tag_of(1), buf.data(), kBytes)
                             : t->isend(2, tag_of(1), buf.data(), kBytes);
    Error e = [&] {
      try {
        request->wait(Clock::now() + 60s);
      } catch (const Error& error) {
        return error;
      }
      throw std::runtime_error("wait on the killed peer succeeded");
    }();
    std::string victim_pid = to_string(store->get("victim_pid", 10s));
    require(e.kind() == ErrorKind::kPeerLost, std::string("kPeerLost, got: ") + e.what());
    require(e.peer() == 2, std::string("error names peer 2: ") + e.what());
    require(contains(e.what(), "peer process " + victim_pid),
            std::string("names pid: ") + e.what());
    // Sticky: the transport stays failed, even towards healthy peers.
    try {
      t->isend(1 - rank, tag_of(2), buf.data(), 1)->wait(Clock::now() + 10s);
      throw std::runtime_error("operation after peer loss succeeded");
    } catch (const Error& later) {
      require(later.kind() == ErrorKind::kPeerLost,
              std::string("sticky kPeerLost: ") + later.what());
    }
    return 0;
  });
  EXPECT_TRUE(exited_cleanly(statuses[0]));
  EXPECT_TRUE(exited_cleanly(statuses[1]));
  EXPECT_TRUE(WIFSIGNALED(statuses[2]) && WTERMSIG(statuses[2]) == SIGKILL);
  EXPECT_EQ(segments_left(prefix), std::vector<std::string>{});
}

// A dead child that nobody has reaped yet is a zombie: kill(pid, 0) still succeeds, yet it
// will never write again. This process is rank 0 and deliberately does not reap rank 1.
TEST(ShmTransport, DeadButUnreapedPeerIsDetected) {
  constexpr std::size_t kBytes = std::size_t{16} << 20;
  testing::TempDir dir;
  std::string prefix = testing::unique_name("shm-zombie");
  std::fflush(nullptr);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    try {
      auto store = make_file_store(dir.path());
      auto t = make_shm_transport(*store, prefix, 1, 2, all_ranks(2), {}, kSetupTimeout);
      std::vector<unsigned char> buf(kBytes);
      auto send = t->isend(0, tag_of(1), buf.data(), kBytes);
      while (t->traffic(0).bytes_sent < kBytes / 4) send->test();
      ::raise(SIGKILL);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
    }
    ::_exit(3);
  }
  auto store = make_file_store(dir.path());
  auto t = make_shm_transport(*store, prefix, 0, 2, all_ranks(2), {}, kSetupTimeout);
  std::vector<unsigned char> buf(kBytes);
  Error e = expect_error(ErrorKind::kPeerLost, [&] {
    t->irecv(1, tag_of(1), buf.data(), kBytes)->wait(Clock::now() + 60s);
  });
  EXPECT_EQ(e.peer(), 1);
  EXPECT_TRUE(contains(e.what(), "exited")) << e.what();
  EXPECT_EQ(process_state(child), 'Z') << "the test meant to exercise an unreaped child";
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  EXPECT_EQ(segments_left(prefix), std::vector<std::string>{});
}

TEST(ShmTransport, SetupThatTimesOutLeavesNothingBehind) {
  auto store = make_inproc_store();
  std::string prefix = testing::unique_name("shm-lonely");
  // Rank 1 never shows up.
  expect_error(ErrorKind::kTimeout,
               [&] { make_shm_transport(*store, prefix, 0, 2, all_ranks(2), {}, 200ms); });
  EXPECT_EQ(segments_left(prefix), std::vector<std::string>{});
}

TEST(ShmTransport, InvalidGroupsAreRejected) {
  auto store = make_inproc_store();
  for (const std::vector<int>& group :
       std::vector<std::vector<int>>{{}, {1, 0}, {0, 0, 1}, {0, 2}, {1}}) {
    expect_error(ErrorKind::kInvalidArgument,
                 [&] { make_shm_transport(*store, "bad", 0, 2, group, {}, 100ms); });
  }
}

TEST(ShmTransport, PeersOutsideTheGroupAreInvalid) {
  // World of 4, but this shm group holds ranks 1 and 3 only.
  auto store = make_inproc_store();
  std::string prefix = testing::unique_name("shm-subgroup");
  testing::run_threads(2, [&](int i) {
    int rank = i == 0 ? 1 : 3;
    auto t = make_shm_transport(*store, prefix, rank, 4, {1, 3}, {}, kSetupTimeout);
    char byte = 7;
    expect_error(ErrorKind::kInvalidArgument, [&] { t->isend(0, tag_of(1), &byte, 1); });
    expect_error(ErrorKind::kInvalidArgument, [&] { t->irecv(2, tag_of(1), &byte, 1); });
    int peer = rank == 1 ? 3 : 1;
    auto send = t->isend(peer, tag_of(2), &byte, 1);
    char got = 0;
    t->irecv(peer, tag_of(2), &got, 1)->wait(Clock::now() + 30s);
    send->wait(Clock::now() + 30s);
    EXPECT_EQ(got, 7);
  });
}

// A send the receiver does not take times out naming the missing bytes, and a timeout is not
// fatal: once the receiver shows up the same send completes.
TEST(ShmTransport, SendTimeoutIsReportedAndNotSticky) {
  constexpr std::size_t kBytes = std::size_t{8} << 20;  // larger than a ring
  std::atomic<bool> sender_timed_out{false};
  run_shm_threads(2, {}, [&](int rank, Transport& t) {
    if (rank == 0) {
      auto payload = pattern(8, kBytes);
      auto send = t.isend(1, tag_of(1), payload.data(), kBytes);
      Error e = expect_error(ErrorKind::kTimeout, [&] { send->wait(Clock::now() + 100ms); });
      EXPECT_EQ(e.peer(), 1);
      EXPECT_TRUE(contains(e.what(), "still missing")) << e.what();
      EXPECT_TRUE(contains(e.what(), std::to_string(kBytes) + " bytes")) << e.what();
      sender_timed_out = true;
      send->wait(Clock::now() + 60s);
    } else {
      while (!sender_timed_out) std::this_thread::sleep_for(1ms);
      std::vector<unsigned char> got(kBytes);
      t.irecv(0, tag_of(1), got.data(), kBytes)->wait(Clock::now() + 60s);
      EXPECT_EQ(first_pattern_error(got, 8), kBytes);
    }
  });
}

TEST(ShmTransport, MismatchIsSticky) {
  run_shm_threads(2, {}, [&](int rank, Transport& t) {
    int v = 1;
    if (rank == 0) {
      t.isend(1, tag_of(1), &v, sizeof v)->wait(Clock::now() + 30s);
      t.isend(1, tag_of(2), &v, sizeof v)->wait(Clock::now() + 30s);
    } else {
      expect_error(ErrorKind::kMismatch,
                   [&] { t.irecv(0, tag_of(9), &v, sizeof v)->wait(Clock::now() + 30s); });
      expect_error(ErrorKind::kMismatch,
                   [&] { t.irecv(0, tag_of(2), &v, sizeof v)->wait(Clock::now() + 30s); });
    }
  });
}

// What a peer sent before closing its transport is still delivered; waiting for more fails
// at once instead of running into the deadline.
TEST(ShmTransport, ClosedPeerDeliversWhatItSentThenFails) {
  auto store = make_inproc_store();
  std::string prefix = testing::unique_name("shm-closed");
  std::atomic<bool> closed{false};
  testing::run_threads(2, [&](int rank) {
    auto t = make_shm_transport(*store, prefix, rank, 2, all_ranks(2), {}, kSetupTimeout);
    if (rank == 1) {
      char hello[3] = {'h', 'i', '!'};
      t->isend(0, tag_of(1), hello, 3)->wait(Clock::now() + 30s);
      t.reset();
      closed = true;
      return;
    }
    while (!closed) std::this_thread::sleep_for(1ms);
    char got[3] = {};
    t->irecv(1, tag_of(1), got, 3)->wait(Clock::now() + 30s);
    EXPECT_EQ(std::string(got, 3), "hi!");
    // kPeerLost, not the kTimeout that running into the deadline would give.
    Error e = expect_error(ErrorKind::kPeerLost,
                           [&] { t->irecv(1, tag_of(2), got, 3)->wait(Clock::now() + 30s); });
    EXPECT_TRUE(contains(e.what(), "closed")) << e.what();
  });
}

// Ranks often outnumber cores (4 ranks on 2 cores in CI): a rank blocked on a late message
// must sleep on its futex after a brief spin, not burn the core its peer needs. The sender
// sends only once it has seen the waiter asleep in futex(2), which a spinning waiter never is.
TEST(ShmTransport, IdleWaiterSleepsInsteadOfSpinning) {
  std::atomic<pid_t> waiter_tid{0};
  run_shm_threads(2, {}, [&](int rank, Transport& t) {
    int value = 0;
    if (rank == 1) {
      waiter_tid = static_cast<pid_t>(::gettid());
      t.irecv(0, tag_of(1), &value, sizeof value)->wait(Clock::now() + 30s);
      EXPECT_EQ(value, 42);
      return;
    }
    while (waiter_tid == 0) std::this_thread::yield();
    // A sleeping waiter runs only for its brief spin after each liveness check (every 50 ms),
    // so it shows as asleep within a few looks however loaded the machine; a spinning one is
    // never seen so. The bound counts looks, not time, and only ends a failing test.
    constexpr int kLooks = 10000;
    int looks = 1;
    while (!asleep_in_futex(waiter_tid) && looks < kLooks) {
      ++looks;
      std::this_thread::sleep_for(1ms);
    }
    EXPECT_LT(looks, kLooks) << "the waiting rank was never seen asleep in futex(2)";
    value = 42;
    t.isend(1, tag_of(1), &value, sizeof value)->wait(Clock::now() + 30s);
  });
}

// The native consuming receive hands out pieces straight from ring slots: several pieces for
// a large message, each cache-line aligned so reductions can use aligned vector loads.
TEST(ShmTransport, ConsumerReadsSlotsInPlace) {
  constexpr std::size_t kBytes = std::size_t{3} << 20;
  run_shm_threads(2, {}, [&](int rank, Transport& t) {
    if (rank == 0) {
      auto payload = pattern(3, kBytes);
      t.isend(1, tag_of(1), payload.data(), kBytes)->wait(Clock::now() + 30s);
    } else {
      std::size_t pieces = 0;
      bool aligned = true;
      t.irecv_consume(0, tag_of(1), kBytes, [&](const void* data, std::size_t, std::size_t) {
         ++pieces;
         aligned &= reinterpret_cast<std::uintptr_t>(data) % 64 == 0;
       })->wait(Clock::now() + 30s);
      EXPECT_GT(pieces, 1u);
      EXPECT_TRUE(aligned);
    }
  });
}

// The one definition of a segment name, which gradsync-run's clean-up reads back: the creator
// is read from the end, so a key prefix that looks like a name's tail does not confuse it.
TEST(ShmSegmentNames, CreatorIsReadBackFromTheName) {
  EXPECT_EQ(shm_segment_name("ab/cdefghij", "ctx 1", 4242, 3, 7),
            "/gradsync-ab_cdefg-ctx_1-p4242-r3-7");
  EXPECT_EQ(shm_segment_prefix("ab/cdefghij"), "gradsync-ab_cdefg-");
  EXPECT_EQ(shm_segment_creator(shm_segment_name("tok", "ctx-p99-r1-2", 4242, 3, 7)), 4242);
  EXPECT_EQ(shm_segment_creator("gradsync-abcdefgh-p4242-r3-7"), 4242);  // as /dev/shm lists it
  EXPECT_EQ(shm_segment_creator("gradsync-abcdefgh-seg"), std::nullopt);
  EXPECT_EQ(shm_segment_creator("gradsync-abcdefgh-p-r3-7"), std::nullopt);
  EXPECT_EQ(shm_segment_creator("gradsync-abcdefgh-p12345678901-r3-7"), std::nullopt);
}

// The name the transport really gives its segment (read from the store while the group is
// still setting up, so the segment still exists) reads back to this process and carries the
// job's prefix: what gradsync-run relies on to keep a live job's segments.
TEST(ShmSegmentNames, TransportNamesItsSegmentsByTheDefinition) {
  auto store = make_inproc_store();
  std::string prefix = testing::unique_name("shm-names");
  TransportOptions options;
  options.token = "f00dcafe-and-the-rest";
  testing::run_threads(2, [&](int rank) {
    if (rank == 1) {
      std::string name = to_string(store->get(prefix + "/shm/segment/0", kSetupTimeout));
      EXPECT_EQ(shm_segment_creator(name), ::getpid()) << name;
      EXPECT_TRUE(name.starts_with("/" + shm_segment_prefix(options.token))) << name;
      EXPECT_TRUE(std::filesystem::exists("/dev/shm" + name)) << name;
    }
    make_shm_transport(*store, prefix, rank, 2, all_ranks(2), options, kSetupTimeout);
  });
  EXPECT_EQ(segments_left(prefix), std::vector<std::string>{});
}

}  // namespace
}  // namespace gradsync::transport
