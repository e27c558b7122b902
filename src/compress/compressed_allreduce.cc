// Compressed all-reduce: the communication pattern that suits each codec (see compress.h),
// run as the steps of one call on the context's engine.
#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "collectives/algorithms.h"
#include "compress/codecs.h"
#include "compress/compressed_steps.h"
#include "core/context_impl.h"
#include "kernels/kernels.h"

namespace gradsync::compress {

namespace {

constexpr const char* kOp = "compressed_allreduce";

// float16/bfloat16 messages of a ring.
class HalfWire final : public collectives::WireFormat {
 public:
  explicit HalfWire(DataType type) : type_(type) {}
  std::size_t bytes(std::size_t count) const override { return 2 * count; }
  void encode(const float* in, std::size_t count, std::uint8_t* wire) override {
    kernels::float_to_16bit(in, reinterpret_cast<std::uint16_t*>(wire), count, type_);
  }
  void decode(const std::uint8_t* wire, std::size_t count, float* out) const override {
    kernels::float_from_16bit(reinterpret_cast<const std::uint16_t*>(wire), out, count, type_);
  }
  void decode_add(const std::uint8_t* wire, std::size_t count, float* out) const override {
    thread_local std::vector<float> widened;
    widened.resize(count);
    decode(wire, count, widened.data());
    kernels::reduce_into(out, widened.data(), count, DataType::kFloat32, ReduceOp::kSum);
  }

 private:
  DataType type_;
};

// int8-layout messages of a ring (int8, qsgd): the block scales, then a byte per value.
class QuantizedWire final : public collectives::WireFormat {
 public:
  explicit QuantizedWire(BlockQuantizer& q) : q_(q) {}
  std::size_t bytes(std::size_t count) const override {
    return 4 * blocks(count) + (count + 3) / 4 * 4;
  }
  void encode(const float* in, std::size_t count, std::uint8_t* wire) override {
    q_.quantize(in, count, reinterpret_cast<float*>(wire),
                reinterpret_cast<std::int8_t*>(wire + 4 * blocks(count)));
  }
  void decode(const std::uint8_t* wire, std::size_t count, float* out) const override {
    kernels::dequantize_int8_blocks(reinterpret_cast<const std::int8_t*>(wire + 4 * blocks(count)),
                                    reinterpret_cast<const float*>(wire), count, q_.block(), out);
  }
  void decode_add(const std::uint8_t* wire, std::size_t count, float* out) const override {
    kernels::dequantize_int8_blocks_add(
        reinterpret_cast<const std::int8_t*>(wire + 4 * blocks(count)),
        reinterpret_cast<const float*>(wire), count, q_.block(), out);
  }

 private:
  std::size_t blocks(std::size_t count) const { return (count + q_.block() - 1) / q_.block(); }
  BlockQuantizer& q_;
};

// The codec's spec, hashed into the call signature: ranks that pass different codecs to the
// same call fail with kMismatch instead of decoding each other's bytes as their own format.
std::int32_t spec_tag(const Codec& codec) {
  return static_cast<std::int32_t>(name_hash(codec.spec()) & 0x7fffffff);
}

void ring(CallSteps& steps, std::span<float> data, DataType wire_type,
          collectives::WireFormat& wire, float* lost) {
  steps.run({0, collectives::CollectiveKind::kCompressedAllreduce, wire_type, ReduceOp::kSum,
             Algorithm::kRing, -1, data.size()},
            [&](collectives::Comm& c) {
              collectives::ring_allreduce_wire(c, data.data(), data.size(), wire, lost);
            });
}

void finish_average(std::span<float> data, ReduceOp op, int n) {
  if (op == ReduceOp::kAvg && !data.empty()) {
    kernels::scale_for_average(data.data(), data.size(), DataType::kFloat32, n);
  }
}

// What a call reduces, for its errors: one tensor, or a bucket and the parts that tile it.
struct Reduced {
  const Tensor& tensor;
  std::span<const TensorSlice> parts;

  // Element `i` of the call's data, by the part that holds it: a user knows parameters, not
  // the offsets of a bucket the reducer built.
  std::string element(std::size_t i) const {
    for (const TensorSlice& part : parts) {
      if (i >= part.offset && i - part.offset < part.count) {
        return "element " + std::to_string(i - part.offset) + " of '" + part.tensor.name + "'";
      }
    }
    return "element " + std::to_string(i);
  }
};

// Settles what the ranks found: codes[r] is -1 or 2 x element + (1 if NaN) of rank r's first
// NaN or Inf, `overflow` the same for a sum of finite values past the float range. True if
// nothing was found; otherwise every rank (they all hold the same codes) throws (kThrow) or
// returns false (kSkip).
bool settle_non_finite(const CallSteps& steps, const Reduced& reduced,
                       std::span<const std::int64_t> codes, std::int64_t overflow, NonFinite policy,
                       std::size_t bytes) {
  std::string where;
  auto add = [&](std::int64_t code, const std::string& what) {
    where += std::string(where.empty() ? "" : ", ") + (code % 2 ? "NaN" : "Inf") + what + " (" +
             reduced.element(static_cast<std::size_t>(code / 2)) + ")";
  };
  for (std::size_t r = 0; r < codes.size(); ++r) {
    if (codes[r] >= 0) add(codes[r], " on rank " + std::to_string(r));
  }
  if (overflow >= 0) add(overflow, " in the sum of finite values");
  if (where.empty()) return true;
  if (policy == NonFinite::kSkip) return false;
  throw AgreedError(
      Error(ErrorKind::kInvalidArgument,
            "tensor '" + reduced.tensor.name + "' has " + where + ": not reduced on any rank",
            steps.rank(), Error::kNoPeer, kOp, bytes));
}

// True if no rank's data holds NaN or Inf (see settle_non_finite). One pass over the data and
// one 8-byte all-gather: each rank's first bad element.
bool every_rank_finite(CallSteps& steps, std::span<const float> data, const Reduced& reduced,
                       NonFinite policy) {
  const std::size_t bad = kernels::first_non_finite(data.data(), data.size());
  const std::int64_t mine =
      bad == data.size() ? -1
                         : static_cast<std::int64_t>(2 * bad + (std::isnan(data[bad]) ? 1 : 0));
  std::vector<std::int64_t> all(static_cast<std::size_t>(steps.size()));
  steps.allgather(&mine, all.data(), 1, DataType::kInt64);
  return settle_non_finite(steps, reduced, all, -1, policy, data.size_bytes());
}

// float32 and fp16/bf16 (without feedback) where every rank shares an arena and the cost
// model picks the shared-memory all-reduce: bytes are not what limits the call. It sums in
// float32, rounds each finished element once on its way out, and looks for NaN/Inf in the
// finished sums while they are in cache (an input pass would cost as much as half the call):
// only a bad sum sends it to the inputs, to name the rank. Past that point the data is
// reduced, so kSkip leaves the sums, not the inputs.
bool shm_allreduce(CallSteps& steps, std::span<float> data, DataType round_through, ReduceOp op,
                   const Reduced& reduced, NonFinite policy) {
  const Context::Impl& context = steps.context();
  const int n = steps.size();
  std::vector<std::int64_t> found(static_cast<std::size_t>(n) + 1, -1);
  collectives::ShmFloatExtras extras;
  extras.round_through = round_through;
  if (policy != NonFinite::kPropagate) extras.non_finite = found.data();
  transport::SharedArena* arena = context.transport->shared_arena();
  steps.run({0, collectives::CollectiveKind::kCompressedAllreduce, round_through, op,
             Algorithm::kSharedMemory, -1, data.size()},
            [&](collectives::Comm& c) {
              collectives::shm_direct_allreduce(c, *arena, data.data(), data.data(), data.size(),
                                                DataType::kFloat32, op, context.config, extras);
            });
  if (policy == NonFinite::kPropagate) return true;
  std::vector<std::int64_t> all(found.size() * static_cast<std::size_t>(n));
  steps.allgather(found.data(), all.data(), found.size(), DataType::kInt64);
  std::vector<std::int64_t> codes(static_cast<std::size_t>(n), -1);
  std::int64_t overflow = -1;
  auto keep_first = [](std::int64_t& into, std::int64_t code) {
    if (code >= 0 && (into < 0 || code < into)) into = code;
  };
  for (std::size_t r = 0; r < static_cast<std::size_t>(n); ++r) {
    for (std::size_t m = 0; m < codes.size(); ++m) keep_first(codes[m], all[r * found.size() + m]);
    keep_first(overflow, all[r * found.size() + codes.size()]);
  }
  return settle_non_finite(steps, reduced, codes, overflow, policy, data.size_bytes());
}

// fp16/bf16 without feedback, off the shared-memory path: where the ranks share an arena
// (small messages), a latency-bound float32 all-reduce and one rounding pass; elsewhere a
// ring whose messages are halves.
void half_allreduce(CallSteps& steps, std::span<float> data, DataType type, ReduceOp op) {
  if (steps.context().transport->shared_arena()) {
    steps.allreduce(data.data(), data.data(), data.size(), DataType::kFloat32, op);
    thread_local std::vector<std::uint16_t> narrow;
    narrow.resize(data.size());
    kernels::float_to_16bit(data.data(), narrow.data(), data.size(), type);
    kernels::float_from_16bit(narrow.data(), data.data(), data.size(), type);
    return;
  }
  HalfWire wire(type);
  ring(steps, data, type, wire, nullptr);
  finish_average(data, op, steps.size());
}

// Encodes this rank's data: through the codec, or with error feedback from the call's state.
using Encode = std::function<void(std::span<const float>, std::vector<std::uint8_t>&)>;

// Every rank's payload to every rank, summed in rank order; or, when the payloads together are
// large enough that a float32 all-reduce of the decoded tensor is cheaper (a dense union of
// sparse picks, or many ranks of sign bits), that.
void gather_allreduce(CallSteps& steps, std::span<float> data, Codec& codec, const Encode& encode,
                      const Tensor& tensor, ReduceOp op) {
  const int n = steps.size();
  std::vector<std::uint8_t> mine;
  encode(data, mine);
  std::vector<std::size_t> counts(static_cast<std::size_t>(n), mine.size());
  if (codec.size_varies()) {
    const auto my_bytes = static_cast<std::int64_t>(mine.size());
    std::vector<std::int64_t> sizes(static_cast<std::size_t>(n));
    steps.allgather(&my_bytes, sizes.data(), 1, DataType::kInt64);
    counts.assign(sizes.begin(), sizes.end());
  }
  const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
  const Context::Impl& context = steps.context();
  const int hosts = context.topology.hosts();
  const Algorithm dense = context.pick_allreduce(data.size_bytes(), Algorithm::kAuto);
  if (context.cost.allreduce_us(dense, n, data.size_bytes(), hosts) <
      context.cost.allgather_us(n, total, hosts, context.transport->shared_arena() != nullptr)) {
    codec.decode(mine, data);
    steps.allreduce(data.data(), data.data(), data.size(), DataType::kFloat32, op);
    return;
  }
  std::vector<std::uint8_t> all(total);
  if (codec.size_varies()) {
    steps.allgatherv(mine.data(), all.data(), counts, DataType::kUInt8);
  } else {
    steps.allgather(mine.data(), all.data(), mine.size(), DataType::kUInt8);
  }
  std::size_t at = 0;
  for (int r = 0; r < n; ++r) {
    const std::span<const std::uint8_t> payload(all.data() + at,
                                                counts[static_cast<std::size_t>(r)]);
    at += payload.size();
    try {
      if (r == 0) {
        codec.decode(payload, data);
      } else {
        codec.decode_add(payload, data);
      }
    } catch (const Error& e) {
      throw Error(
          e.kind(),
          "rank " + std::to_string(r) + "'s payload of tensor '" + tensor.name + "': " + e.detail(),
          steps.rank(), r, kOp, payload.size());
    }
  }
  finish_average(data, op, n);
}

// randomk: every rank drew the same indices, so the payloads add element by element: one
// float32 all-reduce of the k values.
void randomk_allreduce(CallSteps& steps, std::span<float> data, Codec& codec, const Encode& encode,
                       ReduceOp op) {
  std::vector<std::uint8_t> payload;
  encode(data, payload);
  const std::size_t at = randomk_values_offset(), k = (payload.size() - at) / 4;
  // The values start 16 bytes into an operator-new buffer: float-aligned.
  auto* values = reinterpret_cast<float*>(payload.data() + at);
  steps.allreduce(values, values, k, DataType::kFloat32, ReduceOp::kSum);
  codec.decode(payload, data);
  finish_average(data, op, steps.size());
}

// top-k with union=1: the ranks exchange their k indices, then every rank sends what it owes
// at each index any rank picked, in one float32 all-reduce of the union. An element one rank
// found large leaves every rank's residual at once, instead of waiting there until each rank
// finds it large too: up to N k elements per step leave the residuals, for the bytes of k
// indices and at most N k values.
void union_allreduce(CallSteps& steps, std::span<float> data, ErrorFeedback& feedback,
                     FeedbackState state, const Tensor& tensor, ReduceOp op) {
  // The registry gives this pattern to top-k with union=1, which selects indices.
  auto& selector = dynamic_cast<SelectsIndices&>(feedback.inner());
  thread_local std::vector<std::uint32_t> mine, picked;
  // The residual holds what is owed from here on; if the exchange fails, it stays owed.
  feedback.owe(state, data, state.residual);
  const std::span<const float> owed = state.residual;
  selector.select_indices(tensor, owed, mine);
  // Each rank's element count travels ahead of its indices, so ranks that pass tensors of
  // different sizes but the same k all fail alike instead of indexing past a tensor's end.
  // (A different k already fails the all-gather's signature check.)
  mine.insert(mine.begin(), static_cast<std::uint32_t>(data.size()));
  const std::size_t per_rank = mine.size();
  picked.resize(per_rank * static_cast<std::size_t>(steps.size()));
  steps.allgather(mine.data(), picked.data(), per_rank, DataType::kInt32);
  std::size_t kept = 0;
  for (int r = 0; r < steps.size(); ++r) {
    const std::uint32_t* from = picked.data() + static_cast<std::size_t>(r) * per_rank;
    if (from[0] != data.size()) {  // every rank sees every size: all fail alike
      throw AgreedError(Error(ErrorKind::kMismatch,
                              "tensor '" + tensor.name + "' has " + std::to_string(from[0]) +
                                  " elements on rank " + std::to_string(r) + " and " +
                                  std::to_string(data.size()) + " here",
                              steps.rank(), r, kOp, data.size_bytes()));
    }
    for (std::size_t j = 1; j < per_rank; ++j) picked[kept++] = from[j];
  }
  picked.resize(kept);
  std::sort(picked.begin(), picked.end());
  picked.erase(std::unique(picked.begin(), picked.end()), picked.end());
  std::vector<float> values(picked.size());
  for (std::size_t j = 0; j < picked.size(); ++j) values[j] = owed[picked[j]];
  steps.allreduce(values.data(), values.data(), values.size(), DataType::kFloat32, op);
  feedback.keep_unsent(state, picked);
  std::fill(data.begin(), data.end(), 0.0f);
  for (std::size_t j = 0; j < picked.size(); ++j) data[picked[j]] = values[j];
}

// int8 / qsgd: quantised again at every hop. With feedback the residual (and momentum) joins
// the data, and the residual collects what every encoding of this rank drops.
void quantized_allreduce(CallSteps& steps, std::span<float> data, Codec& codec,
                         ErrorFeedback* feedback, FeedbackState state, const Tensor& tensor,
                         ReduceOp op) {
  float* lost = nullptr;
  if (feedback) {
    feedback->owe(state, data, data);
    std::fill(state.residual.begin(), state.residual.end(), 0.0f);
    lost = state.residual.data();
  }
  // The registry gives this pattern to block quantisers only.
  auto& quantizer = static_cast<BlockQuantizer&>(feedback ? feedback->inner() : codec);
  quantizer.begin(tensor);
  QuantizedWire wire(quantizer);
  ring(steps, data, DataType::kUInt8, wire, lost);
  finish_average(data, op, steps.size());
}

// PowerSGD: a matrix as its factors P and Q, each summed by a float32 all-reduce; a vector
// as itself.
void low_rank_allreduce(CallSteps& steps, std::span<float> data, PowerSgd& power,
                        const Tensor& tensor, ReduceOp op) {
  if (!power.compresses(tensor, data.size())) {
    steps.allreduce(data.data(), data.data(), data.size(), DataType::kFloat32, op);
    return;
  }
  const int n = steps.size();
  power.reduce(
      tensor, data,
      [&](std::span<float> v) {
        steps.allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
      },
      n, op == ReduceOp::kAvg ? n : 1);
}

void check_op(const Context& ctx, ReduceOp op) {
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg) {
    throw Error(ErrorKind::kInvalidArgument,
                std::string("compressed all-reduce sums or averages, not ") + to_string(op),
                ctx.rank(), Error::kNoPeer, kOp);
  }
}

// The call's steps for a tensor, or a bucket reduced whole (`parts` name its elements).
bool reduce_whole(CallSteps& steps, std::span<float> data, Codec& codec, const Reduced& reduced,
                  ReduceOp op, NonFinite non_finite, const FeedbackState* caller_state) {
  const Tensor& tensor = reduced.tensor;
  const CodecTraits& traits = codec.traits();
  const Context::Impl& context = steps.context();
  codec.set_stream(static_cast<std::uint64_t>(steps.rank()));
  const bool cast = traits.pattern == Pattern::kFloat32 || traits.pattern == Pattern::kHalfRing;
  if (cast && context.transport->shared_arena() &&
      context.pick_allreduce(data.size_bytes(), Algorithm::kAuto) == Algorithm::kSharedMemory) {
    const DataType round_through =
        traits.pattern == Pattern::kHalfRing ? traits.half_type : DataType::kFloat32;
    return shm_allreduce(steps, data, round_through, op, reduced, non_finite);
  }
  const NonFinite policy = non_finite == NonFinite::kPropagate && traits.refuses_non_finite
                               ? NonFinite::kThrow
                               : non_finite;
  if (policy != NonFinite::kPropagate && !every_rank_finite(steps, data, reduced, policy)) {
    return false;
  }
  // Error feedback's state: the caller's, or the codec's own under the tensor's name.
  auto* feedback = dynamic_cast<ErrorFeedback*>(&codec);
  FeedbackState state;
  if (feedback) state = caller_state ? *caller_state : feedback->state(tensor, data.size());
  const Encode encode = [&](std::span<const float> in, std::vector<std::uint8_t>& out) {
    if (feedback) {
      feedback->encode(state, tensor, in, out);
    } else {
      codec.encode(tensor, in, out);
    }
  };
  switch (traits.pattern) {
    case Pattern::kFloat32:
      steps.allreduce(data.data(), data.data(), data.size(), DataType::kFloat32, op);
      break;
    case Pattern::kHalfRing:
      half_allreduce(steps, data, traits.half_type, op);
      break;
    case Pattern::kQuantizedRing:
      quantized_allreduce(steps, data, codec, feedback, state, tensor, op);
      break;
    case Pattern::kSharedIndices:
      randomk_allreduce(steps, data, codec, encode, op);
      break;
    case Pattern::kIndexUnion:
      if (!data.empty()) union_allreduce(steps, data, *feedback, state, tensor, op);
      break;
    case Pattern::kLowRank:
      // The registry gives this pattern to PowerSGD only.
      low_rank_allreduce(steps, data, static_cast<PowerSgd&>(codec), tensor, op);
      break;
    case Pattern::kGather:
      gather_allreduce(steps, data, codec, encode, tensor, op);
      break;
  }
  return true;
}

// `parts` must tile `data`: a float outside every part would lose its residual, one in two
// would be fed back twice.
void check_tiling(const Context& ctx, std::span<const float> data, const Tensor& bucket,
                  std::span<const TensorSlice> parts) {
  std::vector<const TensorSlice*> by_offset;
  for (const TensorSlice& part : parts) by_offset.push_back(&part);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorSlice* a, const TensorSlice* b) { return a->offset < b->offset; });
  std::size_t covered = 0;
  for (const TensorSlice* part : by_offset) {
    const bool empty_inside = part->count == 0 && part->offset <= data.size();
    if (!empty_inside && (part->offset != covered || part->count > data.size() - covered)) {
      throw Error(ErrorKind::kInvalidArgument,
                  "bucket '" + bucket.name + "': part '" + part->tensor.name + "' at [" +
                      std::to_string(part->offset) + ", " +
                      std::to_string(part->offset + part->count) + ") " +
                      (part->offset < covered ? "overlaps the part before it"
                       : part->offset > covered
                           ? "leaves a gap after " + std::to_string(covered)
                           : "ends past the bucket's " + std::to_string(data.size()) + " floats"),
                  ctx.rank(), Error::kNoPeer, kOp, data.size_bytes());
    }
    covered += part->count;
  }
  if (covered != data.size()) {
    throw Error(ErrorKind::kInvalidArgument,
                "bucket '" + bucket.name + "': its parts cover " + std::to_string(covered) +
                    " of its " + std::to_string(data.size()) + " floats",
                ctx.rank(), Error::kNoPeer, kOp, data.size_bytes());
  }
}

}  // namespace

bool compressed_allreduce_steps(CallSteps& steps, std::span<float> data, Codec& codec,
                                const Tensor& tensor, ReduceOp op, NonFinite non_finite,
                                const FeedbackState* caller_state) {
  return reduce_whole(steps, data, codec, Reduced{tensor, {}}, op, non_finite, caller_state);
}

bool compressed_allreduce_steps(CallSteps& steps, std::span<float> data, Codec& codec,
                                const Tensor& bucket, std::span<const TensorSlice> parts,
                                ReduceOp op, NonFinite non_finite,
                                const FeedbackState* caller_state) {
  if (codec.traits().pattern == Pattern::kLowRank) {  // its matrices are the tensors'
    bool all_reduced = true;
    for (const TensorSlice& part : parts) {
      all_reduced &= compressed_allreduce_steps(steps, data.subspan(part.offset, part.count), codec,
                                                part.tensor, op, non_finite);
    }
    return all_reduced;
  }
  return reduce_whole(steps, data, codec, Reduced{bucket, parts}, op, non_finite, caller_state);
}

namespace {

// Queues one compressed all-reduce whose steps `reduce` runs (false: skipped on every rank).
Work submit(Context& ctx, const Codec& codec, std::size_t count, ReduceOp op, bool blocking,
            std::function<bool(CallSteps&)> reduce) {
  check_op(ctx, op);
  const collectives::CallSignature call{0,
                                        collectives::CollectiveKind::kCompressedAllreduce,
                                        DataType::kFloat32,
                                        op,
                                        Algorithm::kAuto,
                                        spec_tag(codec),
                                        count};
  return detail::ContextAccess::impl(ctx).submit_steps(
      call,
      [reduce = std::move(reduce)](CallSteps& steps) {
        if (!reduce(steps)) steps.mark_skipped();
      },
      blocking);
}

// One tensor's call, queued (async) or run after the calls before it (blocking).
Work tensor_call(Context& ctx, std::span<float> data, Codec& codec, const Tensor& tensor,
                 ReduceOp op, NonFinite non_finite, bool blocking) {
  return submit(ctx, codec, data.size(), op, blocking, [=, &codec](CallSteps& steps) {
    return compressed_allreduce_steps(steps, data, codec, tensor, op, non_finite);
  });
}

// A bucket's call, likewise; `parts` is copied, as the caller's may go first.
Work bucket_call(Context& ctx, std::span<float> data, Codec& codec, const Tensor& bucket,
                 std::span<const TensorSlice> parts, ReduceOp op, NonFinite non_finite,
                 bool blocking) {
  check_tiling(ctx, data, bucket, parts);
  std::vector<TensorSlice> copied(parts.begin(), parts.end());
  return submit(ctx, codec, data.size(), op, blocking,
                [=, &codec, parts = std::move(copied)](CallSteps& steps) {
                  return compressed_allreduce_steps(steps, data, codec, bucket, parts, op,
                                                    non_finite);
                });
}

}  // namespace

Work compressed_allreduce_async(Context& ctx, std::span<float> data, Codec& codec,
                                const Tensor& tensor, ReduceOp op, NonFinite non_finite) {
  return tensor_call(ctx, data, codec, tensor, op, non_finite, false);
}

bool compressed_allreduce(Context& ctx, std::span<float> data, Codec& codec, const Tensor& tensor,
                          ReduceOp op, NonFinite non_finite) {
  return !tensor_call(ctx, data, codec, tensor, op, non_finite, true).skipped();
}

Work compressed_allreduce_async(Context& ctx, std::span<float> data, Codec& codec,
                                const Tensor& bucket, std::span<const TensorSlice> parts,
                                ReduceOp op, NonFinite non_finite) {
  return bucket_call(ctx, data, codec, bucket, parts, op, non_finite, false);
}

bool compressed_allreduce(Context& ctx, std::span<float> data, Codec& codec, const Tensor& bucket,
                          std::span<const TensorSlice> parts, ReduceOp op, NonFinite non_finite) {
  return !bucket_call(ctx, data, codec, bucket, parts, op, non_finite, true).skipped();
}

}  // namespace gradsync::compress
