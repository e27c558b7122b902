// Point-to-point send and recv: every world size and awkward count against a plain reference,
// blocking and async, over thread ranks on the inproc and shm transports; the exchanges that
// must complete at any size (also between processes over shm and tcp); issue order; counts,
// dtypes and tags that disagree; bad peers; the collectives' numbering left alone; sends and
// recvs around collectives; and a dead peer.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/store.h"
#include "harness.h"
#include "reference.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
using testing::contains;
using Buffer = testing::Buffer;
using testing::guard_intact;
using testing::holds_at;
using testing::kGuard;
using testing::kGuardByte;
using testing::pattern;

void run_contexts(const std::string& transport, int n, const std::function<void(Context&)>& fn,
                  const Options& options = {}) {
  if (transport == "shm") {
    testing::run_shm_contexts(n, fn, options);
  } else {
    testing::run_inproc_contexts(n, fn, options);
  }
}

// ---- Every world size and awkward count ----

class P2pGrid : public ::testing::TestWithParam<std::tuple<std::string, int>> {
 protected:
  const std::string transport = std::get<0>(GetParam());
  const int n = std::get<1>(GetParam());
};

// Every rank sends to r + 1 and receives from r - 1: async with the send or the receive first,
// blocking (even ranks send first), and torch's isend then blocking recv.
TEST_P(P2pGrid, RingExchangeMatchesReference) {
  const std::size_t counts[] = {0, 1, 7, 1000003};
  const DataType dtypes[] = {DataType::kFloat32, DataType::kUInt8, DataType::kFloat64};
  run_contexts(transport, n, [&](Context& ctx) {
    const int r = ctx.rank(), next = (r + 1) % n, prev = (r - 1 + n) % n;
    int k = 0;
    for (std::size_t count : counts) {
      for (DataType t : dtypes) {
        if (count > 1000 && t != DataType::kFloat32) continue;  // keep the grid fast
        const std::size_t bytes = count * dtype_size(t);
        for (int mode = 0; mode < 4; ++mode, ++k) {
          const std::string what = transport + " n=" + std::to_string(n) +
                                   " count=" + std::to_string(count) + " " + to_string(t) +
                                   " mode " + std::to_string(mode);
          if (n == 1) {
            Buffer b(bytes + 1);
            testing::expect_error(ErrorKind::kInvalidArgument,
                                  [&] { ctx.send(b.data(), count, t, 0); });
            continue;
          }
          const Buffer out = pattern(r, next, bytes, k);
          Buffer in(bytes + kGuard, kGuardByte);
          if (mode == 0) {
            Work s = ctx.send_async(out.data(), count, t, next);
            Work q = ctx.recv_async(in.data(), count, t, prev);
            s.wait();
            q.wait();
          } else if (mode == 1) {
            Work q = ctx.recv_async(in.data(), count, t, prev);
            Work s = ctx.send_async(out.data(), count, t, next);
            q.wait();
            s.wait();
          } else if (mode == 2) {
            if (r % 2 == 0) {
              ctx.send(out.data(), count, t, next);
              ctx.recv(in.data(), count, t, prev);
            } else {
              ctx.recv(in.data(), count, t, prev);
              ctx.send(out.data(), count, t, next);
            }
          } else {
            Work s = ctx.send_async(out.data(), count, t, next);
            ctx.recv(in.data(), count, t, prev);
            s.wait();
          }
          EXPECT_TRUE(holds_at(in, 0, pattern(prev, r, bytes, k))) << what;
          EXPECT_TRUE(guard_intact(in, bytes)) << what;
        }
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, P2pGrid,
                         ::testing::Combine(::testing::Values("inproc", "shm"),
                                            ::testing::Values(1, 2, 3, 4, 5, 8)),
                         [](const auto& p) {
                           return std::get<0>(p.param) + "_n" +
                                  std::to_string(std::get<1>(p.param));
                         });

// ---- Behaviours, over thread ranks on both transports ----

class P2p : public ::testing::TestWithParam<std::string> {
 protected:
  const std::string transport = GetParam();
};

// Rank 0 sends to 1 and receives from 1 while 1 does the same towards 0, both posting both
// before waiting, for a message that fits any transport buffer and one that does not;
// also with a pause between the two, so the worker has started the first before the second
// is issued (a worker that waited for it would wait forever). The context's timeout only
// bounds a regression; it is not what the test measures.
TEST_P(P2p, PairExchangeCompletesForSmallAndLargeMessages) {
  run_contexts(transport, 2,
               [&](Context& ctx) {
                 const int r = ctx.rank(), peer = 1 - r;
                 int k = 0;
                 for (std::size_t bytes : {std::size_t{4}, testing::kBeyondEveryTransportBuffer}) {
                   const Buffer out = pattern(r, peer, bytes, k);
                   for (int order = 0; order < 4; ++order, ++k) {
                     const bool send_first = order % 2 == 0, pause = order >= 2;
                     Buffer in(bytes + kGuard, kGuardByte);
                     const std::size_t count = bytes / 4;
                     Work s, q;
                     if (send_first) {
                       s = ctx.send_async(out.data(), count, DataType::kFloat32, peer);
                     } else {
                       q = ctx.recv_async(in.data(), count, DataType::kFloat32, peer);
                     }
                     if (pause) std::this_thread::sleep_for(20ms);
                     if (send_first) {
                       q = ctx.recv_async(in.data(), count, DataType::kFloat32, peer);
                     } else {
                       s = ctx.send_async(out.data(), count, DataType::kFloat32, peer);
                     }
                     s.wait();
                     q.wait();
                     EXPECT_TRUE(holds_at(in, 0, pattern(peer, r, bytes, k - order)))
                         << bytes << " bytes";
                     EXPECT_TRUE(guard_intact(in, bytes));
                   }
                 }
               },
               {.timeout = 60s});
}

// Messages from one rank to another arrive in the order they were issued, whatever their
// sizes and whether they were sent blocking or async.
TEST_P(P2p, SendsToOnePeerArriveInIssueOrder) {
  const std::size_t sizes[] = {0, 4, 3 << 20, 12, 0, 1 << 20, 4, 5 << 20, 8, 16};
  constexpr int kMessages = static_cast<int>(std::size(sizes));
  run_contexts(transport, 3, [&](Context& ctx) {
    const int r = ctx.rank();
    if (r == 0) {
      std::vector<Buffer> out;
      std::vector<Work> sent;
      for (int i = 0; i < kMessages; ++i) out.push_back(pattern(0, 1, sizes[i], i));
      for (int i = 0; i < kMessages; ++i) {
        auto& b = out[static_cast<std::size_t>(i)];
        if (i % 3 == 2) {
          ctx.send(b.data(), b.size(), DataType::kUInt8, 1, 5);
        } else {
          sent.push_back(ctx.send_async(b.data(), b.size(), DataType::kUInt8, 1, 5));
        }
      }
      for (auto& w : sent) w.wait();
    } else if (r == 1) {
      std::vector<Buffer> in;
      std::vector<Work> received;
      for (int i = 0; i < kMessages; ++i) in.emplace_back(sizes[i] + kGuard, kGuardByte);
      // The first half posted at once, the rest one by one.
      for (int i = 0; i < kMessages / 2; ++i) {
        auto& b = in[static_cast<std::size_t>(i)];
        received.push_back(ctx.recv_async(b.data(), sizes[i], DataType::kUInt8, 0, 5));
      }
      for (auto& w : received) w.wait();
      for (int i = kMessages / 2; i < kMessages; ++i) {
        ctx.recv(in[static_cast<std::size_t>(i)].data(), sizes[i], DataType::kUInt8, 0, 5);
      }
      for (int i = 0; i < kMessages; ++i) {
        EXPECT_TRUE(holds_at(in[static_cast<std::size_t>(i)], 0, pattern(0, 1, sizes[i], i)))
            << "message " << i;
        EXPECT_TRUE(guard_intact(in[static_cast<std::size_t>(i)], sizes[i])) << "message " << i;
      }
    }
    ctx.barrier();
  });
}

// Only ranks 0 and 1 exchange messages; ranks 2 and 3 do not. The collectives after them must
// still match on every rank: point-to-point calls take no collective call number.
TEST_P(P2p, CollectivesStayNumberedAlikeOnEveryRank) {
  run_contexts(transport, 4, [&](Context& ctx) {
    const int r = ctx.rank();
    if (r < 2) {
      for (int i = 0; i < 3; ++i) {
        Buffer out = pattern(r, 1 - r, 100, i), in(100);
        Work s = ctx.send_async(out.data(), 100, DataType::kUInt8, 1 - r);
        ctx.recv(in.data(), 100, DataType::kUInt8, 1 - r);
        s.wait();
        EXPECT_TRUE(in == pattern(1 - r, r, 100, i));
      }
    }
    std::vector<float> v(1000, static_cast<float>(r + 1));
    ctx.allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
    EXPECT_EQ(v[999], 10.0f);
    std::vector<float> b(7, r == 2 ? 3.0f : 0.0f);
    ctx.broadcast(b.data(), b.size(), DataType::kFloat32, 2);
    EXPECT_EQ(b[6], 3.0f);
  });
}

// Sends and recvs issued on the same side of a collective on both ranks: the collective runs
// once they are done, and the ones after it run after it, at a size the transports do not
// buffer.
TEST_P(P2p, SendsAndRecvsAroundCollectivesInAConsistentOrder) {
  const std::size_t bytes = std::size_t{8} << 20;
  run_contexts(transport, 3, [&](Context& ctx) {
    const int r = ctx.rank();
    std::vector<float> v(5000, 1.0f);
    Buffer in(bytes + kGuard, kGuardByte), in2(bytes + kGuard, kGuardByte);
    const Buffer out = pattern(r, 1 - r, bytes, 0), out2 = pattern(r, 1 - r, bytes, 1);
    std::vector<Work> works;
    if (r == 0) works.push_back(ctx.send_async(out.data(), bytes, DataType::kUInt8, 1));
    if (r == 1) works.push_back(ctx.recv_async(in.data(), bytes, DataType::kUInt8, 0));
    works.push_back(
        ctx.allreduce_async(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum));
    if (r == 0) works.push_back(ctx.recv_async(in2.data(), bytes, DataType::kUInt8, 1));
    if (r == 1) works.push_back(ctx.send_async(out2.data(), bytes, DataType::kUInt8, 0));
    ctx.barrier();  // blocking: waits for all of them
    for (auto& w : works) EXPECT_TRUE(w.test());
    for (auto& w : works) w.wait();
    EXPECT_EQ(v[4999], 3.0f);
    if (r == 1) {
      EXPECT_TRUE(holds_at(in, 0, pattern(0, 1, bytes, 0)));
    }
    if (r == 0) {
      EXPECT_TRUE(holds_at(in2, 0, pattern(1, 0, bytes, 1)));
    }
  });
}

// Rank 0 waits for a recv it queued before an all-reduce, while rank 1 sends only after the
// all-reduce: the order the header forbids. It must end in an error on both ranks, not a hang.
TEST_P(P2p, ARecvQueuedBeforeACollectiveWhoseSendComesAfterItFails) {
  std::vector<std::string> errors(2);
  run_contexts(transport, 2, [&](Context& ctx) {
    const int r = ctx.rank();
    std::vector<float> v(100, 1.0f), in(10);
    auto& error = errors[static_cast<std::size_t>(r)];
    try {
      if (r == 0) {
        Work q = ctx.recv_async(in.data(), in.size(), DataType::kFloat32, 1, 0, {.timeout = 5s});
        Work a =
            ctx.allreduce_async(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
        try {
          q.wait();
        } catch (const Error& e) {
          error = e.what();
        }
        a.wait();
      } else {
        ctx.allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
        ctx.send(in.data(), in.size(), DataType::kFloat32, 0);
      }
      ADD_FAILURE() << "rank " << r << " did not fail";
    } catch (const Error& e) {
      if (error.empty()) error = e.what();
    }
  });
  // Rank 0's recv met the all-reduce's message (kMismatch naming both) or, where that never
  // came, ran into its timeout.
  EXPECT_TRUE((contains(errors[0], "mismatched call") && contains(errors[0], "p2p #1") &&
               contains(errors[0], "allreduce #1")) ||
              contains(errors[0], "timeout"))
      << errors[0];
  EXPECT_TRUE(contains(errors[0], "recv from rank 1")) << errors[0];
  EXPECT_FALSE(errors[1].empty());
}

// A recv whose count or dtype differs from the send's fails with kMismatch naming both sides,
// and writes nothing past its buffer, whether it expects more or less than comes.
TEST_P(P2p, CountsOrDtypesThatDifferFailNamingBoth) {
  struct Case {
    std::size_t send_count, recv_count;
    DataType send_type, recv_type;
    std::vector<std::string> named;
  };
  const Case cases[] = {
      {100, 200, DataType::kFloat32, DataType::kFloat32, {"count=100 float32", "count=200"}},
      {100, 50, DataType::kFloat32, DataType::kFloat32, {"count=100 float32", "count=50"}},
      {(std::size_t{4} << 20) + 1,
       3,
       DataType::kUInt8,
       DataType::kUInt8,
       {"count=4194305", "count=3"}},
      {16, 16, DataType::kFloat32, DataType::kInt32, {"count=16 float32", "count=16 int32"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.named[1]);
    std::string receiver_error;
    run_contexts(transport, 2, [&](Context& ctx) {
      if (ctx.rank() == 0) {
        const Buffer out(c.send_count * dtype_size(c.send_type), 0x11);
        try {
          ctx.send(out.data(), c.send_count, c.send_type, 1);
          ctx.barrier();  // the receiver's failure aborted the communicator
          ADD_FAILURE() << "the sender's next call succeeded";
        } catch (const Error& e) {
          EXPECT_TRUE(e.kind() == ErrorKind::kAborted || e.kind() == ErrorKind::kMismatch)
              << e.what();
        }
      } else {
        const std::size_t bytes = c.recv_count * dtype_size(c.recv_type);
        Buffer in(bytes + kGuard, kGuardByte);
        Error e = testing::expect_error(ErrorKind::kMismatch,
                                        [&] { ctx.recv(in.data(), c.recv_count, c.recv_type, 0); });
        receiver_error = e.what();
        EXPECT_EQ(e.peer(), 0) << e.what();
        EXPECT_TRUE(guard_intact(in, bytes)) << "written past the buffer";
        testing::expect_error(ErrorKind::kAborted, [&] { ctx.barrier(); });
      }
    });
    for (const auto& part : c.named) {
      EXPECT_TRUE(contains(receiver_error, part)) << receiver_error;
    }
  }
}

// The user's tag must match too: a message is not searched for by tag, so different tags in
// the same order are a mismatch naming both.
TEST_P(P2p, TagsThatDifferFailNamingBoth) {
  std::string receiver_error;
  run_contexts(transport, 2, [&](Context& ctx) {
    std::vector<float> buf(10, 1.0f);
    if (ctx.rank() == 0) {
      ctx.send(buf.data(), buf.size(), DataType::kFloat32, 1, 7);  // tags that agree
      try {
        ctx.send(buf.data(), buf.size(), DataType::kFloat32, 1, 8);
        ctx.barrier();
        ADD_FAILURE() << "the sender's next call succeeded";
      } catch (const Error&) {
      }
    } else {
      ctx.recv(buf.data(), buf.size(), DataType::kFloat32, 0, 7);
      Error e = testing::expect_error(ErrorKind::kMismatch, [&] {
        ctx.recv(buf.data(), buf.size(), DataType::kFloat32, 0, 9);
      });
      receiver_error = e.what();
    }
  });
  EXPECT_TRUE(contains(receiver_error, "p2p #2 (count=10 float32 tag=8)")) << receiver_error;
  EXPECT_TRUE(contains(receiver_error, "p2p #2 (count=10 float32 tag=9)")) << receiver_error;
}

// Sending to or receiving from this rank itself, or from no rank at all, is refused before
// anything is queued; the communicator goes on.
TEST_P(P2p, PeersThatAreNotAnotherRankAreRefused) {
  run_contexts(transport, 3, [&](Context& ctx) {
    std::vector<float> buf(4);
    const int r = ctx.rank();
    for (int peer : {r, -1, 3, 1000}) {
      for (int form = 0; form < 4; ++form) {
        Error e = testing::expect_error(ErrorKind::kInvalidArgument, [&] {
          switch (form) {
            case 0:
              ctx.send(buf.data(), buf.size(), DataType::kFloat32, peer);
              break;
            case 1:
              ctx.recv(buf.data(), buf.size(), DataType::kFloat32, peer);
              break;
            case 2:
              ctx.send_async(buf.data(), buf.size(), DataType::kFloat32, peer).wait();
              break;
            default:
              ctx.recv_async(buf.data(), buf.size(), DataType::kFloat32, peer).wait();
          }
        });
        EXPECT_TRUE(contains(e.what(), "peer " + std::to_string(peer))) << e.what();
      }
    }
    testing::expect_error(ErrorKind::kInvalidArgument,
                          [&] { ctx.send(nullptr, 4, DataType::kFloat32, (r + 1) % 3); });
    // Nothing was queued: the ranks still agree on everything.
    const int next = (r + 1) % 3, prev = (r + 2) % 3;
    Buffer out = pattern(r, next, 64), in(64);
    Work s = ctx.send_async(out.data(), 64, DataType::kUInt8, next);
    ctx.recv(in.data(), 64, DataType::kUInt8, prev);
    s.wait();
    EXPECT_TRUE(in == pattern(prev, r, 64));
    ctx.barrier();
  });
}

INSTANTIATE_TEST_SUITE_P(Transports, P2p, ::testing::Values("inproc", "shm"),
                         [](const auto& p) { return p.param; });

// ---- Between processes, over shm and tcp ----

// gtest assertions in a forked child would be lost with it: children report by exit status.
void require(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("check failed: " + what);
}

std::unique_ptr<Context> process_context(const testing::TempDir& dir, int rank, int n,
                                         const std::string& transport) {
  Options o;
  o.rank = rank;
  o.size = n;
  o.store = make_file_store(dir.path());
  o.transport = transport;
  o.token = "p2p" + std::to_string(::getppid());  // this test's process: its own segments
  o.cost_model = "alpha_us=5,bandwidth_gbps=5,reduce_gbps=5";  // no calibration
  // A bound on a hang, not a timing claim: under ThreadSanitizer on a loaded 2-core machine
  // the large exchanges take tens of seconds.
  o.timeout = 200s;
  return init(o);
}

void expect_all_exited_zero(const std::vector<int>& statuses) {
  for (std::size_t r = 0; r < statuses.size(); ++r) {
    EXPECT_TRUE(WIFEXITED(statuses[r]) && WEXITSTATUS(statuses[r]) == 0)
        << "rank " << r << " status " << statuses[r];
  }
}

class P2pProcesses : public ::testing::TestWithParam<std::string> {};

// The pair exchange of PairExchangeCompletesForSmallAndLargeMessages, and a ring of three,
// between processes.
TEST_P(P2pProcesses, PairAndRingExchangesComplete) {
  testing::TempDir dir;
  const std::string transport = GetParam();
  auto statuses = testing::run_processes(
      3,
      [&](int rank) {
        auto ctx = process_context(dir, rank, 3, transport);
        require(ctx->transport_name((rank + 1) % 3) == transport, "runs over " + transport);
        int k = 0;
        for (std::size_t bytes : {std::size_t{4}, testing::kBeyondEveryTransportBuffer}) {
          for (int order = 0; order < 4; ++order) {
            const bool send_first = order % 2 == 0, pause = order >= 2;
            if (rank < 2) {
              const int peer = 1 - rank;
              const Buffer out = pattern(rank, peer, bytes, k);
              Buffer in(bytes + kGuard, kGuardByte);
              Work s, q;
              if (send_first) s = ctx->send_async(out.data(), bytes, DataType::kUInt8, peer);
              if (pause) std::this_thread::sleep_for(20ms);
              q = ctx->recv_async(in.data(), bytes, DataType::kUInt8, peer);
              if (pause && !send_first) std::this_thread::sleep_for(20ms);
              if (!send_first) s = ctx->send_async(out.data(), bytes, DataType::kUInt8, peer);
              s.wait();
              q.wait();
              require(holds_at(in, 0, pattern(peer, rank, bytes, k)) && guard_intact(in, bytes),
                      "pair exchange of " + std::to_string(bytes) + " bytes");
            }
            ++k;
          }
        }
        const int next = (rank + 1) % 3, prev = (rank + 2) % 3;
        for (std::size_t count : {std::size_t{0}, std::size_t{7}, std::size_t{1000003}}) {
          const Buffer out = pattern(rank, next, count * 4, k);
          Buffer in(count * 4 + kGuard, kGuardByte);
          Work s = ctx->send_async(out.data(), count, DataType::kFloat32, next, 3);
          ctx->recv(in.data(), count, DataType::kFloat32, prev, 3);
          s.wait();
          require(holds_at(in, 0, pattern(prev, rank, count * 4, k)) && guard_intact(in, count * 4),
                  "ring exchange of " + std::to_string(count));
          ++k;
        }
        ctx->barrier();
        return 0;
      },
      120);
  expect_all_exited_zero(statuses);
}

bool process_gone(pid_t pid) {
  const std::string stat = testing::read_file("/proc/" + std::to_string(pid) + "/stat");
  const std::size_t close = stat.rfind(')');
  return stat.empty() || close == std::string::npos || close + 2 >= stat.size() ||
         stat[close + 2] == 'Z' || stat[close + 2] == 'X';
}

// Rank 1 dies (SIGKILL); rank 0 then sends it a message no transport buffers, or waits for
// one from it. Either fails with kPeerLost naming rank 1, not a hang and not a timeout.
TEST_P(P2pProcesses, ACallToADeadPeerFailsNamingIt) {
  const std::string transport = GetParam();
  for (bool sending : {true, false}) {
    SCOPED_TRACE(sending ? "send" : "recv");
    testing::TempDir dir;
    auto statuses = testing::run_processes(
        2,
        [&](int rank) {
          auto ctx = process_context(dir, rank, 2, transport);
          Buffer buf(testing::kBeyondEveryTransportBuffer, 1);
          auto store = make_file_store(dir.path());
          if (rank == 1) {
            const std::string pid = std::to_string(::getpid());
            store->set("victim_pid", Bytes(pid.begin(), pid.end()));
            ctx->barrier();
            ::raise(SIGKILL);
          }
          const Bytes pid_bytes = store->get("victim_pid", 30000ms);
          const pid_t victim = std::stoi(std::string(pid_bytes.begin(), pid_bytes.end()));
          ctx->barrier();
          while (!process_gone(victim)) std::this_thread::sleep_for(5ms);
          try {
            if (sending) {
              ctx->send(buf.data(), buf.size(), DataType::kUInt8, 1);
            } else {
              ctx->recv(buf.data(), buf.size(), DataType::kUInt8, 1);
            }
          } catch (const Error& e) {
            std::fprintf(stderr, "as expected: %s\n", e.what());
            require(e.kind() == ErrorKind::kPeerLost && e.peer() == 1,
                    std::string("kPeerLost naming peer 1: ") + e.what());
            require(contains(e.what(), sending ? "send to rank 1" : "recv from rank 1"),
                    std::string("names the call: ") + e.what());
            return 0;
          }
          require(false, "the call to a dead peer succeeded");
          return 1;
        },
        120);
    EXPECT_TRUE(WIFEXITED(statuses[0]) && WEXITSTATUS(statuses[0]) == 0) << statuses[0];
    EXPECT_TRUE(WIFSIGNALED(statuses[1]) && WTERMSIG(statuses[1]) == SIGKILL) << statuses[1];
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, P2pProcesses, ::testing::Values("shm", "tcp"),
                         [](const auto& p) { return p.param; });

}  // namespace
}  // namespace gradsync
