// Helpers every Store implementation shares: integer encoding for add(), timeout errors.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "gradsync/store.h"

namespace gradsync {

// add() stores integers as decimal text, so every store agrees and files stay readable.
Bytes encode_int(std::int64_t v);
std::int64_t decode_int(const Bytes& b);  // empty -> 0; throws kProtocol on garbage
Bytes to_bytes(const std::string& s);
std::string to_string(const Bytes& b);

// The longest wait a store takes: timeouts are clamped to it so `now + timeout` cannot overflow
// the clock's representation when a caller passes milliseconds::max() to mean "forever".
inline constexpr std::chrono::milliseconds kMaxTimeout = std::chrono::hours(24 * 365);
std::chrono::milliseconds clamp_timeout(std::chrono::milliseconds t);

// `why`: what the store knows of why the keys never appeared (may be empty).
[[noreturn]] void throw_store_timeout(const std::string& store,
                                      const std::vector<std::string>& missing,
                                      std::chrono::milliseconds timeout,
                                      const std::string& why = "");

}  // namespace gradsync
