// Gradient codecs: what a float32 gradient becomes on the wire, configured by a spec string
// users write in flags and config files ("fp16", "int8:block=256", "topk:ratio=0.01,ef=1").
//
// A codec turns `count` floats into a self-describing byte payload and back. Decoding
// validates the payload (length, header, scales) and throws gradsync::Error(kProtocol) naming
// what is wrong instead of reading out of bounds. Codecs that lose information in a biased
// way take error feedback: what the wire could not carry this step is added to the tensor's
// next step, so nothing is lost over time. That state (and any other per-call state) is
// kept under the name the call gives (a tensor's, or a bucket's), and can be saved and
// restored with a checkpoint.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
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
  // The value given, else the codec's default for the key (Error if it has none).
  double value(const std::string& key) const;
  std::string to_string() const;  // canonical form, round-trips through parse
};

// The tensor a codec works on: a stable name, under which its state (error-feedback residual,
// PowerSGD's Q, random-k's step count) is kept from call to call, and for a matrix its number
// of rows (PowerSGD compresses rows x count/rows; 0 = a vector).
struct Tensor {
  Tensor(std::string tensor_name, std::size_t matrix_rows = 0)
      : name(std::move(tensor_name)), rows(matrix_rows) {}
  Tensor(const char* tensor_name) : name(tensor_name) {}
  std::string name;
  std::size_t rows = 0;
};

// How compressed_allreduce moves a codec's payloads (see compressed_allreduce below).
enum class Pattern : std::uint8_t {
  kFloat32,        // none: the float32 all-reduce
  kHalfRing,       // fp16/bf16: a ring of half-size messages, added in float32 at every hop
  kQuantizedRing,  // int8/qsgd: re-quantised at every hop of a ring
  kGather,         // every rank's payload to every rank, decoded and summed (or dense, if cheaper)
  kSharedIndices,  // randomk: the same indices on every rank, so only the values are summed
  kIndexUnion,     // topk union=1: the picked indices, then the values at their union
  kLowRank,        // powersgd: P and Q all-reduced
};

// What the all-reduce and the reducer need to know of a codec, from the codec registry.
// A codec made outside make_codec keeps the defaults: the generic gather, NaN checked on every
// rank, tensor by tensor.
struct CodecTraits {
  Pattern pattern = Pattern::kGather;
  // Its encoder refuses NaN or Inf (it ranks magnitudes or takes a mean): every rank checks
  // its input before any message, even under NonFinite::kPropagate.
  bool refuses_non_finite = true;
  // The reducer hands it a whole bucket per call: elementwise codecs without state (nothing
  // changes but the call count), and top-k, which then ranks across the bucket's tensors.
  bool whole_buckets = false;
  // kHalfRing: the 16-bit float type on the wire.
  DataType half_type = DataType::kFloat16;
};

class Codec {
 public:
  virtual ~Codec() = default;

  const CodecTraits& traits() const { return traits_; }

  // The canonical spec, e.g. "int8:block=256,ef=1".
  virtual std::string spec() const = 0;
  // True if decode(encode(g)) is not g in expectation: such codecs need error feedback.
  virtual bool biased() const = 0;
  // Bytes of the payload of `count` floats: exact unless size_varies() (then an upper bound).
  virtual std::size_t encoded_bytes(std::size_t count) const = 0;
  // True if the payload size depends on the values (threshold sparsification).
  virtual bool size_varies() const { return false; }

  // Encodes `in` (the gradient of `tensor`) into `out`, replacing its contents.
  virtual void encode(const Tensor& tensor, std::span<const float> in,
                      std::vector<std::uint8_t>& out) = 0;
  // Decodes a payload of `out.size()` floats into `out`. Throws Error(kProtocol) if the
  // payload is malformed or does not hold exactly out.size() floats.
  virtual void decode(std::span<const std::uint8_t> payload, std::span<float> out) const = 0;
  // out += decode(payload): how all-reduce sums the payloads of every rank. Sparse and sign
  // codecs add in place, without a dense scratch copy.
  virtual void decode_add(std::span<const std::uint8_t> payload, std::span<float> out) const;

  // Stochastic codecs (qsgd) draw their randomness from (seed, stream, tensor, step):
  // compressed_allreduce sets the stream to the rank, so ranks round independently and runs
  // repeat exactly.
  virtual void set_stream(std::uint64_t stream) { (void)stream; }

  // What this rank holds back of `tensor`'s gradient: the error-feedback residual, the part
  // of past gradients the wire has not carried yet (empty for a codec without one, or a
  // tensor it has not seen). A view of the codec's state, valid until its next call.
  virtual std::span<const float> held_back(const std::string& tensor) const {
    (void)tensor;
    return {};
  }

  // Per-tensor state (error-feedback residuals...), as bytes for a checkpoint, and back.
  // load_state throws Error(kProtocol) on bytes it did not write.
  virtual std::vector<std::uint8_t> save_state() const { return {}; }
  virtual void load_state(std::span<const std::uint8_t> state);

 private:
  friend std::unique_ptr<Codec> make_codec(std::string_view spec);
  CodecTraits traits_;
};

// The codec a spec names. Each takes ef=0|1 (error feedback; on by default for the biased
// codecs: int8, topk, randomk, threshold, sign, powersgd).
//   none                   float32
//   fp16, bf16             half-size floats, rounded to nearest even
//   int8[:block=B]         symmetric 8-bit, one scale per block of B elements (default 256)
//   qsgd[:levels=S,block=B,seed=X]  stochastic rounding to S levels (1..127, default 127) of
//                          each block's L2 norm (default block 512): unbiased
//   topk:ratio=R[,exact=1,warmup=S,union=1]  the k = ceil(R n) largest magnitudes as (index,
//                          value) pairs, ties to the lower index. By default a sampled threshold
//                          (Deep Gradient Compression) narrows the candidates first: the same k
//                          elements, faster on large tensors; exact=1 selects over the whole
//                          tensor. warmup=S: R starts at 0.25 and falls exponentially to R over
//                          each tensor's first S steps (DGC's warm-up). union=1 (all-reduce
//                          only, with error feedback): the ranks exchange their k indices, then
//                          all send their values at every index any rank picked (one float32
//                          all-reduce of at most N k values), so what one rank found large
//                          leaves every rank's residual in the same step
//   randomk:ratio=R[,seed=X]  k values at indices drawn from (seed, tensor, step), the same on
//                          every rank, so no indices travel
//   threshold:rel=R        every element with |g| >= R max|g| (0 < R <= 1)
//   sign[:block=B]         one bit per element and one scale (mean |g|): EF-SignSGD; with B
//                          (a multiple of 8) one scale per block of B elements, so a few
//                          large entries do not set the step of the whole tensor
//   powersgd:rank=R        rows x cols matrices as P (rows x R) and Q (R x cols), Q warm-started
//                          from the last step; vectors travel as float32
// All but none and powersgd also take momentum=M (0 <= M <= 0.999, implies ef=1): Deep
// Gradient Compression's momentum correction. The codec keeps u = M u + g per tensor and
// encodes u plus the residual (sparse codecs then clear u where they sent), so what is held
// back keeps its momentum. The all-reduce then yields the update with momentum already in it:
// give the optimizer no momentum of its own (gradsync-train does that for such a codec).
// Throws Error(kInvalidArgument) for an unknown or malformed spec.
std::unique_ptr<Codec> make_codec(std::string_view spec);
// The codecs make_codec knows, in the registry's order.
std::vector<std::string> codec_names();
// A spec of each, in the same order, with the settings a user would start from
// ("topk:ratio=0.01"): what gradsync-probe times.
std::vector<std::string> codec_examples();

// What compressed_allreduce does when a rank's gradient holds NaN or Inf.
enum class NonFinite {
  kThrow,      // every rank throws Error(kInvalidArgument) naming the tensor and the ranks
  kSkip,       // every rank returns false: skip the step. The data is then either as it was or
               // already reduced (the shared-memory path finds NaN in the sums it makes, to
               // spare a pass over the inputs): not a gradient to apply
  kPropagate,  // no check: the NaN reaches every rank (saves one pass and one small exchange)
};

// All-reduce (kSum or kAvg) of float32 gradients `data` of `tensor` through `codec`,
// collective over the context; every rank passes the same spec and tensor. The pattern
// follows the codec: fp16/bf16 travel half-size through a ring that adds in float32 at
// every hop; int8/qsgd are quantised again at every hop of a ring (scales travel with the
// values); topk/threshold all-gather (index, value) pairs, or go dense when the union is
// dense enough that a float32 all-reduce is cheaper (the cost model decides); randomk
// all-reduces just its k values; sign all-gathers packed bits and scales; powersgd
// all-reduces P and Q. Every rank ends with bitwise-identical data. Returns false only when
// `non_finite` is kSkip and some rank's data held NaN or Inf.
bool compressed_allreduce(Context& ctx, std::span<float> data, Codec& codec, const Tensor& tensor,
                          ReduceOp op = ReduceOp::kSum, NonFinite non_finite = NonFinite::kThrow);
// The same on the context's worker, in issue order with every other call. Until the Work is
// done, `data` and `codec` are in use there: neither read nor written by the caller, and both
// alive. Work::skipped() is the negation of the blocking form's result.
Work compressed_allreduce_async(Context& ctx, std::span<float> data, Codec& codec,
                                const Tensor& tensor, ReduceOp op = ReduceOp::kSum,
                                NonFinite non_finite = NonFinite::kThrow);

// One tensor of a bucket: its floats are data[offset, offset + count).
struct TensorSlice {
  Tensor tensor;
  std::size_t offset = 0, count = 0;
};

// A bucket of tensors in one call, as DDP's communication hooks see a bucket. The codec
// encodes `data` whole: top-k ranks across every tensor in it, so the tensors with the largest
// gradients get most of the k. Its state (error-feedback residual and momentum, top-k's
// warm-up count) is kept under the bucket's name, as for one tensor of that name: a bucket
// whose tensors change must carry the state itself (the Reducer keeps its buckets' and moves
// it with the gradients when it rebuilds them). `parts` must tile `data`
// (Error(kInvalidArgument) otherwise); PowerSGD, whose matrices are the tensors', reduces
// part by part under the parts' names.
bool compressed_allreduce(Context& ctx, std::span<float> data, Codec& codec, const Tensor& bucket,
                          std::span<const TensorSlice> parts, ReduceOp op = ReduceOp::kSum,
                          NonFinite non_finite = NonFinite::kThrow);
// Its async form (`parts` is copied; `data` and `codec` as above).
Work compressed_allreduce_async(Context& ctx, std::span<float> data, Codec& codec,
                                const Tensor& bucket, std::span<const TensorSlice> parts,
                                ReduceOp op = ReduceOp::kSum,
                                NonFinite non_finite = NonFinite::kThrow);

// Compression of a framework's own gradient buckets (torch DDP's comm hooks): lists of named
// parameters that may be regrouped between steps, as DDP rebuilds its buckets after the
// first iteration. Error feedback's residual and momentum live here per parameter, so a
// regrouping loses nothing; PowerSGD's state is its codec's, per parameter too. Codecs that
// take a whole bucket per call (top-k, the elementwise ones) still do.
class BucketCompressor {
 public:
  explicit BucketCompressor(std::string_view spec);  // throws Error(kInvalidArgument)
  ~BucketCompressor();
  BucketCompressor(const BucketCompressor&) = delete;
  BucketCompressor& operator=(const BucketCompressor&) = delete;

  const Codec& codec() const;
  // The all-reduce of a bucket's float32 `data`, tiled by `parts` (each named by its
  // parameter, the key of its state), on ctx's worker in issue order. Every rank passes the
  // same spec and the same parts. Until the Work is done, `data` and this compressor are in
  // use there.
  Work allreduce_async(Context& ctx, std::span<float> data, std::span<const TensorSlice> parts,
                       ReduceOp op = ReduceOp::kAvg, NonFinite non_finite = NonFinite::kThrow);
  // Every parameter's state and the codec's, for a checkpoint (no call in flight), and back:
  // load_state throws Error(kProtocol) on bytes it did not write or of another codec.
  std::vector<std::uint8_t> save_state() const;
  void load_state(std::span<const std::uint8_t> state);
  // What this rank holds back of `parameter` (its residual; empty if none yet).
  std::span<const float> held_back(const std::string& parameter) const;

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace gradsync::compress
