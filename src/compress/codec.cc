// Spec parsing, the dense codecs (none, fp16, bf16, int8 with per-block scales) and the
// error-feedback wrapper.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <set>

#include "gradsync/compress.h"
#include "gradsync/error.h"
#include "kernels/kernels.h"

namespace gradsync::compress {

namespace {

[[noreturn]] void bad_spec(std::string_view spec, const std::string& why) {
  throw Error(ErrorKind::kInvalidArgument,
              "codec spec '" + std::string(spec) + "': " + why +
                  " (like \"none\", \"fp16\", \"bf16\", \"int8:block=256\", \"int8:ef=0\")");
}

[[noreturn]] void bad_payload(const std::string& codec, const std::string& why) {
  throw Error(ErrorKind::kProtocol, codec + " payload: " + why, Error::kUnknownRank, Error::kNoPeer,
              "decode");
}

// Keys each codec takes. ef (error feedback) goes with every codec.
const std::set<std::string>& keys_of(const std::string& name) {
  static const std::map<std::string, std::set<std::string>> keys = {
      {"none", {"ef"}}, {"fp16", {"ef"}}, {"bf16", {"ef"}}, {"int8", {"block", "ef"}}};
  static const std::set<std::string> none;
  auto it = keys.find(name);
  return it == keys.end() ? none : it->second;
}

void put_u32(std::vector<std::uint8_t>& out, std::size_t at, std::uint32_t v) {
  std::memcpy(out.data() + at, &v, sizeof v);
}
std::uint32_t get_u32(std::span<const std::uint8_t> in, std::size_t at) {
  std::uint32_t v;
  std::memcpy(&v, in.data() + at, sizeof v);
  return v;
}

void expect_bytes(const std::string& codec, std::span<const std::uint8_t> payload, std::size_t want,
                  std::size_t count) {
  if (payload.size() != want) {
    bad_payload(codec, std::to_string(payload.size()) + " bytes, but " + std::to_string(count) +
                           " elements take " + std::to_string(want));
  }
}

class NoneCodec final : public Codec {
 public:
  std::string spec() const override { return "none"; }
  bool biased() const override { return false; }
  std::size_t encoded_bytes(std::size_t count) const override { return count * 4; }
  void encode(const std::string&, std::span<const float> in,
              std::vector<std::uint8_t>& out) override {
    out.resize(in.size_bytes());
    if (!in.empty()) std::memcpy(out.data(), in.data(), in.size_bytes());
  }
  void decode(std::span<const std::uint8_t> payload, std::span<float> out) const override {
    expect_bytes("none", payload, encoded_bytes(out.size()), out.size());
    if (!out.empty()) std::memcpy(out.data(), payload.data(), payload.size());
  }
};

// float16 or bfloat16 on the wire: half the bytes, one rounding (to nearest even).
class HalfCodec final : public Codec {
 public:
  explicit HalfCodec(DataType wire) : wire_(wire) {}
  std::string spec() const override { return wire_ == DataType::kBFloat16 ? "bf16" : "fp16"; }
  bool biased() const override { return false; }
  std::size_t encoded_bytes(std::size_t count) const override { return count * 2; }
  void encode(const std::string&, std::span<const float> in,
              std::vector<std::uint8_t>& out) override {
    out.resize(in.size() * 2);
    kernels::float_to_16bit(in.data(), reinterpret_cast<std::uint16_t*>(out.data()), in.size(),
                            wire_);
  }
  void decode(std::span<const std::uint8_t> payload, std::span<float> out) const override {
    expect_bytes(spec(), payload, encoded_bytes(out.size()), out.size());
    kernels::float_from_16bit(reinterpret_cast<const std::uint16_t*>(payload.data()), out.data(),
                              out.size(), wire_);
  }

 private:
  DataType wire_;
};

// Symmetric 8-bit quantisation with one float32 scale per block of `block` elements:
// q = round(x / s) with s = max|x| / 127 over the block, so every element is off by at most
// half a step (s / 2). Payload: u32 count, u32 block, the scales, then the int8 values.
class Int8Codec final : public Codec {
 public:
  explicit Int8Codec(std::size_t block) : block_(block) {}
  std::string spec() const override { return "int8:block=" + std::to_string(block_); }
  bool biased() const override { return true; }
  std::size_t encoded_bytes(std::size_t count) const override {
    return 8 + 4 * blocks(count) + count;
  }
  void encode(const std::string& tensor, std::span<const float> in,
              std::vector<std::uint8_t>& out) override {
    const std::size_t n = in.size(), nb = blocks(n);
    out.assign(encoded_bytes(n), 0);
    put_u32(out, 0, static_cast<std::uint32_t>(n));
    put_u32(out, 4, static_cast<std::uint32_t>(block_));
    auto* q = reinterpret_cast<std::int8_t*>(out.data() + 8 + 4 * nb);
    for (std::size_t b = 0; b < nb; ++b) {
      const std::size_t lo = b * block_, hi = std::min(n, lo + block_);
      float peak = 0;
      for (std::size_t i = lo; i < hi; ++i) {
        if (!std::isfinite(in[i])) {
          throw Error(ErrorKind::kInvalidArgument,
                      "tensor '" + tensor + "' has " + (std::isnan(in[i]) ? "NaN" : "Inf") +
                          " at element " + std::to_string(i) + ": int8 cannot carry it",
                      Error::kUnknownRank, Error::kNoPeer, "encode");
        }
        peak = std::max(peak, std::fabs(in[i]));
      }
      const float scale = peak / 127.0f;
      std::memcpy(out.data() + 8 + 4 * b, &scale, 4);
      const float inverse = scale > 0 ? 1.0f / scale : 0.0f;
      for (std::size_t i = lo; i < hi; ++i) {
        const float v = std::nearbyint(in[i] * inverse);
        q[i] = static_cast<std::int8_t>(std::clamp(v, -127.0f, 127.0f));
      }
    }
  }
  void decode(std::span<const std::uint8_t> payload, std::span<float> out) const override {
    if (payload.size() < 8) bad_payload("int8", "shorter than its 8-byte header");
    const std::size_t n = get_u32(payload, 0), block = get_u32(payload, 4);
    if (n != out.size()) {
      bad_payload("int8", "holds " + std::to_string(n) + " elements, expected " +
                              std::to_string(out.size()));
    }
    if (block != block_) {
      bad_payload("int8",
                  "block " + std::to_string(block) + ", expected " + std::to_string(block_));
    }
    expect_bytes("int8", payload, encoded_bytes(n), n);
    const std::size_t nb = blocks(n);
    const auto* q = reinterpret_cast<const std::int8_t*>(payload.data() + 8 + 4 * nb);
    for (std::size_t b = 0; b < nb; ++b) {
      float scale;
      std::memcpy(&scale, payload.data() + 8 + 4 * b, 4);
      if (!std::isfinite(scale) || scale < 0) {
        bad_payload("int8", "block " + std::to_string(b) + " has scale " + std::to_string(scale));
      }
      const std::size_t lo = b * block_, hi = std::min(n, lo + block_);
      for (std::size_t i = lo; i < hi; ++i) out[i] = static_cast<float>(q[i]) * scale;
    }
  }

 private:
  std::size_t blocks(std::size_t n) const { return (n + block_ - 1) / block_; }
  std::size_t block_;
};

// Error feedback (Seide et al. 2014; Karimireddy et al. 2019, EF-SignSGD): the part of each
// step's gradient the wire could not carry is kept per tensor and added to the next step's
// before encoding, so over T steps transmitted + residual = the sum of the inputs.
class ErrorFeedback final : public Codec {
 public:
  explicit ErrorFeedback(std::unique_ptr<Codec> inner) : inner_(std::move(inner)) {}
  std::string spec() const override { return with_key(inner_->spec(), "ef=1"); }
  bool biased() const override { return false; }  // over time, nothing is lost
  std::size_t encoded_bytes(std::size_t count) const override {
    return inner_->encoded_bytes(count);
  }
  void encode(const std::string& tensor, std::span<const float> in,
              std::vector<std::uint8_t>& out) override {
    std::vector<float>& residual = residuals_[tensor];
    if (residual.empty()) residual.assign(in.size(), 0.0f);
    if (residual.size() != in.size()) {
      throw Error(ErrorKind::kInvalidArgument,
                  "tensor '" + tensor + "' has " + std::to_string(in.size()) +
                      " elements, its error-feedback residual " + std::to_string(residual.size()) +
                      ": one name per tensor",
                  Error::kUnknownRank, Error::kNoPeer, "encode");
    }
    // What is owed now; the residual changes only once the encoding succeeded.
    owed_.resize(in.size());
    for (std::size_t i = 0; i < in.size(); ++i) owed_[i] = residual[i] + in[i];
    inner_->encode(tensor, owed_, out);
    sent_.resize(in.size());
    inner_->decode(out, sent_);
    for (std::size_t i = 0; i < in.size(); ++i) residual[i] = owed_[i] - sent_[i];
  }
  void decode(std::span<const std::uint8_t> payload, std::span<float> out) const override {
    inner_->decode(payload, out);
  }

  // "GSEF", u32 tensors, then per tensor: u32 name bytes, name, u64 floats, floats.
  std::vector<std::uint8_t> save_state() const override {
    std::vector<std::uint8_t> s;
    auto append = [&](const void* p, std::size_t n) {
      const std::size_t at = s.size();
      s.resize(at + n);
      if (n) std::memcpy(s.data() + at, p, n);
    };
    append(kMagic, 4);
    const auto tensors = static_cast<std::uint32_t>(residuals_.size());
    append(&tensors, 4);
    for (const auto& [name, r] : residuals_) {
      const auto len = static_cast<std::uint32_t>(name.size());
      const std::uint64_t floats = r.size();
      append(&len, 4);
      append(name.data(), name.size());
      append(&floats, 8);
      append(r.data(), r.size() * 4);
    }
    return s;
  }
  void load_state(std::span<const std::uint8_t> s) override {
    std::size_t at = 0;
    auto take = [&](void* p, std::size_t n) {
      if (s.size() - at < n) {
        bad_payload("error-feedback state", "truncated at byte " + std::to_string(at));
      }
      if (n) std::memcpy(p, s.data() + at, n);  // an empty name or residual has no buffer
      at += n;
    };
    char magic[4];
    take(magic, 4);
    if (std::memcmp(magic, kMagic, 4) != 0) bad_payload("error-feedback state", "not one (magic)");
    std::uint32_t tensors;
    take(&tensors, 4);
    std::map<std::string, std::vector<float>> loaded;
    for (std::uint32_t t = 0; t < tensors; ++t) {
      std::uint32_t len;
      take(&len, 4);
      std::string name(len <= s.size() - at ? len : 0, '\0');
      if (name.size() != len) bad_payload("error-feedback state", "name longer than the state");
      take(name.data(), len);
      std::uint64_t floats;
      take(&floats, 8);
      if (floats > (s.size() - at) / 4)
        bad_payload("error-feedback state", "residual longer than the state");
      std::vector<float> r(floats);
      take(r.data(), floats * 4);
      loaded[name] = std::move(r);
    }
    if (at != s.size()) bad_payload("error-feedback state", "trailing bytes");
    residuals_ = std::move(loaded);
  }

 private:
  static constexpr char kMagic[4] = {'G', 'S', 'E', 'F'};
  static std::string with_key(const std::string& spec, const std::string& kv) {
    return spec + (spec.find(':') == std::string::npos ? ":" : ",") + kv;
  }
  std::unique_ptr<Codec> inner_;
  std::map<std::string, std::vector<float>> residuals_;
  std::vector<float> owed_, sent_;  // scratch: residual + input, what the wire carried
};

}  // namespace

CodecSpec CodecSpec::parse(std::string_view spec) {
  CodecSpec s;
  const std::size_t colon = spec.find(':');
  s.name = std::string(spec.substr(0, colon));
  if (s.name.empty()) bad_spec(spec, "no codec name");
  const auto& allowed = keys_of(s.name);
  if (allowed.empty()) bad_spec(spec, "unknown codec '" + s.name + "'");
  std::string_view rest = colon == std::string_view::npos ? "" : spec.substr(colon + 1);
  if (colon != std::string_view::npos && rest.empty()) bad_spec(spec, "nothing after ':'");
  while (!rest.empty()) {
    const std::size_t comma = rest.find(',');
    const std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? "" : rest.substr(comma + 1);
    const std::size_t eq = item.find('=');
    if (eq == std::string_view::npos)
      bad_spec(spec, "'" + std::string(item) + "' is not key=value");
    const std::string key(item.substr(0, eq));
    const std::string_view value = item.substr(eq + 1);
    if (!allowed.count(key)) bad_spec(spec, "codec '" + s.name + "' takes no '" + key + "'");
    double v = 0;
    auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
    if (ec != std::errc() || end != value.data() + value.size() || !std::isfinite(v)) {
      bad_spec(spec, "'" + std::string(value) + "' is not a number");
    }
    if (s.params.count(key)) bad_spec(spec, "'" + key + "' given twice");
    s.params[key] = v;
  }
  if (s.params.count("ef") && s.params["ef"] != 0 && s.params["ef"] != 1) {
    bad_spec(spec, "ef is 0 or 1");
  }
  if (s.params.count("block")) {
    const double b = s.params["block"];
    if (b < 1 || b > (1 << 24) || b != std::floor(b))
      bad_spec(spec, "block is a whole number 1..16777216");
  }
  return s;
}

double CodecSpec::get(const std::string& key, double fallback) const {
  auto it = params.find(key);
  return it == params.end() ? fallback : it->second;
}

std::string CodecSpec::to_string() const {
  std::string s = name;
  char sep = ':';
  for (const auto& [k, v] : params) {
    char buf[64];
    auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
    s += sep + k + "=" + std::string(buf, ec == std::errc() ? end : buf);
    sep = ',';
  }
  return s;
}

std::unique_ptr<Codec> make_codec(std::string_view text) {
  const CodecSpec s = CodecSpec::parse(text);
  std::unique_ptr<Codec> codec;
  if (s.name == "none") {
    codec = std::make_unique<NoneCodec>();
  } else if (s.name == "fp16" || s.name == "bf16") {
    codec =
        std::make_unique<HalfCodec>(s.name == "bf16" ? DataType::kBFloat16 : DataType::kFloat16);
  } else {  // int8: parse() admits no other names
    codec = std::make_unique<Int8Codec>(static_cast<std::size_t>(s.get("block", 256)));
  }
  const bool feedback = s.get("ef", codec->biased() ? 1 : 0) != 0;
  if (feedback) codec = std::make_unique<ErrorFeedback>(std::move(codec));
  return codec;
}

}  // namespace gradsync::compress
