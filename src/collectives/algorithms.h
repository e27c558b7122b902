// Every collective algorithm, as a function of (Comm, buffers, sizes). All operate on
// element counts of one dtype; `send` may equal `recv` (in place) unless stated.
#pragma once

#include <cstddef>
#include <span>

#include "collectives/comm.h"

namespace gradsync::collectives {

// Tunables shared by the algorithms.
struct AlgorithmConfig {
  // Bytes per pipelined ring message: big enough to amortise per-message cost, small enough
  // that a received piece is still in cache when it is reduced and forwarded.
  std::size_t chunk_bytes = 256 * 1024;
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

// Broadcast from `root`: binomial tree for small messages, pipelined chain for large ones.
void broadcast(Comm& c, void* data, std::size_t count, DataType dtype, int root,
               const AlgorithmConfig& cfg);

// Reduce to `root` (binomial tree); `recv` used only on root. kAvg finished on root.
void reduce(Comm& c, const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op,
            int root);

// Dissemination barrier: ceil(log2 N) rounds of empty messages.
void barrier(Comm& c);

}  // namespace gradsync::collectives
