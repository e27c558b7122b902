// The saved-state format (see gradsync/bytes.h): bounds checked on every read.
#include "gradsync/bytes.h"

#include <stdexcept>

#include "gradsync/error.h"

namespace gradsync {

namespace {

constexpr std::size_t kKindBytes = 4;

std::string printable(std::span<const std::uint8_t> b) {
  std::string s;
  for (std::uint8_t c : b) s += c >= 32 && c < 127 ? static_cast<char>(c) : '?';
  return s;
}

}  // namespace

ByteWriter::ByteWriter(std::string_view kind, std::uint32_t version) {
  if (kind.size() != kKindBytes) throw std::logic_error("a state kind has 4 characters");
  raw(kind.data(), kKindBytes);
  put(version);
}

void ByteWriter::raw(const void* data, std::size_t n) {
  const std::size_t at = out_.size();
  out_.resize(at + n);
  if (n) std::memcpy(out_.data() + at, data, n);
}

void ByteWriter::string(std::string_view s) {
  put(static_cast<std::uint32_t>(s.size()));
  raw(s.data(), s.size());
}

void ByteWriter::bytes(std::span<const std::uint8_t> b) {
  put(static_cast<std::uint64_t>(b.size()));
  raw(b.data(), b.size());
}

void ByteWriter::floats(std::span<const float> f) {
  put(static_cast<std::uint64_t>(f.size()));
  raw(f.data(), f.size_bytes());
}

ByteReader::ByteReader(std::span<const std::uint8_t> in, std::string_view kind,
                       std::uint32_t version, std::string what)
    : in_(in), what_(std::move(what)) {
  if (in_.size() < kKindBytes + 4 || std::memcmp(in_.data(), kind.data(), kKindBytes) != 0) {
    fail("not one (it starts with '" + printable(in_.first(std::min(in_.size(), kKindBytes))) +
         "', not '" + std::string(kind) + "')");
  }
  at_ = kKindBytes;
  const auto found = get<std::uint32_t>();
  if (found != version) {
    fail("format version " + std::to_string(found) + ", this build reads version " +
         std::to_string(version));
  }
}

void ByteReader::raw(void* data, std::size_t n) {
  if (in_.size() - at_ < n) {
    fail("truncated: " + std::to_string(n) + " bytes wanted at byte " + std::to_string(at_) +
         " of " + std::to_string(in_.size()));
  }
  if (n) std::memcpy(data, in_.data() + at_, n);
  at_ += n;
}

std::string ByteReader::string() {
  const auto n = get<std::uint32_t>();
  if (n > in_.size() - at_) fail("a string longer than what is left");
  std::string s(n, '\0');
  raw(s.data(), n);
  return s;
}

std::span<const std::uint8_t> ByteReader::bytes() {
  const auto n = get<std::uint64_t>();
  if (n > in_.size() - at_) fail("a block longer than what is left");
  const auto b = in_.subspan(at_, n);
  at_ += n;
  return b;
}

std::vector<float> ByteReader::floats() {
  const auto n = get<std::uint64_t>();
  if (n > (in_.size() - at_) / sizeof(float)) fail("more floats than what is left");
  std::vector<float> f(n);
  raw(f.data(), n * sizeof(float));
  return f;
}

void ByteReader::floats(std::span<float> out) {
  const auto n = get<std::uint64_t>();
  if (n != out.size()) {
    fail(std::to_string(n) + " floats stored where " + std::to_string(out.size()) + " are wanted");
  }
  raw(out.data(), out.size_bytes());
}

void ByteReader::finish() const {
  if (!at_end()) fail(std::to_string(in_.size() - at_) + " bytes left over");
}

void ByteReader::fail(const std::string& why) const {
  throw Error(ErrorKind::kProtocol, what_ + ": " + why, Error::kUnknownRank, Error::kNoPeer,
              "load_state");
}

}  // namespace gradsync
