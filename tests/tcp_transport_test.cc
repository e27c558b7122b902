// TCP transport: the shared conformance suite, plus what only TCP has: the token
// handshake, strays and garbage on the listening port, killed peer processes, abort frames.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <thread>

#include "harness.h"
#include "rendezvous/auth.h"
#include "rendezvous/socket.h"
#include "rendezvous/store_util.h"
#include "transport/frame.h"
#include "transport/tcp.h"
#include "transport/tcp_core.h"
#include "transport_conformance.h"

namespace gradsync::transport {
namespace {

using namespace std::chrono_literals;
using conformance::contains;
using conformance::expect_error;
using conformance::first_pattern_error;
using conformance::pattern;
using conformance::tag_of;

constexpr char kToken[] = "s3cret-job-token";

TcpOptions loopback() {
  TcpOptions tcp;
  tcp.bind_addr = "127.0.0.1";  // tests never listen beyond this host
  return tcp;
}

// Builds the n transports of one group concurrently (construction is collective), runs
// `body` on n threads, and destroys the transports only after every body returned.
void run_tcp_group(int n, const TransportOptions& options, const RankBody& body,
                   std::shared_ptr<Store> store = make_inproc_store(),
                   const std::string& prefix = testing::unique_name("tcp")) {
  TransportOptions with_token = options;
  if (with_token.token.empty()) with_token.token = kToken;
  std::vector<int> group(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) group[static_cast<std::size_t>(r)] = r;
  std::vector<std::unique_ptr<Transport>> ts(static_cast<std::size_t>(n));
  testing::run_threads(n, [&](int r) {
    ts[static_cast<std::size_t>(r)] =
        make_tcp_transport(*store, prefix, r, n, group, with_token, loopback(), 20s);
  });
  testing::run_threads(n, [&](int r) { body(r, *ts[static_cast<std::size_t>(r)]); });
}

INSTANTIATE_TEST_SUITE_P(Tcp, TransportConformance,
                         ::testing::Values(TransportFactory{
                             "tcp", [](int n, const TransportOptions& o,
                                       const RankBody& b) { run_tcp_group(n, o, b); }}),
                         TransportFactoryName);

Clock::time_point soon() {
  return Clock::now() + 30s;
}

// A raw client socket to `address` ("host:port").
net::Fd raw_connect(const std::string& address) {
  auto [host, port] = net::split_host_port(address);
  return net::connect_tcp(host, port, std::chrono::steady_clock::now() + 5s, "test");
}

// True once the other side closed the connection (recv returns 0 or an error).
bool closed_within(int fd, std::chrono::milliseconds limit) {
  auto end = std::chrono::steady_clock::now() + limit;
  char buf[256];
  while (std::chrono::steady_clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return true;
  }
  return false;
}

std::vector<std::uint8_t> hello_frame(const frame::Hello& h) {
  return frame::encode_frame(frame::Type::kHello, Tag{}, frame::encode_hello(h));
}

frame::Hello stray_hello(std::uint32_t rank, std::uint32_t world) {
  return frame::Hello{rank, world, net::fresh_nonce(), "10.9.9.9:1"};
}

std::vector<std::uint8_t> proof_frame(const std::string& proof) {
  return frame::encode_frame(frame::Type::kProof, Tag{},
                             std::vector<std::uint8_t>(proof.begin(), proof.end()));
}

// The acceptor's answer to a hello on `fd`: its challenge (5 s at most).
frame::Challenge read_challenge(int fd) {
  timeval limit{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
  auto read_exactly = [&](std::uint8_t* into, std::size_t n) {
    for (std::size_t got = 0; got < n;) {
      const ssize_t r = ::recv(fd, into + got, n - got, 0);
      if (r <= 0) return false;
      got += static_cast<std::size_t>(r);
    }
    return true;
  };
  std::uint8_t hdr[frame::kHeaderBytes];
  frame::Header h;
  EXPECT_TRUE(read_exactly(hdr, sizeof hdr));
  EXPECT_EQ(frame::parse_header(hdr, frame::kDefaultMaxDataBytes, h), frame::ParseStatus::kOk);
  EXPECT_EQ(h.type, frame::Type::kChallenge);
  std::vector<std::uint8_t> payload(h.length);
  EXPECT_TRUE(read_exactly(payload.data(), payload.size()));
  return frame::parse_challenge(payload).value_or(frame::Challenge{});
}

// The proof a dialer of rank `rank` with `token` gives for a challenge to its hello.
std::string dialer_proof(const std::string& token, const frame::Hello& h, const frame::Challenge& c,
                         int acceptor) {
  return net::prove(token, tcp::kDialerRole, h.nonce, c.nonce, tcp::binding(h.rank, acceptor));
}

// Every rank of the 3-rank group `ts` sends each other rank 100000 bytes of its own pattern,
// and every byte arrives: the group formed whole, whatever else reached its listeners.
void expect_every_pair_exchanges(std::vector<std::unique_ptr<Transport>>& ts) {
  testing::run_threads(3, [&](int r) {
    Transport& t = *ts[static_cast<std::size_t>(r)];
    std::vector<RequestPtr> reqs;
    std::vector<std::vector<unsigned char>> in(3), out(3);
    for (int p = 0; p < 3; ++p) {
      if (p == r) continue;
      in[static_cast<std::size_t>(p)].resize(100000);
      out[static_cast<std::size_t>(p)] = pattern(static_cast<std::uint64_t>(r * 3 + p), 100000);
      reqs.push_back(t.irecv(p, tag_of(1), in[static_cast<std::size_t>(p)].data(), 100000));
      reqs.push_back(t.isend(p, tag_of(1), out[static_cast<std::size_t>(p)].data(), 100000));
    }
    for (auto& q : reqs) q->wait(soon());
    for (int p = 0; p < 3; ++p) {
      if (p == r) continue;
      EXPECT_EQ(first_pattern_error(in[static_cast<std::size_t>(p)],
                                    static_cast<std::uint64_t>(p * 3 + r)),
                100000u);
    }
  });
}

TEST(TcpTransport, StraysWithWrongTokenOrGarbageAreRefusedWithoutDisturbingTheJob) {
  // Rank 2 only accepts (lower ranks dial higher). Strays hit its port first; the real
  // ranks 0 and 1 start dialing only after every stray has been refused or parked.
  auto store = make_inproc_store();
  std::string prefix = testing::unique_name("strays");
  std::atomic<bool> strays_done{false};
  std::vector<int> group = {0, 1, 2};
  TransportOptions options;
  options.token = kToken;
  std::vector<std::unique_ptr<Transport>> ts(3);
  std::thread stray([&] {
    Bytes addr = store->get(prefix + "/tcp/2", 10000ms);
    std::string address(addr.begin(), addr.end());
    // 1. A valid hello, then the proof of the wrong token.
    net::Fd wrong = raw_connect(address);
    const frame::Hello wrong_hello = stray_hello(0, 3);
    auto f = hello_frame(wrong_hello);
    ASSERT_TRUE(net::write_all(wrong.get(), f.data(), f.size()));
    f = proof_frame(dialer_proof("not-the-token", wrong_hello, read_challenge(wrong.get()), 2));
    ASSERT_TRUE(net::write_all(wrong.get(), f.data(), f.size()));
    // 2. Bytes that are not a frame at all.
    net::Fd garbage = raw_connect(address);
    std::string junk = "GET / HTTP/1.1\r\nHost: x\r\n\r\n and some more bytes to fill a header";
    ASSERT_TRUE(net::write_all(garbage.get(), junk.data(), junk.size()));
    // 3. A well-formed header declaring an oversized hello.
    net::Fd oversized = raw_connect(address);
    std::uint8_t hdr[frame::kHeaderBytes];
    frame::encode_header(frame::Header{frame::Type::kHello, Tag{}, std::uint64_t{1} << 40}, hdr);
    ASSERT_TRUE(net::write_all(oversized.get(), hdr, sizeof hdr));
    // 4. A data frame before any hello.
    net::Fd data_first = raw_connect(address);
    frame::encode_header(frame::Header{frame::Type::kData, Tag{}, 4}, hdr);
    ASSERT_TRUE(net::write_all(data_first.get(), hdr, sizeof hdr));
    // 5. The right token but a rank that is no peer.
    net::Fd bad_rank = raw_connect(address);
    const frame::Hello rank_seven = stray_hello(7, 3);
    f = hello_frame(rank_seven);
    ASSERT_TRUE(net::write_all(bad_rank.get(), f.data(), f.size()));
    f = proof_frame(dialer_proof(kToken, rank_seven, read_challenge(bad_rank.get()), 2));
    ASSERT_TRUE(net::write_all(bad_rank.get(), f.data(), f.size()));
    // 6. A connection that never says anything: must not block the real peers.
    net::Fd silent = raw_connect(address);
    EXPECT_TRUE(closed_within(wrong.get(), 5000ms));
    EXPECT_TRUE(closed_within(garbage.get(), 5000ms));
    EXPECT_TRUE(closed_within(oversized.get(), 5000ms));
    EXPECT_TRUE(closed_within(data_first.get(), 5000ms));
    EXPECT_TRUE(closed_within(bad_rank.get(), 5000ms));
    strays_done = true;
    // Keep the silent one open until the group has formed.
    store->get(prefix + "/formed", 30000ms);
  });
  testing::run_threads(3, [&](int r) {
    if (r != 2) {
      while (!strays_done) std::this_thread::sleep_for(5ms);
    }
    ts[static_cast<std::size_t>(r)] =
        make_tcp_transport(*store, prefix, r, 3, group, options, loopback(), 20s);
  });
  store->set(prefix + "/formed", {});
  stray.join();
  expect_every_pair_exchanges(ts);
}

// Hundreds of junk connections reach rank 2's listener before any real peer dials: silent
// ones (more than the listener holds unidentified at once), garbage, an oversized hello,
// half a header. Each costs junk its place, never a real peer's: the group forms, the data
// arrives intact, and every junk connection is refused (and counted) rather than taken for a
// peer.
TEST(TcpTransport, FloodOfJunkConnectionsNeverCostsARealPeerItsPlace) {
  auto store = make_inproc_store();
  std::string prefix = testing::unique_name("flood");
  std::atomic<bool> flooded{false};
  std::vector<int> group = {0, 1, 2};
  TransportOptions options;
  options.token = kToken;
  std::vector<std::unique_ptr<Transport>> ts(3);
  constexpr int kSilent = 400, kGarbage = 50, kOversized = 50, kHalfHeader = 20;
  constexpr int kJunk = kSilent + kGarbage + kOversized + kHalfHeader;
  ::testing::internal::CaptureStderr();
  std::thread flood([&] {
    Bytes addr = store->get(prefix + "/tcp/2", 10000ms);
    std::string address(addr.begin(), addr.end());
    std::vector<net::Fd> junk;
    for (int i = 0; i < kSilent; ++i) junk.push_back(raw_connect(address));
    const std::string garbage(200, 'x');
    for (int i = 0; i < kGarbage; ++i) {
      junk.push_back(raw_connect(address));
      EXPECT_TRUE(net::write_all(junk.back().get(), garbage.data(), garbage.size()));
    }
    std::uint8_t hdr[frame::kHeaderBytes];
    frame::encode_header(frame::Header{frame::Type::kHello, Tag{}, std::uint64_t{1} << 40}, hdr);
    for (int i = 0; i < kOversized; ++i) {
      junk.push_back(raw_connect(address));
      EXPECT_TRUE(net::write_all(junk.back().get(), hdr, sizeof hdr));
    }
    frame::encode_header(frame::Header{frame::Type::kHello, Tag{}, 100}, hdr);
    for (int i = 0; i < kHalfHeader; ++i) {
      junk.push_back(raw_connect(address));
      EXPECT_TRUE(net::write_all(junk.back().get(), hdr, frame::kHeaderBytes / 2));
    }
    flooded = true;
    store->get(prefix + "/formed", 30000ms);  // junk stays open until the group formed
  });
  std::string setup_error;
  try {
    testing::run_threads(3, [&](int r) {
      if (r != 2) {
        while (!flooded) std::this_thread::sleep_for(5ms);
      }
      ts[static_cast<std::size_t>(r)] =
          make_tcp_transport(*store, prefix, r, 3, group, options, loopback(), 20s);
    });
  } catch (const Error& e) {
    setup_error = e.what();
  }
  store->set(prefix + "/formed", {});
  flood.join();
  ASSERT_EQ(setup_error, "");
  expect_every_pair_exchanges(ts);
  ts.clear();
  const std::string log = ::testing::internal::GetCapturedStderr();
  // Every junk connection refused exactly once: none of them became a peer.
  EXPECT_TRUE(contains(log, "rank 2: refused " + std::to_string(kJunk) + " tcp connections in all"))
      << log;
  EXPECT_TRUE(contains(log, "evicted without a complete hello")) << log;
}

// What crosses the network proves the token without carrying it, and a captured exchange is
// useless on a new connection: the acceptor's nonce is new, so the old proof does not hold.
TEST(TcpTransport, ACapturedHandshakeReplayedIsRefusedAndNeverCarriesTheToken) {
  auto store = make_inproc_store();
  std::string prefix = testing::unique_name("replay");
  std::atomic<bool> replayed{false};
  std::vector<int> group = {0, 1, 2};
  TransportOptions options;
  options.token = kToken;
  std::vector<std::unique_ptr<Transport>> ts(3);
  ::testing::internal::CaptureStderr();
  std::thread thief([&] {
    Bytes addr = store->get(prefix + "/tcp/2", 10000ms);
    std::string address(addr.begin(), addr.end());
    // What rank 0 would send: its hello, then its proof for the challenge it got.
    const frame::Hello hello = stray_hello(0, 3);
    const auto captured_hello = hello_frame(hello);
    net::Fd first = raw_connect(address);
    ASSERT_TRUE(net::write_all(first.get(), captured_hello.data(), captured_hello.size()));
    const frame::Challenge challenge = read_challenge(first.get());
    const auto captured_proof = proof_frame(dialer_proof(kToken, hello, challenge, 2));
    first.reset();  // the capture is all the thief keeps
    const std::string wire(captured_hello.begin(), captured_hello.end());
    EXPECT_EQ(wire.find(kToken), std::string::npos);
    EXPECT_EQ(std::string(captured_proof.begin(), captured_proof.end()).find(kToken),
              std::string::npos);
    // The replay: the same hello and proof on a new connection.
    net::Fd replay = raw_connect(address);
    ASSERT_TRUE(net::write_all(replay.get(), captured_hello.data(), captured_hello.size()));
    const frame::Challenge fresh = read_challenge(replay.get());
    EXPECT_NE(fresh.nonce, challenge.nonce);
    ASSERT_TRUE(net::write_all(replay.get(), captured_proof.data(), captured_proof.size()));
    EXPECT_TRUE(closed_within(replay.get(), 5000ms));
    replayed = true;
  });
  testing::run_threads(3, [&](int r) {
    if (r != 2) {
      while (!replayed) std::this_thread::sleep_for(5ms);
    }
    ts[static_cast<std::size_t>(r)] =
        make_tcp_transport(*store, prefix, r, 3, group, options, loopback(), 20s);
  });
  thief.join();
  expect_every_pair_exchanges(ts);
  ts.clear();
  const std::string log = ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(contains(log, "wrong job token: its proof of the token does not hold")) << log;
}

TEST(TcpTransport, MismatchedTokensFailSetupNamingThePeer) {
  auto store = make_inproc_store();
  std::string prefix = testing::unique_name("tokens");
  std::vector<int> group = {0, 1};
  std::vector<std::string> errors(2);
  testing::run_threads(2, [&](int r) {
    TransportOptions options;
    options.token = r == 0 ? "token-a" : "token-b";
    try {
      make_tcp_transport(*store, prefix, r, 2, group, options, loopback(), 1500ms);
    } catch (const Error& e) {
      errors[static_cast<std::size_t>(r)] = e.what();
    }
  });
  // Rank 0 dialed and refused rank 1's proof; rank 1 waited for a rank 0 that never proved
  // the token.
  EXPECT_TRUE(contains(errors[0], "rank 1")) << errors[0];
  EXPECT_TRUE(contains(errors[0], "wrong job token")) << errors[0];
  EXPECT_TRUE(contains(errors[0], "127.0.0.1:")) << errors[0];
  EXPECT_TRUE(contains(errors[1], "rank 0")) << errors[1];
}

TEST(TcpTransport, ConnectTimeoutNamesHostAndPort) {
  auto store = make_inproc_store();
  std::string prefix = testing::unique_name("refused");
  int closed_port;
  {
    net::Fd l = net::listen_tcp("127.0.0.1", 0, false);
    closed_port = net::local_port(l.get());
  }  // closed: connecting there is refused
  store->set(prefix + "/tcp/1", to_bytes("127.0.0.1:" + std::to_string(closed_port)));
  TransportOptions options;
  options.token = kToken;
  Error e = expect_error(ErrorKind::kTimeout, [&] {
    make_tcp_transport(*store, prefix, 0, 2, {0, 1}, options, loopback(), 300ms);
  });
  EXPECT_TRUE(contains(e.what(), "127.0.0.1:" + std::to_string(closed_port))) << e.what();
  EXPECT_EQ(e.peer(), 1);
}

TEST(TcpTransport, MissingAddressNamesThePeer) {
  auto store = make_inproc_store();
  TransportOptions options;
  options.token = kToken;
  Error e = expect_error(ErrorKind::kTimeout, [&] {
    make_tcp_transport(*store, testing::unique_name("absent"), 0, 2, {0, 1}, options, loopback(),
                       200ms);
  });
  EXPECT_EQ(e.peer(), 1);
  EXPECT_TRUE(contains(e.what(), "/tcp/1")) << e.what();
}

TEST(TcpTransport, SubgroupAddressesPeersByGlobalRank) {
  // World of 5, a transport over ranks {1, 3, 4} only.
  auto store = make_inproc_store();
  std::string prefix = testing::unique_name("subgroup");
  std::vector<int> group = {1, 3, 4};
  TransportOptions options;
  options.token = kToken;
  std::vector<std::unique_ptr<Transport>> ts(3);
  testing::run_threads(3, [&](int i) {
    ts[static_cast<std::size_t>(i)] = make_tcp_transport(
        *store, prefix, group[static_cast<std::size_t>(i)], 5, group, options, loopback(), 20s);
  });
  testing::run_threads(3, [&](int i) {
    Transport& t = *ts[static_cast<std::size_t>(i)];
    int me = group[static_cast<std::size_t>(i)];
    EXPECT_EQ(t.rank(), me);
    EXPECT_EQ(t.size(), 5);
    int v = me * 10, got = -1;
    int next = group[static_cast<std::size_t>((i + 1) % 3)];
    int prev = group[static_cast<std::size_t>((i + 2) % 3)];
    auto r = t.irecv(prev, tag_of(2), &got, sizeof got);
    t.isend(next, tag_of(2), &v, sizeof v)->wait(soon());
    r->wait(soon());
    EXPECT_EQ(got, prev * 10);
    expect_error(ErrorKind::kInvalidArgument, [&] { t.isend(0, tag_of(2), &v, sizeof v); });
  });
}

TEST(TcpTransport, LargeTransferBothWaysAt64MiB) {
  constexpr std::size_t kBytes = std::size_t{64} << 20;
  run_tcp_group(2, {}, [&](int rank, Transport& t) {
    int peer = 1 - rank;
    auto out = pattern(static_cast<std::uint64_t>(rank) + 40, kBytes);
    std::vector<unsigned char> in(kBytes);
    auto r = t.irecv(peer, tag_of(3), in.data(), kBytes);
    auto s = t.isend(peer, tag_of(3), out.data(), kBytes);
    s->wait(soon());
    r->wait(soon());
    EXPECT_EQ(first_pattern_error(in, static_cast<std::uint64_t>(peer) + 40), kBytes);
    EXPECT_EQ(t.traffic(peer).bytes_sent, kBytes);
    EXPECT_EQ(t.traffic(peer).bytes_received, kBytes);
  });
}

TEST(TcpTransport, ReceivePostedWhileUnexpectedMessageStreamsIn) {
  // The sender starts a big message before the receive exists; the receive, posted late,
  // must take over mid-stream and still see every byte in place, then a later message.
  constexpr std::size_t kBytes = (std::size_t{24} << 20) + 5;
  run_tcp_group(2, {}, [&](int rank, Transport& t) {
    if (rank == 0) {
      auto big = pattern(7, kBytes);
      auto small = pattern(8, 33);
      auto a = t.isend(1, tag_of(1), big.data(), kBytes);
      auto b = t.isend(1, tag_of(2), small.data(), small.size());
      a->wait(soon());
      b->wait(soon());
    } else {
      std::this_thread::sleep_for(20ms);
      std::vector<unsigned char> big(kBytes), small(33);
      auto b = t.irecv(0, tag_of(1), big.data(), kBytes);
      b->wait(soon());
      t.irecv(0, tag_of(2), small.data(), small.size())->wait(soon());
      EXPECT_EQ(first_pattern_error(big, 7), kBytes);
      EXPECT_EQ(first_pattern_error(small, 8), 33u);
    }
  });
}

TEST(TcpTransport, DroppedRequestsKeepTheStreamInStep) {
  // A send whose request is destroyed before completing is still delivered, from a copy
  // taken at that moment; a receive dropped after a timeout keeps its FIFO slot, and its
  // message is discarded rather than written to the freed buffer.
  constexpr std::size_t kBytes = std::size_t{16} << 20;
  std::atomic<bool> receive_timed_out{false};
  run_tcp_group(2, {}, [&](int rank, Transport& t) {
    if (rank == 0) {
      auto buf = pattern(1, kBytes);
      t.isend(1, tag_of(1), buf.data(), kBytes).reset();  // dropped at once
      std::fill(buf.begin(), buf.end(), 0xEE);            // must not reach the peer
      Bytes late(1000, 0x42);
      receive_timed_out.wait(false);  // sent only once rank 1's receive for it timed out
      t.isend(1, tag_of(2), late.data(), late.size())->wait(soon());
      int last = 77;
      t.isend(1, tag_of(3), &last, sizeof last)->wait(soon());
    } else {
      std::vector<unsigned char> got(kBytes);
      t.irecv(0, tag_of(1), got.data(), kBytes)->wait(soon());
      EXPECT_EQ(first_pattern_error(got, 1), kBytes);
      {
        auto dropped = std::make_unique<std::vector<unsigned char>>(1000);
        auto r = t.irecv(0, tag_of(2), dropped->data(), 1000);
        expect_error(ErrorKind::kTimeout, [&] { r->wait(Clock::now() + 50ms); });
        r.reset();
        dropped.reset();  // freed: the transport must not write here any more
        receive_timed_out = true;
        receive_timed_out.notify_all();
      }
      int last = 0;
      t.irecv(0, tag_of(3), &last, sizeof last)->wait(soon());
      EXPECT_EQ(last, 77);
    }
  });
}

TEST(TcpTransport, TestPollsToCompletion) {
  run_tcp_group(2, {}, [&](int rank, Transport& t) {
    std::uint64_t v = rank == 0 ? 0xABCDEF : 0;
    RequestPtr r =
        rank == 0 ? t.isend(1, tag_of(4), &v, sizeof v) : t.irecv(0, tag_of(4), &v, sizeof v);
    auto end = Clock::now() + 30s;
    while (!r->test()) {
      ASSERT_LT(Clock::now(), end) << "test() never reported completion";
      std::this_thread::sleep_for(100us);
    }
    EXPECT_EQ(v, 0xABCDEFu);
  });
}

TEST(TcpTransport, ManySmallMessagesAllToAll) {
  constexpr int kMessages = 2000;
  run_tcp_group(4, {}, [&](int rank, Transport& t) {
    std::vector<std::uint32_t> out(kMessages), in(static_cast<std::size_t>(4 * kMessages));
    for (int i = 0; i < kMessages; ++i)
      out[static_cast<std::size_t>(i)] = static_cast<std::uint32_t>(rank * 100000 + i);
    std::vector<RequestPtr> reqs;
    for (int i = 0; i < kMessages; ++i) {
      for (int p = 0; p < 4; ++p) {
        if (p == rank) continue;
        reqs.push_back(t.irecv(p, tag_of(i), &in[static_cast<std::size_t>(p * kMessages + i)], 4));
        reqs.push_back(t.isend(p, tag_of(i), &out[static_cast<std::size_t>(i)], 4));
      }
    }
    for (auto& r : reqs) r->wait(soon());
    for (int p = 0; p < 4; ++p) {
      if (p == rank) continue;
      for (int i = 0; i < kMessages; ++i) {
        ASSERT_EQ(in[static_cast<std::size_t>(p * kMessages + i)],
                  static_cast<std::uint32_t>(p * 100000 + i));
      }
      EXPECT_EQ(t.traffic(p).messages_received, static_cast<std::uint64_t>(kMessages));
    }
  });
}

TEST(TcpTransport, AbortInterruptsLargeSendsAndCarriesReason) {
  // Rank 0 aborts while a large send to rank 1 is half written; the stream must stay in
  // step so rank 1 still decodes the abort frame after the rest of that message.
  constexpr std::size_t kBytes = std::size_t{48} << 20;
  run_tcp_group(2, {}, [&](int rank, Transport& t) {
    if (rank == 0) {
      auto buf = std::make_unique<std::vector<unsigned char>>(kBytes, 1);
      auto s = t.isend(1, tag_of(1), buf->data(), kBytes);
      t.abort("numerics exploded");
      expect_error(ErrorKind::kAborted, [&] { s->wait(soon()); });
      s.reset();
      buf.reset();  // the transport must have taken a copy of what it still had to send
    } else {
      // The big message either went out whole (its header had left before the abort) or
      // not at all; either way the abort frame that follows must be decoded.
      std::vector<unsigned char> big(kBytes);
      try {
        t.irecv(0, tag_of(1), big.data(), kBytes)->wait(soon());
        EXPECT_EQ(big[kBytes - 1], 1);
      } catch (const Error& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kAborted) << e.what();
      }
      std::vector<unsigned char> never(8);
      Error e = expect_error(ErrorKind::kAborted,
                             [&] { t.irecv(0, tag_of(9), never.data(), 8)->wait(soon()); });
      EXPECT_TRUE(contains(e.what(), "numerics exploded")) << e.what();
      EXPECT_TRUE(contains(e.what(), "rank 0")) << e.what();
    }
  });
}

// A receive posted before another rank's abort, whose message is in the kernel but unread
// when the abort frame is read (the socket parked since the last wait: nobody reads it until
// the next wait or the loop's reclaim), still completes: the abort reads what arrived first.
TEST(TcpTransport, AnAbortFirstReadsWhatArrivedForAPostedReceive) {
  std::atomic<bool> posted{false}, sent{false};
  run_tcp_group(3, {}, [&](int rank, Transport& t) {
    int v = 42;
    if (rank == 0) {
      t.isend(1, tag_of(1), &v, sizeof v)->wait(soon());
      while (!posted) std::this_thread::sleep_for(1ms);
      t.isend(1, tag_of(2), &v, sizeof v)->wait(soon());
      sent = true;
    } else if (rank == 2) {
      while (!sent) std::this_thread::sleep_for(1ms);
      t.abort("rank 2 gives up");
    } else {
      int first = 0, got = 0;
      t.irecv(0, tag_of(1), &first, sizeof first)->wait(soon());  // parks rank 0's socket
      auto r = t.irecv(0, tag_of(2), &got, sizeof got);
      posted = true;
      // Learns of the abort by sending, not by a wait, which would read the parked socket.
      for (bool aborted = false; !aborted;) {
        try {
          t.isend(2, tag_of(9), &v, sizeof v);
          std::this_thread::sleep_for(100us);
        } catch (const Error& e) {
          EXPECT_EQ(e.kind(), ErrorKind::kAborted) << e.what();
          aborted = true;
        }
      }
      r->wait(soon());
      EXPECT_EQ(got, 42);
    }
  });
}

TEST(TcpTransport, AbortReachesPeersEvenIfTheAborterExitsAtOnce) {
  auto store = make_inproc_store();
  std::string prefix = testing::unique_name("abort-exit");
  TransportOptions options;
  options.token = kToken;
  std::vector<std::unique_ptr<Transport>> ts(3);
  testing::run_threads(3, [&](int r) {
    ts[static_cast<std::size_t>(r)] =
        make_tcp_transport(*store, prefix, r, 3, {0, 1, 2}, options, loopback(), 20s);
  });
  testing::run_threads(3, [&](int r) {
    if (r == 0) {
      std::vector<unsigned char> big(std::size_t{32} << 20, 3);
      auto s = ts[0]->isend(1, tag_of(1), big.data(), big.size());
      ts[0]->abort("out of memory on rank 0");
      s.reset();
      ts[0].reset();  // gone right after the abort: the frame must still get out
      return;
    }
    std::vector<unsigned char> buf(std::size_t{32} << 20);
    Transport& t = *ts[static_cast<std::size_t>(r)];
    try {
      if (r == 1) t.irecv(0, tag_of(1), buf.data(), buf.size())->wait(soon());
      t.irecv(0, tag_of(2), buf.data(), 8)->wait(soon());
      ADD_FAILURE() << "rank " << r << " saw no abort";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kAborted) << e.what();
      EXPECT_TRUE(contains(e.what(), "out of memory on rank 0")) << e.what();
    }
  });
}

TEST(TcpTransport, ConsumingReceiveReadsWhereTheBytesLanded) {
  // Posted after the message has fully arrived, and posted before it is sent.
  constexpr std::size_t kBytes = (std::size_t{3} << 20) + 11;
  run_tcp_group(2, {}, [&](int rank, Transport& t) {
    if (rank == 0) {
      auto a = pattern(21, kBytes), b = pattern(22, kBytes);
      t.isend(1, tag_of(1), a.data(), kBytes)->wait(soon());
      char go = 0;
      t.irecv(1, tag_of(9), &go, 1)->wait(soon());
      t.isend(1, tag_of(2), b.data(), kBytes)->wait(soon());
      t.isend(1, tag_of(4), b.data(), 5)->wait(soon());
    } else {
      std::this_thread::sleep_for(50ms);  // let message 1 arrive whole first
      auto collect = [](std::vector<unsigned char>& out) {
        return [&out](const void* data, std::size_t offset, std::size_t len) {
          if (out.size() < offset + len) out.resize(offset + len);
          std::memcpy(out.data() + offset, data, len);
        };
      };
      std::vector<unsigned char> first, second;
      t.irecv_consume(0, tag_of(1), kBytes, collect(first))->wait(soon());
      auto r = t.irecv_consume(0, tag_of(2), kBytes, collect(second));
      char go = 1;
      t.isend(0, tag_of(9), &go, 1)->wait(soon());
      r->wait(soon());
      EXPECT_EQ(first_pattern_error(first, 21), kBytes);
      EXPECT_EQ(first_pattern_error(second, 22), kBytes);
      // A mismatched consuming receive fails and never calls the consumer.
      bool called = false;
      expect_error(ErrorKind::kMismatch, [&] {
        t.irecv_consume(0, tag_of(3), 5, [&](const void*, std::size_t, std::size_t) {
           called = true;
         })->wait(soon());
      });
      EXPECT_FALSE(called);
    }
  });
}

// A socket a waiting caller has read stays with callers between waits (the loop thread
// does not read it), so bytes that arrive early wait in the kernel for the next wait. A rank
// that then stays out of the transport must still let a peer's large send complete.
TEST(TcpTransport, SendCompletesWhileTheReceiverStaysOutOfTheTransport) {
  constexpr std::size_t kBytes = std::size_t{48} << 20;  // far beyond the socket buffers
  std::atomic<bool> sent{false};
  run_tcp_group(2, {}, [&](int rank, Transport& t) {
    int v = 0;
    if (rank == 0) {
      t.isend(1, tag_of(1), &v, sizeof v)->wait(soon());
      auto big = pattern(3, kBytes);
      t.isend(1, tag_of(2), big.data(), kBytes)->wait(soon());
      sent = true;
    } else {
      t.irecv(0, tag_of(1), &v, sizeof v)->wait(soon());  // this thread read the socket
      auto end = Clock::now() + 30s;
      while (!sent && Clock::now() < end) std::this_thread::sleep_for(1ms);  // busy elsewhere
      EXPECT_TRUE(sent) << "the send completed only once its receiver came back";
      std::vector<unsigned char> got(kBytes);
      t.irecv(0, tag_of(2), got.data(), kBytes)->wait(soon());
      EXPECT_EQ(first_pattern_error(got, 3), kBytes);
    }
  });
}

// Rank 1 waits on rank 2, whose message depends on rank 0's large send to rank 1 completing
// first. That send can only complete if rank 1's wait on rank 2 also reads rank 0's socket,
// which rank 1's own earlier wait left with callers.
TEST(TcpTransport, WaitOnOnePeerKeepsReadingTheOthers) {
  constexpr std::size_t kBytes = std::size_t{32} << 20;
  run_tcp_group(3, {}, [&](int rank, Transport& t) {
    int v = 7;
    if (rank == 0) {
      t.isend(1, tag_of(1), &v, sizeof v)->wait(soon());
      auto big = pattern(4, kBytes);
      t.isend(1, tag_of(2), big.data(), kBytes)->wait(soon());
      t.isend(2, tag_of(3), &v, sizeof v)->wait(soon());
    } else if (rank == 1) {
      t.irecv(0, tag_of(1), &v, sizeof v)->wait(soon());
      int from2 = 0;
      t.irecv(2, tag_of(4), &from2, sizeof from2)->wait(soon());
      EXPECT_EQ(from2, 9);
      std::vector<unsigned char> got(kBytes);
      t.irecv(0, tag_of(2), got.data(), kBytes)->wait(soon());
      EXPECT_EQ(first_pattern_error(got, 4), kBytes);
    } else {
      t.irecv(0, tag_of(3), &v, sizeof v)->wait(soon());
      int nine = 9;
      t.isend(1, tag_of(4), &nine, sizeof nine)->wait(soon());
    }
  });
}

// Two threads of one rank exchange with two different peers at once, each waiting on its
// own requests: each may be the one doing the other's socket I/O at times.
TEST(TcpTransport, ConcurrentCallersOnOneTransport) {
  constexpr int kRounds = 150;
  auto size_of = [](int i) -> std::size_t { return i % 10 == 9 ? 300000 + i : (i * 131) % 5000; };
  run_tcp_group(3, {}, [&](int rank, Transport& t) {
    auto exchange = [&](int peer) {
      for (int i = 0; i < kRounds; ++i) {
        std::vector<unsigned char> got(size_of(i));
        auto out = pattern(static_cast<std::uint64_t>(rank * 1000 + i), size_of(i));
        auto r = t.irecv(peer, tag_of(static_cast<std::uint64_t>(i)), got.data(), got.size());
        auto s = t.isend(peer, tag_of(static_cast<std::uint64_t>(i)), out.data(), out.size());
        if (i % 2) {
          s->wait(soon());
          r->wait(soon());
        } else {
          r->wait(soon());
          s->wait(soon());
        }
        ASSERT_EQ(first_pattern_error(got, static_cast<std::uint64_t>(peer * 1000 + i)), got.size())
            << "rank " << rank << " from " << peer << " round " << i;
      }
    };
    if (rank == 0) {
      std::thread other([&] { exchange(2); });
      exchange(1);
      other.join();
    } else {
      exchange(0);
    }
  });
}

// Buffers of messages that arrive before their receive are recycled; many messages of many
// sizes, received late by plain and consuming receives, must each keep their own bytes.
TEST(TcpTransport, EarlyMessagesOfManySizesKeepTheirBytes) {
  constexpr int kMessages = 40;
  auto size_of = [](int i) -> std::size_t {
    return 40000 + static_cast<std::size_t>(i % 7) * 150001 + i;
  };
  run_tcp_group(2, {}, [&](int rank, Transport& t) {
    for (int round = 0; round < 3; ++round) {
      if (rank == 0) {
        std::vector<std::vector<unsigned char>> out;
        std::vector<RequestPtr> sends;
        for (int i = 0; i < kMessages; ++i)
          out.push_back(pattern(static_cast<std::uint64_t>(round * 100 + i), size_of(i)));
        for (int i = 0; i < kMessages; ++i)
          sends.push_back(
              t.isend(1, tag_of(static_cast<std::uint64_t>(i)), out[i].data(), out[i].size()));
        for (auto& s : sends) s->wait(soon());
        char go = 0;
        t.irecv(1, tag_of(99), &go, 1)->wait(soon());  // keep `out` alive until all arrived
      } else {
        std::this_thread::sleep_for(30ms);  // most messages arrive before their receive
        for (int i = 0; i < kMessages; ++i) {
          std::vector<unsigned char> got;
          if (i % 2) {
            got.resize(size_of(i));
            t.irecv(0, tag_of(static_cast<std::uint64_t>(i)), got.data(), got.size())->wait(soon());
          } else {
            t.irecv_consume(0, tag_of(static_cast<std::uint64_t>(i)), size_of(i),
                            [&](const void* data, std::size_t offset, std::size_t len) {
                              if (got.size() < offset + len) got.resize(offset + len);
                              std::memcpy(got.data() + offset, data, len);
                            })
                ->wait(soon());
          }
          ASSERT_EQ(got.size(), size_of(i));
          ASSERT_EQ(first_pattern_error(got, static_cast<std::uint64_t>(round * 100 + i)),
                    got.size())
              << "round " << round << " message " << i;
        }
        char go = 1;
        t.isend(0, tag_of(99), &go, 1)->wait(soon());
      }
    }
  });
}

// Peer death across real processes: rank 2 is SIGKILLed after the group formed; the other
// ranks' pending and later operations with it fail as kPeerLost naming it and its address,
// while they can still talk to each other.
TEST(TcpTransport, KilledPeerProcessIsReportedAsPeerLost) {
  testing::TempDir dir;
  std::string prefix = testing::unique_name("kill");
  auto status = testing::run_processes(3, [&](int rank) -> int {
    auto store = make_file_store(dir.path());
    TransportOptions options;
    options.token = kToken;
    auto t = make_tcp_transport(*store, prefix, rank, 3, {0, 1, 2}, options, loopback(), 20s);
    // One round so every connection is known to work before the kill.
    int v = rank, got = -1;
    for (int p = 0; p < 3; ++p) {
      if (p == rank) continue;
      auto r = t->irecv(p, tag_of(1), &got, sizeof got);
      t->isend(p, tag_of(1), &v, sizeof v)->wait(soon());
      r->wait(soon());
    }
    if (rank == 2) {
      store->set(prefix + "/armed", {});
      ::raise(SIGKILL);
    }
    store->get(prefix + "/armed", 10000ms);
    std::vector<unsigned char> buf(1 << 20);
    try {
      // Bounded by 2 s: the loss must be noticed well before a timeout would fire.
      t->irecv(2, tag_of(2), buf.data(), buf.size())->wait(Clock::now() + 2s);
      std::fprintf(stderr, "rank %d: receive from the killed rank succeeded\n", rank);
      return 10;
    } catch (const Error& e) {
      std::string what = e.what();
      if (e.kind() != ErrorKind::kPeerLost || e.peer() != 2 || !contains(what, "rank 2") ||
          !contains(what, "127.0.0.1:")) {
        std::fprintf(stderr, "rank %d: wrong error: %s\n", rank, what.c_str());
        return 11;
      }
    }
    try {  // sticky: a later send fails the same way
      t->isend(2, tag_of(3), buf.data(), 16)->wait(soon());
      return 12;
    } catch (const Error& e) {
      if (e.kind() != ErrorKind::kPeerLost) return 13;
    }
    // The survivors still talk.
    int other = 1 - rank, x = rank + 100, y = -1;
    auto r = t->irecv(other, tag_of(4), &y, sizeof y);
    t->isend(other, tag_of(4), &x, sizeof x)->wait(soon());
    r->wait(soon());
    return y == other + 100 ? 0 : 14;
  });
  EXPECT_TRUE(WIFEXITED(status[0]) && WEXITSTATUS(status[0]) == 0) << status[0];
  EXPECT_TRUE(WIFEXITED(status[1]) && WEXITSTATUS(status[1]) == 0) << status[1];
  EXPECT_TRUE(WIFSIGNALED(status[2]) && WTERMSIG(status[2]) == SIGKILL) << status[2];
}

}  // namespace
}  // namespace gradsync::transport
