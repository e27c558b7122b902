// Wire protocol of the TCP store: length-prefixed request/response messages. Pure encode,
// parse and stream-splitting functions (no sockets), shared by server, client and fuzzer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace gradsync::store_protocol {

using Bytes = std::vector<std::uint8_t>;

// Every message is `u32 body length (LE)` + body; body[0] is the request type or the
// response status. Strings are `u32 length` + bytes; integers are little-endian.
//
// Limits bound what one message can make the server allocate: values up to 64 MiB are
// plenty for rendezvous data (addresses, ids) and keep a hostile length harmless.
constexpr std::size_t kMaxKeyBytes = 4096;
constexpr std::size_t kMaxValueBytes = std::size_t{64} << 20;
constexpr std::size_t kMaxWaitKeys = 65536;
constexpr std::size_t kMaxMessageBytes = kMaxValueBytes + 2 * kMaxKeyBytes + 64;
constexpr std::size_t kLengthPrefixBytes = 4;
// Before a connection has authenticated, the server reads nothing but a hello and a proof of
// at most this many body bytes each: a nonce or a proof (up to kMaxKeyBytes), a host name and
// a few integers. An unauthenticated peer can thus make it hold only a few KiB, not a whole
// message.
constexpr std::size_t kMaxHostBytes = 256;
constexpr std::size_t kMaxHelloBytes = 1 + 4 + kMaxKeyBytes + 4 + 4 + 4 + 4 + kMaxHostBytes + 8;

// A connection starts with the challenge-response of rendezvous/auth.h: the client's kHello
// (key = its nonce) is answered with the server's nonce and proof of the job token (the
// response's value), then the client's kProof (key = its proof) admits it or is refused.
// The token never crosses the network.
enum class RequestType : std::uint8_t {
  kProof = 1,  // key = the client's proof of the token; the second request of a connection
  kSet = 2,    // key, value
  kGet = 3,    // key, timeout_ms: answered when the key exists or the timeout passes
  kWait = 4,   // keys, timeout_ms: answered when every key exists or the timeout passes
  kAdd = 5,    // key, delta: answers the new value
  kCheck = 6,  // key: answers whether it exists
  kHello = 7,  // key = the client's nonce, hello = who is asking; the first request
};
const char* to_string(RequestType t);

// Who a client is, announced in its kHello so that the server can catch ranks that were
// started with different world sizes, or twice with the same rank, as soon as they connect.
struct Hello {
  std::int32_t rank = -1;        // -1: not a rank (a tool, a test); nothing is checked
  std::int32_t world_size = -1;  // as this rank was started with
  std::uint32_t pid = 0;
  std::string host;             // host name, at most kMaxHostBytes
  std::uint64_t client_id = 0;  // the same on every reconnect of one client
  bool operator==(const Hello&) const = default;
};

// The roles each side's proof of the token signs, and what both proofs bind: who the hello
// says is asking (rendezvous/auth.h).
inline constexpr std::string_view kServerRole = "gradsync store server";
inline constexpr std::string_view kClientRole = "gradsync store client";
inline std::string proof_binding(const Hello& h) {
  return std::to_string(h.rank) + "/" + std::to_string(h.world_size) + "/" +
         std::to_string(h.client_id);
}

struct Request {
  RequestType type = RequestType::kCheck;
  std::string key;                // kHello (nonce), kProof (proof), kSet, kGet, kAdd, kCheck
  Hello hello;                    // kHello
  std::vector<std::string> keys;  // kWait
  Bytes value;                    // kSet
  std::int64_t delta = 0;         // kAdd
  std::uint64_t timeout_ms = 0;   // kGet, kWait
  bool operator==(const Request&) const = default;
};

enum class Status : std::uint8_t {
  kOk = 0,
  kTimeout = 1,  // `missing` lists the keys that never appeared, `message` what the server
                 // knows of why (e.g. a rank it refused for a wrong token), or ""
  kError = 2,    // `message` says why (e.g. add() on a value that is not an integer)
  // The job cannot go on (`message` says why, e.g. two processes claim one rank): the
  // answer to every request from then on, parked ones included.
  kJobFailed = 3,
  // An answer to a hello only: the server dropped the connection before authenticating it
  // (too many were pending, or its hello came too late); the client may connect again.
  kBusy = 4,
};

struct Response {
  Status status = Status::kOk;
  Bytes value;                       // kGet
  std::int64_t number = 0;           // kAdd
  bool exists = false;               // kCheck
  std::vector<std::string> missing;  // kTimeout
  std::string message;               // kError, kJobFailed, kBusy, kTimeout
  bool operator==(const Response&) const = default;
};

// Encoders return the whole message, length prefix included. Inputs over the limits are
// the caller's bug: the encoders do not check, the receiving parser rejects them.
Bytes encode_request(const Request& r);
Bytes encode_response(RequestType answered, const Response& r);

// Parse one message body (without its length prefix). On failure returns nullopt and
// puts the reason in `why` when given.
std::optional<Request> parse_request(std::span<const std::uint8_t> body,
                                     std::string* why = nullptr);
std::optional<Response> parse_response(RequestType answered, std::span<const std::uint8_t> body,
                                       std::string* why = nullptr);

// Splits a byte stream into message bodies. Feed bytes as they arrive with append(), then
// call next() until it stops returning kMessage.
class MessageReader {
 public:
  enum class Result { kNeedMore, kMessage, kTooLong };
  explicit MessageReader(std::size_t max_body = kMaxMessageBytes) : max_body_(max_body) {}
  void append(const std::uint8_t* data, std::size_t len);
  // kMessage: `body` views the next message, valid until the next append()/next().
  // kTooLong: the declared length is over the limit; the stream cannot be trusted further.
  Result next(std::span<const std::uint8_t>& body);
  std::size_t buffered() const { return buf_.size() - pos_; }
  // The server reads a connection with kMaxHelloBytes until it authenticates, then raises it.
  void set_max_body(std::size_t max_body) { max_body_ = max_body; }

 private:
  std::size_t max_body_;
  Bytes buf_;
  std::size_t pos_ = 0;  // start of the unconsumed bytes in buf_
};

}  // namespace gradsync::store_protocol
