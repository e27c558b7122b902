// The binary format of every saved state (codec, reducer, optimizer, checkpoint files): a
// 4-character kind and a version, then fields in order, little-endian as the machine writes
// them. A reader refuses, naming what it expected, bytes of another kind, another version,
// too few bytes or bytes left over, so an old or foreign file is never half-loaded.
//
// Example:
//   std::uint32_t step = 7;
//   std::vector<float> residual(1024);
//   gradsync::ByteWriter w("GSRD", 2);
//   w.put<std::uint32_t>(step);
//   w.floats(residual);
//   std::vector<std::uint8_t> saved = w.take();
//
//   gradsync::ByteReader r(saved, "GSRD", 2, "reducer state");  // throws unless a GSRD v2
//   step = r.get<std::uint32_t>();
//   r.floats(residual);  // throws unless it holds residual.size() floats
//   r.finish();          // throws on bytes left over
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace gradsync {

class ByteWriter {
 public:
  // `kind`: exactly 4 characters naming the format ("GSRD"); `version` its layout's number.
  ByteWriter(std::string_view kind, std::uint32_t version);

  template <typename T>
  void put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    raw(&value, sizeof value);
  }
  void string(std::string_view s);              // u32 length, the characters
  void bytes(std::span<const std::uint8_t> b);  // u64 length, the bytes
  void floats(std::span<const float> f);        // u64 count, the floats
  void raw(const void* data, std::size_t n);    // n bytes, no length

  const std::vector<std::uint8_t>& data() const { return out_; }
  std::vector<std::uint8_t> take() { return std::move(out_); }

 private:
  std::vector<std::uint8_t> out_;
};

class ByteReader {
 public:
  // Throws Error(kProtocol), naming `what` ("reducer state"), unless `in` starts with
  // `kind` and `version`.
  ByteReader(std::span<const std::uint8_t> in, std::string_view kind, std::uint32_t version,
             std::string what);

  template <typename T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T>);
    T value;
    raw(&value, sizeof value);
    return value;
  }
  std::string string();
  // Reads the next key of a map written in key order (each key once): throws unless it sorts
  // after every key already in `so_far`, so a repeated or reordered entry is refused rather
  // than silently merged.
  template <typename Map>
  std::string key_after(const Map& so_far) {
    std::string key = string();
    if (!so_far.empty() && !(so_far.rbegin()->first < key)) {
      fail("entry '" + key + "' repeated or out of order");
    }
    return key;
  }
  std::span<const std::uint8_t> bytes();  // a view into the input
  std::vector<float> floats();
  // Reads floats stored by ByteWriter::floats into `out`; the stored count must be out.size().
  void floats(std::span<float> out);
  void raw(void* data, std::size_t n);

  bool at_end() const { return at_ == in_.size(); }
  void finish() const;  // throws if bytes are left
  // Throws Error(kProtocol): "<what>: <why>".
  [[noreturn]] void fail(const std::string& why) const;

 private:
  std::span<const std::uint8_t> in_;
  std::size_t at_ = 0;
  std::string what_;
};

}  // namespace gradsync
