// Shared-memory transport: the conformance suite over threads, then what only real processes
// show (data between processes, kill -9, unreaped zombies, nothing left in /dev/shm).
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>

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

std::int64_t monotonic_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// The state letter from /proc/<pid>/stat ('R', 'S', 'Z'...), or '?' if unreadable.
char process_state(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(in, line);
  auto close_paren = line.rfind(')');
  return close_paren != std::string::npos && close_paren + 2 < line.size() ? line[close_paren + 2]
                                                                           : '?';
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
// sending 64 MiB to it. Both survivors must name rank 2 within 2 s (the bound is a
// correctness property: liveness is checked every 50 ms).
TEST(ShmTransport, KilledPeerIsReportedWithinTwoSeconds) {
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
      store->set("killed_at_ns", to_bytes(std::to_string(monotonic_ns())));
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
    auto detected_ns = monotonic_ns();
    auto killed_ns = std::stoll(to_string(store->get("killed_at_ns", 10s)));
    std::string victim_pid = to_string(store->get("victim_pid", 10s));
    require(e.kind() == ErrorKind::kPeerLost, std::string("kPeerLost, got: ") + e.what());
    require(e.peer() == 2, std::string("error names peer 2: ") + e.what());
    require(contains(e.what(), "peer process " + victim_pid),
            std::string("names pid: ") + e.what());
    require(
        detected_ns - killed_ns < 2'000'000'000,
        "detected within 2 s, took " + std::to_string((detected_ns - killed_ns) / 1000000) + " ms");
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
    auto start = Clock::now();
    Error e = expect_error(ErrorKind::kPeerLost,
                           [&] { t->irecv(1, tag_of(2), got, 3)->wait(Clock::now() + 30s); });
    EXPECT_LT(Clock::now() - start, 10s);
    EXPECT_TRUE(contains(e.what(), "closed")) << e.what();
  });
}

// Ranks often outnumber cores (4 ranks on 2 cores in CI): a rank blocked on a late message
// must sleep on its futex after a brief spin, not burn the core its peer needs.
TEST(ShmTransport, IdleWaiterSleepsInsteadOfSpinning) {
  run_shm_threads(2, {},
                  [&](int rank, Transport& t) {
                    int value = 0;
                    if (rank == 0) {
                      std::this_thread::sleep_for(300ms);
                      value = 42;
                      t.isend(1, tag_of(1), &value, sizeof value)->wait(Clock::now() + 30s);
                      return;
                    }
                    auto thread_cpu = [] {
                      timespec ts;
                      ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
                      return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
                    };
                    auto cpu_before = thread_cpu();
                    t.irecv(0, tag_of(1), &value, sizeof value)->wait(Clock::now() + 30s);
                    auto cpu_used = thread_cpu() - cpu_before;
                    EXPECT_EQ(value, 42);
                    // Spinning through the 300 ms would cost ~300 ms of CPU; sleeping costs a few
                    // wake-ups.
                    EXPECT_LT(cpu_used, 100ms)
                        << "waiting used "
                        << std::chrono::duration_cast<std::chrono::milliseconds>(cpu_used).count()
                        << " ms of CPU";
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

}  // namespace
}  // namespace gradsync::transport
