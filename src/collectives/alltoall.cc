// All-to-all of variable blocks by pairwise exchange.
#include <cstring>
#include <string>
#include <vector>

#include "collectives/algorithms.h"

namespace gradsync::collectives {

namespace {
std::vector<std::size_t> byte_offsets(std::span<const std::size_t> counts, std::size_t es) {
  std::vector<std::size_t> offsets(counts.size());
  std::size_t at = 0;
  for (std::size_t i = 0; i < counts.size(); ++i) {
    offsets[i] = at;
    at += counts[i] * es;
  }
  return offsets;
}
}  // namespace

void alltoallv(Comm& c, const void* send_v, std::span<const std::size_t> send_counts, void* recv_v,
               std::span<const std::size_t> recv_counts, DataType dtype) {
  const int n = c.size(), r = c.rank();
  const std::size_t es = dtype_size(dtype), me = static_cast<std::size_t>(r);
  const auto* send = static_cast<const unsigned char*>(send_v);
  auto* recv = static_cast<unsigned char*>(recv_v);
  const std::vector<std::size_t> send_at = byte_offsets(send_counts, es);
  const std::vector<std::size_t> recv_at = byte_offsets(recv_counts, es);
  // The pair of this rank with itself: the same rule as every other pair, checked here as no
  // message carries it. Raised inside the call, so the other ranks learn of it at once.
  if (send_counts[me] != recv_counts[me]) {
    throw Error(ErrorKind::kMismatch,
                "this rank sends itself " + std::to_string(send_counts[me]) +
                    " elements (send_counts[" + std::to_string(r) + "]) but receives " +
                    std::to_string(recv_counts[me]) + " from itself (recv_counts[" +
                    std::to_string(r) + "])",
                r);
  }
  if (send_counts[me]) std::memcpy(recv + recv_at[me], send + send_at[me], send_counts[me] * es);
  for (int step = 1; step < n; ++step) {
    const auto to = static_cast<std::size_t>((r + step) % n);
    const auto from = static_cast<std::size_t>((r - step + n) % n);
    // Each message is tagged with its own count, so the receiver names both sides' counts
    // when they differ. Both are posted before either is waited on: a send larger than the
    // transport buffers (shm's ring) completes only as its receiver takes it, and the
    // receiver waits on its own send to someone else at the same time.
    Comm in = c.with_count(recv_counts[from]), out = c.with_count(send_counts[to]);
    auto receive = in.irecv(static_cast<int>(from), recv + recv_at[from], recv_counts[from] * es);
    auto sent = out.isend(static_cast<int>(to), send + send_at[to], send_counts[to] * es);
    c.wait(receive);
    c.wait(sent);
  }
}

}  // namespace gradsync::collectives
