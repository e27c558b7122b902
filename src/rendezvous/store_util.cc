// Shared pieces of the Store implementations.
#include "rendezvous/store_util.h"

#include <algorithm>
#include <charconv>

#include "gradsync/error.h"

namespace gradsync {

Bytes encode_int(std::int64_t v) {
  return to_bytes(std::to_string(v));
}

std::int64_t decode_int(const Bytes& b) {
  if (b.empty()) return 0;
  std::int64_t v = 0;
  const char* first = reinterpret_cast<const char*>(b.data());
  auto [ptr, ec] = std::from_chars(first, first + b.size(), v);
  if (ec != std::errc() || ptr != first + b.size()) {
    throw Error(ErrorKind::kProtocol, "store value is not an integer: '" + to_string(b) + "'");
  }
  return v;
}

Bytes to_bytes(const std::string& s) {
  return Bytes(s.begin(), s.end());
}
std::string to_string(const Bytes& b) {
  return std::string(b.begin(), b.end());
}

std::chrono::milliseconds clamp_timeout(std::chrono::milliseconds t) {
  return std::clamp(t, std::chrono::milliseconds(0), kMaxTimeout);
}

void throw_store_timeout(const std::string& store, const std::vector<std::string>& missing,
                         std::chrono::milliseconds timeout, const std::string& why) {
  std::string keys;
  for (const auto& k : missing) keys += (keys.empty() ? "" : ", ") + k;
  throw Error(ErrorKind::kTimeout,
              "waited " + std::to_string(timeout.count()) + " ms for key(s) [" + keys +
                  "] that never appeared" + (why.empty() ? "" : "; " + why),
              Error::kUnknownRank, Error::kNoPeer, store);
}

}  // namespace gradsync
