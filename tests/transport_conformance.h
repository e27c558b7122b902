// The transport conformance suite: the behaviour transport.h promises, written once and run
// against every Transport implementation (inproc, shm, tcp...).
//
// To run it for a transport, include this header in exactly one test file and instantiate it
// with a factory that runs n ranks concurrently, each with its own endpoint of one group:
//
//   const TransportFactory kFactory{"tcp", [](int n, const TransportOptions& options,
//                                             const RankBody& body) { ... }};
//   INSTANTIATE_TEST_SUITE_P(Tcp, TransportConformance, ::testing::Values(kFactory),
//                            TransportFactoryName);
//
// Factory contract:
//  - Build n transports of one group of world size n (ranks 0..n-1) using `options` (the
//    factory may add what its transport needs, e.g. a token, but must keep format_tag).
//  - Call body(rank, transport) on n threads at once; rethrow the first failure after all
//    threads returned (testing::run_threads does this).
//  - Destroy the transports only after every body returned: a rank that finishes early must not
//    look like a lost peer to ranks still waiting (e.g. on a deliberate timeout).
//
// What the suite assumes beyond transport.h: a send may stay incomplete until the receiver has
// posted the matching receive (bounded buffering), so bodies post receives before they wait on
// sends. Waits use generous deadlines: a hang shows up as kTimeout rather than a stuck test.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "gradsync/error.h"
#include "harness.h"
#include "transport/transport.h"

namespace gradsync::transport {

using RankBody = std::function<void(int rank, Transport& transport)>;

struct TransportFactory {
  std::string name;  // used as the gtest parameter name: letters, digits and '_' only
  std::function<void(int n, const TransportOptions& options, const RankBody& body)> run;
};

inline void PrintTo(const TransportFactory& factory, std::ostream* os) {
  *os << factory.name;
}

// Name generator for INSTANTIATE_TEST_SUITE_P.
inline std::string TransportFactoryName(const ::testing::TestParamInfo<TransportFactory>& info) {
  return info.param.name;
}

namespace conformance {

using namespace std::chrono_literals;

// Long enough for 64 MiB under sanitizers on a loaded 2-core machine; only a hang reaches it.
constexpr auto kPatience = 60s;

inline Clock::time_point deadline() {
  return Clock::now() + kPatience;
}

// A deterministic byte pattern that differs per message (`seed`) and per position, and is not
// periodic in any power of two, so a misplaced or repeated piece shows up.
inline unsigned char pattern_byte(std::uint64_t seed, std::size_t i) {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull + i;
  x ^= x >> 29;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 32;
  return static_cast<unsigned char>(x);
}

inline std::vector<unsigned char> pattern(std::uint64_t seed, std::size_t bytes) {
  std::vector<unsigned char> v(bytes);
  for (std::size_t i = 0; i < bytes; ++i) v[i] = pattern_byte(seed, i);
  return v;
}

// Index of the first byte that differs from pattern(seed), or bytes if none.
inline std::size_t first_pattern_error(const std::vector<unsigned char>& v, std::uint64_t seed) {
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (v[i] != pattern_byte(seed, i)) return i;
  }
  return v.size();
}

inline Tag tag_of(std::uint64_t a, std::uint64_t b = 0) {
  return Tag{{a, b, 0x5eed, 0}};
}

using testing::contains;
using testing::expect_error;

}  // namespace conformance

class TransportConformance : public ::testing::TestWithParam<TransportFactory> {
 protected:
  void run(int n, const RankBody& body, const TransportOptions& options = {}) {
    GetParam().run(n, options, body);
  }
};

TEST_P(TransportConformance, ManyMessagesArriveInFifoOrder) {
  using namespace conformance;
  constexpr int kMessages = 600;
  // Mostly small messages, every 50th larger than a typical ring slot.
  auto size_of = [](int i) -> std::size_t { return i % 50 == 49 ? 300000 + i : (i * 37) % 501; };
  run(2, [&](int rank, Transport& t) {
    if (rank == 0) {
      std::vector<std::vector<unsigned char>> payloads;
      std::vector<RequestPtr> sends;
      for (int i = 0; i < kMessages; ++i) payloads.push_back(pattern(i, size_of(i)));
      for (int i = 0; i < kMessages; ++i) {
        sends.push_back(t.isend(1, tag_of(i), payloads[i].data(), payloads[i].size()));
      }
      for (auto& s : sends) s->wait(deadline());
    } else {
      // Half posted up front, half one at a time as earlier ones complete.
      std::vector<std::vector<unsigned char>> got(kMessages);
      std::vector<RequestPtr> receives;
      for (int i = 0; i < kMessages / 2; ++i) {
        got[i].resize(size_of(i));
        receives.push_back(t.irecv(0, tag_of(i), got[i].data(), got[i].size()));
      }
      for (auto& r : receives) r->wait(deadline());
      for (int i = kMessages / 2; i < kMessages; ++i) {
        got[i].resize(size_of(i));
        t.irecv(0, tag_of(i), got[i].data(), got[i].size())->wait(deadline());
      }
      for (int i = 0; i < kMessages; ++i) {
        ASSERT_EQ(first_pattern_error(got[i], i), got[i].size()) << "message " << i;
      }
    }
  });
}

TEST_P(TransportConformance, WaitingOutOfOrderStillMatchesInPostingOrder) {
  using namespace conformance;
  const std::vector<std::size_t> sizes = {1000, (1 << 20) + 3, 17, 0, 5000};
  run(2, [&](int rank, Transport& t) {
    if (rank == 0) {
      std::vector<std::vector<unsigned char>> payloads;
      std::vector<RequestPtr> sends;
      for (std::size_t i = 0; i < sizes.size(); ++i) payloads.push_back(pattern(i + 100, sizes[i]));
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        sends.push_back(t.isend(1, tag_of(i), payloads[i].data(), sizes[i]));
      }
      for (std::size_t i = sizes.size(); i-- > 0;) sends[i]->wait(deadline());
    } else {
      std::vector<std::vector<unsigned char>> got;
      std::vector<RequestPtr> receives;
      for (std::size_t i = 0; i < sizes.size(); ++i) got.emplace_back(sizes[i]);
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        receives.push_back(t.irecv(0, tag_of(i), got[i].data(), sizes[i]));
      }
      for (std::size_t i : {4, 1, 3, 0, 2}) receives[i]->wait(deadline());
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        EXPECT_TRUE(receives[i]->test());
        EXPECT_EQ(first_pattern_error(got[i], i + 100), sizes[i]) << "message " << i;
      }
    }
  });
}

TEST_P(TransportConformance, LargeMessageArrivesIntact) {
  using namespace conformance;
  // Not a multiple of any plausible slot, chunk or page size.
  constexpr std::size_t kBytes = (std::size_t{64} << 20) + 12345;
  run(2, [&](int rank, Transport& t) {
    if (rank == 0) {
      auto payload = pattern(64, kBytes);
      t.isend(1, tag_of(1), payload.data(), kBytes)->wait(deadline());
    } else {
      std::vector<unsigned char> got(kBytes);
      t.irecv(0, tag_of(1), got.data(), kBytes)->wait(deadline());
      EXPECT_EQ(first_pattern_error(got, 64), kBytes);
    }
  });
}

TEST_P(TransportConformance, ZeroLengthMessagesCarryTheirTag) {
  using namespace conformance;
  run(2, [&](int rank, Transport& t) {
    if (rank == 0) {
      unsigned char one = 42;
      t.isend(1, tag_of(1), nullptr, 0)->wait(deadline());
      t.isend(1, tag_of(2), &one, 1)->wait(deadline());
      t.isend(1, tag_of(3), nullptr, 0)->wait(deadline());
      t.isend(1, tag_of(4), nullptr, 0)->wait(deadline());  // received with a wrong tag below
    } else {
      unsigned char one = 0;
      t.irecv(0, tag_of(1), nullptr, 0)->wait(deadline());
      t.irecv(0, tag_of(2), &one, 1)->wait(deadline());
      EXPECT_EQ(one, 42);
      bool consumer_saw_bytes = false;
      t.irecv_consume(0, tag_of(3), 0, [&](const void*, std::size_t, std::size_t len) {
         consumer_saw_bytes |= len != 0;
       })->wait(deadline());
      EXPECT_FALSE(consumer_saw_bytes);
      Error e = expect_error(ErrorKind::kMismatch,
                             [&] { t.irecv(0, tag_of(5), nullptr, 0)->wait(deadline()); });
      EXPECT_TRUE(contains(e.what(), default_format_tag(tag_of(4)))) << e.what();
    }
  });
}

// What buffered_send_bytes promises: a send of that size, to a peer with nothing else queued,
// has left the caller's buffer when isend returns (the buffer is overwritten at once here), and
// arrives intact. The receiver posts only after that test, so it frees no room meanwhile.
TEST_P(TransportConformance, BufferedSendsLeaveTheCallersBufferAtOnce) {
  using namespace conformance;
  std::atomic<bool> tested{false};
  run(2, [&](int rank, Transport& t) {
    const std::size_t bytes = t.buffered_send_bytes();
    if (bytes == 0) return;  // no promise to check
    if (rank == 0) {
      auto payload = pattern(5, bytes);
      auto sent = t.isend(1, tag_of(5), payload.data(), bytes);
      EXPECT_TRUE(sent->test());
      tested = true;
      std::fill(payload.begin(), payload.end(), 0);
      sent->wait(deadline());
    } else {
      const auto until = deadline();  // a sender that failed before the test never sets it
      while (!tested && Clock::now() < until) std::this_thread::sleep_for(1ms);
      std::vector<unsigned char> got(bytes);
      t.irecv(0, tag_of(5), got.data(), bytes)->wait(deadline());
      EXPECT_EQ(first_pattern_error(got, 5), bytes);
    }
  });
}

TEST_P(TransportConformance, SimultaneousLargeSendsBothWaysDoNotDeadlock) {
  using namespace conformance;
  constexpr std::size_t kBytes = (std::size_t{32} << 20) + 7;
  run(2, [&](int rank, Transport& t) {
    int peer = 1 - rank;
    auto payload = pattern(rank, kBytes);
    std::vector<unsigned char> got(kBytes);
    // Both ranks send first and wait on their receive: only a transport that keeps the send
    // moving while the receive waits can finish.
    auto send = t.isend(peer, tag_of(9), payload.data(), kBytes);
    auto receive = t.irecv(peer, tag_of(9), got.data(), kBytes);
    receive->wait(deadline());
    send->wait(deadline());
    EXPECT_EQ(first_pattern_error(got, static_cast<std::uint64_t>(peer)), kBytes);
  });
}

TEST_P(TransportConformance, AllPairsExchangeForSeveralGroupSizes) {
  using namespace conformance;
  for (int n : {2, 3, 4, 5}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    // Sizes differ per ordered pair, some span several slots.
    auto size_of = [](int src, int dst) -> std::size_t {
      return static_cast<std::size_t>((src * 7 + dst * 3) % 5) * 200001 + src + 1;
    };
    auto seed_of = [n](int src, int dst) { return static_cast<std::uint64_t>(src * n + dst); };
    run(n, [&](int rank, Transport& t) {
      std::vector<std::vector<unsigned char>> out(n), in(n);
      std::vector<RequestPtr> receives, sends;
      for (int p = 0; p < n; ++p) {
        if (p == rank) continue;
        in[p].resize(size_of(p, rank));
        receives.push_back(t.irecv(p, tag_of(rank, p), in[p].data(), in[p].size()));
      }
      for (int p = 0; p < n; ++p) {
        if (p == rank) continue;
        out[p] = pattern(seed_of(rank, p), size_of(rank, p));
        sends.push_back(t.isend(p, tag_of(p, rank), out[p].data(), out[p].size()));
      }
      for (std::size_t i = receives.size(); i-- > 0;) receives[i]->wait(deadline());
      for (auto& s : sends) s->wait(deadline());
      for (int p = 0; p < n; ++p) {
        if (p == rank) continue;
        EXPECT_EQ(first_pattern_error(in[p], seed_of(p, rank)), in[p].size())
            << "from " << p << " to " << rank;
      }
    });
  }
}

TEST_P(TransportConformance, ConsumerGetsEveryByteInOrder) {
  using namespace conformance;
  constexpr std::size_t kBytes = (std::size_t{5} << 20) + 77;
  run(2, [&](int rank, Transport& t) {
    if (rank == 0) {
      auto first = pattern(5, kBytes);
      auto second = pattern(6, 3);
      auto a = t.isend(1, tag_of(1), first.data(), kBytes);
      auto b = t.isend(1, tag_of(2), second.data(), 3);
      a->wait(deadline());
      b->wait(deadline());
    } else {
      std::vector<unsigned char> got;
      std::size_t pieces = 0;
      bool in_order = true;
      auto consume = [&](const void* data, std::size_t offset, std::size_t len) {
        in_order &= offset == got.size();
        auto* bytes = static_cast<const unsigned char*>(data);
        got.insert(got.end(), bytes, bytes + len);
        ++pieces;
      };
      t.irecv_consume(0, tag_of(1), kBytes, consume)->wait(deadline());
      EXPECT_TRUE(in_order);
      EXPECT_GE(pieces, 1u);
      EXPECT_EQ(got.size(), kBytes);
      EXPECT_EQ(first_pattern_error(got, 5), kBytes);
      // A plain receive after a consuming one continues the same FIFO.
      std::vector<unsigned char> small(3);
      t.irecv(0, tag_of(2), small.data(), 3)->wait(deadline());
      EXPECT_EQ(first_pattern_error(small, 6), 3u);
    }
  });
}

TEST_P(TransportConformance, TagMismatchNamesBothTags) {
  using namespace conformance;
  TransportOptions options;
  options.format_tag = [](const Tag& tag) { return "call#" + std::to_string(tag.words[0]); };
  run(
      2,
      [&](int rank, Transport& t) {
        int v = 5;
        if (rank == 0) {
          t.isend(1, tag_of(7), &v, sizeof v)->wait(deadline());
        } else {
          Error e = expect_error(ErrorKind::kMismatch,
                                 [&] { t.irecv(0, tag_of(8), &v, sizeof v)->wait(deadline()); });
          EXPECT_TRUE(contains(e.what(), "call#7")) << e.what();
          EXPECT_TRUE(contains(e.what(), "call#8")) << e.what();
          EXPECT_EQ(e.peer(), 0);
        }
      },
      options);
}

// On either side of every size where a transport changes how it moves a message (inline or
// streamed, pooled), fewer bytes than expected are named with both lengths, and more with the
// expected length and the sender's or "more than" (a transport that cuts the message off may
// not learn its size); the sender's call ends too (delivered, or failed by the receiver's
// abort).
TEST_P(TransportConformance, LengthMismatchNamesBothLengths) {
  using namespace conformance;
  const std::pair<std::size_t, std::size_t> sent_expected[] = {{1000, 4096},     {4096, 1000},
                                                               {1000, 100000},   {100000, 1000},
                                                               {100000, 300000}, {300000, 100000}};
  for (const auto& [sent, expected] : sent_expected) {
    SCOPED_TRACE("sent " + std::to_string(sent) + ", expected " + std::to_string(expected));
    run(2, [&](int rank, Transport& t) {
      std::vector<unsigned char> buf(std::max(sent, expected));
      if (rank == 0) {
        try {
          t.isend(1, tag_of(3), buf.data(), sent)->wait(deadline());
        } catch (const Error& e) {
          EXPECT_TRUE(e.kind() == ErrorKind::kAborted || e.kind() == ErrorKind::kMismatch)
              << e.what();
        }
      } else {
        Error e = expect_error(ErrorKind::kMismatch, [&] {
          t.irecv(0, tag_of(3), buf.data(), expected)->wait(deadline());
        });
        EXPECT_TRUE(contains(e.what(), std::to_string(sent) + " bytes") ||
                    (sent > expected && contains(e.what(), "more than the")))
            << e.what();
        EXPECT_TRUE(contains(e.what(), std::to_string(expected) + " bytes")) << e.what();
        EXPECT_TRUE(contains(e.what(), default_format_tag(tag_of(3)))) << e.what();
      }
    });
  }
}

// A transport that finds a mismatch leaves the abort to its caller: a context names the call
// first ("mismatched call in allreduce #1"), and that name, not the transport's own, is what
// the other ranks must report.
TEST_P(TransportConformance, AMismatchIsAbortedWithTheCallersReason) {
  using namespace conformance;
  run(2, [&](int rank, Transport& t) {
    int v = 5;
    if (rank == 0) {
      t.isend(1, tag_of(7), &v, sizeof v)->wait(deadline());
      Error e = expect_error(ErrorKind::kAborted,
                             [&] { t.irecv(1, tag_of(9), &v, sizeof v)->wait(deadline()); });
      EXPECT_TRUE(contains(e.what(), "the caller's name for it")) << e.what();
    } else {
      expect_error(ErrorKind::kMismatch,
                   [&] { t.irecv(0, tag_of(8), &v, sizeof v)->wait(deadline()); });
      t.abort("the caller's name for it");
    }
  });
}

TEST_P(TransportConformance, TimeoutNamesPeerTagAndMissingBytes) {
  using namespace conformance;
  run(2, [&](int rank, Transport& t) {
    if (rank != 1) return;  // rank 0 stays silent (and its transport stays open)
    char buf[16];
    auto start = Clock::now();
    Error e = expect_error(ErrorKind::kTimeout, [&] {
      t.irecv(0, tag_of(11), buf, sizeof buf)->wait(Clock::now() + 100ms);
    });
    EXPECT_GE(Clock::now() - start, 100ms);
    EXPECT_EQ(e.peer(), 0);
    EXPECT_TRUE(contains(e.what(), "16 bytes")) << e.what();
    EXPECT_TRUE(contains(e.what(), "missing")) << e.what();
    EXPECT_TRUE(contains(e.what(), default_format_tag(tag_of(11)))) << e.what();
  });
}

TEST_P(TransportConformance, AbortReachesEveryRank) {
  using namespace conformance;
  run(3, [&](int rank, Transport& t) {
    char buf[8] = {};
    if (rank == 0) {
      // Let the others block first, so the abort has to wake them.
      std::this_thread::sleep_for(100ms);
      t.abort("disk on fire");
      Error e = expect_error(ErrorKind::kAborted,
                             [&] { t.isend(1, tag_of(1), buf, sizeof buf)->wait(deadline()); });
      EXPECT_TRUE(contains(e.what(), "disk on fire")) << e.what();
    } else {
      // Blocked on a receive nobody will send: only the abort can end it before the deadline.
      Error e = expect_error(ErrorKind::kAborted, [&] {
        t.irecv(rank == 1 ? 2 : 1, tag_of(1), buf, sizeof buf)->wait(deadline());
      });
      EXPECT_TRUE(contains(e.what(), "disk on fire")) << e.what();
      EXPECT_TRUE(contains(e.what(), "rank 0")) << e.what();
      // Sticky: later operations fail the same way.
      expect_error(ErrorKind::kAborted,
                   [&] { t.isend(0, tag_of(2), buf, sizeof buf)->wait(deadline()); });
    }
  });
}

// A message sent before another rank aborted is still received: its sender may have left the
// collective it belongs to while the receiver is still in it (a faster pair met a mismatch in
// the next call). A receive with nothing sent for it fails with the abort. (After a wait has
// failed with the abort, a transport may fail everything: shm does.)
TEST_P(TransportConformance, AMessageSentBeforeAnAbortIsStillReceived) {
  using namespace conformance;
  std::atomic<bool> sent{false}, aborted{false};
  run(3, [&](int rank, Transport& t) {
    int v = 42;
    if (rank == 0) {
      t.isend(1, tag_of(1), &v, sizeof v)->wait(deadline());
      sent = true;
    } else if (rank == 2) {
      while (!sent) std::this_thread::sleep_for(1ms);
      t.abort("rank 2 gives up");
      aborted = true;
    } else {
      // Whether or not the abort has reached this rank yet (shm: at once; tcp, ucx: a message
      // of its own), the message sent before it is received.
      while (!aborted) std::this_thread::sleep_for(1ms);
      int got = 0;
      t.irecv(0, tag_of(1), &got, sizeof got)->wait(deadline());
      EXPECT_EQ(got, 42);
      Error e = expect_error(ErrorKind::kAborted,
                             [&] { t.irecv(0, tag_of(2), &got, sizeof got)->wait(deadline()); });
      EXPECT_TRUE(contains(e.what(), "rank 2 gives up")) << e.what();
    }
  });
}

TEST_P(TransportConformance, TrafficCountersAreExact) {
  using namespace conformance;
  run(3, [&](int rank, Transport& t) {
    std::vector<unsigned char> buf(700000);
    if (rank == 0) {
      t.isend(1, tag_of(1), buf.data(), 0)->wait(deadline());
      t.isend(1, tag_of(2), buf.data(), 100)->wait(deadline());
      t.isend(1, tag_of(3), buf.data(), 700000)->wait(deadline());
      t.isend(2, tag_of(4), buf.data(), 5)->wait(deadline());
      EXPECT_EQ(t.traffic(1).bytes_sent, 700100u);
      EXPECT_EQ(t.traffic(1).messages_sent, 3u);
      EXPECT_EQ(t.traffic(2).bytes_sent, 5u);
      EXPECT_EQ(t.traffic(2).messages_sent, 1u);
      EXPECT_EQ(t.traffic(1).bytes_received, 0u);
      EXPECT_EQ(t.traffic(1).messages_received, 0u);
    } else if (rank == 1) {
      t.irecv(0, tag_of(1), buf.data(), 0)->wait(deadline());
      t.irecv(0, tag_of(2), buf.data(), 100)->wait(deadline());
      t.irecv_consume(0, tag_of(3), 700000, [](const void*, std::size_t, std::size_t) {
       })->wait(deadline());
      PeerTraffic from0 = t.traffic(0);
      EXPECT_EQ(from0.bytes_received, 700100u);
      EXPECT_EQ(from0.messages_received, 3u);
      EXPECT_EQ(from0.bytes_sent, 0u);
      EXPECT_EQ(t.traffic(2).messages_received, 0u);
    } else {
      t.irecv(0, tag_of(4), buf.data(), 5)->wait(deadline());
      EXPECT_EQ(t.traffic(0).bytes_received, 5u);
      EXPECT_EQ(t.traffic(0).messages_received, 1u);
      EXPECT_EQ(t.traffic(1).bytes_received, 0u);
    }
  });
}

TEST_P(TransportConformance, SelfAndOutOfRangePeersAreInvalid) {
  using namespace conformance;
  run(2, [&](int rank, Transport& t) {
    char buf[4] = {};
    for (int bad : {rank, -1, 2}) {
      SCOPED_TRACE("peer " + std::to_string(bad));
      expect_error(ErrorKind::kInvalidArgument,
                   [&] { t.isend(bad, tag_of(1), buf, sizeof buf)->wait(deadline()); });
      expect_error(ErrorKind::kInvalidArgument,
                   [&] { t.irecv(bad, tag_of(1), buf, sizeof buf)->wait(deadline()); });
    }
  });
}

}  // namespace gradsync::transport
