// gather, scatter, alltoall and alltoallv against a plain reference, for world sizes 1-8 and
// awkward counts, blocking and async, in place and not, over thread ranks on the inproc and
// shm transports; counts that disagree between ranks (kMismatch naming both, nothing written
// past a buffer) and bad arguments.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

#include "harness.h"
#include "reference.h"

namespace gradsync {
namespace {

using testing::contains;
using Buffer = testing::Buffer;
using testing::guard_intact;
using testing::holds_at;
using testing::kGuard;
using testing::kGuardByte;
using testing::pattern;

// `bytes` then guard bytes that must stay untouched.
Buffer with_guard(std::size_t bytes, std::uint8_t fill = 0x5A) {
  Buffer b(bytes + kGuard, kGuardByte);
  std::fill(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(bytes), fill);
  return b;
}

void run_contexts(const std::string& transport, int n, const std::function<void(Context&)>& fn) {
  if (transport == "shm") {
    testing::run_shm_contexts(n, fn);
  } else {
    testing::run_inproc_contexts(n, fn);
  }
}

// The large count spans several shared-memory slots (128 KiB at most) and tcp stages.
const std::size_t kCounts[] = {0, 1, 7, 100003};

// Large counts move bytes only (the dtype changes nothing but the element size), so they keep
// to one dtype; the small ones try elements of every size.
std::vector<DataType> dtypes_for(std::size_t count, DataType large) {
  if (count > 1000) return {large};
  return {DataType::kFloat32, DataType::kUInt8, DataType::kFloat64, DataType::kBFloat16};
}

class BlockGrid : public ::testing::TestWithParam<std::tuple<std::string, int>> {
 protected:
  const std::string transport = std::get<0>(GetParam());
  const int n = std::get<1>(GetParam());
  std::string what(const char* call, std::size_t count, DataType t, int root, int form) const {
    return std::string(call) + " " + transport + " n=" + std::to_string(n) +
           " count=" + std::to_string(count) + " " + to_string(t) +
           " root=" + std::to_string(root) + " form=" + std::to_string(form);
  }
};

// Forms: 0 blocking, 1 async, 2 in place (root's own block already in place).
TEST_P(BlockGrid, GatherMatchesReference) {
  run_contexts(transport, n, [&](Context& ctx) {
    const int r = ctx.rank();
    int k = 0;
    for (std::size_t count : kCounts) {
      for (DataType t : dtypes_for(count, DataType::kFloat32)) {
        const std::size_t bytes = count * dtype_size(t),
                          total = bytes * static_cast<std::size_t>(n);
        for (int root = 0; root < n; ++root) {
          if (count > 1000 && root != n - 1) continue;
          for (int form = 0; form < 3; ++form, ++k) {
            const Buffer mine = pattern(r, root, bytes, k);
            Buffer out = with_guard(total);
            const void* send = mine.data();
            if (form == 2 && r == root) {
              std::copy(mine.begin(), mine.end(),
                        out.begin() + static_cast<std::ptrdiff_t>(r * bytes));
              send = out.data() + static_cast<std::size_t>(r) * bytes;
            }
            void* recv = r == root ? out.data() : nullptr;
            if (form == 1) {
              ctx.gather_async(send, recv, count, t, root).wait();
            } else {
              ctx.gather(send, recv, count, t, root);
            }
            if (r != root) continue;
            for (int src = 0; src < n; ++src) {
              EXPECT_TRUE(holds_at(out, static_cast<std::size_t>(src) * bytes,
                                   pattern(src, root, bytes, k)))
                  << what("gather", count, t, root, form) << ": block " << src;
            }
            EXPECT_TRUE(guard_intact(out, total)) << what("gather", count, t, root, form);
          }
        }
      }
    }
  });
}

TEST_P(BlockGrid, ScatterMatchesReference) {
  run_contexts(transport, n, [&](Context& ctx) {
    const int r = ctx.rank();
    int k = 0;
    for (std::size_t count : kCounts) {
      for (DataType t : dtypes_for(count, DataType::kFloat32)) {
        const std::size_t bytes = count * dtype_size(t);
        for (int root = 0; root < n; ++root) {
          if (count > 1000 && root != 0) continue;
          for (int form = 0; form < 3; ++form, ++k) {
            Buffer all;
            if (r == root) {
              for (int dst = 0; dst < n; ++dst) {
                const Buffer b = pattern(root, dst, bytes, k);
                all.insert(all.end(), b.begin(), b.end());
              }
            }
            Buffer out = with_guard(bytes);
            void* recv = out.data();
            if (form == 2 && r == root) recv = all.data() + static_cast<std::size_t>(r) * bytes;
            const void* send = r == root ? all.data() : nullptr;
            if (form == 1) {
              ctx.scatter_async(send, recv, count, t, root).wait();
            } else {
              ctx.scatter(send, recv, count, t, root);
            }
            const Buffer want = pattern(root, r, bytes, k);
            if (recv == out.data()) {
              EXPECT_TRUE(holds_at(out, 0, want)) << what("scatter", count, t, root, form);
              EXPECT_TRUE(guard_intact(out, bytes)) << what("scatter", count, t, root, form);
            } else {
              EXPECT_TRUE(holds_at(all, static_cast<std::size_t>(r) * bytes, want))
                  << what("scatter", count, t, root, form);
            }
          }
        }
      }
    }
  });
}

// Forms: 0 blocking, 1 async, 2 in place (send == recv).
TEST_P(BlockGrid, AlltoallMatchesReference) {
  run_contexts(transport, n, [&](Context& ctx) {
    const int r = ctx.rank();
    int k = 0;
    for (std::size_t count : kCounts) {
      for (DataType t : dtypes_for(count, DataType::kUInt8)) {
        const std::size_t bytes = count * dtype_size(t),
                          total = bytes * static_cast<std::size_t>(n);
        for (int form = 0; form < 3; ++form, ++k) {
          Buffer in;
          for (int dst = 0; dst < n; ++dst) {
            const Buffer b = pattern(r, dst, bytes, k);
            in.insert(in.end(), b.begin(), b.end());
          }
          Buffer out = with_guard(total);
          if (form == 2) {
            std::copy(in.begin(), in.end(), out.begin());
            ctx.alltoall(out.data(), out.data(), count, t);
          } else if (form == 1) {
            ctx.alltoall_async(in.data(), out.data(), count, t).wait();
          } else {
            ctx.alltoall(in.data(), out.data(), count, t);
          }
          for (int src = 0; src < n; ++src) {
            EXPECT_TRUE(
                holds_at(out, static_cast<std::size_t>(src) * bytes, pattern(src, r, bytes, k)))
                << what("alltoall", count, t, -1, form) << ": block from " << src;
          }
          EXPECT_TRUE(guard_intact(out, total)) << what("alltoall", count, t, -1, form);
        }
      }
    }
  });
}

// Elements rank `src` sends rank `dst` in a round around `count`: some pairs none at all.
std::size_t pair_count(int src, int dst, std::size_t count) {
  if ((src * 7 + dst * 3) % 4 == 0) return 0;
  return count + static_cast<std::size_t>((src + 2 * dst) % 3);
}

TEST_P(BlockGrid, AlltoallvMatchesReference) {
  run_contexts(transport, n, [&](Context& ctx) {
    const int r = ctx.rank();
    int k = 0;
    for (std::size_t count : kCounts) {
      for (DataType t : dtypes_for(count, DataType::kUInt8)) {
        const std::size_t es = dtype_size(t);
        std::vector<std::size_t> send_counts, recv_counts;
        for (int j = 0; j < n; ++j) {
          send_counts.push_back(pair_count(r, j, count));
          recv_counts.push_back(pair_count(j, r, count));
        }
        const std::size_t recv_total =
            std::accumulate(recv_counts.begin(), recv_counts.end(), std::size_t{0});
        for (int form = 0; form < 2; ++form, ++k) {
          Buffer in;
          for (int dst = 0; dst < n; ++dst) {
            const Buffer b = pattern(r, dst, send_counts[static_cast<std::size_t>(dst)] * es, k);
            in.insert(in.end(), b.begin(), b.end());
          }
          Buffer out = with_guard(recv_total * es);
          if (form == 1) {
            ctx.alltoallv_async(in.data(), send_counts, out.data(), recv_counts, t).wait();
          } else {
            ctx.alltoallv(in.data(), send_counts, out.data(), recv_counts, t);
          }
          std::size_t at = 0;
          for (int src = 0; src < n; ++src) {
            const std::size_t b = recv_counts[static_cast<std::size_t>(src)] * es;
            EXPECT_TRUE(holds_at(out, at, pattern(src, r, b, k)))
                << what("alltoallv", count, t, -1, form) << ": block from " << src;
            at += b;
          }
          EXPECT_TRUE(guard_intact(out, recv_total * es)) << what("alltoallv", count, t, -1, form);
        }
      }
    }
    // Several calls queued at once run in issue order.
    std::vector<Buffer> ins, outs;
    std::vector<Work> works;
    for (int i = 0; i < 4; ++i) {
      Buffer in;
      for (int dst = 0; dst < n; ++dst) {
        const Buffer b = pattern(r, dst, 40, 1000 + i);
        in.insert(in.end(), b.begin(), b.end());
      }
      ins.push_back(std::move(in));
      outs.emplace_back(40 * static_cast<std::size_t>(n));
    }
    for (int i = 0; i < 4; ++i) {
      works.push_back(ctx.alltoall_async(ins[static_cast<std::size_t>(i)].data(),
                                         outs[static_cast<std::size_t>(i)].data(), 10,
                                         DataType::kFloat32));
    }
    for (auto& w : works) w.wait();
    for (int i = 0; i < 4; ++i) {
      for (int src = 0; src < n; ++src) {
        EXPECT_TRUE(holds_at(outs[static_cast<std::size_t>(i)], static_cast<std::size_t>(src) * 40,
                             pattern(src, r, 40, 1000 + i)))
            << "queued alltoall " << i << " block from " << src;
      }
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, BlockGrid,
                         ::testing::Combine(::testing::Values("inproc", "shm"),
                                            ::testing::Values(1, 2, 3, 4, 5, 8)),
                         [](const auto& p) {
                           return std::get<0>(p.param) + "_n" +
                                  std::to_string(std::get<1>(p.param));
                         });

// ---- Ranks that disagree, and bad arguments ----

// Runs `n` inproc ranks where `call(ctx)` must fail on every rank: kMismatch where it was
// seen, kAborted where the abort carried it, never a timeout. A rank whose part of the call
// did not involve the disagreement (a sender whose message was buffered) may finish it; its
// next call fails. Returns each rank's message.
std::vector<std::string> expect_all_fail(int n, const std::function<void(Context&)>& call) {
  std::vector<std::string> messages(static_cast<std::size_t>(n));
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    try {
      call(ctx);
      ctx.barrier();
      ADD_FAILURE() << "rank " << ctx.rank() << " did not fail";
    } catch (const Error& e) {
      messages[static_cast<std::size_t>(ctx.rank())] = e.what();
      EXPECT_TRUE(e.kind() == ErrorKind::kMismatch || e.kind() == ErrorKind::kAborted)
          << "rank " << ctx.rank() << ": " << e.what();
    }
  });
  return messages;
}

// Rank 2 expects 5 elements from rank 0, which sends it 4 (and, the other way round, more
// than rank 1 expects): the receiver names both counts and writes nothing past its buffer.
TEST(AlltoallvMismatch, CountsOfAPairThatDisagreeAreNamedBoth) {
  for (std::size_t expected : {std::size_t{5}, std::size_t{3}}) {
    std::vector<bool> guards(3, true);
    auto messages = expect_all_fail(3, [&](Context& ctx) {
      const int r = ctx.rank();
      std::vector<std::size_t> send_counts(3, 4), recv_counts(3, 4);
      if (r == 2) recv_counts[0] = expected;
      const std::size_t recv_total =
          std::accumulate(recv_counts.begin(), recv_counts.end(), std::size_t{0});
      std::vector<float> in(12, 1.0f);
      Buffer out = with_guard(recv_total * 4);
      try {
        ctx.alltoallv(in.data(), send_counts, out.data(), recv_counts, DataType::kFloat32);
      } catch (...) {
        guards[static_cast<std::size_t>(r)] = guard_intact(out, recv_total * 4);
        throw;
      }
    });
    EXPECT_TRUE(contains(messages[2], "mismatched call")) << messages[2];
    EXPECT_TRUE(contains(messages[2], "alltoallv #1 (count=4 float32)")) << messages[2];
    EXPECT_TRUE(contains(messages[2], "alltoallv #1 (count=" + std::to_string(expected)))
        << messages[2];
    for (bool g : guards) EXPECT_TRUE(g) << "written past a receive buffer";
  }
}

TEST(AlltoallvMismatch, ARankWhoseOwnTwoCountsDifferIsNamed) {
  auto messages = expect_all_fail(3, [&](Context& ctx) {
    std::vector<std::size_t> send_counts(3, 2), recv_counts(3, 2);
    if (ctx.rank() == 1) send_counts[1] = 3;
    std::vector<float> in(7), out(6);
    ctx.alltoallv(in.data(), send_counts, out.data(), recv_counts, DataType::kFloat32);
  });
  EXPECT_TRUE(contains(messages[1], "sends itself 3 elements")) << messages[1];
  EXPECT_TRUE(contains(messages[1], "receives 2 from itself")) << messages[1];
  for (const auto& m : messages) EXPECT_TRUE(contains(m, "alltoallv #1")) << m;
}

TEST(BlockMismatch, GatherScatterAndAlltoallCountsThatDifferAreNamedBoth) {
  struct Case {
    const char* name;
    std::function<void(Context&, std::vector<float>&)> call;
    std::vector<std::string> named;  // in the message of the rank that saw it
    int seen_by;
  };
  const Case cases[] = {
      {"gather",
       [](Context& ctx, std::vector<float>& buf) {
         ctx.gather(buf.data(), buf.data() + 100, ctx.rank() == 2 ? 9 : 8, DataType::kFloat32, 0);
       },
       {"gather #1 (count=8 float32 root=0)", "gather #1 (count=9 float32 root=0)"},
       0},
      {"scatter",
       [](Context& ctx, std::vector<float>& buf) {
         ctx.scatter(buf.data(), buf.data() + 100, ctx.rank() == 1 ? 3 : 8, DataType::kFloat32, 2);
       },
       {"scatter #1 (count=3 float32 root=2)", "scatter #1 (count=8 float32 root=2)"},
       1},
      {"alltoall",
       [](Context& ctx, std::vector<float>& buf) {
         ctx.alltoall(buf.data(), buf.data() + 100, ctx.rank() == 0 ? 6 : 5, DataType::kFloat32);
       },
       {"alltoall #1 (count=6 float32)", "alltoall #1 (count=5 float32)"},
       -1},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto messages = expect_all_fail(3, [&](Context& ctx) {
      std::vector<float> buf(200);
      c.call(ctx, buf);
    });
    bool named = false;
    for (std::size_t r = 0; r < messages.size(); ++r) {
      if (c.seen_by >= 0 && static_cast<int>(r) != c.seen_by) continue;
      named |= contains(messages[r], c.named[0]) && contains(messages[r], c.named[1]);
    }
    EXPECT_TRUE(named) << messages[0] << "\n" << messages[1] << "\n" << messages[2];
  }
}

TEST(BlockArguments, AreRefusedNamingTheProblem) {
  testing::run_inproc_contexts(3, [&](Context& ctx) {
    std::vector<float> buf(100);
    float* p = buf.data();
    const auto t = DataType::kFloat32;
    auto refused = [&](const std::string& part, const std::function<void()>& call) {
      Error e = testing::expect_error(ErrorKind::kInvalidArgument, call);
      EXPECT_TRUE(contains(e.what(), part)) << e.what();
    };
    refused("root 3 is not a rank", [&] { ctx.gather(p, p, 1, t, 3); });
    refused("root -1 is not a rank", [&] { ctx.scatter_async(p, p, 1, t, -1).wait(); });
    if (ctx.rank() == 1) {
      refused("recv buffer is null", [&] { ctx.gather(p, nullptr, 1, t, 1); });
      refused("send buffer is null", [&] { ctx.scatter(nullptr, p, 1, t, 1); });
    }
    refused("send buffer is null", [&] { ctx.gather(nullptr, p, 1, t, 0); });
    refused("recv buffer is null", [&] { ctx.scatter(p, nullptr, 1, t, 0); });
    refused("recv buffer is null", [&] { ctx.alltoall(p, nullptr, 1, t); });
    refused("unknown dtype", [&] { ctx.alltoall(p, p, 1, static_cast<DataType>(99)); });
    const std::size_t two[] = {1, 1}, three[] = {1, 1, 1};
    refused("send_counts has 2 entries for 3 ranks",
            [&] { ctx.alltoallv(p, two, p + 50, three, t); });
    refused("recv_counts has 2 entries for 3 ranks",
            [&] { ctx.alltoallv_async(p, three, p + 50, two, t).wait(); });
    // Nothing was queued: the ranks still agree. Non-roots may pass null where root only reads.
    std::vector<float> mine(2, static_cast<float>(ctx.rank())), all(6, -1.0f);
    ctx.gather(mine.data(), ctx.rank() == 0 ? all.data() : nullptr, 2, t, 0);
    if (ctx.rank() == 0) {
      EXPECT_EQ(all, (std::vector<float>{0, 0, 1, 1, 2, 2}));
    }
    ctx.scatter(ctx.rank() == 0 ? all.data() : nullptr, mine.data(), 2, t, 0);
    EXPECT_EQ(mine[1], static_cast<float>(ctx.rank()));
  });
}

}  // namespace
}  // namespace gradsync
