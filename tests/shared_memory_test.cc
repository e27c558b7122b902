// The shared arena (regions, progress counters, waits that fail instead of hanging) of every
// transport that offers one: shm, and ucx over UCX's shared memory; and the shared-memory
// all-reduce across real processes, including kill -9; the copy into shared memory. The
// algorithm's grid over thread ranks lives in collectives_test.cc.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <thread>
#include <vector>

#include "collectives/signature.h"
#include "gradsync/gradsync.h"
#include "harness.h"
#include "transport/inproc.h"
#include "transport/router.h"
#include "transport/shared_arena.h"
#include "transport/shm.h"
#if GRADSYNC_HAVE_UCX
#include "transport/ucx.h"
#endif

namespace gradsync::transport {
namespace {

using namespace std::chrono_literals;
using testing::all_ranks;
using testing::contains;
using testing::expect_error;
using testing::segments_left;

constexpr auto kSetupTimeout = 30s;

Tag call_tag(std::uint64_t seq, std::uint64_t count = 10) {
  collectives::CallSignature sig;
  sig.seq = seq;
  sig.kind = collectives::CollectiveKind::kAllreduce;
  sig.dtype = DataType::kFloat32;
  sig.algorithm = Algorithm::kSharedMemory;
  sig.count = count;
  return collectives::encode(sig);
}

TransportOptions describing_options() {
  TransportOptions options;
  options.format_tag = collectives::describe_tag;
  return options;
}

// A transport that offers a shared arena: how to make rank `rank` of `n`, all in one group.
struct ArenaTransport {
  std::string name;
  std::function<std::unique_ptr<Transport>(Store&, const std::string& prefix, int rank, int n)>
      make;
};

void PrintTo(const ArenaTransport& transport, std::ostream* os) {
  *os << transport.name;
}

class SharedArenaSuite : public ::testing::TestWithParam<ArenaTransport> {
 protected:
  std::unique_ptr<Transport> make(Store& store, const std::string& prefix, int rank, int n) {
    return GetParam().make(store, prefix, rank, n);
  }
  // Builds the transports of one group on n threads, runs body on n threads, destroys them
  // only after every body returned (an early finisher must not look like a lost peer).
  void run_arena_threads(int n, const std::function<void(int, Transport&, SharedArena&)>& body) {
    auto store = make_inproc_store();
    const std::string prefix = testing::unique_name("arena");
    std::vector<std::unique_ptr<Transport>> transports(static_cast<std::size_t>(n));
    testing::run_threads(
        n, [&](int r) { transports[static_cast<std::size_t>(r)] = make(*store, prefix, r, n); });
    testing::run_threads(n, [&](int r) {
      Transport& t = *transports[static_cast<std::size_t>(r)];
      ASSERT_NE(t.shared_arena(), nullptr);
      body(r, t, *t.shared_arena());
    });
  }
};

TEST_P(SharedArenaSuite, EveryMemberSeesWhatOthersPublished) {
  constexpr int kRanks = 4;
  run_arena_threads(kRanks, [&](int rank, Transport&, SharedArena& arena) {
    EXPECT_EQ(arena.members(), kRanks);
    EXPECT_EQ(arena.member_index(), rank);
    EXPECT_EQ(arena.member_rank(rank), rank);
    EXPECT_GE(arena.region_bytes(), std::size_t{2} << 20);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(arena.region(rank)) % 4096, 0u);
    // Rounds: each member fills its region with its round's pattern, publishes, and checks
    // every other member's region once it has published the same round.
    const std::size_t bytes = arena.region_bytes();
    for (std::uint64_t round = 1; round <= 20; ++round) {
      std::memset(arena.region(rank), static_cast<int>(round * 16 + static_cast<unsigned>(rank)),
                  bytes);
      arena.publish(2 * round - 1);
      for (int m = 0; m < kRanks; ++m) {
        if (m == rank) continue;
        arena.wait_for(m, 2 * round - 1, call_tag(round), Clock::now() + 30s);
        const auto want = static_cast<unsigned char>(round * 16 + static_cast<unsigned>(m));
        const unsigned char* region = arena.region(m);
        EXPECT_TRUE(region[0] == want && region[bytes / 2] == want && region[bytes - 1] == want)
            << "member " << m << " round " << round;
      }
      // Nobody overwrites its region before everyone has read it.
      arena.publish(2 * round);
      for (int m = 0; m < kRanks; ++m) {
        if (m != rank) arena.wait_for(m, 2 * round, call_tag(round), Clock::now() + 30s);
      }
      EXPECT_GE(arena.progress(rank), 2 * round);
    }
    expect_error(ErrorKind::kInvalidArgument, [&] { arena.publish(1); });  // never backwards
  });
}

// A wait whose deadline passes gives kTimeout (not before the deadline: a lower bound, which
// no slow machine can break), naming whom and what it waited for, and the arena stays usable.
TEST_P(SharedArenaSuite, WaitTimesOutNamingMemberAndCallAndIsNotFatal) {
  run_arena_threads(2, [](int rank, Transport&, SharedArena& arena) {
    if (rank == 0) {
      const auto deadline = Clock::now() + 150ms;
      Error e = expect_error(ErrorKind::kTimeout,
                             [&] { arena.wait_for(1, 5, call_tag(7, 1234), deadline); });
      EXPECT_TRUE(Clock::now() >= deadline) << "gave up before its deadline";
      EXPECT_EQ(e.peer(), 1);
      EXPECT_TRUE(contains(e.what(), "allreduce #7 (count=1234")) << e.what();
      EXPECT_TRUE(contains(e.what(), "waits for 5")) << e.what();
      arena.publish(1);  // tells rank 1 to go on
      arena.wait_for(1, 5, call_tag(7, 1234), Clock::now() + 30s);
    } else {
      arena.wait_for(0, 1, call_tag(7, 1234), Clock::now() + 30s);
      arena.publish(5);
    }
  });
}

// kAborted, not the kTimeout that running into the 30 s deadline would give: the abort ends
// the waits, and its reason reaches every waiter.
TEST_P(SharedArenaSuite, AbortWakesWaitersWithTheReason) {
  run_arena_threads(3, [](int rank, Transport& t, SharedArena& arena) {
    if (rank == 2) {
      std::this_thread::sleep_for(50ms);  // let the others fall asleep
      t.abort("rank 2 gives up");
      return;
    }
    Error e = expect_error(ErrorKind::kAborted,
                           [&] { arena.wait_for(1 - rank, 1, call_tag(1), Clock::now() + 30s); });
    EXPECT_TRUE(contains(e.what(), "rank 2 gives up")) << e.what();
  });
}

// A member that published what others wait for and then closed its transport is no error;
// waiting for more than it published fails with kPeerLost naming it, not the kTimeout of
// running into the 30 s deadline.
TEST_P(SharedArenaSuite, ClosedMemberDeliversWhatItPublishedThenIsLost) {
  auto store = make_inproc_store();
  const std::string prefix = testing::unique_name("arena-closed");
  std::atomic<bool> closed{false};
  testing::run_threads(2, [&](int rank) {
    auto t = make(*store, prefix, rank, 2);
    ASSERT_NE(t->shared_arena(), nullptr);
    SharedArena& arena = *t->shared_arena();
    if (rank == 1) {
      arena.publish(3);
      t.reset();
      closed = true;
      return;
    }
    while (!closed) std::this_thread::sleep_for(1ms);
    arena.wait_for(1, 3, call_tag(1), Clock::now() + 30s);
    Error e = expect_error(ErrorKind::kPeerLost,
                           [&] { arena.wait_for(1, 4, call_tag(2), Clock::now() + 30s); });
    EXPECT_EQ(e.peer(), 1);
    EXPECT_TRUE(contains(e.what(), "closed its transport")) << e.what();
    EXPECT_TRUE(contains(e.what(), "allreduce #2")) << e.what();
  });
}

// A message arriving while this rank waits in shared memory means the sender runs a
// message-based collective instead of the shared-memory one: kMismatch naming both calls on
// the arena side. The message side learns it from its own look at the arena (shm) or from the
// abort the arena side's caller then sends, as a context does (ucx); either names both calls.
TEST_P(SharedArenaSuite, MessagesDuringArenaWaitsAreMismatches) {
  run_arena_threads(2, [](int rank, Transport& t, SharedArena& arena) {
    if (rank == 0) {
      arena.publish(1);  // in its shared-memory call
      Error e = expect_error(ErrorKind::kMismatch,
                             [&] { arena.wait_for(1, 1, call_tag(4, 100), Clock::now() + 30s); });
      EXPECT_EQ(e.peer(), 1);
      EXPECT_TRUE(contains(e.what(), "count=100")) << e.what();
      EXPECT_TRUE(contains(e.what(), "count=200")) << e.what();
      t.abort(e.what());
    } else {
      const int payload = 42;
      int reply = 0;
      auto send = t.isend(0, call_tag(4, 200), &payload, sizeof payload);
      try {
        t.irecv(0, call_tag(4, 200), &reply, sizeof reply)->wait(Clock::now() + 30s);
        ADD_FAILURE() << "the receive completed";
      } catch (const Error& e) {
        EXPECT_TRUE(e.kind() == ErrorKind::kMismatch || e.kind() == ErrorKind::kAborted)
            << e.what();
        EXPECT_EQ(e.peer(), 0);
        EXPECT_TRUE(contains(e.what(), "count=100")) << e.what();
        EXPECT_TRUE(contains(e.what(), "count=200")) << e.what();
      }
    }
  });
}

std::vector<ArenaTransport> arena_transports() {
  std::vector<ArenaTransport> all = {
      {"shm", [](Store& store, const std::string& prefix, int rank, int n) {
         return make_shm_transport(store, prefix, rank, n, all_ranks(n), describing_options(),
                                   kSetupTimeout);
       }}};
#if GRADSYNC_HAVE_UCX
  all.push_back({"ucx_sm", [](Store& store, const std::string& prefix, int rank, int n) {
                   UcxOptions ucx;
                   ucx.config.emplace_back("TLS", "sm");
                   return make_ucx_transport(store, prefix, rank, n, all_ranks(n),
                                             describing_options(), ucx, kSetupTimeout);
                 }});
#endif
  return all;
}

INSTANTIATE_TEST_SUITE_P(Transports, SharedArenaSuite, ::testing::ValuesIn(arena_transports()),
                         [](const auto& p) { return p.param.name; });

// Every distance between source and destination modulo a page, the 1-63 bytes that go
// through the private buffer among them, and sizes around the page and that buffer's chunk.
TEST(CopyToShared, CopiesExactlyTheBytesAtEveryDistance) {
  constexpr std::size_t kPage = 4096;
  const std::size_t sizes[] = {0, 1, 63, 4095, 4096, 4097, 32 * 1024, 32 * 1024 + 17, 100003};
  std::vector<unsigned char> src_memory(2 * kPage + 100003), dst_memory(3 * kPage + 100003);
  for (std::size_t i = 0; i < src_memory.size(); ++i) {
    src_memory[i] = static_cast<unsigned char>(i * 131 + 7);
  }
  auto page_start = [&](std::vector<unsigned char>& memory) {
    const auto address = reinterpret_cast<std::uintptr_t>(memory.data());
    return memory.data() + (kPage - address % kPage) % kPage;
  };
  const unsigned char* src = page_start(src_memory) + 100;
  for (std::size_t distance = 0; distance <= 130; ++distance) {
    unsigned char* dst = page_start(dst_memory) + 100 + distance;
    for (const std::size_t bytes : sizes) {
      std::fill(dst_memory.begin(), dst_memory.end(), 0xEE);
      copy_to_shared(dst, src, bytes);
      ASSERT_EQ(std::memcmp(dst, src, bytes), 0)
          << "distance " << distance << ", " << bytes << " B";
      EXPECT_EQ(dst[-1], 0xEE) << "distance " << distance << ", " << bytes << " B";
      EXPECT_EQ(dst[bytes], 0xEE) << "distance " << distance << ", " << bytes << " B";
    }
  }
}

TEST(SharedArena, OfferedOnlyWhereOneSharedMemoryTransportReachesEveryone) {
  auto group = make_inproc_group(2);
  EXPECT_EQ(make_inproc_transport(group, 0)->shared_arena(), nullptr);

  // Router over shm for every peer: the arena; a world where one peer routes elsewhere: none.
  auto store = make_inproc_store();
  const std::string prefix = testing::unique_name("arena-router");
  testing::run_threads(2, [&](int rank) {
    std::vector<std::unique_ptr<Transport>> transports;
    transports.push_back(
        make_shm_transport(*store, prefix, rank, 2, all_ranks(2), {}, kSetupTimeout));
    SharedArena* arena = transports[0]->shared_arena();
    const std::size_t buffered = transports[0]->buffered_send_bytes();
    EXPECT_GT(buffered, 0u);
    RouterTransport all_shm(rank, 2, std::move(transports), {0, 0});
    EXPECT_EQ(all_shm.shared_arena(), arena);
    EXPECT_EQ(all_shm.buffered_send_bytes(), buffered);
  });
  testing::run_threads(2, [&](int i) {
    // World of 3: ranks 0 and 1 share memory, rank 2 is elsewhere (routed to inproc here).
    auto inproc_group = make_inproc_group(3);
    std::vector<std::unique_ptr<Transport>> transports;
    transports.push_back(
        make_shm_transport(*store, prefix + "-partial", i, 3, {0, 1}, {}, kSetupTimeout));
    transports.push_back(make_inproc_transport(inproc_group, i));
    RouterTransport partial(i, 3, std::move(transports), {0, 0, 1});
    EXPECT_EQ(partial.shared_arena(), nullptr);
    // What every peer's transport buffers: inproc promises nothing.
    EXPECT_EQ(partial.buffered_send_bytes(), 0u);
  });
}

// ---- The shared-memory all-reduce across processes ----

// gtest assertions in a forked child would be lost with it: children report by exit status.
void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

// `token` (8 characters) names the job's shm segments, so a test can check it left none.
std::unique_ptr<Context> process_context(const testing::TempDir& dir, int rank, int n,
                                         const std::string& token = "shmdirct") {
  Options options;
  options.token = token;
  options.rank = rank;
  options.size = n;
  options.transport = "shm";
  options.timeout = 30s;
  options.store = make_file_store(dir.path());
  return init(options);
}

TEST(SharedMemoryAllreduce, ProcessesGetExactIdenticalResults) {
  for (int n : {2, 3}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    testing::TempDir dir;
    auto statuses = testing::run_processes(n, [&](int rank) {
      auto ctx = process_context(dir, rank, n);
      require(ctx->transport_name((rank + 1) % n) == "shm", "shm between processes");
      // Integer-valued floats: every sum is exact, so the result is known.
      for (std::size_t count : {std::size_t{0}, std::size_t{5}, (std::size_t{3} << 20) + 7}) {
        std::vector<float> v(count);
        for (std::size_t i = 0; i < count; ++i)
          v[i] = static_cast<float>((i + static_cast<std::size_t>(rank)) % 13);
        ctx->allreduce(v.data(), v.data(), count, DataType::kFloat32, ReduceOp::kSum,
                       {.algorithm = Algorithm::kSharedMemory});
        for (std::size_t i = 0; i < count; ++i) {
          float want = 0;
          for (int r = 0; r < n; ++r)
            want += static_cast<float>((i + static_cast<std::size_t>(r)) % 13);
          if (v[i] != want) {
            require(false, "element " + std::to_string(i) + " of " + std::to_string(count));
          }
        }
      }
      return 0;
    });
    for (int r = 0; r < n; ++r) {
      EXPECT_TRUE(WIFEXITED(statuses[static_cast<std::size_t>(r)]) &&
                  WEXITSTATUS(statuses[static_cast<std::size_t>(r)]) == 0)
          << "rank " << r;
    }
  }
}

// Rank 2 dies by SIGKILL in the middle of a stream of shared-memory all-reduces. Every
// survivor must fail because of rank 2: its own kPeerLost naming peer 2, or the abort of a
// survivor that saw the death first, whose reason quotes that error. Not a timeout: the
// contexts' 30 s deadline is what a survivor that missed the death would run into (kTimeout),
// and run_processes' hang guard kills one that hangs regardless, which fails its status check.
// Nothing may be left in /dev/shm.
TEST(SharedMemoryAllreduce, KilledRankIsNamedBySurvivors) {
  constexpr int kRanks = 3;
  testing::TempDir dir;
  const std::string token = "k9" + std::to_string(100000 + ::getpid() % 900000);
  auto statuses = testing::run_processes(kRanks, [&](int rank) {
    auto ctx = process_context(dir, rank, kRanks, token);
    std::vector<float> buf(std::size_t{4} << 20, 1.0f);
    if (rank == 2) {
      for (int i = 0; i < 3; ++i) {
        ctx->allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kMax,
                       {.algorithm = Algorithm::kSharedMemory});
      }
      ::raise(SIGKILL);
    }
    try {
      for (;;) {
        ctx->allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kMax,
                       {.algorithm = Algorithm::kSharedMemory});
      }
    } catch (const Error& e) {
      const bool lost = e.kind() == ErrorKind::kPeerLost && e.peer() == 2;
      const bool aborted_over_it = e.kind() == ErrorKind::kAborted &&
                                   contains(e.what(), "peer lost") &&
                                   contains(e.what(), "(peer 2)");
      require(lost || aborted_over_it,
              std::string("kPeerLost naming peer 2, or an abort quoting it: ") + e.what());
      require(!contains(e.what(), "timeout"), std::string("not a timeout: ") + e.what());
      return 0;
    }
  });
  EXPECT_TRUE(WIFEXITED(statuses[0]) && WEXITSTATUS(statuses[0]) == 0);
  EXPECT_TRUE(WIFEXITED(statuses[1]) && WEXITSTATUS(statuses[1]) == 0);
  EXPECT_TRUE(WIFSIGNALED(statuses[2]) && WTERMSIG(statuses[2]) == SIGKILL);
  EXPECT_EQ(segments_left("gradsync-" + token), std::vector<std::string>{});
}

}  // namespace
}  // namespace gradsync::transport
