// Gradient codecs: what a float32 gradient becomes on the wire, configured by a spec string
// users write in flags and config files ("fp16", "int8:block=256", "int8,ef=1").
//
// A codec turns `count` floats into a self-describing byte payload and back. Decoding
// validates the payload (length, header, scales) and throws gradsync::Error(kProtocol) naming
// what is wrong instead of reading out of bounds. Codecs that lose information in a biased
// way take error feedback: what the wire could not carry this step is added to the tensor's
// next step, so nothing is lost over time. That state (and any other per-tensor state) is
// keyed by a stable tensor name, not by a bucket position, and can be saved and restored
// with a checkpoint.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "gradsync/gradsync.h"

namespace gradsync::compress {

// A parsed spec: "name" or "name:key=value,key=value". Keys a codec does not take, values
// that are not numbers, and values out of range are errors naming the spec.
struct CodecSpec {
  std::string name;
  std::map<std::string, double> params;

  static CodecSpec parse(std::string_view spec);  // throws Error(kInvalidArgument)
  double get(const std::string& key, double fallback) const;
  std::string to_string() const;  // canonical form, round-trips through parse
};

class Codec {
 public:
  virtual ~Codec() = default;

  // The canonical spec, e.g. "int8:block=256,ef=1".
  virtual std::string spec() const = 0;
  // True if decode(encode(g)) is not g in expectation: such codecs need error feedback.
  virtual bool biased() const = 0;
  // Bytes of the payload of `count` floats (exact for the dense codecs).
  virtual std::size_t encoded_bytes(std::size_t count) const = 0;

  // Encodes `in` (the gradient of tensor `tensor`) into `out`, replacing its contents.
  virtual void encode(const std::string& tensor, std::span<const float> in,
                      std::vector<std::uint8_t>& out) = 0;
  // Decodes a payload of `out.size()` floats into `out`. Throws Error(kProtocol) if the
  // payload is malformed or does not hold exactly out.size() floats.
  virtual void decode(std::span<const std::uint8_t> payload, std::span<float> out) const = 0;

  // Per-tensor state (error-feedback residuals...), as bytes for a checkpoint, and back.
  // load_state throws Error(kProtocol) on bytes it did not write.
  virtual std::vector<std::uint8_t> save_state() const { return {}; }
  virtual void load_state(std::span<const std::uint8_t> state) { (void)state; }
};

// The codec a spec names: none, fp16, bf16, int8[:block=B] (per-block scale, B elements per
// block, default 256), each with an optional ef=0|1 (error feedback; default on for biased
// codecs, i.e. int8). Throws Error(kInvalidArgument) for an unknown or malformed spec.
std::unique_ptr<Codec> make_codec(std::string_view spec);

// All-reduce (kSum or kAvg) of float32 gradients `data` of tensor `tensor` through `codec`,
// collective over the context; every rank passes the same spec and tensor. fp16 and bf16
// travel half-size through a ring that adds in float32 at every hop; other codecs encode
// once per rank, all-gather the payloads and sum what every rank decodes, in rank order.
// Every rank ends with bitwise-identical data.
void compressed_allreduce(Context& ctx, std::span<float> data, Codec& codec,
                          const std::string& tensor, ReduceOp op = ReduceOp::kSum);

}  // namespace gradsync::compress
