// Inproc transport: FIFO matching, mismatch and timeout errors.
#include <gtest/gtest.h>

#include <cstring>

#include "harness.h"
#include "transport/inproc.h"

namespace gradsync::transport {
namespace {

using namespace std::chrono_literals;

TEST(InprocTransport, FifoPerPeerAndCounters) {
  testing::run_inproc_transports(2, [](int rank, Transport& t) {
    if (rank == 0) {
      int a = 1, b = 2;
      t.isend(1, Tag{{1}}, &a, sizeof a)->wait(Clock::now() + 5s);
      t.isend(1, Tag{{2}}, &b, sizeof b)->wait(Clock::now() + 5s);
      EXPECT_EQ(t.traffic(1).bytes_sent, 8u);
    } else {
      int a = 0, b = 0;
      auto ra = t.irecv(0, Tag{{1}}, &a, sizeof a);
      auto rb = t.irecv(0, Tag{{2}}, &b, sizeof b);
      rb->wait(Clock::now() + 5s);  // waiting out of order still matches in posted order
      ra->wait(Clock::now() + 5s);
      EXPECT_EQ(a, 1);
      EXPECT_EQ(b, 2);
      EXPECT_EQ(t.traffic(0).bytes_received, 8u);
    }
  });
}

TEST(InprocTransport, MismatchNamesBothTags) {
  testing::run_inproc_transports(2, [](int rank, Transport& t) {
    int v = 0;
    if (rank == 0) {
      t.isend(1, Tag{{7}}, &v, sizeof v);
    } else {
      try {
        t.irecv(0, Tag{{8}}, &v, sizeof v)->wait(Clock::now() + 5s);
        FAIL() << "mismatch not detected";
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kMismatch);
        EXPECT_NE(std::string(e.what()).find("0000000000000007"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("0000000000000008"), std::string::npos) << e.what();
      }
    }
  });
}

TEST(InprocTransport, TimeoutNamesPeerAndBytes) {
  testing::run_inproc_transports(2, [](int rank, Transport& t) {
    if (rank != 1) return;
    char buf[16];
    try {
      t.irecv(0, Tag{}, buf, sizeof buf)->wait(Clock::now() + 50ms);
      FAIL() << "no timeout";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
      EXPECT_EQ(e.peer(), 0);
      EXPECT_NE(std::string(e.what()).find("16 bytes"), std::string::npos) << e.what();
    }
  });
}

}  // namespace
}  // namespace gradsync::transport
