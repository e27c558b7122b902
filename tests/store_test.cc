// Rendezvous stores: one behavioural suite run on the inproc, file and TCP stores, plus
// the TCP server's defences (tokens, garbage, oversized requests) and client reconnects.
#include "gradsync/store.h"

#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <atomic>
#include <optional>
#include <set>
#include <thread>

#include "gradsync/error.h"
#include "harness.h"
#include "rendezvous/auth.h"
#include "rendezvous/socket.h"
#include "rendezvous/store_protocol.h"
#include "rendezvous/store_util.h"
#include "rendezvous/tcp_store.h"

namespace gradsync {
namespace {

using namespace std::chrono_literals;
namespace sp = store_protocol;

constexpr char kToken[] = "store-token";

// One store instance as seen by several clients. `client()` returns a new handle on the
// same data; for the file and TCP stores it also works in a forked child.
class StoreUnderTest {
 public:
  virtual ~StoreUnderTest() = default;
  virtual std::shared_ptr<Store> client() = 0;
  virtual bool crosses_processes() const = 0;
};

class InprocUnderTest final : public StoreUnderTest {
 public:
  std::shared_ptr<Store> client() override { return store_; }
  bool crosses_processes() const override { return false; }

 private:
  std::shared_ptr<Store> store_ = make_inproc_store();
};

class FileUnderTest final : public StoreUnderTest {
 public:
  std::shared_ptr<Store> client() override { return make_file_store(dir_.path()); }
  bool crosses_processes() const override { return true; }

 private:
  testing::TempDir dir_;
};

class TcpUnderTest final : public StoreUnderTest {
 public:
  std::shared_ptr<Store> client() override {
    return make_tcp_store("127.0.0.1", server_->port(), kToken, 5s);
  }
  bool crosses_processes() const override { return true; }

 private:
  std::unique_ptr<TcpStoreServer> server_ = make_tcp_store_server("127.0.0.1", 0, kToken);
};

struct StoreKind {
  std::string name;
  std::function<std::unique_ptr<StoreUnderTest>()> make;
};
void PrintTo(const StoreKind& k, std::ostream* os) {
  *os << k.name;
}

class StoreSuite : public ::testing::TestWithParam<StoreKind> {
 protected:
  void SetUp() override { under_test_ = GetParam().make(); }
  std::shared_ptr<Store> client() { return under_test_->client(); }
  std::unique_ptr<StoreUnderTest> under_test_;
};

using testing::contains;

TEST_P(StoreSuite, SetGetCheckAndOverwrite) {
  auto s = client();
  EXPECT_FALSE(s->check("a"));
  s->set("a", to_bytes("one"));
  EXPECT_TRUE(s->check("a"));
  EXPECT_EQ(to_string(s->get("a", 1s)), "one");
  s->set("a", to_bytes("two"));
  EXPECT_EQ(to_string(client()->get("a", 1s)), "two");  // visible to another client
}

TEST_P(StoreSuite, KeysAndValuesMayHoldAnyBytes) {
  auto s = client();
  Bytes binary = {0, 1, 2, 0, 255, '/', '\n'};
  std::string odd_key = "job/rank 3/../%x\x01";
  s->set(odd_key, binary);
  EXPECT_EQ(s->get(odd_key, 1s), binary);
  s->set("empty", {});
  EXPECT_TRUE(s->check("empty"));
  EXPECT_TRUE(s->get("empty", 1s).empty());
  Bytes big(3 << 20);
  for (std::size_t i = 0; i < big.size(); ++i) big[i] = static_cast<std::uint8_t>(i * 7);
  s->set("big", big);
  EXPECT_EQ(client()->get("big", 5s), big);
}

TEST_P(StoreSuite, GetBlocksUntilAnotherClientSets) {
  auto reader = client();
  auto writer = client();
  std::thread t([&] {
    std::this_thread::sleep_for(50ms);
    writer->set("late", to_bytes("here"));
  });
  EXPECT_EQ(to_string(reader->get("late", 10s)), "here");
  t.join();
}

TEST_P(StoreSuite, WaitReturnsOnceEveryKeyExists) {
  auto waiter = client();
  auto writer = client();
  writer->set("k0", {});
  std::thread t([&] {
    std::this_thread::sleep_for(30ms);
    writer->set("k1", {});
    std::this_thread::sleep_for(30ms);
    writer->add("k2", 5);
  });
  waiter->wait({"k0", "k1", "k2", "k1"}, 10s);
  EXPECT_TRUE(waiter->check("k2"));
  t.join();
}

TEST_P(StoreSuite, TimeoutsNameOnlyTheMissingKeys) {
  auto s = client();
  s->set("present", {});
  try {
    s->wait({"present", "absent-1", "absent-2"}, 100ms);
    FAIL() << "no timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
    EXPECT_TRUE(contains(e.what(), "absent-1")) << e.what();
    EXPECT_TRUE(contains(e.what(), "absent-2")) << e.what();
    EXPECT_FALSE(contains(e.what(), "present")) << e.what();
  }
  try {
    s->get("nowhere", 0ms);
    FAIL() << "no timeout";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTimeout);
    EXPECT_TRUE(contains(e.what(), "nowhere")) << e.what();
  }
  // The client is still usable after a timeout.
  s->set("after", to_bytes("ok"));
  EXPECT_EQ(to_string(s->get("after", 1s)), "ok");
}

TEST_P(StoreSuite, AddIsAtomicAcrossThreads) {
  constexpr int kThreads = 8, kAdds = 150;
  std::vector<std::shared_ptr<Store>> clients;
  auto shared = client();  // half the threads share one client, half have their own
  for (int i = 0; i < kThreads; ++i) clients.push_back(i % 2 ? client() : shared);
  std::vector<std::vector<std::int64_t>> seen(kThreads);
  testing::run_threads(kThreads, [&](int i) {
    for (int k = 0; k < kAdds; ++k)
      seen[static_cast<std::size_t>(i)].push_back(
          clients[static_cast<std::size_t>(i)]->add("counter", 1));
  });
  std::set<std::int64_t> all;
  for (auto& v : seen) all.insert(v.begin(), v.end());
  // Every add returned a distinct value, and together they are exactly 1..N.
  EXPECT_EQ(all.size(), static_cast<std::size_t>(kThreads * kAdds));
  EXPECT_EQ(*all.begin(), 1);
  EXPECT_EQ(*all.rbegin(), kThreads * kAdds);
  EXPECT_EQ(client()->add("counter", 0), kThreads * kAdds);
  EXPECT_EQ(client()->add("counter", -kThreads * kAdds - 5), -5);
}

TEST_P(StoreSuite, AddIsAtomicAcrossProcesses) {
  if (!under_test_->crosses_processes()) GTEST_SKIP() << "store lives in one process";
  constexpr int kProcs = 4, kAdds = 100;
  auto status = testing::run_processes(kProcs, [&](int) {
    auto s = client();  // a fresh connection/handle in the child
    for (int k = 0; k < kAdds; ++k) s->add("shared", 1);
    return 0;
  });
  for (int st : status) EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << st;
  EXPECT_EQ(client()->add("shared", 0), kProcs * kAdds);
}

TEST_P(StoreSuite, AddOnANonIntegerValueIsAnError) {
  auto s = client();
  s->set("text", to_bytes("abc"));
  try {
    s->add("text", 1);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kProtocol) << e.what();
  }
  EXPECT_EQ(to_string(s->get("text", 1s)), "abc");  // left untouched
}

INSTANTIATE_TEST_SUITE_P(
    AllStores, StoreSuite,
    ::testing::Values(
        StoreKind{"inproc", [] { return std::unique_ptr<StoreUnderTest>(new InprocUnderTest); }},
        StoreKind{"file", [] { return std::unique_ptr<StoreUnderTest>(new FileUnderTest); }},
        StoreKind{"tcp", [] { return std::unique_ptr<StoreUnderTest>(new TcpUnderTest); }}),
    [](const ::testing::TestParamInfo<StoreKind>& p) { return p.param.name; });

// --- TCP store specifics ------------------------------------------------------------------

net::Fd raw(int port) {
  return net::connect_tcp("127.0.0.1", port, std::chrono::steady_clock::now() + 5s, "test");
}

bool closed_within(int fd, std::chrono::milliseconds limit) {
  auto end = std::chrono::steady_clock::now() + limit;
  std::uint8_t buf[4096];
  while (std::chrono::steady_clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    if (::recv(fd, buf, sizeof buf, 0) <= 0) return true;
  }
  return false;
}

// One response to `answered` read from a raw connection (5 s at most).
std::optional<sp::Response> read_response(int fd, sp::RequestType answered) {
  sp::MessageReader reader;
  std::uint8_t buf[4096];
  std::span<const std::uint8_t> body;
  auto end = std::chrono::steady_clock::now() + 5s;
  while (reader.next(body) != sp::MessageReader::Result::kMessage) {
    pollfd p{fd, POLLIN, 0};
    if (std::chrono::steady_clock::now() > end) return std::nullopt;
    if (::poll(&p, 1, 50) <= 0) continue;
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return std::nullopt;
    reader.append(buf, static_cast<std::size_t>(n));
  }
  return sp::parse_response(answered, body);
}

// What a client sends to authenticate with `token` on `fd`: its hello, then (after reading the
// server's challenge) its proof. Both messages are returned, as a thief on the wire would
// capture them.
std::pair<sp::Bytes, sp::Bytes> authenticate(int fd, const std::string& token) {
  sp::Request hello;
  hello.type = sp::RequestType::kHello;
  hello.key = net::fresh_nonce();
  const sp::Bytes hello_bytes = sp::encode_request(hello);
  EXPECT_TRUE(net::write_all(fd, hello_bytes.data(), hello_bytes.size()));
  const auto challenge = read_response(fd, sp::RequestType::kHello);
  EXPECT_TRUE(challenge && challenge->value.size() == net::kNonceBytes + net::kProofBytes);
  if (!challenge) return {hello_bytes, {}};
  const std::string server_nonce(challenge->value.begin(),
                                 challenge->value.begin() + net::kNonceBytes);
  sp::Request proof;
  proof.type = sp::RequestType::kProof;
  proof.key =
      net::prove(token, sp::kClientRole, hello.key, server_nonce, sp::proof_binding(hello.hello));
  const sp::Bytes proof_bytes = sp::encode_request(proof);
  EXPECT_TRUE(net::write_all(fd, proof_bytes.data(), proof_bytes.size()));
  return {hello_bytes, proof_bytes};
}

// The token never crosses the wire, and a captured hello and proof replayed on a new
// connection are refused: the server's nonce is new, so the old proof does not hold.
TEST(TcpStore, ACapturedHandshakeReplayedIsRefusedAndNeverCarriesTheToken) {
  auto server = make_tcp_store_server("127.0.0.1", 0, kToken);
  net::Fd first = raw(server->port());
  const auto [hello, proof] = authenticate(first.get(), kToken);
  const auto admitted = read_response(first.get(), sp::RequestType::kProof);
  ASSERT_TRUE(admitted && admitted->status == sp::Status::kOk);
  std::string wire(hello.begin(), hello.end());
  wire.append(proof.begin(), proof.end());
  EXPECT_EQ(wire.find(kToken), std::string::npos);

  net::Fd replay = raw(server->port());
  ASSERT_TRUE(net::write_all(replay.get(), hello.data(), hello.size()));
  ASSERT_TRUE(read_response(replay.get(), sp::RequestType::kHello));
  ASSERT_TRUE(net::write_all(replay.get(), proof.data(), proof.size()));
  const auto refused = read_response(replay.get(), sp::RequestType::kProof);
  ASSERT_TRUE(refused && refused->status == sp::Status::kError);
  EXPECT_TRUE(contains(refused->message, "wrong token: its proof does not hold"))
      << refused->message;
  EXPECT_TRUE(closed_within(replay.get(), 5000ms));
}

// A store that does not hold the token cannot pass itself off as the job's: the client
// refuses its challenge before sending any proof.
TEST(TcpStore, AStoreOfAnotherTokenIsRefusedByTheClient) {
  auto server = make_tcp_store_server("127.0.0.1", 0, "another-job");
  auto e = testing::expect_error(ErrorKind::kProtocol,
                                 [&] { make_tcp_store("127.0.0.1", server->port(), kToken, 2s); });
  EXPECT_TRUE(contains(e.what(), "did not prove the job token")) << e.what();
}

TEST(TcpStore, WrongTokenIsRefusedAndTheServerCarriesOn) {
  auto server = make_tcp_store_server("127.0.0.1", 0, kToken);
  try {
    make_tcp_store("127.0.0.1", server->port(), "wrong", 2s);
    FAIL() << "wrong token accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kProtocol) << e.what();
    EXPECT_TRUE(contains(e.what(), "127.0.0.1:" + std::to_string(server->port()))) << e.what();
  }
  auto good = make_tcp_store("127.0.0.1", server->port(), kToken, 2s);
  good->set("x", to_bytes("y"));
  EXPECT_EQ(to_string(good->get("x", 1s)), "y");
}

TEST(TcpStore, GarbageUnauthenticatedAndOversizedRequestsAreDropped) {
  auto server = make_tcp_store_server("127.0.0.1", 0, kToken);
  int port = server->port();
  auto good = make_tcp_store("127.0.0.1", port, kToken, 2s);
  // A get parked on the server while the junk arrives must still be answered.
  std::thread waiter([&] {
    auto other = make_tcp_store("127.0.0.1", port, kToken, 2s);
    EXPECT_EQ(to_string(other->get("go", 10s)), "now");
  });

  net::Fd junk = raw(port);
  const char raw_text[] = "\x05\x00\x00\x00hello world, not a request";
  std::string text(raw_text, sizeof raw_text - 1);  // NULs included
  net::write_all(junk.get(), text.data(), text.size());

  net::Fd oversized = raw(port);
  std::uint8_t huge[4] = {0xff, 0xff, 0xff, 0xff};
  net::write_all(oversized.get(), huge, 4);

  net::Fd unauthenticated = raw(port);
  sp::Request set;
  set.type = sp::RequestType::kSet;
  set.key = "sneaky";
  auto msg = sp::encode_request(set);
  net::write_all(unauthenticated.get(), msg.data(), msg.size());

  net::Fd bad_after_auth = raw(port);
  authenticate(bad_after_auth.get(), kToken);
  ASSERT_TRUE(read_response(bad_after_auth.get(), sp::RequestType::kProof));
  std::uint8_t bad_type[] = {1, 0, 0, 0, 99};
  net::write_all(bad_after_auth.get(), bad_type, sizeof bad_type);

  EXPECT_TRUE(closed_within(junk.get(), 5000ms));
  EXPECT_TRUE(closed_within(oversized.get(), 5000ms));
  EXPECT_TRUE(closed_within(unauthenticated.get(), 5000ms));
  EXPECT_TRUE(closed_within(bad_after_auth.get(), 5000ms));
  EXPECT_FALSE(good->check("sneaky"));
  good->set("go", to_bytes("now"));
  waiter.join();
}

TEST(TcpStore, ManyClientsParkedAtOnceDoNotBlockTheServer) {
  auto server = make_tcp_store_server("127.0.0.1", 0, kToken);
  constexpr int kClients = 32;
  std::atomic<int> done{0};
  std::thread setter([&] {
    auto s = make_tcp_store("127.0.0.1", server->port(), kToken, 2s);
    // While every other client is parked in wait(), this one's requests still go through.
    for (int i = 0; i < 20; ++i) s->add("noise", 1);
    s->set("go", {});
  });
  testing::run_threads(kClients, [&](int i) {
    auto s = make_tcp_store("127.0.0.1", server->port(), kToken, 5s);
    s->wait({"go"}, 20s);
    s->set("done/" + std::to_string(i), {});
    ++done;
  });
  setter.join();
  EXPECT_EQ(done.load(), kClients);
}

TEST(TcpStore, ConnectTimeoutNamesHostAndPort) {
  int port;
  {
    net::Fd l = net::listen_tcp("127.0.0.1", 0, false);
    port = net::local_port(l.get());
  }
  try {
    make_tcp_store("127.0.0.1", port, kToken, 200ms);
    FAIL() << "connected to a closed port";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kTimeout) << e.what();
    EXPECT_TRUE(contains(e.what(), "127.0.0.1:" + std::to_string(port))) << e.what();
  }
}

TEST(TcpStore, ClientReconnectsToARestartedServer) {
  auto server = make_tcp_store_server("127.0.0.1", 0, kToken);
  int port = server->port();
  auto s = make_tcp_store("127.0.0.1", port, kToken, 5s);
  s->set("a", {});
  server.reset();
  server = make_tcp_store_server("127.0.0.1", port, kToken);  // same port, empty store
  s->set("b", to_bytes("again"));  // idempotent: retried on a fresh connection
  EXPECT_EQ(to_string(s->get("b", 1s)), "again");
  EXPECT_FALSE(s->check("a"));
}

TEST(TcpStore, ServerDisappearingIsReportedNotHung) {
  auto server = make_tcp_store_server("127.0.0.1", 0, kToken);
  int port = server->port();
  auto s = make_tcp_store("127.0.0.1", port, kToken, 300ms);
  std::thread killer([&] {
    std::this_thread::sleep_for(50ms);
    server.reset();
  });
  try {
    s->get("never", 30s);  // parked on the server when it goes away
    FAIL() << "get returned";
  } catch (const Error& e) {
    // The retry finds nobody listening: the error names where the store was.
    EXPECT_TRUE(contains(e.what(), "127.0.0.1:" + std::to_string(port))) << e.what();
  }
  killer.join();
}

// Everything a raw connection receives until the server closes it (or `limit` passes),
// read as the server's answer to a hello: what it says when it drops a connection.
std::optional<sp::Response> farewell(int fd, std::chrono::milliseconds limit = 120000ms) {
  sp::MessageReader reader;
  auto end = std::chrono::steady_clock::now() + limit;
  std::uint8_t buf[4096];
  while (std::chrono::steady_clock::now() < end) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 50) <= 0) continue;
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    reader.append(buf, static_cast<std::size_t>(n));
  }
  std::span<const std::uint8_t> body;
  if (reader.next(body) != sp::MessageReader::Result::kMessage) return std::nullopt;
  return sp::parse_response(sp::RequestType::kHello, body);
}

std::string describe(const std::optional<sp::Response>& r) {
  if (!r) return "(closed without a word)";
  return "status " + std::to_string(static_cast<int>(r->status)) + ": " + r->message;
}

// Before a connection authenticates the server reads one small hello and no more: a length
// over the hello's limit is refused at once (not read up to 64 MiB first), and a peer that
// streams on anyway finds the connection reset rather than buffered.
TEST(TcpStore, AnUnauthenticatedConnectionIsReadNoFurtherThanAHello) {
  auto server = make_tcp_store_server("127.0.0.1", 0, kToken);
  const std::uint32_t claimed = 60u << 20;
  const std::uint8_t prefix[4] = {
      static_cast<std::uint8_t>(claimed), static_cast<std::uint8_t>(claimed >> 8),
      static_cast<std::uint8_t>(claimed >> 16), static_cast<std::uint8_t>(claimed >> 24)};

  net::Fd announces = raw(server->port());
  net::write_all(announces.get(), prefix, sizeof prefix);
  auto answer = farewell(announces.get());
  ASSERT_TRUE(answer && answer->status == sp::Status::kError) << describe(answer);
  EXPECT_TRUE(contains(answer->message, "a hello is at most")) << answer->message;

  net::Fd streams = raw(server->port());
  bool sent_all = net::write_all(streams.get(), prefix, sizeof prefix);
  std::vector<std::uint8_t> chunk(1 << 20, 'x');
  for (std::uint32_t sent = 0; sent_all && sent + chunk.size() < claimed; sent += chunk.size()) {
    sent_all = net::write_all(streams.get(), chunk.data(), chunk.size());
  }
  EXPECT_FALSE(sent_all) << "the server took 60 MiB from a connection that never said hello";

  auto good = make_tcp_store("127.0.0.1", server->port(), kToken, 5s);
  good->set("still", to_bytes("here"));
  EXPECT_EQ(to_string(good->get("still", 1s)), "here");
}

// Connections that never say hello hold at most a bounded number of slots: each new one
// evicts the oldest, which is told why, and a real client still gets in.
TEST(TcpStore, AFloodOfSilentConnectionsEvictsTheOldestAndClientsStillConnect) {
  auto server = make_tcp_store_server("127.0.0.1", 0, kToken);
  constexpr int kSilent = 200, kSlots = 64;
  std::vector<net::Fd> silent;
  for (int i = 0; i < kSilent; ++i) silent.push_back(raw(server->port()));
  auto good = make_tcp_store("127.0.0.1", server->port(), kToken, 120s);
  good->set("in", to_bytes("yes"));
  EXPECT_EQ(to_string(good->get("in", 1s)), "yes");
  for (int i = 0; i < kSilent - kSlots; ++i) {
    auto answer = farewell(silent[static_cast<std::size_t>(i)].get());
    ASSERT_TRUE(answer && answer->status == sp::Status::kBusy)
        << "connection " << i << ": " << describe(answer);
    EXPECT_TRUE(contains(answer->message, "waiting to say hello")) << answer->message;
  }
}

// A host name that does not exist fails at once, naming it, rather than being tried for
// the whole timeout (and reported as one).
TEST(TcpStore, AnAddressThatDoesNotResolveIsNamedNotRetriedToTheTimeout) {
  auto e = testing::expect_error(ErrorKind::kInvalidArgument, [] {
    make_tcp_store("nonexistent.invalid", 29500, kToken, 120s);
  });
  EXPECT_TRUE(contains(e.what(), "nonexistent.invalid")) << e.what();
  EXPECT_TRUE(contains(e.what(), "does not resolve")) << e.what();
}

TEST(TcpStore, AConnectionThatSaysNothingIsDroppedAtTheHelloDeadline) {
  TcpStoreServerOptions options;
  options.hello_timeout = 200ms;
  auto server = make_tcp_store_server("127.0.0.1", 0, kToken, options);
  net::Fd silent = raw(server->port());
  auto answer = farewell(silent.get());
  ASSERT_TRUE(answer && answer->status == sp::Status::kBusy) << describe(answer);
  EXPECT_TRUE(contains(answer->message, "no hello within 200 ms")) << answer->message;
}

// Ranks hold one connection each whatever else connects; connections that announce no rank
// (tools, tests) get a few slots beyond them.
TEST(TcpStore, ConnectionsThatAreNoRankAreBoundedWithoutCostingARankItsPlace) {
  TcpStoreServerOptions options;
  options.world_size = 2;
  options.anonymous_slack = 2;
  auto server = make_tcp_store_server("127.0.0.1", 0, kToken, options);
  const int port = server->port();
  auto tool_a = make_tcp_store("127.0.0.1", port, kToken, 120s);
  auto tool_b = make_tcp_store("127.0.0.1", port, kToken, 120s);
  auto e = testing::expect_error(ErrorKind::kProtocol,
                                 [&] { make_tcp_store("127.0.0.1", port, kToken, 120s); });
  EXPECT_TRUE(contains(e.what(), "store full")) << e.what();
  auto rank0 = make_tcp_store("127.0.0.1", port, kToken, 120s, TcpStoreIdentity{0, 2});
  auto rank1 = make_tcp_store("127.0.0.1", port, kToken, 120s, TcpStoreIdentity{1, 2});
  rank1->set("one", to_bytes("here"));
  EXPECT_EQ(to_string(rank0->get("one", 1s)), "here");
  e = testing::expect_error(ErrorKind::kInvalidArgument, [&] {
    make_tcp_store("127.0.0.1", port, kToken, 120s, TcpStoreIdentity{2, 2});
  });
  EXPECT_TRUE(contains(e.what(), "rank 2 (pid ")) << e.what();
  EXPECT_TRUE(contains(e.what(), "is out of range for WORLD_SIZE=2")) << e.what();
}

// A rank that contradicts the others fails the job: the ranks already waiting on the store
// learn why at once, and so does every later request.
TEST(TcpStore, AContradictingHelloFailsTheRanksAlreadyWaiting) {
  TcpStoreServerOptions options;
  options.world_size = 3;
  options.linger = 0ms;  // rank 2 never comes: nothing to wait for
  auto server = make_tcp_store_server("127.0.0.1", 0, kToken, options);
  const int port = server->port();
  auto rank0 = make_tcp_store("127.0.0.1", port, kToken, 120s, TcpStoreIdentity{0, 3});
  std::thread waiting([&] {
    auto e = testing::expect_error(ErrorKind::kInvalidArgument, [&] { rank0->get("never", 120s); });
    EXPECT_TRUE(contains(e.what(), "was started with WORLD_SIZE=2 but rank 0 with WORLD_SIZE=3"))
        << e.what();
  });
  auto e = testing::expect_error(ErrorKind::kInvalidArgument, [&] {
    make_tcp_store("127.0.0.1", port, kToken, 120s, TcpStoreIdentity{1, 2});
  });
  EXPECT_TRUE(contains(e.what(), "rank 1 (pid ")) << e.what();
  waiting.join();
  e = testing::expect_error(ErrorKind::kInvalidArgument, [&] { rank0->check("anything"); });
  EXPECT_TRUE(contains(e.what(), "WORLD_SIZE=2")) << e.what();
}

// After the job failed, the server outlives its owner a little for the ranks that have not
// said hello yet, so that a late rank learns why rather than finding nobody there.
TEST(TcpStore, AFailedServerWaitsForTheRanksThatHaveNotHeardYet) {
  TcpStoreServerOptions options;
  options.world_size = 3;
  options.linger = 120s;  // ended by rank 1's hello, not by time
  auto server = make_tcp_store_server("127.0.0.1", 0, kToken, options);
  const int port = server->port();
  auto rank0 = make_tcp_store("127.0.0.1", port, kToken, 120s, TcpStoreIdentity{0, 3});
  testing::expect_error(ErrorKind::kInvalidArgument, [&] {
    make_tcp_store("127.0.0.1", port, kToken, 120s, TcpStoreIdentity{2, 4});
  });
  rank0.reset();
  std::thread owner_exits([&] { server.reset(); });
  std::this_thread::sleep_for(100ms);  // lets the owner's reset begin first
  auto e = testing::expect_error(ErrorKind::kInvalidArgument, [&] {
    make_tcp_store("127.0.0.1", port, kToken, 120s, TcpStoreIdentity{1, 3});
  });
  EXPECT_TRUE(contains(e.what(), "rank 2 (pid ")) << e.what();
  owner_exits.join();
}

}  // namespace
}  // namespace gradsync
