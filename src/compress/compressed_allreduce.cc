// Compressed all-reduce: picks the communication pattern per codec (see compress.h).
#include <cstring>
#include <numeric>

#include "collectives/algorithms.h"
#include "core/context_impl.h"
#include "gradsync/compress.h"
#include "kernels/kernels.h"

namespace gradsync::compress {

namespace {

// The wire type of a codec that is a plain cast without feedback, else nothing.
std::optional<DataType> half_wire(const CodecSpec& s) {
  if (s.params.count("ef")) return std::nullopt;
  if (s.name == "fp16") return DataType::kFloat16;
  if (s.name == "bf16") return DataType::kBFloat16;
  return std::nullopt;
}

}  // namespace

void compressed_allreduce(Context& ctx, std::span<float> data, Codec& codec,
                          const std::string& tensor, ReduceOp op) {
  if (op != ReduceOp::kSum && op != ReduceOp::kAvg) {
    throw Error(ErrorKind::kInvalidArgument,
                std::string("compressed all-reduce sums or averages, not ") + to_string(op),
                ctx.rank(), Error::kNoPeer, "compressed_allreduce");
  }
  const int n = ctx.size();
  const CodecSpec spec = CodecSpec::parse(codec.spec());
  if (spec.name == "none") {  // float32 on the wire: the plain path
    ctx.allreduce(data.data(), data.data(), data.size(), DataType::kFloat32, op);
    return;
  }
  if (auto wire = half_wire(spec)) {
    Context::Impl& impl = ctx.impl();
    if (impl.transport->shared_arena()) {
      // Every rank on one host: bytes are not what limits the call, and the float32
      // shared-memory all-reduce beats a message ring of halves (4 ranks, 64 MiB: ~25 vs
      // ~78 ms). Sum in float32, then round once: the numerics the wire format promises (no
      // worse), the same bits everywhere.
      ctx.allreduce(data.data(), data.data(), data.size(), DataType::kFloat32, op);
      // Per thread and only grown: a fresh buffer per call would be fresh pages to fault in.
      thread_local std::vector<std::uint8_t> payload;
      codec.encode(tensor, data, payload);
      codec.decode(payload, data);
      return;
    }
    collectives::CallSignature sig{0,
                                   collectives::CollectiveKind::kCompressedAllreduce,
                                   *wire,
                                   op,
                                   Algorithm::kRing,
                                   -1,
                                   data.size()};
    float* p = data.data();
    const std::size_t count = data.size();
    const DataType w = *wire;
    impl.submit(
            sig,
            [=](collectives::Comm& c) {
              collectives::ring_allreduce_half_wire(c, p, count, w, op);
            },
            true)
        .wait();
    return;
  }
  // Any codec: every rank's payload to every rank, decoded and summed in rank order.
  std::vector<std::uint8_t> mine;
  codec.encode(tensor, data, mine);
  std::int64_t my_bytes = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(n));
  ctx.allgather(&my_bytes, sizes.data(), 1, DataType::kInt64);
  std::vector<std::size_t> counts(sizes.begin(), sizes.end());
  const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
  std::vector<std::uint8_t> all(total);
  ctx.allgatherv(mine.data(), all.data(), counts, DataType::kUInt8);
  std::vector<float> decoded(data.size());
  std::size_t at = 0;
  for (int r = 0; r < n; ++r) {
    const std::span<const std::uint8_t> payload(all.data() + at,
                                                counts[static_cast<std::size_t>(r)]);
    at += payload.size();
    try {
      codec.decode(payload, r == 0 ? data : std::span<float>(decoded));
    } catch (const Error& e) {
      throw Error(
          e.kind(),
          "rank " + std::to_string(r) + "'s payload of tensor '" + tensor + "': " + e.detail(),
          ctx.rank(), r, "compressed_allreduce", payload.size());
    }
    if (r > 0) {
      kernels::reduce_into(data.data(), decoded.data(), data.size(), DataType::kFloat32,
                           ReduceOp::kSum);
    }
  }
  if (op == ReduceOp::kAvg)
    kernels::scale_for_average(data.data(), data.size(), DataType::kFloat32, n);
}

}  // namespace gradsync::compress
