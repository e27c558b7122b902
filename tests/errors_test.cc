// Failure behaviour of the context: mismatched calls across ranks, timeouts, bad
// arguments and the sticky failure after an error. Each asserts the message, not only
// that something was thrown.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "harness.h"
#include "reference.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;

using testing::contains;

// Runs `n` ranks where `call(ctx)` is expected to throw on every rank; returns each rank's
// error message. Every rank must fail by the mismatch (kMismatch where it was seen, kAborted
// where the abort carried it), not by running into its deadline (kTimeout).
std::vector<std::string> expect_all_fail(int n, const std::function<void(Context&)>& call,
                                         Options options = {}) {
  std::vector<std::string> messages(static_cast<std::size_t>(n));
  testing::run_inproc_contexts(
      n,
      [&](Context& ctx) {
        try {
          call(ctx);
          ADD_FAILURE() << "rank " << ctx.rank() << " did not fail";
        } catch (const Error& e) {
          messages[static_cast<std::size_t>(ctx.rank())] = e.what();
          EXPECT_EQ(e.rank(), ctx.rank());
          EXPECT_TRUE(e.kind() == ErrorKind::kMismatch || e.kind() == ErrorKind::kAborted)
              << "rank " << ctx.rank() << ": " << e.what();
        }
      },
      options);
  return messages;
}

TEST(Mismatch, DifferentCountsNameBothSidesAndSequenceNumber) {
  auto msgs = expect_all_fail(2, [](Context& ctx) {
    std::vector<float> buf(200, 1.0f);
    ctx.barrier();  // call #1 matches
    ctx.allreduce(buf.data(), buf.data(), ctx.rank() == 0 ? 100 : 200, DataType::kFloat32,
                  ReduceOp::kSum, {.algorithm = Algorithm::kRing});
  });
  for (const auto& m : msgs) {
    EXPECT_TRUE(contains(m, "allreduce #2 (count=100")) << m;
    EXPECT_TRUE(contains(m, "allreduce #2 (count=200")) << m;
  }
}

TEST(Mismatch, DifferentDtypeOpOrCollective) {
  struct Case {
    const char* name;
    std::function<void(Context&)> call;
    const char* side0;
    const char* side1;
  };
  const Case cases[] = {
      {"dtype",
       [](Context& ctx) {
         std::vector<double> buf(64, 1.0);
         ctx.allreduce(buf.data(), buf.data(), 16,
                       ctx.rank() == 0 ? DataType::kFloat32 : DataType::kInt32, ReduceOp::kSum,
                       {.algorithm = Algorithm::kRing});
       },
       "float32", "int32"},
      {"op",
       [](Context& ctx) {
         std::vector<float> buf(16, 1.0f);
         ctx.allreduce(buf.data(), buf.data(), 16, DataType::kFloat32,
                       ctx.rank() == 0 ? ReduceOp::kSum : ReduceOp::kMax,
                       {.algorithm = Algorithm::kRing});
       },
       "float32 sum", "float32 max"},
      {"collective order",
       [](Context& ctx) {
         std::vector<float> buf(16, 1.0f);
         if (ctx.rank() == 0) {
           ctx.allreduce(buf.data(), buf.data(), 16, DataType::kFloat32, ReduceOp::kSum);
           ctx.broadcast(buf.data(), 16, DataType::kFloat32, 0);
         } else {
           ctx.broadcast(buf.data(), 16, DataType::kFloat32, 0);
           ctx.allreduce(buf.data(), buf.data(), 16, DataType::kFloat32, ReduceOp::kSum);
         }
       },
       "allreduce #1", "broadcast #1"},
      {"fingerprint (same count, different shapes)",
       [](Context& ctx) {
         std::vector<float> buf(16, 1.0f);
         ctx.allreduce(buf.data(), buf.data(), 16, DataType::kFloat32, ReduceOp::kSum,
                       {.fingerprint = ctx.rank() == 0 ? 11u : 22u});
       },
       "fingerprint=11)", "fingerprint=22)"},
      {"fingerprint given on one rank only",
       [](Context& ctx) {
         std::vector<float> buf(32, 1.0f);
         ctx.allgather(buf.data(), buf.data() + 16, 8, DataType::kFloat32,
                       {.fingerprint = ctx.rank() == 0 ? 0u : 33u});
       },
       "allgather #1 (count=16 float32)", "fingerprint=33)"},
  };
  for (const auto& c : cases) {
    auto msgs = expect_all_fail(2, c.call);
    for (const auto& m : msgs) {
      EXPECT_TRUE(contains(m, c.side0) && contains(m, c.side1)) << c.name << ": " << m;
    }
  }
}

TEST(Mismatch, UninvolvedRanksAreReleasedByTheAbort) {
  // Only ranks 0 and 1 disagree; ranks 2..4 must not hang either.
  auto msgs = expect_all_fail(5, [](Context& ctx) {
    std::vector<float> buf(1000, 1.0f);
    ctx.allreduce(buf.data(), buf.data(), ctx.rank() == 1 ? 999 : 1000, DataType::kFloat32,
                  ReduceOp::kSum, {.algorithm = Algorithm::kRing});
  });
  for (const auto& m : msgs) EXPECT_TRUE(contains(m, "count=999")) << m;
}

TEST(Timeout, NamesOperationPeerAndMissingBytes) {
  Options o;
  o.timeout = 200ms;
  std::string message;
  std::atomic<bool> timed_out{false};
  testing::run_inproc_contexts(
      2,
      [&](Context& ctx) {
        if (ctx.rank() == 1) {  // never joins the call; stays until rank 0 has timed out
          timed_out.wait(false);
          return;
        }
        std::vector<float> buf(256, 1.0f);
        try {
          ctx.allreduce(buf.data(), buf.data(), 256, DataType::kFloat32, ReduceOp::kSum,
                        {.algorithm = Algorithm::kRecursiveDoubling});
          ADD_FAILURE() << "no timeout";
        } catch (const Error& e) {
          EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
          EXPECT_EQ(e.peer(), 1);
          message = e.what();
        }
        // The failure is sticky: the communicator refuses further calls at once.
        try {
          ctx.barrier();
          ADD_FAILURE() << "barrier after failure succeeded";
        } catch (const Error& e) {
          EXPECT_EQ(e.kind(), ErrorKind::kAborted);
          EXPECT_TRUE(contains(e.what(), "failed earlier")) << e.what();
        }
        timed_out = true;
        timed_out.notify_all();
      },
      o);
  EXPECT_TRUE(contains(message, "timeout in allreduce #1")) << message;
  EXPECT_TRUE(contains(message, "peer 1")) << message;
  EXPECT_TRUE(contains(message, "1024 bytes")) << message;
}

TEST(BadArguments, AreRejectedWithTheirReason) {
  testing::run_inproc_contexts(2, [](Context& ctx) {
    std::vector<float> buf(8);
    auto expect_invalid = [&](const std::function<void()>& f, const std::string& part) {
      try {
        f();
        ADD_FAILURE() << "accepted: " << part;
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
        EXPECT_TRUE(contains(e.what(), part)) << e.what();
      }
    };
    expect_invalid(
        [&] { ctx.allreduce(nullptr, buf.data(), 8, DataType::kFloat32, ReduceOp::kSum); },
        "send buffer is null");
    expect_invalid([&] { ctx.broadcast(buf.data(), 8, DataType::kFloat32, 2); },
                   "root 2 is not a rank");
    expect_invalid(
        [&] { ctx.reduce(buf.data(), buf.data(), 8, DataType::kFloat32, ReduceOp::kSum, -1); },
        "root -1 is not a rank");
    std::vector<std::size_t> counts{1, 2, 3};
    expect_invalid([&] { ctx.allgatherv(buf.data(), buf.data(), counts, DataType::kFloat32); },
                   "3 entries for 2 ranks");
    expect_invalid(
        [&] {
          ctx.allreduce(buf.data(), buf.data(), 8, static_cast<DataType>(42), ReduceOp::kSum);
        },
        "unknown dtype");
    expect_invalid(
        [&] {
          ctx.allreduce(buf.data(), buf.data(), 8, DataType::kFloat32, static_cast<ReduceOp>(9));
        },
        "unknown reduce op");
    // Rejected calls consume no sequence number: the ranks still agree afterwards.
    ctx.allreduce(buf.data(), buf.data(), 8, DataType::kFloat32, ReduceOp::kSum);
  });
}

// A bitwise op on a float dtype is refused at the call, on the calling thread, naming both,
// by every collective that takes an op; the refused calls leave the ranks in step.
TEST(BadArguments, BitwiseOpOnAFloatDtypeIsRefusedNamingBoth) {
  testing::run_inproc_contexts(3, [](Context& ctx) {
    std::vector<double> buf(3 * 8);
    for (DataType t : testing::kAllDtypes) {
      for (ReduceOp op : {ReduceOp::kBand, ReduceOp::kBor, ReduceOp::kBxor}) {
        if (dtype_op_valid(t, op)) continue;  // integers and bool: allowed
        const std::function<void()> calls[] = {
            [&] { ctx.allreduce(buf.data(), buf.data(), 8, t, op); },
            [&] { ctx.allreduce_async(buf.data(), buf.data(), 8, t, op).wait(); },
            [&] { ctx.reduce_scatter(buf.data(), buf.data(), 8, t, op); },
            [&] { ctx.reduce(buf.data(), buf.data(), 8, t, op, 0); },
        };
        for (const auto& call : calls) {
          try {
            call();
            ADD_FAILURE() << "accepted " << to_string(t) << " " << to_string(op);
          } catch (const Error& e) {
            EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
            EXPECT_TRUE(contains(e.what(), to_string(t))) << e.what();
            EXPECT_TRUE(contains(e.what(), std::string(" ") + to_string(op) + " ")) << e.what();
          }
        }
      }
    }
    EXPECT_FALSE(dtype_op_valid(DataType::kFloat32, ReduceOp::kBand));
    std::vector<std::int32_t> ints(8, ctx.rank() + 1);
    ctx.allreduce(ints.data(), ints.data(), 8, DataType::kInt32, ReduceOp::kBor);
    EXPECT_EQ(ints[0], 1 | 2 | 3);
  });
}

}  // namespace
}  // namespace gradsync
