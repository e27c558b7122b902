// The one JSON writer of gradsync-bench, gradsync-train and the peer benchmarks: escaping,
// objects and arrays with their commas, and numbers printed so they parse back exactly.
// Header-only and standard C++ only, so the peer benchmarks (which link no gradsync) use it too.
//
//   gradsync::json::Writer w(file);
//   w.begin_object().field("ranks", 4).field("losses", losses).end_object();
#pragma once

#include <charconv>
#include <cmath>
#include <concepts>
#include <cstdio>
#include <ostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace gradsync::json {

// `s` as it stands between a JSON string's quotes. Bytes from 0x80 up pass through, so
// UTF-8 stays UTF-8.
inline std::string escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (const char ch : s) {
    switch (ch) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20) {
          char code[8];
          std::snprintf(code, sizeof code, "\\u%04x", static_cast<unsigned>(ch));
          out += code;
        } else {
          out += ch;
        }
    }
  }
  return out;
}

// What JSON writes as a number: any integer or floating-point type but bool (true or false).
template <class T>
concept Number = (std::integral<T> && !std::same_as<T, bool>) || std::floating_point<T>;

// The shortest text that reads back as exactly `x` (std::to_chars), so a loss compared bit
// for bit across two runs compares as text too. JSON has no NaN or infinity: those are null.
template <Number T>
std::string number(T x) {
  if constexpr (std::floating_point<T>) {
    if (!std::isfinite(x)) return "null";
  }
  char text[64];
  const auto end = std::to_chars(text, text + sizeof text, x).ptr;
  return {text, end};
}

// Writes one JSON document to a stream as the calls arrive. The outermost object or array
// puts each member on a line of its own and everything inside it stays on one line: a
// benchmark record, a configuration or a series of losses is one line a script can grep.
// Calls out of order (a key outside an object, a value without its key, an end that does
// not match) throw std::logic_error.
class Writer {
 public:
  explicit Writer(std::ostream& out) : out_(out) {}

  Writer& begin_object() { return open('{', true); }
  Writer& end_object() { return close('}', true); }
  Writer& begin_array() { return open('[', false); }
  Writer& end_array() { return close(']', false); }

  Writer& key(std::string_view name) {
    if (open_.empty() || !open_.back().is_object || key_written_) misuse("a key outside an object");
    separate();
    out_ << '"' << escape(name) << "\": ";
    key_written_ = true;
    return *this;
  }

  Writer& value(std::string_view s) {
    begin_value();
    out_ << '"' << escape(s) << '"';
    return *this;
  }
  // Without it a string literal would convert to bool before string_view.
  Writer& value(const char* s) { return value(std::string_view(s)); }
  Writer& value(bool b) {
    begin_value();
    out_ << (b ? "true" : "false");
    return *this;
  }
  template <Number T>
  Writer& value(T x) {
    begin_value();
    out_ << number(x);
    return *this;
  }
  template <class T>
  Writer& value(const std::vector<T>& items) {
    begin_array();
    for (const T& item : items) value(item);
    return end_array();
  }

  template <class T>
  Writer& field(std::string_view name, const T& v) {
    key(name);
    return value(v);
  }

 private:
  struct Open {
    bool is_object;
    bool has_members = false;
  };

  [[noreturn]] static void misuse(const char* what) {
    throw std::logic_error(std::string("json::Writer: ") + what);
  }

  // The comma (and at the outermost level the line break) before a member.
  void separate() {
    Open& level = open_.back();
    if (open_.size() == 1) {
      out_ << (level.has_members ? ",\n  " : "\n  ");
    } else if (level.has_members) {
      out_ << ", ";
    }
    level.has_members = true;
  }

  void begin_value() {
    if (open_.empty()) {
      if (done_) misuse("a second document");
      return;
    }
    if (open_.back().is_object) {
      if (!key_written_) misuse("a value in an object without its key");
      key_written_ = false;
    } else {
      separate();
    }
  }

  Writer& open(char bracket, bool is_object) {
    begin_value();
    out_ << bracket;
    open_.push_back({is_object});
    return *this;
  }

  Writer& close(char bracket, bool is_object) {
    if (open_.empty() || open_.back().is_object != is_object || key_written_) {
      misuse("an end that does not match what is open");
    }
    const bool outermost = open_.size() == 1;
    if (outermost && open_.back().has_members) out_ << '\n';
    out_ << bracket;
    open_.pop_back();
    if (outermost) {
      out_ << '\n';
      done_ = true;
    }
    return *this;
  }

  std::ostream& out_;
  std::vector<Open> open_;
  bool key_written_ = false;  // a key waits for its value
  bool done_ = false;         // the outermost value is closed
};

}  // namespace gradsync::json
