// Wire format of the TCP transport: a fixed 48-byte frame header followed by a payload.
// Pure encode/parse functions (no sockets) so the fuzzer can feed them arbitrary bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "transport/transport.h"

namespace gradsync::transport::frame {

// Layout, all integers little-endian:
//   0  u32 magic 'GSTF'    4  u16 version    6  u8 type    7  u8 flags (0)
//   8  32-byte tag         40 u64 payload length
// A fixed size lets the reader fetch a header with one bounded read and never trust a
// length before the magic and version have been checked.
constexpr std::size_t kHeaderBytes = 48;
constexpr std::uint32_t kMagic = 0x46545347;  // "GSTF" when read as bytes
constexpr std::uint16_t kVersion = 2;         // 2: the token is proven, never sent

enum class Type : std::uint8_t {
  // The handshake (rendezvous/auth.h): the dialer's kHello (its nonce), the acceptor's
  // kChallenge (its nonce and proof of the token), the dialer's kProof, and once that holds,
  // the acceptor's kHello. Then data may flow.
  kHello = 1,  // rank, world size, address and a fresh nonce; no secret
  kData = 2,   // one message of the Transport interface
  kAbort = 3,  // the sender aborted; payload names its rank and reason
  // A rank whose wait timed out asks each peer what it is doing; the peer's transport
  // thread answers at once (kProbeAnswer), which a stopped or hung process cannot.
  kProbe = 4,
  kProbeAnswer = 5,
  kChallenge = 6,  // the acceptor's nonce and its proof of the token
  kProof = 7,      // the dialer's proof of the token
};

// Limits on what a header may declare, so a corrupt or hostile length never turns into a
// huge allocation. Control frames are tiny; data frames are bounded by `max_data_bytes`.
constexpr std::uint64_t kMaxHelloBytes = 4096;
constexpr std::uint64_t kMaxAbortBytes = 64 * 1024;
constexpr std::uint64_t kMaxProbeBytes = 4096;
constexpr std::uint64_t kDefaultMaxDataBytes = std::uint64_t{1} << 40;  // 1 TiB
constexpr std::size_t kMaxAddressBytes = 512;

struct Header {
  Type type = Type::kData;
  Tag tag;
  std::uint64_t length = 0;
  bool operator==(const Header&) const = default;
};

enum class ParseStatus { kOk, kBadMagic, kBadVersion, kBadType, kBadFlags, kTooLong };
const char* to_string(ParseStatus s);

void encode_header(const Header& h, std::uint8_t out[kHeaderBytes]);
// `in` must hold kHeaderBytes bytes. Checks magic, version, type, flags and the length
// limit of the type; `out` is valid only on kOk.
ParseStatus parse_header(const std::uint8_t in[kHeaderBytes], std::uint64_t max_data_bytes,
                         Header& out);

struct Hello {
  std::uint32_t rank = 0;
  std::uint32_t world_size = 0;
  std::string nonce;    // net::kNonceBytes
  std::string address;  // "host:port" the sender listens on, for error messages
  bool operator==(const Hello&) const = default;
};
std::vector<std::uint8_t> encode_hello(const Hello& h);  // payload only
std::optional<Hello> parse_hello(std::span<const std::uint8_t> payload);

struct Challenge {
  std::string nonce;  // net::kNonceBytes
  std::string proof;  // net::kProofBytes
  bool operator==(const Challenge&) const = default;
};
std::vector<std::uint8_t> encode_challenge(const Challenge& c);  // payload only
std::optional<Challenge> parse_challenge(std::span<const std::uint8_t> payload);

// kProof's payload is the proof's bytes alone.
std::optional<std::string> parse_proof(std::span<const std::uint8_t> payload);

struct Abort {
  std::uint32_t rank = 0;
  std::string reason;  // truncated to fit kMaxAbortBytes when encoded
  bool operator==(const Abort&) const = default;
};
std::vector<std::uint8_t> encode_abort(const Abort& a);  // payload only
std::optional<Abort> parse_abort(std::span<const std::uint8_t> payload);

// A probe (`status` empty) or its answer: the probe's number, so a late answer to an earlier
// probe is told apart, and what the answering rank waits on.
struct Probe {
  std::uint64_t nonce = 0;
  std::string status;  // truncated to fit kMaxProbeBytes when encoded
  bool operator==(const Probe&) const = default;
};
std::vector<std::uint8_t> encode_probe(const Probe& p);  // payload only
std::optional<Probe> parse_probe(std::span<const std::uint8_t> payload);

// Header plus payload in one buffer, for control frames.
std::vector<std::uint8_t> encode_frame(Type type, const Tag& tag,
                                       std::span<const std::uint8_t> payload);

}  // namespace gradsync::transport::frame
