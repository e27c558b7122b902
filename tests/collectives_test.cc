// Every collective and every all-reduce algorithm against a plain reference, for world
// sizes 1-8, awkward counts, all dtypes and ops, in place and out of place, over thread
// ranks on the inproc transport. Outputs must also be bitwise identical on every rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <mutex>
#include <numeric>
#include <sstream>

#include "collectives/signature.h"
#include "harness.h"
#include "reference.h"

namespace gradsync {
namespace {

using testing::Buffer;
using testing::periodic_input;
using testing::periodic_reference;

std::vector<std::size_t> awkward_counts(int n) {
  return {0, 1, static_cast<std::size_t>(n > 1 ? n - 1 : 1), 1031};
}

std::string label(int n, Algorithm a, DataType t, ReduceOp op, std::size_t count, bool in_place) {
  std::ostringstream s;
  s << "n=" << n << " algo=" << to_string(a) << " " << to_string(t) << " " << to_string(op)
    << " count=" << count << (in_place ? " in-place" : " out-of-place");
  return s.str();
}

// Collects each rank's output of one call so the test can check they are all identical.
class Outputs {
 public:
  explicit Outputs(int n) : out_(static_cast<std::size_t>(n)) {}
  void put(int rank, Buffer b) {
    std::lock_guard lock(mu_);
    out_[static_cast<std::size_t>(rank)] = std::move(b);
  }
  void expect_identical(const std::string& what) const {
    for (std::size_t r = 1; r < out_.size(); ++r) {
      EXPECT_TRUE(out_[r] == out_[0]) << what << ": rank " << r << " differs from rank 0";
    }
  }

 private:
  std::mutex mu_;
  std::vector<Buffer> out_;
};

// Non-integer floats, uniform in [-0.5, 0.5), different per rank: their sum depends on the
// order of additions, so they show whether every rank and run adds in the same order.
std::vector<float> rounded_input(int rank, std::size_t count) {
  std::vector<float> v(count);
  std::uint32_t x = 12345u + static_cast<std::uint32_t>(rank) * 7919u;
  for (auto& e : v) {
    x = x * 1664525u + 1013904223u;
    e = static_cast<float>(x >> 8) / 16777216.0f - 0.5f;
  }
  return v;
}

// Plain members, not a structured binding of GetParam(): the tests' lambdas capture them, and
// Debian 12's clang 14 refuses to capture bindings.
class AllreduceGrid : public ::testing::TestWithParam<std::tuple<int, Algorithm>> {
 protected:
  const int n = std::get<0>(GetParam());
  const Algorithm algo = std::get<1>(GetParam());
};

TEST_P(AllreduceGrid, EveryDtypeOpCountMatchesReference) {
  // Every rank runs the same sequence of calls; each call's outputs are compared across ranks.
  std::vector<std::unique_ptr<Outputs>> outputs;
  std::vector<std::string> labels;
  for (DataType t : testing::kAllDtypes)
    for (ReduceOp op : testing::kAllOps)
      for (std::size_t count : awkward_counts(n))
        for (bool in_place : {false, true}) {
          if (!dtype_op_valid(t, op)) continue;
          outputs.push_back(std::make_unique<Outputs>(n));
          labels.push_back(label(n, algo, t, op, count, in_place));
        }
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    std::size_t call = 0;
    for (DataType t : testing::kAllDtypes)
      for (ReduceOp op : testing::kAllOps)
        for (std::size_t count : awkward_counts(n))
          for (bool in_place : {false, true}) {
            if (!dtype_op_valid(t, op)) continue;
            Buffer in = testing::make_input(t, op, ctx.rank(), count);
            Buffer out(in.size(), 0xAB);
            if (in_place) {
              out = in;
              ctx.allreduce(out.data(), out.data(), count, t, op, {.algorithm = algo});
            } else {
              ctx.allreduce(in.data(), out.data(), count, t, op, {.algorithm = algo});
              EXPECT_TRUE(in == testing::make_input(t, op, ctx.rank(), count))
                  << "input modified: " << labels[call];
            }
            EXPECT_TRUE(out == testing::reference_reduce(t, op, n, count)) << labels[call];
            outputs[call++]->put(ctx.rank(), std::move(out));
          }
  });
  for (std::size_t i = 0; i < outputs.size(); ++i) outputs[i]->expect_identical(labels[i]);
}

// The large count repeats a prime period of inputs (periodic_input), and each reference is
// computed once, before the ranks start: n ranks each computing an exact reference of a
// million elements over n inputs took a quarter to a third of the test's time under TSan.
TEST_P(AllreduceGrid, LargeAndPrimeCounts) {
  const std::size_t counts[] = {99991, (std::size_t{1} << 20) + 3};
  const std::pair<DataType, ReduceOp> cases[] = {
      {DataType::kFloat32, ReduceOp::kSum},  {DataType::kFloat32, ReduceOp::kAvg},
      {DataType::kBFloat16, ReduceOp::kMax}, {DataType::kInt64, ReduceOp::kProd},
      {DataType::kInt16, ReduceOp::kBxor},   {DataType::kBool, ReduceOp::kMin}};
  struct Call {
    DataType t;
    ReduceOp op;
    std::size_t count;
    Buffer want;
  };
  std::vector<Call> calls;
  for (std::size_t count : counts) {
    for (auto [t, op] : cases) {
      if (count > 100000 && t != DataType::kFloat32) continue;  // keep the grid fast
      calls.push_back({t, op, count, periodic_reference(t, op, n, count)});
    }
  }
  Outputs outputs(n);
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    for (const Call& call : calls) {
      Buffer buf = periodic_input(call.t, call.op, ctx.rank(), call.count);
      ctx.allreduce(buf.data(), buf.data(), call.count, call.t, call.op, {.algorithm = algo});
      EXPECT_TRUE(buf == call.want) << label(n, algo, call.t, call.op, call.count, true);
      if (call.count == counts[1] && call.op == ReduceOp::kSum) outputs.put(ctx.rank(), buf);
    }
  });
  outputs.expect_identical("large allreduce");
}

// Non-integer inputs make the result depend on the order of additions: every rank and
// every run must still produce the same bits.
TEST_P(AllreduceGrid, RoundedResultsAreIdenticalAcrossRanksAndRuns) {
  const std::size_t count = 300007;
  auto run_once = [&] {
    Outputs outputs(n);
    Buffer first;
    std::mutex mu;
    testing::run_inproc_contexts(n, [&](Context& ctx) {
      std::vector<float> v = rounded_input(ctx.rank(), count);
      ctx.allreduce(v.data(), v.data(), count, DataType::kFloat32, ReduceOp::kAvg,
                    {.algorithm = algo});
      Buffer bytes(count * 4);
      std::memcpy(bytes.data(), v.data(), bytes.size());
      outputs.put(ctx.rank(), bytes);
      if (ctx.rank() == 0) {
        std::lock_guard lock(mu);
        first = bytes;
      }
    });
    outputs.expect_identical("rounded allreduce n=" + std::to_string(n));
    return first;
  };
  Buffer a = run_once(), b = run_once();
  EXPECT_TRUE(a == b) << "run-to-run difference, n=" << n << " algo=" << to_string(algo);
}

INSTANTIATE_TEST_SUITE_P(
    Worlds, AllreduceGrid,
    ::testing::Combine(::testing::Values(1, 2, 3, 4, 5, 8),
                       ::testing::Values(Algorithm::kRing, Algorithm::kRecursiveDoubling,
                                         Algorithm::kHalvingDoubling, Algorithm::kParameterServer)),
    [](const auto& p) {
      return "n" + std::to_string(std::get<0>(p.param)) + "_" + to_string(std::get<1>(p.param));
    });

class CollectivesByWorld : public ::testing::TestWithParam<int> {};

TEST_P(CollectivesByWorld, ReduceScatterMatchesReference) {
  const int n = GetParam();
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    for (DataType t : testing::kAllDtypes)
      for (ReduceOp op : testing::kAllOps)
        for (std::size_t block :
             {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{1031}}) {
          if (!dtype_op_valid(t, op)) continue;
          const std::size_t total = block * static_cast<std::size_t>(n), es = dtype_size(t);
          Buffer in = testing::make_input(t, op, ctx.rank(), total);
          Buffer out(block * es, 0xCD);
          ctx.reduce_scatter(in.data(), out.data(), block, t, op);
          Buffer want = testing::reference_reduce(t, op, n, block,
                                                  block * static_cast<std::size_t>(ctx.rank()));
          EXPECT_TRUE(out == want) << label(n, Algorithm::kRing, t, op, block, false);
        }
  });
}

TEST_P(CollectivesByWorld, AllgatherAndAllgathervMatchReference) {
  const int n = GetParam();
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    const int r = ctx.rank();
    for (DataType t : testing::kAllDtypes) {
      const std::size_t es = dtype_size(t);
      for (std::size_t block : {std::size_t{0}, std::size_t{1}, std::size_t{1031}}) {
        Buffer mine = testing::make_input(t, ReduceOp::kSum, r, block);
        Buffer out(block * static_cast<std::size_t>(n) * es, 0xEE);
        ctx.allgather(mine.data(), out.data(), block, t);
        for (int src = 0; src < n; ++src) {
          Buffer want = testing::make_input(t, ReduceOp::kSum, src, block);
          EXPECT_EQ(0, std::memcmp(out.data() + static_cast<std::size_t>(src) * block * es,
                                   want.data(), want.size()))
              << "allgather n=" << n << " block " << src << " " << to_string(t);
        }
        // In place: this rank's block already sits at its offset in the output.
        Buffer inplace(out.size(), 0);
        std::memcpy(inplace.data() + static_cast<std::size_t>(r) * block * es, mine.data(),
                    mine.size());
        ctx.allgather(inplace.data() + static_cast<std::size_t>(r) * block * es, inplace.data(),
                      block, t);
        EXPECT_TRUE(inplace == out) << "in-place allgather n=" << n;
      }
      // Variable counts, some zero.
      std::vector<std::size_t> counts(static_cast<std::size_t>(n));
      for (int i = 0; i < n; ++i)
        counts[static_cast<std::size_t>(i)] =
            static_cast<std::size_t>((i * 37) % 5 == 1 ? 0 : i * 101 + 1);
      const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
      Buffer mine = testing::make_input(t, ReduceOp::kSum, r, counts[static_cast<std::size_t>(r)]);
      Buffer out(total * es, 0x11);
      ctx.allgatherv(mine.data(), out.data(), counts, t);
      std::size_t off = 0;
      for (int src = 0; src < n; ++src) {
        Buffer want =
            testing::make_input(t, ReduceOp::kSum, src, counts[static_cast<std::size_t>(src)]);
        EXPECT_EQ(0, std::memcmp(out.data() + off * es, want.data(), want.size()))
            << "allgatherv n=" << n << " block " << src;
        off += counts[static_cast<std::size_t>(src)];
      }
    }
  });
}

TEST_P(CollectivesByWorld, BroadcastFromEveryRoot) {
  const int n = GetParam();
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    for (int root = 0; root < n; ++root) {
      for (DataType t : testing::kAllDtypes) {
        // Small sizes take the binomial tree, large ones the pipelined chain.
        for (std::size_t count :
             {std::size_t{0}, std::size_t{1}, std::size_t{1031}, std::size_t{300007}}) {
#ifdef GRADSYNC_TEST_SANITIZED
          // A broadcast copies bytes, and a sanitizer checks each one: the large count meets
          // each element size once there.
          if (count > 100000 && !testing::first_of_its_element_size(t)) continue;
#endif
          Buffer want = testing::make_input(t, ReduceOp::kSum, root, count);
          Buffer buf = ctx.rank() == root ? want : Buffer(want.size(), 0x5A);
          ctx.broadcast(buf.data(), count, t, root);
          EXPECT_TRUE(buf == want) << "broadcast n=" << n << " root=" << root << " " << to_string(t)
                                   << " count=" << count;
        }
      }
    }
  });
}

TEST_P(CollectivesByWorld, ReduceToEveryRoot) {
  const int n = GetParam();
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    for (int root = 0; root < n; ++root) {
      for (DataType t : testing::kAllDtypes) {
        for (ReduceOp op : testing::kAllOps) {
          if (!dtype_op_valid(t, op)) continue;
          const std::size_t count = 1031;
          Buffer in = testing::make_input(t, op, ctx.rank(), count);
          Buffer out(in.size(), 0x77);
          ctx.reduce(in.data(), ctx.rank() == root ? out.data() : nullptr, count, t, op, root);
          if (ctx.rank() == root) {
            EXPECT_TRUE(out == testing::reference_reduce(t, op, n, count))
                << "reduce n=" << n << " root=" << root << " " << to_string(t) << " "
                << to_string(op);
          }
        }
      }
    }
  });
}

TEST_P(CollectivesByWorld, BarrierAndAsyncKeepIssueOrder) {
  const int n = GetParam();
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    ctx.barrier();
    std::vector<Buffer> bufs;
    std::vector<Work> works;
    for (int i = 0; i < 6; ++i)
      bufs.push_back(testing::make_input(DataType::kFloat32, ReduceOp::kSum, ctx.rank(),
                                         5000 + static_cast<std::size_t>(i)));
    for (int i = 0; i < 6; ++i) {
      auto& b = bufs[static_cast<std::size_t>(i)];
      works.push_back(ctx.allreduce_async(b.data(), b.data(), 5000 + static_cast<std::size_t>(i),
                                          DataType::kFloat32, ReduceOp::kSum));
    }
    // A blocking call issued behind async ones runs after them.
    Buffer last = testing::make_input(DataType::kFloat32, ReduceOp::kSum, ctx.rank(), 7);
    ctx.allreduce(last.data(), last.data(), 7, DataType::kFloat32, ReduceOp::kSum);
    for (auto& w : works) w.wait();
    for (int i = 0; i < 6; ++i) {
      EXPECT_TRUE(bufs[static_cast<std::size_t>(i)] ==
                  testing::reference_reduce(DataType::kFloat32, ReduceOp::kSum, n,
                                            5000 + static_cast<std::size_t>(i)));
    }
    EXPECT_TRUE(last == testing::reference_reduce(DataType::kFloat32, ReduceOp::kSum, n, 7));
    ctx.barrier();
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, CollectivesByWorld, ::testing::Values(1, 2, 3, 4, 5, 8),
                         [](const auto& p) { return "n" + std::to_string(p.param); });

// ---- The shared-memory all-reduce, over thread ranks on the shm transport: the inproc
// transport offers no shared arena (there kSharedMemory runs the ring). ----

// FNV-1a: ranks compare fingerprints of their outputs instead of keeping every output.
std::uint64_t fingerprint(const Buffer& b) {
  std::uint64_t h = 1469598103934665603ull;
  for (auto c : b) h = (h ^ c) * 1099511628211ull;
  return h;
}

class SharedMemoryGrid : public ::testing::TestWithParam<int> {
 protected:
  // Every case x count, in place and out of place: each output must equal the reference byte
  // for byte (so every rank holds the same bits).
  void run_grid(const std::vector<testing::DtypeOp>& cases,
                const std::vector<std::size_t>& counts) {
    const int n = GetParam();
    const Algorithm algo = Algorithm::kSharedMemory;
    struct Call {
      DataType t;
      ReduceOp op;
      std::size_t count;
      bool in_place;
      Buffer want;
    };
    std::vector<Call> calls;
    for (auto [t, op] : cases)
      for (std::size_t count : counts) {
        Buffer want = periodic_reference(t, op, n, count);
        for (bool in_place : {false, true}) {
          calls.push_back({t, op, count, in_place, want});
        }
      }
    testing::run_shm_contexts(n, [&](Context& ctx) {
      for (Call& call : calls) {
        const std::string what = label(n, algo, call.t, call.op, call.count, call.in_place);
        Buffer in = periodic_input(call.t, call.op, ctx.rank(), call.count);
        Buffer out(in.size(), 0xAB);
        if (call.in_place) {
          out = in;
          ctx.allreduce(out.data(), out.data(), call.count, call.t, call.op, {.algorithm = algo});
        } else {
          const Buffer before = in;
          ctx.allreduce(in.data(), out.data(), call.count, call.t, call.op, {.algorithm = algo});
          EXPECT_TRUE(in == before) << "input modified: " << what;
        }
        EXPECT_TRUE(out == call.want) << what;
      }
    });
  }
};

TEST_P(SharedMemoryGrid, SmallCountsMatchReference) {
  const int n = GetParam();
  run_grid(testing::every_dtype_op_pair(),
           {0, 1, static_cast<std::size_t>(n > 1 ? n - 1 : 1), 1031});
}

TEST_P(SharedMemoryGrid, LargeAndPrimeCountsMatchReference) {
  constexpr std::size_t kLarge = (std::size_t{1} << 20) + 3;
#ifdef GRADSYNC_TEST_SANITIZED
  // A sanitizer checks every element's access, so the large count takes minutes at every dtype
  // and op: there it meets each element size once (the arena's slots are reused within such a
  // call whatever the dtype), and the prime count every dtype and op.
  run_grid(testing::each_dtype_and_each_op(), {99991});
  run_grid({{DataType::kUInt8, ReduceOp::kBxor},
            {DataType::kBFloat16, ReduceOp::kSum},
            {DataType::kFloat32, ReduceOp::kSum},
            {DataType::kInt64, ReduceOp::kBxor}},
           {kLarge});
#else
  run_grid(testing::each_dtype_and_each_op(), {99991, kLarge});
#endif
}

// Non-integer inputs make the result depend on the order of additions: the fixed member order
// must give the same bits on every rank and in every run, and in both forms of the algorithm
// (a one-shot call over the first elements gives the bits the chunked call gave them).
TEST_P(SharedMemoryGrid, RoundedResultsAreIdenticalAcrossRanksAndRuns) {
  const int n = GetParam();
  const std::size_t count = 300007, one_shot_count = 7999;  // 1.2 MB and 32 KB of float32
  auto run_once = [&] {
    std::vector<std::uint64_t> fingerprints(static_cast<std::size_t>(n));
    testing::run_shm_contexts(n, [&](Context& ctx) {
      std::vector<float> v = rounded_input(ctx.rank(), count);
      std::vector<float> head(v.begin(), v.begin() + one_shot_count);
      ctx.allreduce(v.data(), v.data(), count, DataType::kFloat32, ReduceOp::kAvg,
                    {.algorithm = Algorithm::kSharedMemory});
      ctx.allreduce(head.data(), head.data(), one_shot_count, DataType::kFloat32, ReduceOp::kAvg,
                    {.algorithm = Algorithm::kSharedMemory});
      EXPECT_EQ(std::memcmp(head.data(), v.data(), one_shot_count * sizeof(float)), 0)
          << "rank " << ctx.rank();
      Buffer bytes(count * 4);
      std::memcpy(bytes.data(), v.data(), bytes.size());
      fingerprints[static_cast<std::size_t>(ctx.rank())] = fingerprint(bytes);
    });
    for (int r = 1; r < n; ++r) {
      EXPECT_EQ(fingerprints[static_cast<std::size_t>(r)], fingerprints[0]) << "rank " << r;
    }
    return fingerprints[0];
  };
  EXPECT_EQ(run_once(), run_once()) << "run-to-run difference, n=" << n;
}

// The arena's counters carry over from call to call: calls of changing sizes (more and fewer
// chunks than staging slots, empty ones), async ones, and message-based collectives in
// between must all line up.
TEST_P(SharedMemoryGrid, ConsecutiveCallsOfChangingSizesAndOtherCollectives) {
  const int n = GetParam();
  // 8192 float32 is the largest one-shot call between 2 ranks, 8193 the smallest chunked one;
  // 16384 and 16385 among more.
  const std::size_t counts[] = {
      (std::size_t{1} << 20) + 3,  0, 7, 3 * 65536 + 1, 1, 1031, 8192, 8193, 5, 6, 11, 16384, 16385,
      (std::size_t{1} << 21) + 17, 2};
  testing::run_shm_contexts(n, [&](Context& ctx) {
    for (int round = 0; round < 2; ++round) {
      std::vector<Buffer> bufs;
      std::vector<Work> works;
      for (std::size_t count : counts) {
        bufs.push_back(periodic_input(DataType::kFloat32, ReduceOp::kSum, ctx.rank(), count));
      }
      for (std::size_t i = 0; i < std::size(counts); ++i) {
        Buffer& b = bufs[i];
        if (round == 1) {  // the second round issues them asynchronously
          works.push_back(ctx.allreduce_async(b.data(), b.data(), counts[i], DataType::kFloat32,
                                              ReduceOp::kSum,
                                              {.algorithm = Algorithm::kSharedMemory}));
        } else {
          ctx.allreduce(b.data(), b.data(), counts[i], DataType::kFloat32, ReduceOp::kSum,
                        {.algorithm = Algorithm::kSharedMemory});
          if (i % 3 == 2) ctx.barrier();
          if (i % 5 == 3) {  // an all-gather on the same arena, its block 1 or 6 pieces
            const std::size_t block = i % 2 ? 5 * 131072 + 3 : 17;
            Buffer mine = periodic_input(DataType::kFloat32, ReduceOp::kSum, ctx.rank(), block);
            Buffer all(block * static_cast<std::size_t>(n) * 4);
            ctx.allgather(mine.data(), all.data(), block, DataType::kFloat32);
            EXPECT_TRUE(testing::holds_at(
                all, block * 4 * static_cast<std::size_t>(n - 1),
                periodic_input(DataType::kFloat32, ReduceOp::kSum, n - 1, block)));
            // and a reduce-scatter of the gathered blocks: rank r's sum is n x block r
            Buffer sum(block * 4);
            ctx.reduce_scatter(all.data(), sum.data(), block, DataType::kFloat32, ReduceOp::kSum);
            Buffer want(block * 4);
            const auto* own = reinterpret_cast<const float*>(all.data()) +
                              block * static_cast<std::size_t>(ctx.rank());
            auto* w = reinterpret_cast<float*>(want.data());
            for (std::size_t j = 0; j < block; ++j) w[j] = own[j] * static_cast<float>(n);
            EXPECT_TRUE(sum == want) << "reduce-scatter after call " << i << " n=" << n;
          }
          if (i % 4 == 1) {
            Buffer ring = testing::make_input(DataType::kInt32, ReduceOp::kSum, ctx.rank(), 999);
            ctx.allreduce(ring.data(), ring.data(), 999, DataType::kInt32, ReduceOp::kSum,
                          {.algorithm = Algorithm::kRing});
            EXPECT_TRUE(ring ==
                        testing::reference_reduce(DataType::kInt32, ReduceOp::kSum, n, 999));
          }
        }
      }
      for (auto& w : works) w.wait();
      for (std::size_t i = 0; i < std::size(counts); ++i) {
        EXPECT_TRUE(bufs[i] == periodic_reference(DataType::kFloat32, ReduceOp::kSum, n, counts[i]))
            << "round " << round << " call " << i << " count=" << counts[i] << " n=" << n;
      }
    }
  });
}

// Large enough that the result is copied out with non-temporal stores, and with user buffers
// that start off any vector boundary: the copies' unaligned heads and tails.
TEST_P(SharedMemoryGrid, MisalignedBuffersOfStreamedResults) {
  const int n = GetParam();
  const std::size_t count = (std::size_t{9} << 20) + 5;  // uint8: 9 MiB per rank
  const Buffer want = periodic_reference(DataType::kUInt8, ReduceOp::kSum, n, count);
  testing::run_shm_contexts(n, [&](Context& ctx) {
    const Buffer input = periodic_input(DataType::kUInt8, ReduceOp::kSum, ctx.rank(), count);
    Buffer send(count + 1), recv(count + 3, 0xEE);
    std::memcpy(send.data() + 1, input.data(), count);
    ctx.allreduce(send.data() + 1, recv.data() + 3, count, DataType::kUInt8, ReduceOp::kSum,
                  {.algorithm = Algorithm::kSharedMemory});
    EXPECT_TRUE(testing::holds_at(recv, 3, want)) << "n=" << n;
    EXPECT_EQ(recv[0], 0xEE);  // nothing written before the output
    // In place, at yet another offset.
    Buffer both(count + 7);
    std::memcpy(both.data() + 7, input.data(), count);
    ctx.allreduce(both.data() + 7, both.data() + 7, count, DataType::kUInt8, ReduceOp::kSum,
                  {.algorithm = Algorithm::kSharedMemory});
    EXPECT_TRUE(testing::holds_at(both, 7, want)) << "in place, n=" << n;
  });
}

// The all-gather where ranks share an arena (shared_memory_blocks.cc): blocks of the one-shot
// form (up to 64 KiB) and of one piece, of more pieces than slots (a slot reused), uneven and
// empty blocks, in place, and results large enough to be streamed past the cache into buffers
// off any vector boundary.
TEST_P(SharedMemoryGrid, AllgatherAndAllgathervMatchReference) {
  const int n = GetParam();
  const auto ranks = static_cast<std::size_t>(n);
  // 655363 float32: 2.5 MiB, six 512 KiB pieces.
  const std::size_t many_pieces = 5 * 131072 + 3;
  testing::run_shm_contexts(n, [&](Context& ctx) {
    const int r = ctx.rank();
    for (DataType t : {DataType::kFloat32, DataType::kInt8, DataType::kFloat64}) {
      const std::size_t es = dtype_size(t);
      for (std::size_t block : {std::size_t{0}, std::size_t{1}, std::size_t{1031},
                                std::size_t{16384}, std::size_t{16385}, many_pieces}) {
        if (t != DataType::kFloat32 && block > 1031) continue;
        const Buffer mine = periodic_input(t, ReduceOp::kSum, r, block);
        Buffer out(block * ranks * es, 0xEE);
        ctx.allgather(mine.data(), out.data(), block, t);
        for (int src = 0; src < n; ++src) {
          EXPECT_TRUE(testing::holds_at(out, static_cast<std::size_t>(src) * block * es,
                                        periodic_input(t, ReduceOp::kSum, src, block)))
              << "n=" << n << " block " << src << " of " << block << " " << to_string(t);
        }
        Buffer inplace(out.size(), 0);
        if (block)
          std::memcpy(inplace.data() + static_cast<std::size_t>(r) * block * es, mine.data(),
                      mine.size());
        ctx.allgather(inplace.data() + static_cast<std::size_t>(r) * block * es, inplace.data(),
                      block, t);
        EXPECT_TRUE(inplace == out) << "in place, n=" << n << " block " << block;
      }
    }
    // Uneven blocks: one of many pieces, empty ones, small ones.
    std::vector<std::size_t> counts(ranks);
    for (std::size_t i = 0; i < ranks; ++i) counts[i] = i == 1 ? many_pieces : i % 3 * 1031;
    const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
    const auto own = counts[static_cast<std::size_t>(r)];
    const Buffer mine = periodic_input(DataType::kFloat32, ReduceOp::kSum, r, own);
    Buffer out(total * 4, 0x11);
    ctx.allgatherv(mine.data(), out.data(), counts, DataType::kFloat32);
    std::size_t offset = 0;
    for (std::size_t src = 0; src < ranks; ++src) {
      EXPECT_TRUE(testing::holds_at(
          out, offset * 4,
          periodic_input(DataType::kFloat32, ReduceOp::kSum, static_cast<int>(src), counts[src])))
          << "allgatherv n=" << n << " block " << src;
      offset += counts[src];
    }
    // Streamed: at least AlgorithmConfig::shared_memory_streaming_bytes of results.
    const std::size_t streamed = (std::size_t{16} << 20) / ranks + 5;
    const Buffer input = periodic_input(DataType::kUInt8, ReduceOp::kSum, r, streamed);
    Buffer send(streamed + 1), recv(streamed * ranks + 3, 0xEE);
    std::memcpy(send.data() + 1, input.data(), streamed);
    ctx.allgather(send.data() + 1, recv.data() + 3, streamed, DataType::kUInt8);
    for (int src = 0; src < n; ++src) {
      EXPECT_TRUE(
          testing::holds_at(recv, 3 + static_cast<std::size_t>(src) * streamed,
                            periodic_input(DataType::kUInt8, ReduceOp::kSum, src, streamed)))
          << "streamed, n=" << n << " block " << src;
    }
    EXPECT_EQ(recv[0], 0xEE);  // nothing written before the output
  });
}

// The reduce-scatter where ranks share an arena: every dtype and op once at small blocks, and
// blocks of more pieces than slots (6 pieces between 2 ranks, 21 among 8), out of place and with
// `recv` this rank's block of `send`.
TEST_P(SharedMemoryGrid, ReduceScatterMatchesReference) {
  const int n = GetParam();
  const auto ranks = static_cast<std::size_t>(n);
  struct Call {
    DataType t;
    ReduceOp op;
    std::size_t block;
    bool in_place;
    Buffer want;  // the whole reduction: rank r checks block r
  };
  std::vector<Call> calls;
  for (auto [t, op] : testing::each_dtype_and_each_op()) {
    for (std::size_t block : {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{1031}}) {
      calls.push_back({t, op, block, false, periodic_reference(t, op, n, block * ranks)});
    }
  }
  const std::size_t many_pieces = 5 * 65536 + 3;
  for (auto [t, op] : {testing::DtypeOp{DataType::kFloat32, ReduceOp::kSum},
                       testing::DtypeOp{DataType::kFloat32, ReduceOp::kAvg},
                       testing::DtypeOp{DataType::kInt64, ReduceOp::kMax}}) {
    for (bool in_place : {false, true}) {
      calls.push_back(
          {t, op, many_pieces, in_place, periodic_reference(t, op, n, many_pieces * ranks)});
    }
  }
  testing::run_shm_contexts(n, [&](Context& ctx) {
    const auto r = static_cast<std::size_t>(ctx.rank());
    for (const Call& call : calls) {
      const std::size_t es = dtype_size(call.t), block_bytes = call.block * es;
      Buffer in = periodic_input(call.t, call.op, ctx.rank(), call.block * ranks);
      Buffer out(block_bytes, 0xCD);
      unsigned char* recv = call.in_place ? in.data() + r * block_bytes : out.data();
      ctx.reduce_scatter(in.data(), recv, call.block, call.t, call.op);
      if (call.in_place && block_bytes) std::memcpy(out.data(), recv, block_bytes);
      const Buffer want(call.want.begin() + static_cast<std::ptrdiff_t>(r * block_bytes),
                        call.want.begin() + static_cast<std::ptrdiff_t>((r + 1) * block_bytes));
      EXPECT_TRUE(out == want) << label(n, Algorithm::kSharedMemory, call.t, call.op, call.block,
                                        call.in_place);
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Worlds, SharedMemoryGrid, ::testing::Values(1, 2, 3, 4, 5, 8),
                         [](const auto& p) { return "n" + std::to_string(p.param); });

// kAuto picks the shared-memory algorithm for large messages where the ranks share an arena,
// and never picks it without an arena. (Which algorithm takes small messages depends on the
// constants measured at start-up: env_test's CostModel tests pin that down.)
TEST(SharedMemoryAuto, ChosenForLargeMessagesOnlyWhereMemoryIsShared) {
  for (int n : {2, 4}) {
    testing::run_shm_contexts(n, [&](Context& ctx) {
      EXPECT_EQ(ctx.choose_allreduce_algorithm(16 << 20), Algorithm::kSharedMemory) << n;
      EXPECT_EQ(ctx.choose_allreduce_algorithm(256 << 20), Algorithm::kSharedMemory) << n;
      const std::size_t count = (std::size_t{4} << 20) + 5;
      Buffer b = periodic_input(DataType::kFloat32, ReduceOp::kMax, ctx.rank(), count);
      ctx.allreduce(b.data(), b.data(), count, DataType::kFloat32, ReduceOp::kMax);
      EXPECT_TRUE(b == periodic_reference(DataType::kFloat32, ReduceOp::kMax, n, count));
    });
    testing::run_inproc_contexts(n, [&](Context& ctx) {
      EXPECT_NE(ctx.choose_allreduce_algorithm(256 << 20), Algorithm::kSharedMemory) << n;
      // Forced without an arena it runs the ring.
      Buffer b = testing::make_input(DataType::kInt64, ReduceOp::kSum, ctx.rank(), 5000);
      ctx.allreduce(b.data(), b.data(), 5000, DataType::kInt64, ReduceOp::kSum,
                    {.algorithm = Algorithm::kSharedMemory});
      EXPECT_TRUE(b == testing::reference_reduce(DataType::kInt64, ReduceOp::kSum, n, 5000));
    });
  }
}

// How a call's description ends for an all-gatherv of these counts.
std::string counts_tag(std::vector<std::size_t> counts) {
  return std::to_string(collectives::counts_digest(counts)) + ")";
}

// Over the ring too (thread ranks on the inproc transport): ranks given different block counts
// with the same sum fail, every one, naming both sets, where before only the ranks that met a
// message of the wrong size failed and a rank whose blocks happened to arrive whole returned.
TEST(AllgathervMismatch, EveryRankFailsOverTheRingNamingBothCounts) {
  std::vector<std::string> messages(3);
  testing::run_inproc_contexts(3, [&](Context& ctx) {
    std::vector<std::size_t> counts{1000, 2000, 3000};
    if (ctx.rank() == 2) counts = {1001, 1999, 3000};
    std::vector<float> in(3000, 1.0f), out(6000);
    try {
      ctx.allgatherv(in.data(), out.data(), counts, DataType::kFloat32);
      ADD_FAILURE() << "rank " << ctx.rank() << " did not fail";
    } catch (const Error& e) {
      EXPECT_TRUE(e.kind() == ErrorKind::kMismatch || e.kind() == ErrorKind::kAborted) << e.what();
      messages[static_cast<std::size_t>(ctx.rank())] = e.what();
    }
  });
  for (const auto& m : messages) {
    EXPECT_NE(m.find("counts#" + counts_tag({1000, 2000, 3000})), std::string::npos) << m;
    EXPECT_NE(m.find("counts#" + counts_tag({1001, 1999, 3000})), std::string::npos) << m;
  }
}

// A mismatched call must fail on every rank within a second, naming both sides, never hang
// or produce a silently wrong result: differing counts (also 0 against many chunks), and one
// rank in the shared-memory algorithm while another runs a message-based one.

TEST(SharedMemoryMismatch, EveryRankFailsFastNamingBothSides) {
  using namespace std::chrono_literals;
  struct Case {
    const char* name;
    int n;
    std::function<void(Context&, std::vector<float>&)> call;
    std::vector<std::string> named;  // every rank's message names all of these
  };
  const auto shm = Algorithm::kSharedMemory;
  const Case cases[] = {
      {"counts",
       2,
       [&](Context& ctx, std::vector<float>& buf) {
         ctx.allreduce(buf.data(), buf.data(), ctx.rank() == 0 ? 100 : 200, DataType::kFloat32,
                       ReduceOp::kSum, {.algorithm = shm});
       },
       {"allreduce #3 (count=100", "allreduce #3 (count=200"}},
      {"empty against many chunks",
       3,
       [&](Context& ctx, std::vector<float>& buf) {
         ctx.allreduce(buf.data(), buf.data(), ctx.rank() == 1 ? 0 : buf.size(), DataType::kFloat32,
                       ReduceOp::kSum, {.algorithm = shm});
       },
       {"allreduce #3 (count=0", "allreduce #3 (count=" + std::to_string(3 << 20)}},
      {"shm against ring",
       2,
       [&](Context& ctx, std::vector<float>& buf) {
         ctx.allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum,
                       {.algorithm = ctx.rank() == 0 ? shm : Algorithm::kRing});
       },
       {"algo=shm", "algo=ring"}},
      {"shm against recursive doubling, 4 ranks",
       4,
       [&](Context& ctx, std::vector<float>& buf) {
         ctx.allreduce(buf.data(), buf.data(), 64, DataType::kFloat32, ReduceOp::kSum,
                       {.algorithm = ctx.rank() == 3 ? shm : Algorithm::kRecursiveDoubling});
       },
       {"algo=shm", "algo=rd"}},
      {"all-gatherv of other block sizes, same total (one-shot form)",
       3,
       [&](Context& ctx, std::vector<float>& buf) {
         std::vector<std::size_t> counts{1000, 2000, 3000};
         if (ctx.rank() == 2) counts = {1001, 1999, 3000};
         ctx.allgatherv(buf.data() + 6000 * static_cast<std::size_t>(ctx.rank()), buf.data(),
                        counts, DataType::kFloat32);
       },
       {"allgatherv #3 (count=6000 float32 counts#" + counts_tag({1000, 2000, 3000}),
        "allgatherv #3 (count=6000 float32 counts#" + counts_tag({1001, 1999, 3000})}},
      {"all-gatherv of other block sizes, same total (chunked form)",
       3,
       [&](Context& ctx, std::vector<float>& buf) {
         std::vector<std::size_t> counts{100000, 200000, 300000};
         if (ctx.rank() == 0) counts = {100000, 200001, 299999};
         ctx.allgatherv(buf.data() + 600000, buf.data(), counts, DataType::kFloat32);
       },
       {"allgatherv #3 (count=600000 float32 counts#" + counts_tag({100000, 200000, 300000}),
        "allgatherv #3 (count=600000 float32 counts#" + counts_tag({100000, 200001, 299999})}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<std::string> messages(static_cast<std::size_t>(c.n));
    testing::run_shm_contexts(c.n, [&](Context& ctx) {
      std::vector<float> buf(std::size_t{3} << 20, 1.0f);
      // Two matching calls first, so the mismatch meets counters that have moved.
      ctx.allreduce(buf.data(), buf.data(), buf.size(), DataType::kFloat32, ReduceOp::kSum,
                    {.algorithm = shm});
      ctx.barrier();
      try {
        c.call(ctx, buf);
        ADD_FAILURE() << "rank " << ctx.rank() << " did not fail";
      } catch (const Error& e) {
        EXPECT_TRUE(e.kind() == ErrorKind::kMismatch || e.kind() == ErrorKind::kAborted)
            << e.what();
        messages[static_cast<std::size_t>(ctx.rank())] = e.what();
      }
      // Sticky: the communicator stays failed.
      EXPECT_THROW(ctx.allreduce(buf.data(), buf.data(), 1, DataType::kFloat32, ReduceOp::kSum,
                                 {.algorithm = shm}),
                   Error);
    });
    for (const auto& m : messages) {
      for (const auto& part : c.named) EXPECT_NE(m.find(part), std::string::npos) << m;
    }
  }
}

}  // namespace
}  // namespace gradsync
