// Rooted collectives (broadcast, reduce, gather, scatter), the parameter-server baseline built
// from them, and the barrier.
#include <algorithm>
#include <cstring>
#include <vector>

#include "collectives/algorithms.h"
#include "collectives/element_stream.h"
#include "collectives/scratch.h"
#include "kernels/kernels.h"

namespace gradsync::collectives {

namespace {
// Rank numbering relative to the root, so every tree is rooted at virtual rank 0.
int to_virtual(int rank, int root, int n) {
  return (rank - root + n) % n;
}
int to_real(int vrank, int root, int n) {
  return (vrank + root) % n;
}

// Below this size a binomial tree (log2 N latency) beats a pipelined chain.
constexpr std::size_t kChainBroadcastMinBytes = 256 * 1024;
}  // namespace

void broadcast(Comm& c, void* data_v, std::size_t count, DataType dtype, int root,
               const AlgorithmConfig& cfg) {
  const int n = c.size();
  if (n == 1) return;
  auto* data = static_cast<unsigned char*>(data_v);
  const std::size_t es = dtype_size(dtype), bytes = count * es;
  const int v = to_virtual(c.rank(), root, n);
  if (bytes < kChainBroadcastMinBytes) {
    // Binomial tree: receive once from the parent, then send to children, largest subtree first.
    int mask = 1;
    while (mask < n) {
      if (v & mask) {
        c.recv(to_real(v - mask, root, n), data, bytes);
        break;
      }
      mask <<= 1;
    }
    std::vector<transport::RequestPtr> sends;
    for (mask >>= 1; mask > 0; mask >>= 1) {
      if (v + mask < n) sends.push_back(c.isend(to_real(v + mask, root, n), data, bytes));
    }
    c.wait_all(sends);
    return;
  }
  // Pipelined chain along the ring from the root: each piece is forwarded as soon as it lands,
  // so the time is about bytes/bandwidth plus one piece per hop, and the chain crosses each
  // host boundary once.
  const std::size_t chunk = std::max<std::size_t>(es, cfg.chunk_bytes / es * es);
  const std::size_t pieces = (bytes + chunk - 1) / chunk;
  const int root_position = c.topology() ? c.topology()->ring_position(root) : root;
  const int hop = to_virtual(c.ring_position(), root_position, n);  // hops from the root
  const int prev = c.ring_rank(c.ring_position() - 1), next = c.ring_rank(c.ring_position() + 1);
  std::vector<transport::RequestPtr> sends;
  for (std::size_t j = 0; j < pieces; ++j) {
    std::size_t off = j * chunk, len = std::min(chunk, bytes - off);
    if (hop != 0) c.recv(prev, data + off, len);
    if (hop != n - 1) sends.push_back(c.isend(next, data + off, len));
  }
  c.wait_all(sends);
}

void reduce(Comm& c, const void* send, void* recv, std::size_t count, DataType dtype, ReduceOp op,
            int root) {
  const int n = c.size();
  const std::size_t bytes = count * dtype_size(dtype);
  const int v = to_virtual(c.rank(), root, n);
  // The root accumulates in its output; every other rank in a scratch copy of its input.
  unsigned char* acc = v == 0 ? static_cast<unsigned char*>(recv)
                              : scratch_of<unsigned char>(ScratchUse::kPartialSums, bytes);
  if (bytes && acc != send) std::memcpy(acc, send, bytes);
  auto* incoming = scratch_of<unsigned char>(ScratchUse::kIncoming, bytes);
  for (int mask = 1; mask < n; mask <<= 1) {
    if (v & mask) {
      c.send(to_real(v - mask, root, n), acc, bytes);
      break;
    }
    if (v + mask < n) {
      c.recv(to_real(v + mask, root, n), incoming, bytes);
      kernels::reduce_into(acc, incoming, count, dtype, op);
    }
  }
  if (v == 0 && op == ReduceOp::kAvg) kernels::scale_for_average(acc, count, dtype, n);
}

void parameter_server_allreduce(Comm& c, const void* send, void* recv_v, std::size_t count,
                                DataType dtype, ReduceOp op) {
  // Every worker sends its whole gradient to the server (rank 0), which reduces them one
  // after another and sends the whole result back to each: the server moves 2(N-1) times
  // the payload, the cost that ring all-reduce removes. Kept as a baseline only.
  const int n = c.size();
  const std::size_t es = dtype_size(dtype), bytes = count * es;
  auto* recv = static_cast<unsigned char*>(recv_v);
  if (send != recv && bytes) std::memcpy(recv, send, bytes);
  if (c.rank() == 0) {
    for (int peer = 1; peer < n; ++peer) {
      ElementStream stream(es, [&](std::size_t e, const void* data, std::size_t k) {
        kernels::reduce_into(recv + e * es, data, k, dtype, op);
      });
      c.wait(c.irecv_consume(peer, bytes, std::ref(stream)));
    }
    if (op == ReduceOp::kAvg) kernels::scale_for_average(recv, count, dtype, n);
    std::vector<transport::RequestPtr> sends;
    for (int peer = 1; peer < n; ++peer) sends.push_back(c.isend(peer, recv, bytes));
    c.wait_all(sends);
  } else {
    c.send(0, recv, bytes);
    c.recv(0, recv, bytes);
  }
}

void gather(Comm& c, const void* send, void* recv, std::size_t count, DataType dtype, int root) {
  const std::size_t bytes = count * dtype_size(dtype);
  if (c.rank() != root) {
    c.send(root, send, bytes);  // empty ones too: the root checks every rank's count
    return;
  }
  auto* out = static_cast<unsigned char*>(recv);
  std::vector<transport::RequestPtr> receives;
  for (int peer = 0; peer < c.size(); ++peer) {
    if (peer != root) {
      receives.push_back(c.irecv(peer, out + static_cast<std::size_t>(peer) * bytes, bytes));
    }
  }
  unsigned char* mine = out + static_cast<std::size_t>(root) * bytes;
  if (bytes && send != mine) std::memmove(mine, send, bytes);
  c.wait_all(receives);
}

void scatter(Comm& c, const void* send, void* recv, std::size_t count, DataType dtype, int root) {
  const std::size_t bytes = count * dtype_size(dtype);
  if (c.rank() != root) {
    c.recv(root, recv, bytes);
    return;
  }
  const auto* in = static_cast<const unsigned char*>(send);
  std::vector<transport::RequestPtr> sends;
  for (int peer = 0; peer < c.size(); ++peer) {
    if (peer != root) {
      sends.push_back(c.isend(peer, in + static_cast<std::size_t>(peer) * bytes, bytes));
    }
  }
  c.wait_all(sends);  // before writing `recv`, which may be root's own block of `send`
  const unsigned char* mine = in + static_cast<std::size_t>(root) * bytes;
  if (bytes && recv != mine) std::memmove(recv, mine, bytes);
}

void barrier(Comm& c) {
  const int n = c.size(), r = c.rank();
  for (int k = 1; k < n; k <<= 1) {
    auto in = c.irecv((r - k + n) % n, nullptr, 0);
    c.wait(c.isend((r + k) % n, nullptr, 0));
    c.wait(in);
  }
}

}  // namespace gradsync::collectives
