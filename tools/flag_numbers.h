// Strict numbers for the command lines of gradsync-run, gradsync-bench and gradsync-train:
// the whole value must be the number (no space, no '+', no hex, no trailing junk), within the
// flag's range, and a refusal reads "--flag: 'value' is not <kind> in [lo, hi]". strtol and
// strtod take " 5", "0x10" and "inf", and a cast to int turns 2^32 into 0; these do not.
//
// Header-only and free of the library, so gradsync-run (which links nothing of it) can use it.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

namespace gradsync::flags {

// The tools' usage_error: prints the message and exits 2. It must not return.
using Refuse = void (*)(const std::string& message);

inline std::string format_number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

// "--flag: 'value' is not <kind> in [lo, hi]" (kind: "an integer", "a number", ...).
inline std::string refusal(const std::string& flag, const std::string& value,
                           const std::string& kind, const std::string& range) {
  return flag + ": '" + value + "' is not " + kind + " in " + range;
}

// All of `text` as a decimal integer of T; nullopt for anything else, overflow included.
template <class T>
std::optional<T> to_integer(std::string_view text) {
  T x{};
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, x);
  if (text.empty() || ec != std::errc() || ptr != end) return std::nullopt;
  return x;
}

// An integer flag in [lo, hi].
inline long long integer(const std::string& flag, const std::string& value, long long lo,
                         long long hi, Refuse refuse) {
  auto x = to_integer<long long>(value);
  if (!x || *x < lo || *x > hi) {
    refuse(refusal(flag, value, "an integer",
                   "[" + std::to_string(lo) + ", " + std::to_string(hi) + "]"));
    std::abort();  // refuse exits
  }
  return *x;
}

// A finite decimal number flag in [lo, hi], or in (lo, hi] when `lo_open` (a rate that must
// be positive).
inline double number(const std::string& flag, const std::string& value, double lo, double hi,
                     bool lo_open, Refuse refuse) {
  double x = 0;
  const char* end = value.data() + value.size();
  // from_chars reads neither space, '+' nor hex; "inf" and "nan" are caught by isfinite.
  auto [ptr, ec] = std::from_chars(value.data(), end, x);
  const bool ok = !value.empty() && ec == std::errc() && ptr == end && std::isfinite(x) &&
                  (lo_open ? x > lo : x >= lo) && x <= hi;
  if (!ok) {
    refuse(refusal(flag, value, "a number",
                   (lo_open ? "(" : "[") + format_number(lo) + ", " + format_number(hi) + "]"));
    std::abort();
  }
  return x;
}

// A byte count: digits with an optional K, M or G (or KiB, MiB, GiB; k, m, g) suffix, powers
// of 1024, in [lo, hi].
inline std::uint64_t bytes(const std::string& flag, const std::string& value, std::uint64_t lo,
                           std::uint64_t hi, Refuse refuse) {
  std::size_t digits = 0;
  while (digits < value.size() && value[digits] >= '0' && value[digits] <= '9') ++digits;
  const std::string_view suffix = std::string_view(value).substr(digits);
  int shift = -1;
  if (suffix.empty()) shift = 0;
  if (suffix == "K" || suffix == "k" || suffix == "KiB") shift = 10;
  if (suffix == "M" || suffix == "m" || suffix == "MiB") shift = 20;
  if (suffix == "G" || suffix == "g" || suffix == "GiB") shift = 30;
  auto x = to_integer<std::uint64_t>(std::string_view(value).substr(0, digits));
  const bool ok =
      x && shift >= 0 && *x <= (hi >> shift) && (*x << shift) >= lo && (*x << shift) <= hi;
  if (!ok) {
    refuse(refusal(flag, value, "a size",
                   "[" + std::to_string(lo) + ", " + std::to_string(hi) +
                       "] bytes (K, M, G: powers of 1024)"));
    std::abort();
  }
  return *x << shift;
}

// Why `path` cannot be written, or "" when it can: tried by opening it for writing, without
// truncating a file that is there, and removing the file again if the try made it, so a
// long run learns at its start that its report would be lost at its end.
inline std::string cannot_write(const std::string& path) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd >= 0) {
    ::close(fd);
    ::unlink(path.c_str());
    return "";
  }
  if (errno == EEXIST) fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd >= 0) {
    ::close(fd);
    return "";
  }
  return std::strerror(errno);
}

}  // namespace gradsync::flags
