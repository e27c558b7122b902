// Every collective algorithm, as a function of (Comm, buffers, sizes). All operate on
// element counts of one dtype; `send` may equal `recv` (in place) unless stated.
#pragma once

#include <cstddef>
#include <span>

#include "collectives/comm.h"

namespace gradsync::transport {
class SharedArena;
}

namespace gradsync::collectives {

// Tunables shared by the algorithms.
struct AlgorithmConfig {
  // Bytes per pipelined ring message: big enough to amortise per-message cost, small enough
  // that a received piece is still in cache when it is reduced and forwarded.
  std::size_t chunk_bytes = 256 * 1024;
  // Bytes per chunk of the shared-memory all-reduce (capped by what fits in the arena). 512 KiB
  // chunks: fewer waits than smaller ones, so fewer context switches when ranks oversubscribe
  // the cores, and larger ones gain nothing; see docs/performance-notes.md. All ranks' slots
  // (4 x 512 KiB each) stay within the 32 MiB L3.
  std::size_t shared_memory_chunk_bytes = 512 * 1024;
  // The shared-memory all-reduce copies its result out with non-temporal stores once the
  // ranks' messages together are at least this large: then the outputs would not stay in the
  // cache anyway, and streaming saves the read-for-ownership of every output line; smaller
  // ones are faster left in cache (docs/performance-notes.md).
  std::size_t shared_memory_streaming_bytes = std::size_t{16} << 20;
  // Messages up to this size take the shared-memory all-reduce's one-shot form between 2 ranks,
  // and up to twice it among more (shared_memory_one_shot_limit): every rank stages its whole
  // input and reduces the whole message itself, one wait for every rank instead of three.
  // Between 2 ranks faster up to 32 KiB, slower from 64 KiB; among 3 or 4, where each wait
  // needs every rank scheduled, still faster at 64 KiB (docs/performance-notes.md, sessions 30
  // and 33). The arena keeps room for 64 KiB. 0: never.
  std::size_t shared_memory_one_shot_bytes = 32 * 1024;
  std::size_t shared_memory_one_shot_limit(int ranks) const {
    return ranks > 2 ? 2 * shared_memory_one_shot_bytes : shared_memory_one_shot_bytes;
  }
};

// All-reduce. kAvg is finished inside (division applied once per element).
void ring_allreduce(Comm& c, const void* send, void* recv, std::size_t count, DataType dtype,
                    ReduceOp op, const AlgorithmConfig& cfg);
void recursive_doubling_allreduce(Comm& c, const void* send, void* recv, std::size_t count,
                                  DataType dtype, ReduceOp op);
void halving_doubling_allreduce(Comm& c, const void* send, void* recv, std::size_t count,
                                DataType dtype, ReduceOp op);
void parameter_server_allreduce(Comm& c, const void* send, void* recv, std::size_t count,
                                DataType dtype, ReduceOp op);
// What compressed gradients ask of the shared-memory all-reduce (float32 data only), done on
// each finished tile while it is in L1.
struct ShmFloatExtras {
  // A 16-bit float type every finished element is rounded through before the ranks copy it
  // out (fp16/bf16 compression); kFloat32: none.
  DataType round_through = DataType::kFloat32;
  // If not null, size() + 1 entries, -1 or 2 x element + (1 if NaN): entry m, the first
  // element at which member m's input holds NaN or Inf, among the elements this rank reduced;
  // the last entry, an element where finite inputs summed past the float range (or past
  // round_through's). A tile is searched
  // only when its sum is not finite, so a healthy call pays one look at 1/N of the data.
  std::int64_t* non_finite = nullptr;
};

// Ranks that all share `arena` reduce straight out of each other's staging buffers: user
// memory is read once and written once (see shared_memory.cc).
void shm_direct_allreduce(Comm& c, transport::SharedArena& arena, const void* send, void* recv,
                          std::size_t count, DataType dtype, ReduceOp op,
                          const AlgorithmConfig& cfg, const ShmFloatExtras& extras = {});

// All-gather and reduce-scatter (blocks of `block_count` elements) among ranks that all share
// `arena`: each byte is written to shared memory once and read by the ranks that need it, with
// no chain of hops (see shared_memory_blocks.cc). As ring_allgatherv and ring_reduce_scatter;
// the reduce-scatter's `recv` may be this rank's block of `send`.
void shm_direct_allgatherv(Comm& c, transport::SharedArena& arena, const void* send, void* recv,
                           std::span<const std::size_t> block_counts, DataType dtype,
                           const AlgorithmConfig& cfg);
void shm_direct_reduce_scatter(Comm& c, transport::SharedArena& arena, const void* send, void* recv,
                               std::size_t block_count, DataType dtype, ReduceOp op,
                               const AlgorithmConfig& cfg);

// Ring reduce-scatter: `send` holds size() blocks of `block_counts[i]` elements packed in
// rank order; `recv` receives this rank's reduced block. kAvg finished inside.
void ring_reduce_scatter(Comm& c, const void* send, void* recv,
                         std::span<const std::size_t> block_counts, DataType dtype, ReduceOp op,
                         const AlgorithmConfig& cfg);

// Ring all-gather of variable-size blocks: rank r's `send` (block_counts[r] elements) lands
// at its offset in `recv`; `send` may already be at that offset in `recv`.
void ring_allgatherv(Comm& c, const void* send, void* recv,
                     std::span<const std::size_t> block_counts, DataType dtype,
                     const AlgorithmConfig& cfg);

// Two-level versions for ranks spread over several hosts with the same number of ranks each
// (the Comm's topology says which; see hierarchical.cc): the host-local steps run among each
// host's ranks, only one slice per rank crosses between hosts. Where that does not apply
// (one host, one rank per host, uneven hosts) they run the ring versions.
bool hierarchical_applicable(const Comm& c);
void hierarchical_allreduce(Comm& c, const void* send, void* recv, std::size_t count,
                            DataType dtype, ReduceOp op, const AlgorithmConfig& cfg);
void hierarchical_reduce_scatter(Comm& c, const void* send, void* recv,
                                 std::span<const std::size_t> block_counts, DataType dtype,
                                 ReduceOp op, const AlgorithmConfig& cfg);
void hierarchical_allgatherv(Comm& c, const void* send, void* recv,
                             std::span<const std::size_t> block_counts, DataType dtype,
                             const AlgorithmConfig& cfg);

// How ring_allreduce_wire's messages carry a segment of float32 partial sums: a cast to a
// 16-bit float, or a quantisation with scales (compress/ defines them).
class WireFormat {
 public:
  virtual ~WireFormat() = default;
  // Bytes of a message of `count` floats. Segments lie back to back in one buffer: a format
  // that stores floats keeps this a multiple of 4 so that every segment stays aligned.
  virtual std::size_t bytes(std::size_t count) const = 0;
  virtual void encode(const float* in, std::size_t count, std::uint8_t* wire) = 0;
  virtual void decode(const std::uint8_t* wire, std::size_t count, float* out) const = 0;
  virtual void decode_add(const std::uint8_t* wire, std::size_t count, float* out) const = 0;
};

// Ring all-reduce (sum) of float32 data whose messages travel in `wire`'s format: every hop
// decodes and adds in float32 (a partial sum is encoded once per hop, never summed in the
// wire format). The owner of each segment encodes the final sum once and every rank, the
// owner included, decodes that message: identical bits everywhere. If `lost` is not null it
// receives (+=) what each of this rank's encodings dropped, element by element, so error
// feedback can carry it into the next step: over all ranks, sum(lost) + result = sum(data).
void ring_allreduce_wire(Comm& c, float* data, std::size_t count, WireFormat& wire, float* lost);

// Broadcast from `root`: binomial tree for small messages, pipelined chain for large ones.
void broadcast(Comm& c, void* data, std::size_t count, DataType dtype, int root,
               const AlgorithmConfig& cfg);

// Reduce to `root` (binomial tree); `recv` used only on root. kAvg finished on root.
void reduce(Comm& c, const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op,
            int root);

// Dissemination barrier: ceil(log2 N) rounds of empty messages.
void barrier(Comm& c);

// Gather to `root`: rank r's `count` elements land at offset r * count of root's `recv`
// (used only on root; root's `send` may already sit there). Scatter from `root`: rank r
// receives block r of root's `send` (used only on root; root's `recv` may be its block).
// Root posts every receive (every send) at once: no rank waits for another's turn.
void gather(Comm& c, const void* send, void* recv, std::size_t count, DataType dtype, int root);
void scatter(Comm& c, const void* send, void* recv, std::size_t count, DataType dtype, int root);

// All-to-all of variable blocks by pairwise exchange: `send` holds one block per rank packed in
// rank order (send_counts[j] elements for rank j), `recv` one block per rank (recv_counts[i]
// from rank i). Step s exchanges with ranks r + s and r - s, so every rank has one partner
// each way per step and none serves everyone in turn. Every pair exchanges a message, empty or
// not, tagged with its count: a pair whose counts disagree fails with kMismatch naming both
// (before any byte is copied), as does this rank if its own two counts differ. `send` and
// `recv` must not overlap.
void alltoallv(Comm& c, const void* send, std::span<const std::size_t> send_counts, void* recv,
               std::span<const std::size_t> recv_counts, DataType dtype);

}  // namespace gradsync::collectives
