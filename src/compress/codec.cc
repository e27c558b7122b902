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

constexpr char kFeedbackMagic[4] = {'G', 'S', 'E', 'F'};
constexpr char kWrapperMagic[4] = {'G', 'S', 'E', 'W'};
constexpr char kMomentumMagic[4] = {'G', 'S', 'E', 'M'};

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
  std::vector<std::uint8_t> s;
  auto append = [&](const void* p, std::size_t n) {
    const std::size_t at = s.size();
    s.resize(at + n);
    if (n) std::memcpy(s.data() + at, p, n);
  };
  append(magic, 4);
  const auto entries = static_cast<std::uint32_t>(m.size());
  append(&entries, 4);
  for (const auto& [name, v] : m) {
    const auto len = static_cast<std::uint32_t>(name.size());
    const std::uint64_t floats = v.size();
    append(&len, 4);
    append(name.data(), name.size());
    append(&floats, 8);
    append(v.data(), v.size() * 4);
  }
  return s;
}

std::map<std::string, std::vector<float>> load_tensor_state(const char magic[4],
                                                            std::span<const std::uint8_t> s) {
  const std::string what = "codec state '" + std::string(magic, 4) + "'";
  std::size_t at = 0;
  auto take = [&](void* p, std::size_t n) {
    if (s.size() - at < n) bad_payload(what, "truncated at byte " + std::to_string(at));
    if (n) std::memcpy(p, s.data() + at, n);  // an empty name or vector has no buffer
    at += n;
  };
  char found[4];
  take(found, 4);
  if (std::memcmp(found, magic, 4) != 0) bad_payload(what, "not one (magic)");
  std::uint32_t entries;
  take(&entries, 4);
  std::map<std::string, std::vector<float>> loaded;
  for (std::uint32_t t = 0; t < entries; ++t) {
    std::uint32_t len;
    take(&len, 4);
    std::string name(len <= s.size() - at ? len : 0, '\0');
    if (name.size() != len) bad_payload(what, "name longer than the state");
    take(name.data(), len);
    // Written in name order, each once: anything else is not a state this wrote.
    if (!loaded.empty() && name <= loaded.rbegin()->first) {
      bad_payload(what, "entry '" + name + "' out of order");
    }
    std::uint64_t floats;
    take(&floats, 8);
    if (floats > (s.size() - at) / 4) bad_payload(what, "entry longer than the state");
    std::vector<float> v(floats);
    take(v.data(), floats * 4);
    loaded[name] = std::move(v);
  }
  if (at != s.size()) bad_payload(what, "trailing bytes");
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

std::vector<float>& ErrorFeedback::state_of(std::map<std::string, std::vector<float>>& states,
                                            const Tensor& tensor, std::size_t count,
                                            const char* what) {
  // A tensor's own state while its bucket's is joined would be a second, stale copy.
  if (!joined_.contains(tensor.name)) split_holder_of(tensor.name);
  std::vector<float>& r = states[tensor.name];
  if (r.empty()) r.assign(count, 0.0f);
  if (r.size() != count) {
    throw Error(ErrorKind::kInvalidArgument,
                "tensor '" + tensor.name + "' has " + std::to_string(count) + " elements, its " +
                    what + " " + std::to_string(r.size()) + ": one name per tensor",
                Error::kUnknownRank, Error::kNoPeer, "encode");
  }
  return r;
}

std::vector<float>& ErrorFeedback::residual(const Tensor& tensor, std::size_t count) {
  return state_of(residuals_, tensor, count, "error-feedback residual");
}

void ErrorFeedback::owe(const Tensor& tensor, std::span<const float> in, std::span<float> owed) {
  const std::vector<float>& r = residual(tensor, in.size());
  if (momentum_ == 0) {
    for (std::size_t i = 0; i < in.size(); ++i) owed[i] = r[i] + in[i];
    return;
  }
  std::vector<float>& u = state_of(velocities_, tensor, in.size(), "momentum");
  for (std::size_t i = 0; i < in.size(); ++i) {
    u[i] = momentum_ * u[i] + in[i];
    owed[i] = r[i] + u[i];
  }
}

std::span<float> ErrorFeedback::owe_next(const Tensor& tensor, std::span<const float> in) {
  std::vector<float>& owed = next_residual_[tensor.name];
  owed.resize(in.size());
  owe(tensor, in, owed);
  return owed;
}

void ErrorFeedback::keep_unsent(const Tensor& tensor, std::span<const std::uint32_t> sent) {
  std::vector<float>& owed = next_residual_[tensor.name];
  std::vector<float>& r = residual(tensor, owed.size());
  r.swap(owed);
  for (std::uint32_t i : sent) r[i] = 0.0f;
  if (momentum_ == 0) return;
  std::vector<float>& u = state_of(velocities_, tensor, r.size(), "momentum");
  for (std::uint32_t i : sent) u[i] = 0.0f;
}

void ErrorFeedback::join(const Tensor& bucket, std::span<const TensorSlice> parts,
                         std::size_t count) {
  if (const auto it = joined_.find(bucket.name);
      it != joined_.end() &&
      std::equal(it->second.begin(), it->second.end(), parts.begin(), parts.end(),
                 [](const TensorSlice& a, const TensorSlice& b) {
                   return a.tensor.name == b.tensor.name && a.offset == b.offset &&
                          a.count == b.count;
                 })) {
    return;  // as last time: the state is where the call will look for it
  }
  // The bucket under another layout, and every joined bucket a part (or the bucket's name)
  // travelled in or is named like, hand their state back first.
  split(bucket.name);
  split_holder_of(bucket.name);
  for (const TensorSlice& part : parts) {
    split(part.tensor.name);
    split_holder_of(part.tensor.name);
  }
  std::vector<float> wholes[2];
  const std::array states{&residuals_, &velocities_};
  const int kinds = momentum_ > 0 ? 2 : 1;
  for (int kind = 0; kind < kinds; ++kind) {  // may throw (a size changed): nothing moved yet
    wholes[kind].assign(count, 0.0f);
    for (const TensorSlice& part : parts) {
      const std::vector<float>& own = state_of(*states[kind], part.tensor, part.count,
                                               kind == 0 ? "error-feedback residual" : "momentum");
      std::copy(own.begin(), own.end(), wholes[kind].begin() + static_cast<long>(part.offset));
    }
  }
  for (int kind = 0; kind < kinds; ++kind) {
    for (const TensorSlice& part : parts) states[kind]->erase(part.tensor.name);
    (*states[kind])[bucket.name] = std::move(wholes[kind]);
  }
  joined_[bucket.name].assign(parts.begin(), parts.end());
  for (const TensorSlice& part : parts) {
    bucket_of_[part.tensor.name] = bucket.name;
    next_residual_.erase(part.tensor.name);
  }
}

namespace {

// Moves the entry `bucket` of `states` into one entry per part.
void split_into_parts(std::map<std::string, std::vector<float>>& states, const std::string& bucket,
                      const std::vector<TensorSlice>& parts) {
  auto node = states.extract(bucket);  // first: a part may share the bucket's name
  if (node.empty()) return;
  const std::vector<float>& whole = node.mapped();
  for (const TensorSlice& part : parts) {
    const auto from = whole.begin() + static_cast<long>(part.offset);
    states[part.tensor.name].assign(from, from + static_cast<long>(part.count));
  }
}

}  // namespace

void ErrorFeedback::split(const std::string& bucket) {
  const auto node = joined_.extract(bucket);
  if (node.empty()) return;
  split_into_parts(residuals_, bucket, node.mapped());
  split_into_parts(velocities_, bucket, node.mapped());
  next_residual_.erase(bucket);
  for (const TensorSlice& part : node.mapped()) bucket_of_.erase(part.tensor.name);
}

std::span<const float> ErrorFeedback::held_back(const std::string& tensor) const {
  if (const auto bucket = bucket_of_.find(tensor); bucket != bucket_of_.end()) {
    const std::vector<float>& whole = residuals_.at(bucket->second);
    for (const TensorSlice& part : joined_.at(bucket->second)) {
      if (part.tensor.name == tensor) {
        return std::span<const float>(whole).subspan(part.offset, part.count);
      }
    }
  }
  const auto own = residuals_.find(tensor);
  return own == residuals_.end() ? std::span<const float>() : std::span<const float>(own->second);
}

void ErrorFeedback::split_holder_of(const std::string& name) {
  if (const auto it = bucket_of_.find(name); it != bucket_of_.end()) split(it->second);
}

std::map<std::string, std::vector<float>> ErrorFeedback::per_tensor(
    const std::map<std::string, std::vector<float>>& states) const {
  std::map<std::string, std::vector<float>> out = states;
  for (const auto& [bucket, parts] : joined_) split_into_parts(out, bucket, parts);
  return out;
}

void ErrorFeedback::clear_sent_momentum(const Tensor& tensor, std::span<const float> owed) {
  if (momentum_ == 0) return;
  const std::vector<float>& r = residual(tensor, owed.size());
  std::vector<float>& u = state_of(velocities_, tensor, owed.size(), "momentum");
  for (std::size_t i = 0; i < owed.size(); ++i) {
    if (r[i] != owed[i]) u[i] = 0.0f;
  }
}

void ErrorFeedback::encode(const Tensor& tensor, std::span<const float> in,
                           std::vector<std::uint8_t>& out) {
  // What is owed now; the residual changes only once the encoding succeeded.
  const std::span<float> owed = owe_next(tensor, in);
  std::vector<float>& r = residual(tensor, in.size());
  inner_->encode(tensor, owed, out);
  const auto* in_place = dynamic_cast<const SubtractsPayload*>(inner_.get());
  if (in_place) {
    if (momentum_ > 0) sent_.assign(owed.begin(), owed.end());  // kept to see what was sent
    in_place->subtract(out, owed);
  } else {
    sent_.resize(in.size());
    inner_->decode(out, sent_);
    for (std::size_t i = 0; i < in.size(); ++i) owed[i] -= sent_[i];
  }
  r.swap(next_residual_[tensor.name]);
  if (in_place && momentum_ > 0) clear_sent_momentum(tensor, sent_);
}

// "GSEW", u64 bytes of the inner codec's state, that state, u64 bytes of the residuals, the
// residuals, then the momentum (no tensors without momentum).
std::vector<std::uint8_t> ErrorFeedback::save_state() const {
  const std::vector<std::uint8_t> inner = inner_->save_state();
  const std::vector<std::uint8_t> residuals =
      save_tensor_state(kFeedbackMagic, per_tensor(residuals_));
  const std::vector<std::uint8_t> velocities =
      save_tensor_state(kMomentumMagic, per_tensor(velocities_));
  std::vector<std::uint8_t> s(20 + inner.size() + residuals.size() + velocities.size());
  std::memcpy(s.data(), kWrapperMagic, 4);
  std::size_t at = 4;
  for (const auto* part : {&inner, &residuals}) {
    const std::uint64_t bytes = part->size();
    std::memcpy(s.data() + at, &bytes, 8);
    if (!part->empty()) std::memcpy(s.data() + at + 8, part->data(), part->size());
    at += 8 + part->size();
  }
  std::memcpy(s.data() + at, velocities.data(), velocities.size());
  return s;
}

void ErrorFeedback::load_state(std::span<const std::uint8_t> state) {
  if (state.size() < 4 || std::memcmp(state.data(), kWrapperMagic, 4) != 0) {
    bad_payload("error-feedback state", "not one (magic)");
  }
  std::size_t at = 4;
  std::span<const std::uint8_t> parts[2];
  for (auto& part : parts) {
    std::uint64_t bytes;
    if (state.size() - at < 8) bad_payload("error-feedback state", "truncated");
    std::memcpy(&bytes, state.data() + at, 8);
    if (bytes > state.size() - at - 8) bad_payload("error-feedback state", "truncated");
    part = state.subspan(at + 8, bytes);
    at += 8 + bytes;
  }
  auto residuals = load_tensor_state(kFeedbackMagic, parts[1]);
  auto velocities = load_tensor_state(kMomentumMagic, state.subspan(at));
  if (momentum_ == 0 && !velocities.empty()) {
    bad_payload("error-feedback state", "holds momentum, but " + spec() + " has none");
  }
  inner_->load_state(parts[0]);  // may throw: nothing of ours replaced yet
  residuals_ = std::move(residuals);
  velocities_ = std::move(velocities);
  joined_.clear();  // what was loaded is per tensor
  bucket_of_.clear();
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
