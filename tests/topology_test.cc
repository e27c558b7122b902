// Host grouping and the ring order that follows it: the ring keeps each host's ranks together
// whatever the rank numbering, every ring-based collective still equals the reference over a
// permuted ring, each rank sends only to its ring successor, and ranks that disagree on the
// topology fail at start-up naming both orders.
#include "collectives/topology.h"

#include <gtest/gtest.h>

#include <numeric>

#include "core/context_impl.h"
#include "harness.h"
#include "reference.h"
#include "transport/inproc.h"

namespace gradsync {
namespace {

using collectives::parse_topology;
using collectives::Topology;
using testing::Buffer;
using testing::contains;

// Ranks dealt round-robin over `hosts` hosts: the placement that makes a rank-order ring
// cross between hosts at every step.
std::vector<std::string> round_robin(int n, int hosts) {
  std::vector<std::string> labels;
  for (int r = 0; r < n; ++r) labels.push_back("host" + std::to_string(r % hosts));
  return labels;
}

// The same placement as a GRADSYNC_TOPOLOGY spec: "0,2;1,3".
std::string round_robin_spec(int n, int hosts) {
  std::string spec;
  for (int h = 0; h < hosts; ++h) {
    if (h) spec += ";";
    for (int r = h, first = 1; r < n; r += hosts, first = 0)
      spec += (first ? "" : ",") + std::to_string(r);
  }
  return spec;
}

TEST(Topology, RingKeepsEachHostTogetherWhateverTheNumbering) {
  const Topology t = Topology::from_hosts(round_robin(8, 4));
  EXPECT_EQ(t.hosts(), 4);
  EXPECT_EQ(t.ring(), (std::vector<int>{0, 4, 1, 5, 2, 6, 3, 7}));
  // A ring over 4 hosts must cross 4 boundaries; in rank order it would cross all 8 edges.
  EXPECT_EQ(t.ring_crossings(), 4);
  EXPECT_EQ(Topology::from_hosts({"a", "b", "a", "b", "a", "b", "a", "b"}).ring_crossings(), 2);
  for (int p = 0; p < 8; ++p) EXPECT_EQ(t.ring_position(t.ring_rank(p)), p);
  EXPECT_EQ(t.ring_rank(-1), 7);
  EXPECT_EQ(t.ring_rank(8), 0);
  EXPECT_EQ(t.host_members(1), (std::vector<int>{1, 5}));
  EXPECT_EQ(t.describe(), "4 hosts: [0 4] [1 5] [2 6] [3 7]");

  const Topology flat = Topology::flat(5);
  EXPECT_EQ(flat.hosts(), 1);
  EXPECT_EQ(flat.ring(), (std::vector<int>{0, 1, 2, 3, 4}));
  EXPECT_EQ(flat.ring_crossings(), 0);
  // Hosts already contiguous keep rank order.
  EXPECT_EQ(Topology::from_hosts({"x", "x", "y", "y"}).ring(), (std::vector<int>{0, 1, 2, 3}));
}

TEST(Topology, ParsesGroupsAndNamesWhatIsWrong) {
  std::string error;
  auto labels = parse_topology("0,2;1,3", 4, &error);
  ASSERT_TRUE(labels.has_value()) << error;
  EXPECT_EQ(Topology::from_hosts(*labels).ring(), (std::vector<int>{0, 2, 1, 3}));
  auto lines = parse_topology("0 2\n1 3\n", 4, &error);
  ASSERT_TRUE(lines.has_value()) << error;
  EXPECT_EQ(*lines, *labels);

  struct Bad {
    const char* spec;
    const char* says;
  };
  for (const Bad& b :
       {Bad{"0,1;2", "rank 3 is missing"}, Bad{"0,1;1,2,3", "rank 1 is listed twice"},
        Bad{"0,1;2,3,4", "rank 4 is outside the world of 4"}, Bad{"0,1;2,x", "unexpected 'x'"},
        Bad{"0,1;2,-3", "rank -3 is outside"}}) {
    error.clear();
    EXPECT_FALSE(parse_topology(b.spec, 4, &error).has_value()) << b.spec;
    EXPECT_TRUE(contains(error, b.says)) << b.spec << ": " << error;
  }
}

class PermutedRing : public ::testing::TestWithParam<int> {};

TEST_P(PermutedRing, RingCollectivesMatchReferenceAndSendOnlyToTheSuccessor) {
  const int n = GetParam();
  const int hosts = n >= 4 ? 3 : 2;
  Options options;
  options.topology = round_robin_spec(n, hosts);
  const Topology expected = Topology::from_hosts(round_robin(n, hosts));
  testing::run_inproc_contexts(
      n,
      [&](Context& ctx) {
        const int r = ctx.rank();
        EXPECT_EQ(ctx.topology(), expected.describe());
        for (std::size_t count : {std::size_t{0}, std::size_t{1}, static_cast<std::size_t>(n - 1),
                                  std::size_t{1031}, std::size_t{99991}}) {
          for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
            Buffer in = testing::make_input(DataType::kFloat32, op, r, count), out(in.size());
            ctx.allreduce(in.data(), out.data(), count, DataType::kFloat32, op,
                          {.algorithm = Algorithm::kRing});
            EXPECT_TRUE(out == testing::reference_reduce(DataType::kFloat32, op, n, count))
                << "allreduce n=" << n << " count=" << count << " " << to_string(op);
          }
          // Reduce-scatter: block r lands on rank r, though rank r sits elsewhere in the ring.
          const std::size_t total = count * static_cast<std::size_t>(n);
          Buffer in = testing::make_input(DataType::kInt64, ReduceOp::kSum, r, total);
          Buffer block(count * 8, 0xCD);
          ctx.reduce_scatter(in.data(), block.data(), count, DataType::kInt64, ReduceOp::kSum);
          EXPECT_TRUE(block == testing::reference_reduce(DataType::kInt64, ReduceOp::kSum, n, count,
                                                         count * static_cast<std::size_t>(r)))
              << "reduce_scatter n=" << n << " block=" << count;
        }
        // All-gather-v with uneven (and empty) blocks, and the chained broadcast of large
        // messages, from every root.
        std::vector<std::size_t> counts(static_cast<std::size_t>(n));
        for (int i = 0; i < n; ++i)
          counts[static_cast<std::size_t>(i)] = i % 3 == 1 ? 0 : 997 + 13 * i;
        const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
        Buffer mine = testing::make_input(DataType::kInt32, ReduceOp::kSum, r,
                                          counts[static_cast<std::size_t>(r)]);
        Buffer all(total * 4, 0x11);
        ctx.allgatherv(mine.data(), all.data(), counts, DataType::kInt32);
        std::size_t off = 0;
        for (int src = 0; src < n; ++src) {
          Buffer want = testing::make_input(DataType::kInt32, ReduceOp::kSum, src,
                                            counts[static_cast<std::size_t>(src)]);
          EXPECT_TRUE(testing::holds_at(all, off * 4, want))
              << "allgatherv n=" << n << " block " << src;
          off += counts[static_cast<std::size_t>(src)];
        }
        for (int root = 0; root < n; ++root) {
          Buffer want = testing::make_input(DataType::kFloat32, ReduceOp::kSum, root, 300007);
          Buffer buf = r == root ? want : Buffer(want.size(), 0x5A);
          ctx.broadcast(buf.data(), 300007, DataType::kFloat32, root);
          EXPECT_TRUE(buf == want) << "broadcast n=" << n << " root=" << root;
        }
        ctx.barrier();  // everyone is done with the above before the counters are read

        // A ring all-reduce sends to one peer only: the ring successor, not rank r + 1.
        std::vector<PeerTraffic> before;
        for (int p = 0; p < n; ++p) before.push_back(ctx.traffic(p));
        std::vector<float> data(1 << 16, 1.0f);
        ctx.allreduce(data.data(), data.data(), data.size(), DataType::kFloat32, ReduceOp::kSum,
                      {.algorithm = Algorithm::kRing});
        const int successor = expected.ring_rank(expected.ring_position(r) + 1);
        for (int p = 0; p < n; ++p) {
          const auto sent =
              ctx.traffic(p).bytes_sent - before[static_cast<std::size_t>(p)].bytes_sent;
          if (p == successor && n > 1) {
            EXPECT_GT(sent, 0u) << "rank " << r << " to its successor " << p;
          } else {
            EXPECT_EQ(sent, 0u) << "rank " << r << " sent to " << p << ", not its successor "
                                << successor;
          }
        }
      },
      options);
}

INSTANTIATE_TEST_SUITE_P(Worlds, PermutedRing, ::testing::Values(2, 3, 4, 5, 8),
                         [](const auto& p) { return "n" + std::to_string(p.param); });

// Hosts emulated by topology groups over the inproc transport: the hierarchical all-reduce,
// reduce-scatter and all-gather(v) equal the reference (and every rank's all-reduce output is
// the same bits), whatever the placement; uneven hosts fall back to the ring.
// Plain variables, not a structured binding of GetParam(): the lambda captures them, and
// Debian 12's clang 14 refuses to capture bindings.
class Hierarchical : public ::testing::TestWithParam<std::tuple<int, std::string>> {};

TEST_P(Hierarchical, MatchesReferenceForEveryDtypeAndOp) {
  const int n = std::get<0>(GetParam());
  const std::string spec = std::get<1>(GetParam());
  Options options;
  options.topology = spec;
  std::vector<Buffer> outputs(static_cast<std::size_t>(n));
  testing::run_inproc_contexts(
      n,
      [&](Context& ctx) {
        const int r = ctx.rank();
        for (DataType t : testing::kAllDtypes) {
          for (ReduceOp op : testing::kAllOps) {
            if (!dtype_op_valid(t, op)) continue;
            for (std::size_t count : {std::size_t{0}, std::size_t{1},
                                      static_cast<std::size_t>(n + 1), std::size_t{1031}}) {
              for (bool in_place : {false, true}) {
                Buffer in = testing::make_input(t, op, r, count), out(in.size(), 0xAB);
                void* dst = in_place ? in.data() : out.data();
                ctx.allreduce(in.data(), dst, count, t, op,
                              {.algorithm = Algorithm::kHierarchical});
                const Buffer& got = in_place ? in : out;
                EXPECT_TRUE(got == testing::reference_reduce(t, op, n, count))
                    << spec << " " << to_string(t) << " " << to_string(op) << " count=" << count
                    << (in_place ? " in place" : "");
              }
            }
          }
        }
        // Rounded floats: identical bits on every rank.
        Buffer big = testing::make_input(DataType::kFloat32, ReduceOp::kSum, r, 99991);
        ctx.allreduce(big.data(), big.data(), 99991, DataType::kFloat32, ReduceOp::kAvg,
                      {.algorithm = Algorithm::kHierarchical});
        outputs[static_cast<std::size_t>(r)] = big;

        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
          for (std::size_t block : {std::size_t{0}, std::size_t{1}, std::size_t{1031}}) {
            const std::size_t total = block * static_cast<std::size_t>(n);
            Buffer in = testing::make_input(DataType::kFloat64, op, r, total), out(block * 8, 0xCD);
            ctx.reduce_scatter(in.data(), out.data(), block, DataType::kFloat64, op);
            EXPECT_TRUE(out == testing::reference_reduce(DataType::kFloat64, op, n, block,
                                                         block * static_cast<std::size_t>(r)))
                << spec << " reduce_scatter " << to_string(op) << " block=" << block;
          }
        }
        std::vector<std::size_t> counts(static_cast<std::size_t>(n));
        for (int i = 0; i < n; ++i)
          counts[static_cast<std::size_t>(i)] = i % 3 == 2 ? 0 : 500 + 7 * i;
        const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
        Buffer mine = testing::make_input(DataType::kUInt8, ReduceOp::kSum, r,
                                          counts[static_cast<std::size_t>(r)]);
        Buffer all(total, 0x77);
        ctx.allgatherv(mine.data(), all.data(), counts, DataType::kUInt8);
        std::size_t off = 0;
        for (int src = 0; src < n; ++src) {
          Buffer want = testing::make_input(DataType::kUInt8, ReduceOp::kSum, src,
                                            counts[static_cast<std::size_t>(src)]);
          EXPECT_TRUE(testing::holds_at(all, off, want)) << spec << " allgatherv block " << src;
          off += counts[static_cast<std::size_t>(src)];
        }
      },
      options);
  for (int r = 1; r < n; ++r) EXPECT_TRUE(outputs[static_cast<std::size_t>(r)] == outputs[0]) << r;
}

INSTANTIATE_TEST_SUITE_P(
    Placements, Hierarchical,
    ::testing::Values(std::make_tuple(4, std::string("0,1;2,3")),
                      std::make_tuple(6, std::string("0,2,4;1,3,5")),
                      std::make_tuple(8, std::string("0,1;2,3;4,5;6,7")),
                      std::make_tuple(8, std::string("0,4;1,5;2,6;3,7")),
                      std::make_tuple(4, std::string("0,1,2;3")),  // uneven: the ring
                      std::make_tuple(3, std::string("0;1;2"))),   // one rank per host
    [](const auto& p) {
      return "n" + std::to_string(std::get<0>(p.param)) + "_" + std::to_string(p.index);
    });

// The bytes that cross between hosts, from the transport counters: a host sends 2(H-1)/H of
// the message per hierarchical all-reduce (one slice per local rank), while the flat ring's
// boundary edge carries 2(N-1)/N of it.
TEST(Hierarchical, CrossesHostBoundariesWithTheFewestBytes) {
  const int n = 4, hosts = 2;
  Options options;
  options.topology = "0,1;2,3";
  const std::size_t count = 1 << 18, bytes = count * 4;
  std::vector<std::uint64_t> crossing_hier(n), crossing_ring(n);
  testing::run_inproc_contexts(
      n,
      [&](Context& ctx) {
        const int r = ctx.rank();
        auto across = [&] {
          std::uint64_t sent = 0;
          for (int p = 0; p < n; ++p) {
            if (p != r && (p < 2) != (r < 2)) sent += ctx.traffic(p).bytes_sent;
          }
          return sent;
        };
        std::vector<float> buf(count, 1.0f);
        ctx.barrier();
        std::uint64_t before = across();
        ctx.allreduce(buf.data(), buf.data(), count, DataType::kFloat32, ReduceOp::kSum,
                      {.algorithm = Algorithm::kHierarchical});
        crossing_hier[static_cast<std::size_t>(r)] = across() - before;
        ctx.barrier();
        before = across();
        ctx.allreduce(buf.data(), buf.data(), count, DataType::kFloat32, ReduceOp::kSum,
                      {.algorithm = Algorithm::kRing});
        crossing_ring[static_cast<std::size_t>(r)] = across() - before;
      },
      options);
  for (int h = 0; h < hosts; ++h) {
    const auto hier = crossing_hier[2 * h] + crossing_hier[2 * h + 1];
    const auto ring = crossing_ring[2 * h] + crossing_ring[2 * h + 1];
    EXPECT_EQ(hier, 2 * (hosts - 1) * bytes / hosts) << "host " << h;
    EXPECT_EQ(ring, 2 * (n - 1) * bytes / n) << "host " << h;
  }
}

// Builds n inproc contexts, rank r with topology specs[r]; returns each rank's error message
// ("" if its context came up and a barrier passed).
std::vector<std::string> start_with(const std::vector<std::string>& specs) {
  const int n = static_cast<int>(specs.size());
  auto group = transport::make_inproc_group(n);
  std::vector<std::string> errors(specs.size());
  testing::run_threads(n, [&](int rank) {
    Options options;
    options.topology = specs[static_cast<std::size_t>(rank)];
    options.timeout = std::chrono::milliseconds(20000);
    try {
      transport::TransportOptions topts;
      topts.format_tag = collectives::describe_tag;
      auto ctx = make_context(transport::make_inproc_transport(group, rank, topts), options,
                              cost::LinkParams{});
      ctx->barrier();
    } catch (const Error& e) {
      errors[static_cast<std::size_t>(rank)] = std::string(to_string(e.kind())) + ": " + e.what();
    }
  });
  return errors;
}

TEST(TopologyAgreement, RanksThatDisagreeFailAtStartNamingBothOrders) {
  auto errors = start_with({"0,1;2,3", "0,2;1,3", "0,2;1,3", "0,2;1,3"});
  for (int r = 1; r < 4; ++r) {
    const std::string& e = errors[static_cast<std::size_t>(r)];
    EXPECT_TRUE(contains(e, "mismatch")) << e;
    EXPECT_TRUE(contains(e, "here [0 2 1 3]") && contains(e, "rank 0 [0 1 2 3]")) << e;
  }
  // Rank 0's own check passes; the others' abort reaches it in its next collective.
  EXPECT_TRUE(contains(errors[0], "aborted")) << errors[0];
}

TEST(TopologyAgreement, MalformedSpecIsRefusedOnEveryRank) {
  auto errors = start_with({"0,1;1,2", "0,1;1,2", "0,1;1,2"});
  for (const std::string& e : errors) {
    EXPECT_TRUE(contains(e, "invalid argument") && contains(e, "'0,1;1,2'") &&
                contains(e, "rank 1 is listed twice"))
        << e;
  }
}

}  // namespace
}  // namespace gradsync
