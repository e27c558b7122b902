// The C API (gradsync_c.h): tests/c_api_worker.c, a C program, runs the collective grid over
// world sizes through gradsync-run; the checks below need no peer.
#include <gtest/gtest.h>

#include <string>

#include "gradsync/gradsync_c.h"
#include "harness.h"

namespace gradsync {
namespace {

using testing::build_dir;
using testing::count_of;
using testing::run_shell;

class CApiGrid : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(CApiGrid, EveryCollectiveMatchesReference) {
  const auto [transport, n] = GetParam();
  const auto r = run_shell((transport.empty() ? "" : "GRADSYNC_TRANSPORT=" + transport + " ") +
                           build_dir() + "/tools/gradsync-run -n " + std::to_string(n) + " -- " +
                           build_dir() + "/tests/c_api_worker check 2>&1");
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "every C API check passed"), n) << r.output;
}

INSTANTIATE_TEST_SUITE_P(Worlds, CApiGrid,
                         ::testing::Values(std::tuple{"", 1}, std::tuple{"", 2}, std::tuple{"", 3},
                                           std::tuple{"", 4}, std::tuple{"", 5}, std::tuple{"", 8},
                                           std::tuple{"tcp", 3}),
                         [](const auto& p) {
                           const std::string transport = std::get<0>(p.param);
                           return (transport.empty() ? "auto" : transport) + "_n" +
                                  std::to_string(std::get<1>(p.param));
                         });

TEST(CApi, AMismatchedCallIsAnErrorCodeWithItsMessageOnEveryRank) {
  const auto r = run_shell(build_dir() + "/tools/gradsync-run -n 3 -- " + build_dir() +
                           "/tests/c_api_worker mismatch 2>&1");
  EXPECT_EQ(count_of(r.output, ": refused ("), 3) << r.output;
  // Each rank that compares its call with rank 0's sees the mismatch; the others abort.
  EXPECT_GE(count_of(r.output, "(mismatched call)"), 1) << r.output;
  EXPECT_EQ(count_of(r.output, "every C API check passed"), 3) << r.output;
}

gradsync_options world_of_one() {
  gradsync_options options = GRADSYNC_OPTIONS_INIT;
  options.rank = 0;
  options.size = 1;
  return options;
}

TEST(CApi, AWorldOfOneJoinsAndReportsItself) {
  const gradsync_options options = world_of_one();
  gradsync_comm* comm = nullptr;
  ASSERT_EQ(gradsync_init(&options, &comm), GRADSYNC_SUCCESS) << gradsync_last_error();
  int rank = -1, size = -1;
  EXPECT_EQ(gradsync_comm_rank(comm, &rank), GRADSYNC_SUCCESS);
  EXPECT_EQ(gradsync_comm_size(comm, &size), GRADSYNC_SUCCESS);
  EXPECT_EQ(rank, 0);
  EXPECT_EQ(size, 1);
  double x[3] = {1, 2, 3};
  gradsync_work* work = nullptr;
  ASSERT_EQ(gradsync_allreduce_async(comm, x, x, 3, GRADSYNC_FLOAT64, GRADSYNC_MAX, &work),
            GRADSYNC_SUCCESS);
  int done = 0;
  while (!done) ASSERT_EQ(gradsync_work_test(work, &done), GRADSYNC_SUCCESS);
  gradsync_work_free(work);
  EXPECT_EQ(x[2], 3);
  EXPECT_EQ(gradsync_comm_rank(comm, nullptr), GRADSYNC_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(testing::contains(gradsync_last_error(), "rank is NULL")) << gradsync_last_error();
  EXPECT_EQ(gradsync_allreduce(comm, x, x, 3, GRADSYNC_FLOAT64, static_cast<gradsync_op>(8)),
            GRADSYNC_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(testing::contains(gradsync_last_error(), "op 8 is not a gradsync_op"));
  // A bitwise op on floats is the C++ layer's refusal, passed through with its message.
  EXPECT_EQ(gradsync_allreduce(comm, x, x, 3, GRADSYNC_FLOAT64, GRADSYNC_BXOR),
            GRADSYNC_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(testing::contains(gradsync_last_error(), "float64")) << gradsync_last_error();
  EXPECT_EQ(gradsync_allreduce_async(comm, x, x, 3, GRADSYNC_FLOAT64, GRADSYNC_SUM, nullptr),
            GRADSYNC_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(gradsync_finalize(comm), GRADSYNC_SUCCESS);
  EXPECT_EQ(gradsync_finalize(nullptr), GRADSYNC_SUCCESS);
  gradsync_work_free(nullptr);
}

TEST(CApi, OptionsOfAnotherSizeOrOutOfRangeAreRefused) {
  gradsync_comm* comm = nullptr;
  gradsync_options options = world_of_one();
  options.struct_size = sizeof(int);
  EXPECT_EQ(gradsync_init(&options, &comm), GRADSYNC_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(testing::contains(gradsync_last_error(), "GRADSYNC_OPTIONS_INIT"))
      << gradsync_last_error();
  options.struct_size = sizeof(gradsync_options) + 8;
  EXPECT_EQ(gradsync_init(&options, &comm), GRADSYNC_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(testing::contains(gradsync_last_error(), "from a newer gradsync"))
      << gradsync_last_error();
  options = world_of_one();
  options.algorithm = static_cast<gradsync_algorithm>(99);
  EXPECT_EQ(gradsync_init(&options, &comm), GRADSYNC_ERROR_INVALID_ARGUMENT);
  EXPECT_TRUE(testing::contains(gradsync_last_error(), "not a gradsync_algorithm"));
  EXPECT_EQ(comm, nullptr);
  EXPECT_EQ(gradsync_init(&options, nullptr), GRADSYNC_ERROR_INVALID_ARGUMENT);
  // An older caller's shorter struct: the fields past its end are left to the environment.
  options = world_of_one();
  options.struct_size = offsetof(gradsync_options, master_addr);
  ASSERT_EQ(gradsync_init(&options, &comm), GRADSYNC_SUCCESS) << gradsync_last_error();
  EXPECT_EQ(gradsync_finalize(comm), GRADSYNC_SUCCESS);
}

TEST(CApi, NamesItsVersionAndResults) {
  EXPECT_STREQ(gradsync_version_string(), GRADSYNC_VERSION_STRING);
  EXPECT_STREQ(gradsync_result_string(GRADSYNC_SUCCESS), "success");
  EXPECT_STREQ(gradsync_result_string(GRADSYNC_ERROR_TIMEOUT), "timeout");
  EXPECT_STREQ(gradsync_result_string(static_cast<gradsync_result>(77)), "not a gradsync_result");
}

}  // namespace
}  // namespace gradsync
