// The claim the project rests on, measured by the transport counters: a ring all-reduce
// sends 2(N-1)/N of the payload per rank whatever N, while the parameter server's root
// sends (N-1) times the payload.
#include <gtest/gtest.h>

#include <mutex>

#include "harness.h"

namespace gradsync {
namespace {

std::vector<PeerTraffic> traffic_of_one_allreduce(int n, std::size_t count, Algorithm algo) {
  std::vector<PeerTraffic> per_rank(static_cast<std::size_t>(n));
  testing::run_inproc_contexts(n, [&](Context& ctx) {
    std::vector<float> buf(count, 1.0f);
    ctx.barrier();
    PeerTraffic before = ctx.total_traffic();
    ctx.allreduce(buf.data(), buf.data(), count, DataType::kFloat32, ReduceOp::kSum,
                  {.algorithm = algo});
    PeerTraffic after = ctx.total_traffic();
    EXPECT_EQ(buf[0], static_cast<float>(n));
    per_rank[static_cast<std::size_t>(ctx.rank())] = {
        after.bytes_sent - before.bytes_sent, after.bytes_received - before.bytes_received,
        after.messages_sent - before.messages_sent,
        after.messages_received - before.messages_received};
  });
  return per_rank;
}

TEST(Traffic, RingSendsTwoNMinusOneOverNOfThePayloadPerRank) {
  const std::size_t count = (1 << 20) + 3;
  const double payload = static_cast<double>(count * sizeof(float));
  for (int n : {2, 3, 4, 5, 8}) {
    auto t = traffic_of_one_allreduce(n, count, Algorithm::kRing);
    const double expected = 2.0 * (n - 1) / n * payload;
    for (int r = 0; r < n; ++r) {
      const auto& x = t[static_cast<std::size_t>(r)];
      // Segments differ by at most one element, so a rank's share differs by at most 2(N-1).
      EXPECT_NEAR(static_cast<double>(x.bytes_sent), expected, 2.0 * n * sizeof(float))
          << "n=" << n << " rank " << r;
      EXPECT_NEAR(static_cast<double>(x.bytes_received), expected, 2.0 * n * sizeof(float));
      EXPECT_LT(static_cast<double>(x.bytes_sent), 2.0 * payload) << "bounded independent of N";
    }
  }
}

TEST(Traffic, ParameterServerRootGrowsWithN) {
  const std::size_t count = 100000;
  const std::uint64_t payload = count * sizeof(float);
  for (int n : {2, 4, 8}) {
    auto t = traffic_of_one_allreduce(n, count, Algorithm::kParameterServer);
    EXPECT_EQ(t[0].bytes_sent, (static_cast<std::uint64_t>(n) - 1) * payload) << "n=" << n;
    EXPECT_EQ(t[0].bytes_received, (static_cast<std::uint64_t>(n) - 1) * payload) << "n=" << n;
    for (int r = 1; r < n; ++r) EXPECT_EQ(t[static_cast<std::size_t>(r)].bytes_sent, payload);
  }
}

}  // namespace
}  // namespace gradsync
