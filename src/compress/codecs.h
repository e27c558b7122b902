// Inside compress/: the codec families' constructors, the payload helpers they share, and
// the two codecs whose all-reduce needs more than encode and decode (error feedback's
// residuals, PowerSGD's two-round exchange).
#pragma once

#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gradsync/compress.h"
#include "gradsync/error.h"

namespace gradsync::compress {

[[noreturn]] void bad_payload(const std::string& codec, const std::string& why);
// Encoders take at most 2^32 - 1 elements: payload headers count them in 32 bits.
void check_encodable(const std::string& codec, const Tensor& tensor, std::size_t count);
void expect_bytes(const std::string& codec, std::span<const std::uint8_t> payload, std::size_t want,
                  std::size_t count);

inline void put_u32(std::vector<std::uint8_t>& out, std::size_t at, std::uint32_t v) {
  std::memcpy(out.data() + at, &v, sizeof v);
}
inline std::uint32_t get_u32(std::span<const std::uint8_t> in, std::size_t at) {
  std::uint32_t v;
  std::memcpy(&v, in.data() + at, sizeof v);
  return v;
}

// Deterministic randomness the same on every machine (std:: distributions are not):
// splitmix64 steps, and FNV-1a of tensor names for seeds.
inline std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
inline std::uint64_t name_hash(const std::string& name) {
  std::uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : name) h = (h ^ c) * 0x100000001B3ull;
  return h;
}
// Uniform in [0, 1) with 24 bits, exactly representable as a float.
inline float uniform01(std::uint64_t& state) {
  return static_cast<float>(splitmix64(state) >> 40) * 0x1p-24f;
}

// Per-tensor state kept by name, with the "GS??" byte format every codec's checkpoint uses:
// magic, u32 entries, then per entry u32 name bytes, name, u64 floats, floats.
std::vector<std::uint8_t> save_tensor_state(const char magic[4],
                                            const std::map<std::string, std::vector<float>>& m);
std::map<std::string, std::vector<float>> load_tensor_state(const char magic[4],
                                                            std::span<const std::uint8_t> s);

// The shortest text that reads back as exactly v ("0.01", "4"): how specs print numbers.
std::string format_number(double v);

// Per-tensor step counters (qsgd's and randomk's draws), kept as two exact floats of 24 bits
// each so that they travel in the per-tensor state format: returns the step, counts one more.
std::uint64_t next_step(std::map<std::string, std::vector<float>>& steps, const std::string& name);

// Where a randomk payload's values start: all-reduce sums that part alone.
std::size_t randomk_values_offset();

// A refused spec: Error(kInvalidArgument) naming it, with examples from the registry.
[[noreturn]] void bad_spec(std::string_view spec, const std::string& why);

// The registry's factories (spec already validated by CodecSpec::parse), each in its codec's
// file; make_codec wraps what they make in error feedback where the spec asks for it.
std::unique_ptr<Codec> make_none(const CodecSpec& s);
std::unique_ptr<Codec> make_fp16(const CodecSpec& s);
std::unique_ptr<Codec> make_bf16(const CodecSpec& s);
std::unique_ptr<Codec> make_powersgd(const CodecSpec& s);
std::unique_ptr<Codec> make_int8(const CodecSpec& s);
std::unique_ptr<Codec> make_qsgd(const CodecSpec& s);
std::unique_ptr<Codec> make_sign(const CodecSpec& s);
std::unique_ptr<Codec> make_topk(const CodecSpec& s);
std::unique_ptr<Codec> make_randomk(const CodecSpec& s);
std::unique_ptr<Codec> make_threshold(const CodecSpec& s);

// The int8 payload (int8 and qsgd): u32 count, u32 block, float scales, int8 values.
struct Int8Layout {
  std::size_t count, block;
  std::size_t blocks() const { return (count + block - 1) / block; }
  std::size_t bytes() const { return 8 + 4 * blocks() + count; }
};

// int8 and qsgd: one scale per block of values, one byte per value. Besides encoding whole
// payloads they quantise any run of floats, which is how the all-reduce ring re-quantises
// partial sums at every hop.
class BlockQuantizer : public Codec {
 public:
  BlockQuantizer(std::string name, std::size_t block) : name_(std::move(name)), block_(block) {}
  std::size_t encoded_bytes(std::size_t count) const override {
    return Int8Layout{count, block_}.bytes();
  }
  void encode(const Tensor& tensor, std::span<const float> in,
              std::vector<std::uint8_t>& out) override;
  void decode(std::span<const std::uint8_t> payload, std::span<float> out) const override {
    decode_into(payload, out, false);
  }
  void decode_add(std::span<const std::uint8_t> payload, std::span<float> out) const override {
    decode_into(payload, out, true);
  }

  std::size_t block() const { return block_; }
  // Starts a step of `tensor` (stochastic codecs draw from here on).
  virtual void begin(const Tensor& tensor) { (void)tensor; }
  // Quantises `count` floats: ceil(count / block) scales, count values.
  virtual void quantize(const float* in, std::size_t count, float* scales, std::int8_t* q) = 0;

 protected:
  std::string name_;
  std::size_t block_;

 private:
  void decode_into(std::span<const std::uint8_t> payload, std::span<float> out,
                   bool accumulate) const;
  std::vector<float> scales_;  // scratch: payload scales may be unaligned
};

// A NaN or Inf that `codec` cannot carry or rank: names the tensor and element.
void refuse_non_finite(const Tensor& tensor, std::span<const float> in, const char* codec);

// Codecs that can take what a payload carries off a tensor in place (sparse ones touch just
// their k elements) instead of decoding it into a scratch copy to subtract: error feedback's
// residual is what was owed minus what was sent.
class SubtractsPayload {
 public:
  virtual void subtract(std::span<const std::uint8_t> payload, std::span<float> out) const = 0;

 protected:
  ~SubtractsPayload() = default;
};

// Top-k with union=1: each rank picks its k indices, the ranks exchange just those, and every
// rank then sends its value at every index any rank picked, summed by a float32 all-reduce.
class SelectsIndices {
 public:
  // The indices encode would send for `in` (ascending); counts a warm-up step as encode does.
  virtual void select_indices(const Tensor& tensor, std::span<const float> in,
                              std::vector<std::uint32_t>& out) = 0;

 protected:
  ~SelectsIndices() = default;
};

// Error feedback's state for one call's data, in memory its owner keeps: the codec itself
// (ErrorFeedback::state, by tensor name) for calls that bring none, or the caller, as the
// reducer does for its buckets so that the state moves with the gradients when it rebuilds
// them. Both spans are as long as the call's data; momentum is empty without momentum.
struct FeedbackState {
  std::span<float> residual;  // what the wire has not carried yet
  std::span<float> momentum;  // Deep Gradient Compression's u
};

// Error feedback (Seide et al. 2014; Karimireddy et al. 2019, EF-SignSGD): the part of each
// step's gradient the wire could not carry is kept per tensor and added to the next step's
// before encoding, so over T steps transmitted + residual = the sum of the inputs.
//
// With momentum (Deep Gradient Compression's momentum correction, Lin et al. 2018) the
// optimizer's momentum runs here, before the wire: u = momentum * u + g, and u (plus the
// residual) is what is encoded, so what a sparse codec holds back keeps its momentum instead
// of arriving late without it. Sparse codecs also clear u where they sent (momentum factor
// masking), or stale momentum would push those elements again. What comes out of the
// all-reduce is then an update, for an optimizer without momentum of its own.
class ErrorFeedback final : public Codec {
 public:
  ErrorFeedback(std::unique_ptr<Codec> inner, double momentum = 0)
      : inner_(std::move(inner)),
        momentum_spec_(momentum),
        momentum_(static_cast<float>(momentum)) {}
  std::string spec() const override;
  bool biased() const override { return false; }  // over time, nothing is lost
  std::size_t encoded_bytes(std::size_t count) const override {
    return inner_->encoded_bytes(count);
  }
  bool size_varies() const override { return inner_->size_varies(); }
  // With the codec's own state of `tensor`.
  void encode(const Tensor& tensor, std::span<const float> in,
              std::vector<std::uint8_t>& out) override;
  // With the caller's state `s` (the size of `in`): afterwards its residual holds what was
  // owed and not sent. A step the inner codec refuses leaves the residual as it was.
  void encode(FeedbackState s, const Tensor& tensor, std::span<const float> in,
              std::vector<std::uint8_t>& out);
  void decode(std::span<const std::uint8_t> payload, std::span<float> out) const override {
    inner_->decode(payload, out);
  }
  void decode_add(std::span<const std::uint8_t> payload, std::span<float> out) const override {
    inner_->decode_add(payload, out);
  }
  void set_stream(std::uint64_t stream) override { inner_->set_stream(stream); }
  // The codec's own states, by tensor name.
  std::vector<std::uint8_t> save_state() const override;
  void load_state(std::span<const std::uint8_t> state) override;
  std::span<const float> held_back(const std::string& tensor) const override;

  Codec& inner() { return *inner_; }
  bool has_momentum() const { return momentum_ > 0; }
  // The codec's own state of `tensor` (zeros the first time); an error if its size changed.
  FeedbackState state(const Tensor& tensor, std::size_t count);
  // What this step owes: residual + gradient, or with momentum residual + u after
  // u = momentum * u + gradient, into `owed` (which may be the residual itself).
  void owe(FeedbackState s, std::span<const float> in, std::span<float> owed) const;
  // After the elements `sent` of the residual (holding what was owed) went out whole: they, and
  // their momentum (factor masking), start again from zero.
  void keep_unsent(FeedbackState s, std::span<const std::uint32_t> sent) const;

 private:
  struct Owned {
    std::vector<float> residual, momentum;
  };
  std::unique_ptr<Codec> inner_;
  const double momentum_spec_;  // as written in the spec
  const float momentum_;
  std::map<std::string, Owned> owned_;  // for calls that bring no state of their own
  std::vector<float> owed_, sent_;      // scratch: what is owed, what the wire carried
};

// PowerSGD (Vogels et al. 2019): M (rows x cols, plus the residual with error feedback) is
// sent as P = M Q, orthonormalised, and Q' = M^T P; the result is P Q'^T. Q is warm-started
// from the tensor's last Q, and starts from a seeded draw that every rank makes alike.
class PowerSgd final : public Codec {
 public:
  PowerSgd(std::size_t rank, bool feedback) : rank_(rank), feedback_(feedback) {}
  std::string spec() const override;
  bool biased() const override { return !feedback_; }
  // For a vector (rows unknown): float32. For a matrix, see encode.
  std::size_t encoded_bytes(std::size_t count) const override { return 12 + 4 * count; }
  bool size_varies() const override { return true; }  // depends on the shape
  void encode(const Tensor& tensor, std::span<const float> in,
              std::vector<std::uint8_t>& out) override;
  void decode(std::span<const std::uint8_t> payload, std::span<float> out) const override;
  std::vector<std::uint8_t> save_state() const override;
  void load_state(std::span<const std::uint8_t> state) override;
  std::span<const float> held_back(const std::string& tensor) const override;

  // Sums `values` over every rank in place (the identity for one process).
  using Sum = std::function<void(std::span<float> values)>;
  // True if the tensor is compressed as a matrix (rank below both sides, and P and Q smaller
  // than the tensor).
  bool compresses(const Tensor& tensor, std::size_t count) const;
  // The whole exchange of a matrix over `ranks` ranks: data becomes the sum over ranks of
  // P Q^T, divided by `divisor` (1 or ranks). Every rank ends with the same bits.
  void reduce(const Tensor& tensor, std::span<float> data, const Sum& sum, int ranks, int divisor);

 private:
  std::size_t effective_rank(std::size_t rows, std::size_t cols) const;
  // M (the gradient, plus the residual with error feedback) of `data`; `m` is kept as long
  // as the residual is not touched.
  std::span<const float> owed(const Tensor& tensor, std::span<const float> data);
  // P (in p_) and Q (the tensor's, in place) of M, summed over ranks by `sum`.
  std::vector<float>& factorize(const Tensor& tensor, std::span<const float> m, const Sum& sum);
  std::size_t rank_;
  bool feedback_;
  // Residuals under "r:" + name, warm-start Qs under "q:" + name: one map, one state format.
  std::map<std::string, std::vector<float>> state_;
  std::vector<float> p_, m_;  // scratch
};

}  // namespace gradsync::compress
