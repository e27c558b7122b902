// Encoding and validation of TCP transport frames; every function here is pure.
#include "transport/frame.h"

#include <algorithm>
#include <cstring>

#include "rendezvous/auth.h"

namespace gradsync::transport::frame {

namespace {
// Explicit little-endian byte order: the wire format must not depend on the host.
void put_u16(std::uint8_t* p, std::uint16_t v) {
  p[0] = static_cast<std::uint8_t>(v);
  p[1] = static_cast<std::uint8_t>(v >> 8);
}
void put_u32(std::uint8_t* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
void put_u64(std::uint8_t* p, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<std::uint8_t>(v >> (8 * i));
}
std::uint16_t get_u16(const std::uint8_t* p) {
  return static_cast<std::uint16_t>(p[0] | (p[1] << 8));
}
std::uint32_t get_u32(const std::uint8_t* p) {
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
std::uint64_t get_u64(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Appends a u32-length-prefixed string.
void put_string(std::vector<std::uint8_t>& out, const std::string& s) {
  std::uint8_t len[4];
  put_u32(len, static_cast<std::uint32_t>(s.size()));
  out.insert(out.end(), len, len + 4);
  out.insert(out.end(), s.begin(), s.end());
}

// Reads a u32-length-prefixed string of at most `max` bytes from payload[pos...].
bool get_string(std::span<const std::uint8_t> payload, std::size_t& pos, std::size_t max,
                std::string& out) {
  if (payload.size() - pos < 4) return false;
  std::uint32_t len = get_u32(payload.data() + pos);
  pos += 4;
  if (len > max || payload.size() - pos < len) return false;
  out.assign(reinterpret_cast<const char*>(payload.data() + pos), len);
  pos += len;
  return true;
}
}  // namespace

const char* to_string(ParseStatus s) {
  switch (s) {
    case ParseStatus::kOk:
      return "ok";
    case ParseStatus::kBadMagic:
      return "bad magic (not a gradsync peer)";
    case ParseStatus::kBadVersion:
      return "unsupported protocol version";
    case ParseStatus::kBadType:
      return "unknown frame type";
    case ParseStatus::kBadFlags:
      return "reserved flags set";
    case ParseStatus::kTooLong:
      return "declared payload length over the limit";
  }
  return "?";
}

void encode_header(const Header& h, std::uint8_t out[kHeaderBytes]) {
  put_u32(out, kMagic);
  put_u16(out + 4, kVersion);
  out[6] = static_cast<std::uint8_t>(h.type);
  out[7] = 0;
  for (int i = 0; i < 4; ++i) put_u64(out + 8 + 8 * i, h.tag.words[i]);
  put_u64(out + 40, h.length);
}

ParseStatus parse_header(const std::uint8_t in[kHeaderBytes], std::uint64_t max_data_bytes,
                         Header& out) {
  if (get_u32(in) != kMagic) return ParseStatus::kBadMagic;
  if (get_u16(in + 4) != kVersion) return ParseStatus::kBadVersion;
  if (in[7] != 0) return ParseStatus::kBadFlags;
  std::uint64_t length = get_u64(in + 40);
  std::uint64_t limit = 0;
  switch (in[6]) {
    case static_cast<std::uint8_t>(Type::kHello):
    case static_cast<std::uint8_t>(Type::kChallenge):
    case static_cast<std::uint8_t>(Type::kProof):
      limit = kMaxHelloBytes;
      break;
    case static_cast<std::uint8_t>(Type::kData):
      limit = max_data_bytes;
      break;
    case static_cast<std::uint8_t>(Type::kAbort):
      limit = kMaxAbortBytes;
      break;
    case static_cast<std::uint8_t>(Type::kProbe):
      limit = kMaxProbeBytes;
      break;
    case static_cast<std::uint8_t>(Type::kProbeAnswer):
      limit = kMaxProbeBytes;
      break;
    default:
      return ParseStatus::kBadType;
  }
  if (length > limit) return ParseStatus::kTooLong;
  out.type = static_cast<Type>(in[6]);
  for (int i = 0; i < 4; ++i) out.tag.words[i] = get_u64(in + 8 + 8 * i);
  out.length = length;
  return ParseStatus::kOk;
}

std::vector<std::uint8_t> encode_hello(const Hello& h) {
  std::vector<std::uint8_t> out(8);
  put_u32(out.data(), h.rank);
  put_u32(out.data() + 4, h.world_size);
  put_string(out, h.nonce);
  put_string(out, h.address);
  return out;
}

std::optional<Hello> parse_hello(std::span<const std::uint8_t> payload) {
  if (payload.size() < 8 || payload.size() > kMaxHelloBytes) return std::nullopt;
  Hello h;
  h.rank = get_u32(payload.data());
  h.world_size = get_u32(payload.data() + 4);
  std::size_t pos = 8;
  if (!get_string(payload, pos, net::kNonceBytes, h.nonce)) return std::nullopt;
  if (h.nonce.size() != net::kNonceBytes) return std::nullopt;
  if (!get_string(payload, pos, kMaxAddressBytes, h.address)) return std::nullopt;
  if (pos != payload.size()) return std::nullopt;  // trailing bytes: not what we encode
  return h;
}

std::vector<std::uint8_t> encode_challenge(const Challenge& c) {
  std::vector<std::uint8_t> out;
  put_string(out, c.nonce);
  put_string(out, c.proof);
  return out;
}

std::optional<Challenge> parse_challenge(std::span<const std::uint8_t> payload) {
  Challenge c;
  std::size_t pos = 0;
  if (!get_string(payload, pos, net::kNonceBytes, c.nonce)) return std::nullopt;
  if (!get_string(payload, pos, net::kProofBytes, c.proof)) return std::nullopt;
  if (c.nonce.size() != net::kNonceBytes || c.proof.size() != net::kProofBytes) return std::nullopt;
  if (pos != payload.size()) return std::nullopt;
  return c;
}

std::optional<std::string> parse_proof(std::span<const std::uint8_t> payload) {
  if (payload.size() != net::kProofBytes) return std::nullopt;
  return std::string(reinterpret_cast<const char*>(payload.data()), payload.size());
}

std::vector<std::uint8_t> encode_abort(const Abort& a) {
  std::size_t n = std::min<std::size_t>(kMaxAbortBytes - 4, a.reason.size());
  std::vector<std::uint8_t> out(4 + n);
  put_u32(out.data(), a.rank);
  if (n) std::memcpy(out.data() + 4, a.reason.data(), n);
  return out;
}

std::optional<Abort> parse_abort(std::span<const std::uint8_t> payload) {
  if (payload.size() < 4 || payload.size() > kMaxAbortBytes) return std::nullopt;
  Abort a;
  a.rank = get_u32(payload.data());
  a.reason.assign(reinterpret_cast<const char*>(payload.data() + 4), payload.size() - 4);
  return a;
}

std::vector<std::uint8_t> encode_probe(const Probe& p) {
  std::size_t n = std::min<std::size_t>(kMaxProbeBytes - 8, p.status.size());
  std::vector<std::uint8_t> out(8 + n);
  put_u64(out.data(), p.nonce);
  if (n) std::memcpy(out.data() + 8, p.status.data(), n);
  return out;
}

std::optional<Probe> parse_probe(std::span<const std::uint8_t> payload) {
  if (payload.size() < 8 || payload.size() > kMaxProbeBytes) return std::nullopt;
  Probe p;
  p.nonce = get_u64(payload.data());
  p.status.assign(reinterpret_cast<const char*>(payload.data() + 8), payload.size() - 8);
  return p;
}

std::vector<std::uint8_t> encode_frame(Type type, const Tag& tag,
                                       std::span<const std::uint8_t> payload) {
  std::vector<std::uint8_t> out(kHeaderBytes + payload.size());
  encode_header(Header{type, tag, payload.size()}, out.data());
  std::copy(payload.begin(), payload.end(), out.begin() + kHeaderBytes);
  return out;
}

}  // namespace gradsync::transport::frame
