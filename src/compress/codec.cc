// The codecs that are plain casts (none, fp16, bf16), the error-feedback wrapper, and the
// per-tensor state format.
#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include "compress/codecs.h"
#include "gradsync/bytes.h"
#include "kernels/kernels.h"

namespace gradsync::compress {

namespace {

class NoneCodec final : public Codec {
 public:
  std::string spec() const override { return "none"; }
  bool biased() const override { return false; }
  std::size_t encoded_bytes(std::size_t count) const override { return count * 4; }
  void encode(const Tensor&, std::span<const float> in, std::vector<std::uint8_t>& out) override {
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
  void encode(const Tensor&, std::span<const float> in, std::vector<std::uint8_t>& out) override {
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

std::string with_key(const std::string& spec, const std::string& kv) {
  return spec + (spec.find(':') == std::string::npos ? ":" : ",") + kv;
}

// Layouts of the saved states (gradsync/bytes.h): a new layout takes the next number.
constexpr std::uint32_t kTensorStateVersion = 1;
constexpr std::uint32_t kFeedbackStateVersion = 2;

}  // namespace

std::string format_number(double v) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, ec == std::errc() ? end : buf);
}

[[noreturn]] void bad_payload(const std::string& codec, const std::string& why) {
  throw Error(ErrorKind::kProtocol, codec + " payload: " + why, Error::kUnknownRank, Error::kNoPeer,
              "decode");
}

void check_encodable(const std::string& codec, const Tensor& tensor, std::size_t count) {
  if (count > std::numeric_limits<std::uint32_t>::max()) {
    throw Error(ErrorKind::kInvalidArgument,
                codec + " encodes at most 2^32-1 elements; tensor '" + tensor.name + "' has " +
                    std::to_string(count),
                Error::kUnknownRank, Error::kNoPeer, "encode", count * 4);
  }
}

void expect_bytes(const std::string& codec, std::span<const std::uint8_t> payload, std::size_t want,
                  std::size_t count) {
  if (payload.size() != want) {
    bad_payload(codec, std::to_string(payload.size()) + " bytes, but " + std::to_string(count) +
                           " elements take " + std::to_string(want));
  }
}

void Codec::load_state(std::span<const std::uint8_t> state) {
  if (!state.empty()) bad_payload(spec() + " state", "this codec keeps none");
}

void Codec::decode_add(std::span<const std::uint8_t> payload, std::span<float> out) const {
  thread_local std::vector<float> decoded;
  decoded.resize(out.size());
  decode(payload, decoded);
  if (!out.empty()) {
    kernels::reduce_into(out.data(), decoded.data(), out.size(), DataType::kFloat32,
                         ReduceOp::kSum);
  }
}

std::vector<std::uint8_t> save_tensor_state(const char magic[4],
                                            const std::map<std::string, std::vector<float>>& m) {
  ByteWriter w(std::string_view(magic, 4), kTensorStateVersion);
  w.put(static_cast<std::uint32_t>(m.size()));
  for (const auto& [name, v] : m) {
    w.string(name);
    w.floats(v);
  }
  return w.take();
}

std::map<std::string, std::vector<float>> load_tensor_state(const char magic[4],
                                                            std::span<const std::uint8_t> s) {
  ByteReader r(s, std::string_view(magic, 4), kTensorStateVersion,
               "codec state '" + std::string(magic, 4) + "'");
  const auto entries = r.get<std::uint32_t>();
  std::map<std::string, std::vector<float>> loaded;
  for (std::uint32_t t = 0; t < entries; ++t) {
    std::string name = r.key_after(loaded);
    loaded[std::move(name)] = r.floats();
  }
  r.finish();
  return loaded;
}

std::uint64_t next_step(std::map<std::string, std::vector<float>>& steps, const std::string& name) {
  std::vector<float>& v = steps[name];
  if (v.size() != 2) v.assign(2, 0.0f);
  const std::uint64_t step =
      static_cast<std::uint64_t>(v[0]) * (1ull << 24) + static_cast<std::uint64_t>(v[1]);
  v[0] = static_cast<float>((step + 1) >> 24);
  v[1] = static_cast<float>((step + 1) & ((1ull << 24) - 1));
  return step;
}

std::string ErrorFeedback::spec() const {
  std::string spec = with_key(inner_->spec(), "ef=1");
  if (momentum_ > 0) spec += ",momentum=" + format_number(momentum_spec_);
  return spec;
}

FeedbackState ErrorFeedback::state(const Tensor& tensor, std::size_t count) {
  Owned& own = owned_[tensor.name];
  if (own.residual.empty()) {
    own.residual.assign(count, 0.0f);
    if (momentum_ > 0) own.momentum.assign(count, 0.0f);
  }
  if (own.residual.size() != count) {
    throw Error(ErrorKind::kInvalidArgument,
                "tensor '" + tensor.name + "' has " + std::to_string(count) +
                    " elements, its error-feedback residual " +
                    std::to_string(own.residual.size()) + ": one name per tensor",
                Error::kUnknownRank, Error::kNoPeer, "encode");
  }
  return {own.residual, own.momentum};
}

void ErrorFeedback::owe(FeedbackState s, std::span<const float> in, std::span<float> owed) const {
  if (momentum_ == 0) {
    for (std::size_t i = 0; i < in.size(); ++i) owed[i] = s.residual[i] + in[i];
    return;
  }
  for (std::size_t i = 0; i < in.size(); ++i) {
    s.momentum[i] = momentum_ * s.momentum[i] + in[i];
    owed[i] = s.residual[i] + s.momentum[i];
  }
}

void ErrorFeedback::keep_unsent(FeedbackState s, std::span<const std::uint32_t> sent) const {
  for (std::uint32_t i : sent) s.residual[i] = 0.0f;
  if (momentum_ == 0) return;
  for (std::uint32_t i : sent) s.momentum[i] = 0.0f;
}

std::span<const float> ErrorFeedback::held_back(const std::string& tensor) const {
  const auto own = owned_.find(tensor);
  return own == owned_.end() ? std::span<const float>()
                             : std::span<const float>(own->second.residual);
}

void ErrorFeedback::encode(const Tensor& tensor, std::span<const float> in,
                           std::vector<std::uint8_t>& out) {
  encode(state(tensor, in.size()), tensor, in, out);
}

void ErrorFeedback::encode(FeedbackState s, const Tensor& tensor, std::span<const float> in,
                           std::vector<std::uint8_t>& out) {
  // What is owed goes to scratch first: an encoder that refuses the step (a NaN) leaves the
  // residual as it was. The scratch only grows, so tensors of other sizes taking turns do not
  // reallocate or zero it.
  if (owed_.size() < in.size()) owed_.resize(in.size());
  const std::span<float> owed(owed_.data(), in.size());
  owe(s, in, owed);
  inner_->encode(tensor, owed, out);
  if (const auto* in_place = dynamic_cast<const SubtractsPayload*>(inner_.get())) {
    // Sparse codecs take what they sent off `owed` in place, touching just their k elements.
    if (momentum_ > 0) std::copy(owed.begin(), owed.end(), s.residual.begin());
    in_place->subtract(out, owed);
    // Momentum factor masking: where the codec sent, what is owed and what is left differ,
    // and the momentum starts again from zero.
    for (std::size_t i = 0; i < owed.size() && momentum_ > 0; ++i) {
      if (owed[i] != s.residual[i]) s.momentum[i] = 0.0f;
    }
  } else {
    sent_.resize(in.size());
    inner_->decode(out, sent_);
    for (std::size_t i = 0; i < in.size(); ++i) owed[i] -= sent_[i];
  }
  std::copy(owed.begin(), owed.end(), s.residual.begin());
}

// "GSEW" v2: the inner codec's state, then per tensor its name, residual and momentum
// (no floats without momentum).
std::vector<std::uint8_t> ErrorFeedback::save_state() const {
  ByteWriter w("GSEW", kFeedbackStateVersion);
  w.bytes(inner_->save_state());
  w.put(static_cast<std::uint32_t>(owned_.size()));
  for (const auto& [name, own] : owned_) {
    w.string(name);
    w.floats(own.residual);
    w.floats(own.momentum);
  }
  return w.take();
}

void ErrorFeedback::load_state(std::span<const std::uint8_t> state) {
  ByteReader r(state, "GSEW", kFeedbackStateVersion, "error-feedback state");
  const std::span<const std::uint8_t> inner = r.bytes();
  const auto entries = r.get<std::uint32_t>();
  std::map<std::string, Owned> loaded;
  for (std::uint32_t t = 0; t < entries; ++t) {
    std::string name = r.key_after(loaded);
    Owned own{r.floats(), r.floats()};
    if (momentum_ == 0 && !own.momentum.empty()) {
      r.fail("tensor '" + name + "' holds momentum, but " + spec() + " has none");
    }
    if (momentum_ > 0 && own.momentum.size() != own.residual.size()) {
      r.fail("tensor '" + name + "' has " + std::to_string(own.momentum.size()) +
             " momentum floats for " + std::to_string(own.residual.size()) + " residual ones");
    }
    loaded[std::move(name)] = std::move(own);
  }
  r.finish();
  inner_->load_state(inner);  // may throw: nothing of ours replaced yet
  owned_ = std::move(loaded);
}

std::unique_ptr<Codec> make_none(const CodecSpec&) {
  return std::make_unique<NoneCodec>();
}

std::unique_ptr<Codec> make_fp16(const CodecSpec&) {
  return std::make_unique<HalfCodec>(DataType::kFloat16);
}

std::unique_ptr<Codec> make_bf16(const CodecSpec&) {
  return std::make_unique<HalfCodec>(DataType::kBFloat16);
}

}  // namespace gradsync::compress
