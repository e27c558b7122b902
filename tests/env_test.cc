// Launch environments (torchrun, mpirun, PMI, srun) resolve to the same Options, explicit
// options win, and garbage is named; the cost model picks latency-optimal algorithms for
// small messages and the ring for large ones.
#include "core/env.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "cost/cost_model.h"

namespace gradsync {
namespace {

// Sets variables for one test and removes every launch variable afterwards.
class EnvGuard {
 public:
  explicit EnvGuard(std::initializer_list<std::pair<const char*, const char*>> vars) {
    clear();
    for (auto [k, v] : vars) ::setenv(k, v, 1);
  }
  ~EnvGuard() { clear(); }

 private:
  static void clear() {
    for (const char* k : {"RANK",
                          "WORLD_SIZE",
                          "LOCAL_RANK",
                          "LOCAL_WORLD_SIZE",
                          "MASTER_ADDR",
                          "MASTER_PORT",
                          "OMPI_COMM_WORLD_RANK",
                          "OMPI_COMM_WORLD_SIZE",
                          "OMPI_COMM_WORLD_LOCAL_RANK",
                          "OMPI_COMM_WORLD_LOCAL_SIZE",
                          "PMI_RANK",
                          "PMI_SIZE",
                          "MPI_LOCALRANKID",
                          "MPI_LOCALNRANKS",
                          "SLURM_PROCID",
                          "SLURM_NTASKS",
                          "SLURM_LOCALID",
                          "SLURM_NTASKS_PER_NODE",
                          "GRADSYNC_TRANSPORT",
                          "GRADSYNC_ALGO",
                          "GRADSYNC_TIMEOUT",
                          "GRADSYNC_TOKEN",
                          "GRADSYNC_TOPOLOGY",
                          "TORCHELASTIC_RUN_ID"}) {
      ::unsetenv(k);
    }
  }
};

TEST(Env, TorchrunConvention) {
  EnvGuard g({{"RANK", "3"},
              {"WORLD_SIZE", "8"},
              {"LOCAL_RANK", "1"},
              {"LOCAL_WORLD_SIZE", "2"},
              {"MASTER_ADDR", "10.0.0.1"},
              {"MASTER_PORT", "1234"},
              {"GRADSYNC_TOKEN", "s3cret"}});
  Options o = env::resolve({});
  EXPECT_EQ(o.rank, 3);
  EXPECT_EQ(o.size, 8);
  EXPECT_EQ(o.local_rank, 1);
  EXPECT_EQ(o.local_size, 2);
  EXPECT_EQ(o.master_addr, "10.0.0.1");
  EXPECT_EQ(o.master_port, 1234);
  EXPECT_EQ(o.token, "s3cret");
  EXPECT_EQ(o.timeout.count(), 300000);
}

// torchrun's agent listens on MASTER_PORT with torch's own store: gradsync's store moves to
// the next port, unless the caller brings a store (the torch backend, which uses torch's) or
// names the port itself.
TEST(Env, UnderTorchrunTheStoreTakesTheNextPort) {
  EnvGuard g({{"RANK", "1"},
              {"WORLD_SIZE", "2"},
              {"MASTER_PORT", "1234"},
              {"TORCHELASTIC_RUN_ID", "none"}});
  EXPECT_EQ(env::resolve({}).master_port, 1235);
  Options named;
  named.master_port = 4000;
  EXPECT_EQ(env::resolve(named).master_port, 4000);
  Options with_store;
  with_store.store = make_inproc_store();
  EXPECT_EQ(env::resolve(with_store).master_port, 1234);
}

TEST(Env, MpirunPmiAndSrunConventions) {
  {
    EnvGuard g({{"OMPI_COMM_WORLD_RANK", "2"},
                {"OMPI_COMM_WORLD_SIZE", "4"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
    Options o = env::resolve({});
    EXPECT_EQ(o.rank, 2);
    EXPECT_EQ(o.size, 4);
    EXPECT_EQ(o.local_rank, 0);
    EXPECT_EQ(o.local_size, 2);
  }
  {
    EnvGuard g({{"PMI_RANK", "5"}, {"PMI_SIZE", "6"}});
    Options o = env::resolve({});
    EXPECT_EQ(o.rank, 5);
    EXPECT_EQ(o.size, 6);
    EXPECT_EQ(o.local_rank, -1) << "unknown until host discovery";
  }
  {
    EnvGuard g({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "3"}, {"SLURM_LOCALID", "1"}});
    Options o = env::resolve({});
    EXPECT_EQ(o.rank, 1);
    EXPECT_EQ(o.size, 3);
    EXPECT_EQ(o.local_rank, 1);
  }
}

TEST(Env, ExplicitOptionsOverrideTheEnvironment) {
  EnvGuard g({{"RANK", "3"},
              {"WORLD_SIZE", "8"},
              {"GRADSYNC_TRANSPORT", "tcp"},
              {"GRADSYNC_ALGO", "hd"},
              {"GRADSYNC_TIMEOUT", "1500"}});
  Options in;
  in.rank = 0;
  in.size = 2;
  in.transport = "shm";
  in.algorithm = Algorithm::kRing;
  Options o = env::resolve(in);
  EXPECT_EQ(o.rank, 0);
  EXPECT_EQ(o.size, 2);
  EXPECT_EQ(o.transport, "shm");
  EXPECT_EQ(o.algorithm, Algorithm::kRing);
  EXPECT_EQ(o.timeout.count(), 1500) << "not set explicitly, so the environment's";
  Options from_env = env::resolve({});
  EXPECT_EQ(from_env.algorithm, Algorithm::kHalvingDoubling);
  EXPECT_EQ(from_env.transport, "tcp");
}

// A group of the caller's own (a store, a rank and a size given: torch's process groups and
// subgroups) takes its ranks per host from host discovery: the launcher's LOCAL_* describe
// the whole job, and LOCAL_RANK=5 of a 2-rank subgroup is not this group's.
TEST(Env, AGroupWithItsOwnStoreIgnoresTheLaunchersLocalRanks) {
  EnvGuard g({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "5"}, {"LOCAL_WORLD_SIZE", "8"}});
  Options in;
  in.store = make_inproc_store();
  in.rank = 1;
  in.size = 2;
  Options o = env::resolve(in);
  EXPECT_EQ(o.local_rank, -1);
  EXPECT_EQ(o.local_size, -1);
  in.store = nullptr;
  EXPECT_EQ(env::resolve(in).local_rank, 5) << "without a store of its own: the launcher's";
}

TEST(Env, GarbageIsNamed) {
  auto expect_error = [](std::initializer_list<std::pair<const char*, const char*>> vars,
                         const std::string& part) {
    EnvGuard g(vars);
    try {
      env::resolve({});
      ADD_FAILURE() << "accepted " << part;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  expect_error({{"RANK", "two"}, {"WORLD_SIZE", "4"}}, "RANK='two' is not an integer");
  expect_error({{"RANK", "4"}, {"WORLD_SIZE", "4"}},
               "RANK='4' is not an integer in [0, WORLD_SIZE): the world size is 4");
  // Past int: once cast to int, 2^32 was rank 0.
  expect_error({{"RANK", "4294967296"}, {"WORLD_SIZE", "1"}},
               "RANK='4294967296' is not an integer in [0, WORLD_SIZE)");
  expect_error({{"OMPI_COMM_WORLD_SIZE", "-3"}},
               "OMPI_COMM_WORLD_SIZE='-3' is not an integer in [1, 1048576]");
  expect_error({{"GRADSYNC_TRANSPORT", "carrier-pigeon"}},
               "'carrier-pigeon' is not one of shm, tcp");
  expect_error({{"GRADSYNC_ALGO", "fastest"}}, "GRADSYNC_ALGO='fastest'");
  expect_error({{"MASTER_PORT", "70000"}}, "MASTER_PORT='70000' is not an integer in [1, 65535]");
  // Port 0 used to be taken, and then waited the whole timeout to connect to it.
  expect_error({{"MASTER_PORT", "0"}}, "MASTER_PORT='0' is not an integer in [1, 65535]");
  expect_error({{"GRADSYNC_TOPOLOGY", "@/nonexistent/topology"}},
               "GRADSYNC_TOPOLOGY='@/nonexistent/topology' is not groups like");
  // Not a regular file: a FIFO would block init() forever, /dev/zero fill memory.
  const std::string fifo = ::testing::TempDir() + "/gradsync-fifo-" + std::to_string(::getpid());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_error({{"GRADSYNC_TOPOLOGY", ("@" + fifo).c_str()}}, "is not a regular file");
  ::unlink(fifo.c_str());
  expect_error({{"GRADSYNC_TOPOLOGY", "@/dev/zero"}}, "the file /dev/zero is not a regular file");
}

// GRADSYNC_TOPOLOGY gives the groups inline, or in a file after '@' (one line per group);
// explicit Options win.
TEST(Env, TopologyInlineOrFromAFile) {
  {
    EnvGuard g({{"GRADSYNC_TOPOLOGY", "0,2;1,3"}});
    EXPECT_EQ(env::resolve({}).topology, "0,2;1,3");
    Options explicit_options;
    explicit_options.topology = "0,1;2,3";
    EXPECT_EQ(env::resolve(explicit_options).topology, "0,1;2,3");
  }
  const std::string path =
      ::testing::TempDir() + "/gradsync-topology-" + std::to_string(::getpid());
  {
    std::FILE* f = std::fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("0 2\n1 3\n", f);
    std::fclose(f);
  }
  EnvGuard g({{"GRADSYNC_TOPOLOGY", ("@" + path).c_str()}});
  EXPECT_EQ(env::resolve({}).topology, "0 2\n1 3\n");
  std::remove(path.c_str());
}

TEST(CostModel, LatencyOptimalForSmallRingForLarge) {
  cost::CostModel m(cost::LinkParams{5.0, 5.0, 10.0});
  for (int n : {2, 3, 4, 5, 8}) {
    EXPECT_EQ(m.choose_allreduce(n, 4096), Algorithm::kRecursiveDoubling) << n;
    EXPECT_NE(m.choose_allreduce(n, 256 << 20), Algorithm::kRecursiveDoubling) << n;
  }
  // Large messages: the pipelined ring, also where halving-doubling moves as few bytes.
  EXPECT_EQ(m.choose_allreduce(4, 64 << 20), Algorithm::kRing);
  EXPECT_EQ(m.choose_allreduce(8, 64 << 20), Algorithm::kRing);
  // Non-power-of-two worlds pay for folding; the ring does not.
  EXPECT_EQ(m.choose_allreduce(5, 64 << 20), Algorithm::kRing);
  EXPECT_EQ(m.choose_allreduce(3, 64 << 20), Algorithm::kRing);
  // The baseline's server cost grows with N; the ring's does not.
  double ps2 = m.allreduce_us(Algorithm::kParameterServer, 2, 64 << 20);
  double ps8 = m.allreduce_us(Algorithm::kParameterServer, 8, 64 << 20);
  double ring2 = m.allreduce_us(Algorithm::kRing, 2, 64 << 20);
  double ring8 = m.allreduce_us(Algorithm::kRing, 8, 64 << 20);
  EXPECT_GT(ps8 / ps2, 6.0);
  EXPECT_LT(ring8 / ring2, 2.0);
}

TEST(CostModel, ParsesAndRejectsSpecs) {
  auto p = cost::CostModel::parse("alpha_us=2.5,bandwidth_gbps=12");
  ASSERT_TRUE(p.has_value());
  EXPECT_DOUBLE_EQ(p->alpha_us, 2.5);
  EXPECT_DOUBLE_EQ(p->bandwidth_gbps, 12);
  EXPECT_DOUBLE_EQ(p->reduce_gbps, cost::LinkParams{}.reduce_gbps);
  EXPECT_FALSE(cost::CostModel::parse("alpha_us=-1"));
  EXPECT_FALSE(cost::CostModel::parse("speed=3"));
  EXPECT_FALSE(cost::CostModel::parse("alpha_us"));
  EXPECT_FALSE(cost::CostModel::parse("alpha_us=3x"));
}

// The shared-memory all-reduce competes only where the ranks share an arena: there it takes
// large messages (it moves each byte through memory once in, once out), while recursive
// doubling keeps small ones in power-of-two worlds (the shared-memory algorithm waits on
// every rank three times, log2(N) exchanges are no more).
TEST(CostModel, SharedMemoryForLargeMessagesWhereRanksShareMemory) {
  const cost::LinkParams defaults{5.0, 5.0, 10.0};
  // Constants measured at start-up on the 2-core EPYC VM (shm transport), with 2 ranks and
  // with 4 ranks sharing the 2 cores (alpha, a barrier round, then includes scheduling).
  const cost::LinkParams measured{0.16, 28.0, 40.0}, oversubscribed{1.8, 28.0, 40.0};
  for (const auto& params : {defaults, measured, oversubscribed}) {
    cost::CostModel m(params);
    for (int n : {2, 3, 4, 5, 8}) {
      // Small messages: recursive doubling's log2(N) exchanges, or the one-shot form's single
      // wait for every rank, which unmeasured is priced as a barrier of as many latencies.
      const Algorithm small = m.choose_allreduce(n, 1024, true);
      EXPECT_TRUE(small == Algorithm::kRecursiveDoubling || small == Algorithm::kSharedMemory) << n;
      EXPECT_EQ(m.choose_allreduce(n, 64 << 20, true), Algorithm::kSharedMemory) << n;
      EXPECT_EQ(m.choose_allreduce(n, 256 << 20, true), Algorithm::kSharedMemory) << n;
      for (std::size_t bytes : {std::size_t{1024}, std::size_t{1} << 20, std::size_t{256} << 20}) {
        const Algorithm without = m.choose_allreduce(n, bytes),
                        with = m.choose_allreduce(n, bytes, true);
        EXPECT_NE(without, Algorithm::kSharedMemory) << n << " " << bytes;
        // The flag only adds a candidate.
        if (with != Algorithm::kSharedMemory) {
          EXPECT_EQ(with, without) << n << " " << bytes;
        }
      }
    }
  }
}

// The shared-memory all-reduce's fixed costs, measured at start-up, decide small messages: with
// 2 ranks on their own cores its waits cost less than one message exchange. Where 4 ranks
// share 2 cores each wait needs every rank scheduled: the one-shot form's single wait against
// recursive doubling's two pairwise exchanges, whichever was measured cheaper. A message of
// one chunk is not pipelined, so the ring takes the few-hundred-KiB range with 2 ranks.
// (Constants measured on the 2-core EPYC VM.)
TEST(CostModel, SharedMemoryFixedCostDecidesSmallMessages) {
  cost::LinkParams two{0.57, 29.0, 40.0};
  two.shm_call_us = 0.33;
  cost::CostModel m2(two);
  EXPECT_EQ(m2.choose_allreduce(2, 4096, true), Algorithm::kSharedMemory);
  EXPECT_EQ(m2.choose_allreduce(2, 256 << 10, true), Algorithm::kRing);
  EXPECT_EQ(m2.choose_allreduce(2, 64 << 20, true), Algorithm::kSharedMemory);

  cost::LinkParams four{7.0, 8.1, 48.5};
  four.shm_call_us = 28.1;
  four.shm_one_shot_us = 12.4;
  EXPECT_EQ(cost::CostModel(four).choose_allreduce(4, 4096, true), Algorithm::kSharedMemory);
  EXPECT_EQ(cost::CostModel(four).choose_allreduce(4, 32 << 10, true), Algorithm::kSharedMemory);
  four.shm_one_shot_us = 20.0;
  EXPECT_EQ(cost::CostModel(four).choose_allreduce(4, 4096, true), Algorithm::kRecursiveDoubling);

  cost::LinkParams large{3.0, 29.0, 40.0};
  large.shm_call_us = 7.4;
  large.shm_one_shot_us = 5.5;
  cost::CostModel m4(large);
  EXPECT_EQ(m4.choose_allreduce(4, 1 << 20, true), Algorithm::kSharedMemory);
  EXPECT_EQ(m4.choose_allreduce(4, 64 << 20, true), Algorithm::kSharedMemory);

  // Round trip through the GRADSYNC_COST_MODEL form.
  auto parsed = cost::CostModel::parse(m4.to_string());
  ASSERT_TRUE(parsed.has_value());
  EXPECT_DOUBLE_EQ(parsed->shm_call_us, 7.4);
  EXPECT_DOUBLE_EQ(parsed->shm_one_shot_us, 5.5);
  const std::string unmeasured = cost::CostModel(cost::LinkParams{}).to_string();
  EXPECT_EQ(unmeasured.find("shm_call_us"), std::string::npos);
  EXPECT_EQ(unmeasured.find("shm_one_shot_us"), std::string::npos);
}

// Unmeasured, the one-shot form's single wait is priced at a third of the three the chunked
// form's measured fixed cost holds: a pinned model that keeps the arena away from every call
// (shm_call_us=100000, as the trainer's checkpoint tests pin it) keeps it away from small ones.
TEST(CostModel, OneShotFormFollowsAPinnedFixedCost) {
  auto pinned =
      cost::CostModel::parse("alpha_us=500,bandwidth_gbps=0.5,reduce_gbps=1,shm_call_us=100000");
  ASSERT_TRUE(pinned.has_value());
  for (int n : {2, 3, 4}) {
    for (std::size_t bytes : {std::size_t{4}, std::size_t{4} << 10, std::size_t{32} << 10}) {
      EXPECT_NE(cost::CostModel(*pinned).choose_allreduce(n, bytes, true), Algorithm::kSharedMemory)
          << n << " " << bytes;
    }
  }
  EXPECT_DOUBLE_EQ(cost::CostModel(*pinned).shared_memory_us(2, 0, true), 100000.0 / 3);
}

// Where the transport buffers a send at once (the shm transport's rings), recursive doubling
// reduces its partner's message straight out of the transport's buffer: no staging pass. Between
// 2 ranks it then beats the ring and the arena up to about 100 KiB, as measured (64 KiB: 6.4 us
// against the ring's 7.6 and the arena's 8.5); without, the arena took 16 KiB and up. Messages
// beyond half the buffer still pay the pass. (Constants measured at start-up on the 2-core EPYC
// VM, 2 ranks, shm transport.)
TEST(CostModel, BufferedSendsSpareRecursiveDoublingItsStagingPass) {
  cost::LinkParams two{1.07, 12.9, 52.0};
  two.shm_call_us = 2.38;
  two.shm_one_shot_us = 1.62;
  two.shm_gbps = 14.4;
  const cost::CostModel staged(two);
  two.buffered_send_bytes = 2 << 20;
  const cost::CostModel buffered(two);
  for (std::size_t bytes : {std::size_t{32} << 10, std::size_t{64} << 10}) {
    EXPECT_NE(staged.choose_allreduce(2, bytes, true), Algorithm::kRecursiveDoubling) << bytes;
    EXPECT_EQ(buffered.choose_allreduce(2, bytes, true), Algorithm::kRecursiveDoubling) << bytes;
  }
  EXPECT_EQ(buffered.choose_allreduce(2, 1 << 20, true), staged.choose_allreduce(2, 1 << 20, true));
  // One pass over the bytes at the transport's speed, per step, and only up to half the buffer.
  const double beta = 1e-3 / two.bandwidth_gbps;
  for (int n : {2, 4, 8}) {
    const double steps = n == 2 ? 1 : n == 4 ? 2 : 3;
    for (std::size_t bytes : {std::size_t{4} << 10, std::size_t{1} << 20}) {
      EXPECT_NEAR(staged.allreduce_us(Algorithm::kRecursiveDoubling, n, bytes) -
                      buffered.allreduce_us(Algorithm::kRecursiveDoubling, n, bytes),
                  steps * beta * static_cast<double>(bytes), 1e-9)
          << n << " " << bytes;
    }
    EXPECT_DOUBLE_EQ(staged.allreduce_us(Algorithm::kRecursiveDoubling, n, (1 << 20) + 4),
                     buffered.allreduce_us(Algorithm::kRecursiveDoubling, n, (1 << 20) + 4));
    // Halving-doubling stages every step whatever the transport does.
    EXPECT_DOUBLE_EQ(staged.allreduce_us(Algorithm::kHalvingDoubling, n, 4096),
                     buffered.allreduce_us(Algorithm::kHalvingDoubling, n, 4096));
  }
  auto parsed = cost::CostModel::parse(buffered.to_string());
  ASSERT_TRUE(parsed.has_value());
  EXPECT_DOUBLE_EQ(parsed->buffered_send_bytes, 2 << 20);
  EXPECT_EQ(staged.to_string().find("buffered_send_bytes"), std::string::npos);
}

// A measured call calibrates a per-byte constant: the fitted throughput makes the model predict
// exactly what was measured, for the ring (bandwidth_gbps) and the shared-memory algorithm
// (shm_gbps) alike; a measurement below the model's fixed costs fits nothing.
TEST(CostModel, FitsAThroughputToAMeasuredCall) {
  cost::LinkParams p{2.0, 5.0, 40.0};
  p.shm_call_us = 1.5;
  for (int n : {2, 3, 4, 8}) {
    for (double measured : {60.0, 140.0, 900.0}) {
      const double ring = cost::CostModel::fit_gbps(p, &cost::LinkParams::bandwidth_gbps,
                                                    Algorithm::kRing, n, 1 << 20, measured);
      cost::LinkParams fitted = p;
      fitted.bandwidth_gbps = ring;
      EXPECT_NEAR(cost::CostModel(fitted).allreduce_us(Algorithm::kRing, n, 1 << 20), measured,
                  1e-6 * measured)
          << n;
      const double arena = cost::CostModel::fit_gbps(
          p, &cost::LinkParams::shm_gbps, Algorithm::kSharedMemory, n, 1 << 20, measured);
      fitted = p;
      fitted.shm_gbps = arena;
      EXPECT_NEAR(cost::CostModel(fitted).allreduce_us(Algorithm::kSharedMemory, n, 1 << 20),
                  measured, 1e-6 * measured)
          << n;
    }
  }
  EXPECT_EQ(cost::CostModel::fit_gbps(p, &cost::LinkParams::bandwidth_gbps, Algorithm::kRing, 4,
                                      1 << 20, 2 * 3 * p.alpha_us),
            0.0);
}

// The shared-memory algorithm's copies run at the speed of the memory the ranks share, not at
// that of the transport's messages: with UCX's messages between 2 ranks on one host (constants
// fitted on the 2-core VM: a 4 KiB round of 3 us, a 1 MiB ring of 105 us) the arena (1 MiB in
// 61 us) takes every size, while priced at the messages' speed it lost the middle sizes.
TEST(CostModel, SharedMemoryPricedAtItsOwnThroughput) {
  cost::LinkParams ucx{3.0, 11.0, 39.0};
  ucx.shm_call_us = 0.45;
  EXPECT_EQ(cost::CostModel(ucx).choose_allreduce(2, 1 << 20, true), Algorithm::kRing);
  ucx.shm_gbps = cost::CostModel::fit_gbps(ucx, &cost::LinkParams::shm_gbps,
                                           Algorithm::kSharedMemory, 2, 1 << 20, 61.0);
  const cost::CostModel m(ucx);
  for (std::size_t bytes :
       {std::size_t{4} << 10, std::size_t{64} << 10, std::size_t{1} << 20, std::size_t{64} << 20}) {
    EXPECT_EQ(m.choose_allreduce(2, bytes, true), Algorithm::kSharedMemory) << bytes;
  }
  auto parsed = cost::CostModel::parse(m.to_string());
  ASSERT_TRUE(parsed.has_value());
  EXPECT_DOUBLE_EQ(parsed->shm_gbps, ucx.shm_gbps);
  EXPECT_EQ(cost::CostModel(cost::LinkParams{}).to_string().find("shm_gbps"), std::string::npos);
}

// The shared-memory all-gather (one host, an arena) is priced at the memory's fitted speed for
// the whole output, after the one-shot form's fixed cost (blocks up to 64 KiB) or two of the
// chunked all-reduce's three steps: below the ring's N-1 messages at every size among 4 and 8
// ranks (between 2 both make one copy each way: close, whichever the constants favour). Across
// hosts there is no arena.
TEST(CostModel, SharedMemoryAllgatherAtTheMemorysSpeed) {
  cost::LinkParams p{3.0, 11.0, 39.0};
  p.shm_call_us = 2.1;
  p.shm_one_shot_us = 1.1;
  p.shm_gbps = 20.0;
  const cost::CostModel m(p);
  for (int n : {4, 8}) {
    for (std::size_t bytes : {std::size_t{4} << 10, std::size_t{1} << 20, std::size_t{64} << 20}) {
      EXPECT_LT(m.allgather_us(n, bytes, 1, true), m.allgather_us(n, bytes, 1, false))
          << n << " ranks, " << bytes;
    }
  }
  EXPECT_DOUBLE_EQ(m.allgather_us(2, 128 << 10, 1, true), 1.1 + (128 << 10) * 1e-3 / 20.0);
  EXPECT_DOUBLE_EQ(m.allgather_us(2, (128 << 10) + 2, 1, true),
                   1.4 + ((128 << 10) + 2) * 1e-3 / 20.0);
  EXPECT_DOUBLE_EQ(m.allgather_us(4, 1 << 20, 2, true), m.allgather_us(4, 1 << 20, 2, false));
}

// Across hosts the flat algorithms run at the speed of the links between hosts; the
// hierarchical algorithm keeps most of its traffic inside hosts and wins large messages there,
// while small ones stay latency-optimal. One host never gets it.
TEST(CostModel, HierarchicalForLargeMessagesAcrossHosts) {
  cost::LinkParams p{0.6, 20.0, 40.0};
  p.inter_alpha_us = 60;
  p.inter_bandwidth_gbps = 0.12;  // 1 Gbit/s
  cost::CostModel m(p);
  EXPECT_EQ(m.choose_allreduce(4, 16 << 20, false, 2), Algorithm::kHierarchical);
  EXPECT_EQ(m.choose_allreduce(8, 64 << 20, false, 4), Algorithm::kHierarchical);
  EXPECT_NE(m.choose_allreduce(4, 1024, false, 2), Algorithm::kHierarchical);
  EXPECT_NE(m.choose_allreduce(4, 64 << 20, true, 1), Algorithm::kHierarchical);
  // One rank per host or uneven hosts: not a candidate.
  EXPECT_NE(m.choose_allreduce(4, 64 << 20, false, 4), Algorithm::kHierarchical);
  EXPECT_NE(m.choose_allreduce(5, 64 << 20, false, 2), Algorithm::kHierarchical);
  // 2 hosts x 2 ranks, 16 MiB: the link carries S instead of 1.5 S.
  const double flat = m.allreduce_us(Algorithm::kRing, 4, 16 << 20, 2);
  const double hier = m.allreduce_us(Algorithm::kHierarchical, 4, 16 << 20, 2);
  EXPECT_GT(flat / hier, 1.3);
  // Halving-doubling sends the largest halves to the farthest partners, on other hosts, every
  // rank of a host at once: its host link carries L times the hierarchical algorithm's
  // (measured on 2 namespace hosts x 2 ranks at 1 Gbit/s, 64 MiB: hd 1207 ms, hier 564 ms).
  const double hd = m.allreduce_us(Algorithm::kHalvingDoubling, 4, 64 << 20, 2);
  const double hier64 = m.allreduce_us(Algorithm::kHierarchical, 4, 64 << 20, 2);
  EXPECT_NEAR(hd / hier64, 2.0, 0.2);
  EXPECT_NEAR(m.allreduce_us(Algorithm::kHalvingDoubling, 16, 64 << 20, 2) /
                  m.allreduce_us(Algorithm::kHierarchical, 16, 64 << 20, 2),
              8.0, 0.8);
  EXPECT_EQ(m.choose_allreduce(16, 64 << 20, false, 2), Algorithm::kHierarchical);
  auto parsed = cost::CostModel::parse(m.to_string());
  ASSERT_TRUE(parsed.has_value());
  EXPECT_DOUBLE_EQ(parsed->inter_bandwidth_gbps, 0.12);
}

// Main-memory traffic counts only for what the cache cannot hold, so small messages cost what
// they always did, and the slower memory is, the more the bytes an algorithm moves matter.
TEST(CostModel, MemoryTrafficChargesOnlyMessagesBeyondTheCache) {
  cost::LinkParams fast_memory{5.0, 5.0, 10.0}, slow_memory = fast_memory;
  slow_memory.copy_gbps = fast_memory.copy_gbps / 4;
  cost::CostModel fast(fast_memory), slow(slow_memory);
  for (Algorithm a : {Algorithm::kRing, Algorithm::kRecursiveDoubling, Algorithm::kSharedMemory}) {
    EXPECT_DOUBLE_EQ(fast.allreduce_us(a, 4, 1 << 20), slow.allreduce_us(a, 4, 1 << 20));
    EXPECT_GT(slow.allreduce_us(a, 4, 256 << 20), fast.allreduce_us(a, 4, 256 << 20));
  }
  // The ring writes 2(N-1)/N of the message through the cache, the shared-memory algorithm
  // streams it out once: slower memory widens the gap.
  const auto gap = [](const cost::CostModel& m) {
    return m.allreduce_us(Algorithm::kRing, 4, 256 << 20) -
           m.allreduce_us(Algorithm::kSharedMemory, 4, 256 << 20);
  };
  EXPECT_GT(gap(slow), gap(fast));
}

TEST(CostModel, ParsesMemoryParameters) {
  auto p = cost::CostModel::parse("copy_gbps=7.5,cache_mib=64");
  ASSERT_TRUE(p.has_value());
  EXPECT_DOUBLE_EQ(p->copy_gbps, 7.5);
  EXPECT_DOUBLE_EQ(p->cache_mib, 64);
  EXPECT_NE(cost::CostModel(*p).to_string().find("copy_gbps=7.5,cache_mib=64"), std::string::npos);
  EXPECT_FALSE(cost::CostModel::parse("copy_gbps=0"));
}

}  // namespace
}  // namespace gradsync
