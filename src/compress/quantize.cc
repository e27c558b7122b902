// Quantising codecs: int8 (deterministic, per-block scale), qsgd (stochastic, unbiased) and
// sign (one bit per element). int8 and qsgd share one payload layout (Int8Layout), so one
// decoder and one per-hop ring serve both.
#include <algorithm>
#include <cmath>

#include "compress/codecs.h"
#include "kernels/kernels.h"

namespace gradsync::compress {

void refuse_non_finite(const Tensor& tensor, std::span<const float> in, const char* codec) {
  const std::size_t bad = kernels::first_non_finite(in.data(), in.size());
  if (bad == in.size()) return;
  throw Error(ErrorKind::kInvalidArgument,
              "tensor '" + tensor.name + "' has " + (std::isnan(in[bad]) ? "NaN" : "Inf") +
                  " at element " + std::to_string(bad) + ": " + codec + " cannot carry it",
              Error::kUnknownRank, Error::kNoPeer, "encode");
}

void BlockQuantizer::encode(const Tensor& tensor, std::span<const float> in,
                            std::vector<std::uint8_t>& out) {
  check_encodable(name_, tensor, in.size());
  refuse_non_finite(tensor, in, name_.c_str());
  const Int8Layout layout{in.size(), block_};
  out.resize(layout.bytes());
  put_u32(out, 0, static_cast<std::uint32_t>(in.size()));
  put_u32(out, 4, static_cast<std::uint32_t>(block_));
  scales_.resize(layout.blocks());
  begin(tensor);
  quantize(in.data(), in.size(), scales_.data(),
           reinterpret_cast<std::int8_t*>(out.data() + 8 + 4 * layout.blocks()));
  if (!scales_.empty()) std::memcpy(out.data() + 8, scales_.data(), 4 * scales_.size());
}

// Validates the header against the expected element count and block size, and every scale,
// before touching a value.
void BlockQuantizer::decode_into(std::span<const std::uint8_t> payload, std::span<float> out,
                                 bool accumulate) const {
  if (payload.size() < 8) bad_payload(name_, "shorter than its 8-byte header");
  const std::size_t n = get_u32(payload, 0), block = get_u32(payload, 4);
  if (n != out.size()) {
    bad_payload(name_,
                "holds " + std::to_string(n) + " elements, expected " + std::to_string(out.size()));
  }
  if (block != block_) {
    bad_payload(name_, "block " + std::to_string(block) + ", expected " + std::to_string(block_));
  }
  const Int8Layout layout{n, block_};
  expect_bytes(name_, payload, layout.bytes(), n);
  const std::size_t nb = layout.blocks();
  // The payload is a byte vector: its scales may be unaligned for float loads.
  thread_local std::vector<float> scales;
  scales.resize(nb);
  if (nb) std::memcpy(scales.data(), payload.data() + 8, 4 * nb);
  for (std::size_t b = 0; b < nb; ++b) {
    if (!std::isfinite(scales[b]) || scales[b] < 0) {
      bad_payload(name_, "block " + std::to_string(b) + " has scale " + std::to_string(scales[b]));
    }
  }
  const auto* q = reinterpret_cast<const std::int8_t*>(payload.data() + 8 + 4 * nb);
  if (accumulate) {
    kernels::dequantize_int8_blocks_add(q, scales.data(), n, block_, out.data());
  } else {
    kernels::dequantize_int8_blocks(q, scales.data(), n, block_, out.data());
  }
}

namespace {

// Symmetric 8-bit quantisation with one float32 scale per block of `block` elements:
// q = round(x / s) with s = max|x| / 127 over the block, so every element is off by at most
// half a step (s / 2).
class Int8Codec final : public BlockQuantizer {
 public:
  explicit Int8Codec(std::size_t block) : BlockQuantizer("int8", block) {}
  std::string spec() const override { return "int8:block=" + std::to_string(block_); }
  bool biased() const override { return true; }
  void quantize(const float* in, std::size_t count, float* scales, std::int8_t* q) override {
    kernels::quantize_int8_blocks(in, count, block_, scales, q);
  }
};

// QSGD (Alistarh et al. 2017): each element of a block becomes sign(x) l s_b / S with l one of
// the S + 1 levels around |x| S / s_b, rounded up with probability equal to the remainder, and
// s_b the block's L2 norm: unbiased, E[decode] = x. Same payload as int8, with the level as
// the value and s_b / S as the scale.
class QsgdCodec final : public BlockQuantizer {
 public:
  QsgdCodec(std::size_t levels, std::size_t block, std::uint64_t seed)
      : BlockQuantizer("qsgd", block), levels_(levels), seed_(seed) {}
  std::string spec() const override {
    return "qsgd:block=" + std::to_string(block_) + ",levels=" + std::to_string(levels_) +
           ",seed=" + std::to_string(seed_);
  }
  bool biased() const override { return false; }
  void set_stream(std::uint64_t stream) override { stream_ = stream; }
  void begin(const Tensor& tensor) override {
    rng_ = seed_ ^ name_hash(tensor.name) ^ (stream_ * 0xD1B54A32D192ED03ull) ^
           (next_step(steps_, tensor.name) * 0x8CB92BA72F3D8DD7ull);
  }
  // The kernel's draws are a hash of (key, element index), so every call needs its own key:
  // after one begin() the all-reduce ring quantises each hop's chunk with its own call.
  void quantize(const float* in, std::size_t count, float* scales, std::int8_t* q) override {
    kernels::quantize_stochastic_int8_blocks(in, count, block_, static_cast<int>(levels_),
                                             splitmix64(rng_), scales, q);
  }
  std::vector<std::uint8_t> save_state() const override {
    return save_tensor_state(kMagic, steps_);
  }
  void load_state(std::span<const std::uint8_t> state) override {
    steps_ = load_tensor_state(kMagic, state);
  }

 private:
  static constexpr char kMagic[4] = {'G', 'S', 'Q', 'S'};
  std::size_t levels_;
  std::uint64_t seed_, stream_ = 0, rng_ = 0;
  std::map<std::string, std::vector<float>> steps_;
};

// Sign (signSGD with a scale, as EF-SignSGD sends it): one bit per element (set = negative)
// and the mean magnitude as the scale, 32x smaller than float32. Payload: u32 count, float
// scale, ceil(count / 8) bytes of bits.
class SignCodec final : public Codec {
 public:
  // block 0: one scale for the whole tensor.
  explicit SignCodec(std::size_t block) : block_(block) {}
  std::string spec() const override {
    return block_ ? "sign:block=" + std::to_string(block_) : "sign";
  }
  bool biased() const override { return true; }
  std::size_t encoded_bytes(std::size_t count) const override {
    return 4 + 4 * blocks(count) + (count + 7) / 8;
  }
  void encode(const Tensor& tensor, std::span<const float> in,
              std::vector<std::uint8_t>& out) override {
    check_encodable("sign", tensor, in.size());
    refuse_non_finite(tensor, in, "sign");
    const std::size_t n = in.size(), nb = blocks(n), per = block_ ? block_ : n;
    out.resize(encoded_bytes(n));
    put_u32(out, 0, static_cast<std::uint32_t>(n));
    for (std::size_t b = 0; b < nb; ++b) {
      const std::size_t first = b * per, len = std::min(per, n - first);
      const float scale =
          len == 0 ? 0.0f : kernels::sum_abs(in.data() + first, len) / static_cast<float>(len);
      std::memcpy(out.data() + 4 + 4 * b, &scale, 4);
    }
    kernels::pack_signs(in.data(), n, out.data() + 4 + 4 * nb);
  }
  void decode(std::span<const std::uint8_t> payload, std::span<float> out) const override {
    decode_into(payload, out, false);
  }
  void decode_add(std::span<const std::uint8_t> payload, std::span<float> out) const override {
    decode_into(payload, out, true);
  }

 private:
  // At least one scale, even for an empty tensor: the format of the whole-tensor case.
  std::size_t blocks(std::size_t count) const {
    return block_ && count ? (count + block_ - 1) / block_ : 1;
  }

  void decode_into(std::span<const std::uint8_t> payload, std::span<float> out,
                   bool accumulate) const {
    if (payload.size() < 8) bad_payload("sign", "shorter than its 8-byte header");
    const std::size_t n = get_u32(payload, 0);
    if (n != out.size()) {
      bad_payload("sign", "holds " + std::to_string(n) + " elements, expected " +
                              std::to_string(out.size()));
    }
    expect_bytes("sign", payload, encoded_bytes(n), n);
    const std::size_t nb = blocks(n), per = block_ ? block_ : n;
    const std::uint8_t* bits = payload.data() + 4 + 4 * nb;
    for (std::size_t b = 0; b < nb; ++b) {
      float scale;
      std::memcpy(&scale, payload.data() + 4 + 4 * b, 4);
      if (!std::isfinite(scale) || scale < 0) {
        bad_payload("sign", "scale " + std::to_string(scale) + " of block " + std::to_string(b));
      }
      const std::size_t first = b * per;  // a multiple of 8: whole bytes of bits
      kernels::unpack_signs_scaled(bits + first / 8, std::min(per, n - first), scale,
                                   out.data() + first, accumulate);
    }
  }

  std::size_t block_;
};

}  // namespace

std::unique_ptr<Codec> make_int8(const CodecSpec& s) {
  return std::make_unique<Int8Codec>(static_cast<std::size_t>(s.value("block")));
}

std::unique_ptr<Codec> make_qsgd(const CodecSpec& s) {
  return std::make_unique<QsgdCodec>(static_cast<std::size_t>(s.value("levels")),
                                     static_cast<std::size_t>(s.value("block")),
                                     static_cast<std::uint64_t>(s.value("seed")));
}

std::unique_ptr<Codec> make_sign(const CodecSpec& s) {
  const auto block = static_cast<std::size_t>(s.value("block"));
  if (block % 8 != 0) {  // blocks start on whole bytes of the packed signs
    throw Error(ErrorKind::kInvalidArgument,
                "codec spec '" + s.to_string() +
                    "': sign's block is a multiple of 8 (or 0: one "
                    "scale for the tensor), not " +
                    std::to_string(block),
                Error::kUnknownRank, Error::kNoPeer, "make_codec");
  }
  return std::make_unique<SignCodec>(block);
}

}  // namespace gradsync::compress
