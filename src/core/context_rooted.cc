// Context's gather, scatter, alltoall and alltoallv: argument checks, call signatures and
// submission, as context.cc does for the other collectives.
#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/context_impl.h"

namespace gradsync {

using collectives::CallSignature;
using collectives::CollectiveKind;
using collectives::Comm;

namespace {

void check_root(int root, const Context::Impl& impl, const char* name) {
  require(
      root >= 0 && root < impl.size,
      [&] { return "root " + std::to_string(root) + " is not a rank"; }, impl.rank, name);
}

Work gather_impl(Context::Impl& impl, const void* send, void* recv, std::size_t count,
                 DataType dtype, int root, const CallOptions& options, bool blocking) {
  const char* name = "gather";
  check_dtype_op(dtype, ReduceOp::kSum, impl.rank, name);
  check_root(root, impl, name);
  check_buffer(send, count, "send", impl.rank, name);
  if (impl.rank == root) {
    check_buffer(recv, count * static_cast<std::size_t>(impl.size), "recv", impl.rank, name);
  }
  CallSignature sig{0,    CollectiveKind::kGather, dtype, ReduceOp::kSum, Algorithm::kAuto, root,
                    count};
  return impl.submit(
      sig, [=](Comm& c) { collectives::gather(c, send, recv, count, dtype, root); }, blocking,
      options);
}

Work scatter_impl(Context::Impl& impl, const void* send, void* recv, std::size_t count,
                  DataType dtype, int root, const CallOptions& options, bool blocking) {
  const char* name = "scatter";
  check_dtype_op(dtype, ReduceOp::kSum, impl.rank, name);
  check_root(root, impl, name);
  if (impl.rank == root) {
    check_buffer(send, count * static_cast<std::size_t>(impl.size), "send", impl.rank, name);
  }
  check_buffer(recv, count, "recv", impl.rank, name);
  CallSignature sig{0,    CollectiveKind::kScatter, dtype, ReduceOp::kSum, Algorithm::kAuto, root,
                    count};
  return impl.submit(
      sig, [=](Comm& c) { collectives::scatter(c, send, recv, count, dtype, root); }, blocking,
      options);
}

bool overlap(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return a_bytes && b_bytes && x < y + b_bytes && y < x + a_bytes;
}

std::string show_counts_size(const char* what, std::size_t entries, int ranks) {
  return std::string(what) + " has " + std::to_string(entries) + " entries for " +
         std::to_string(ranks) + " ranks";
}

// alltoall is alltoallv with every count equal, so every message's tag is the call's own.
Work alltoallv_impl(Context::Impl& impl, const void* send, std::vector<std::size_t> send_counts,
                    void* recv, std::vector<std::size_t> recv_counts, DataType dtype,
                    CollectiveKind kind, const CallOptions& options, bool blocking) {
  const char* name = collectives::to_string(kind);
  check_dtype_op(dtype, ReduceOp::kSum, impl.rank, name);
  const auto n = static_cast<std::size_t>(impl.size);
  require(
      send_counts.size() == n,
      [&] { return show_counts_size("send_counts", send_counts.size(), impl.size); }, impl.rank,
      name);
  require(
      recv_counts.size() == n,
      [&] { return show_counts_size("recv_counts", recv_counts.size(), impl.size); }, impl.rank,
      name);
  const std::size_t send_total =
      std::accumulate(send_counts.begin(), send_counts.end(), std::size_t{0});
  const std::size_t recv_total =
      std::accumulate(recv_counts.begin(), recv_counts.end(), std::size_t{0});
  check_buffer(send, send_total, "send", impl.rank, name);
  check_buffer(recv, recv_total, "recv", impl.rank, name);
  // alltoall: the block count, the same on every rank; alltoallv: this rank's total, for
  // naming the call only (its messages carry their own counts, see Comm::with_count).
  const std::size_t count = kind == CollectiveKind::kAlltoall ? send_counts[0] : send_total;
  CallSignature sig{0, kind, dtype, ReduceOp::kSum, Algorithm::kAuto, -1, count};
  const std::size_t es = dtype_size(dtype);
  return impl.submit(
      sig,
      [=](Comm& c) {
        // In place (or overlapping): a block must not be overwritten before it is sent, so
        // the call sends from a copy.
        std::vector<unsigned char> copy;
        const void* from = send;
        if (overlap(send, send_total * es, recv, recv_total * es)) {
          copy.assign(static_cast<const unsigned char*>(send),
                      static_cast<const unsigned char*>(send) + send_total * es);
          from = copy.data();
        }
        collectives::alltoallv(c, from, send_counts, recv, recv_counts, dtype);
      },
      blocking, options);
}

std::vector<std::size_t> equal_blocks(const Context::Impl& impl, std::size_t count) {
  return std::vector<std::size_t>(static_cast<std::size_t>(impl.size), count);
}

}  // namespace

void Context::gather(const void* send, void* recv, std::size_t count, DataType dtype, int root,
                     const CallOptions& options) {
  gather_impl(*impl_, send, recv, count, dtype, root, options, true).wait();
}
Work Context::gather_async(const void* send, void* recv, std::size_t count, DataType dtype,
                           int root, const CallOptions& options) {
  return gather_impl(*impl_, send, recv, count, dtype, root, options, false);
}

void Context::scatter(const void* send, void* recv, std::size_t count, DataType dtype, int root,
                      const CallOptions& options) {
  scatter_impl(*impl_, send, recv, count, dtype, root, options, true).wait();
}
Work Context::scatter_async(const void* send, void* recv, std::size_t count, DataType dtype,
                            int root, const CallOptions& options) {
  return scatter_impl(*impl_, send, recv, count, dtype, root, options, false);
}

void Context::alltoall(const void* send, void* recv, std::size_t count, DataType dtype,
                       const CallOptions& options) {
  alltoallv_impl(*impl_, send, equal_blocks(*impl_, count), recv, equal_blocks(*impl_, count),
                 dtype, CollectiveKind::kAlltoall, options, true)
      .wait();
}
Work Context::alltoall_async(const void* send, void* recv, std::size_t count, DataType dtype,
                             const CallOptions& options) {
  return alltoallv_impl(*impl_, send, equal_blocks(*impl_, count), recv,
                        equal_blocks(*impl_, count), dtype, CollectiveKind::kAlltoall, options,
                        false);
}

void Context::alltoallv(const void* send, std::span<const std::size_t> send_counts, void* recv,
                        std::span<const std::size_t> recv_counts, DataType dtype,
                        const CallOptions& options) {
  alltoallv_impl(*impl_, send, {send_counts.begin(), send_counts.end()}, recv,
                 {recv_counts.begin(), recv_counts.end()}, dtype, CollectiveKind::kAlltoallv,
                 options, true)
      .wait();
}
Work Context::alltoallv_async(const void* send, std::span<const std::size_t> send_counts,
                              void* recv, std::span<const std::size_t> recv_counts, DataType dtype,
                              const CallOptions& options) {
  return alltoallv_impl(*impl_, send, {send_counts.begin(), send_counts.end()}, recv,
                        {recv_counts.begin(), recv_counts.end()}, dtype, CollectiveKind::kAlltoallv,
                        options, false);
}

}  // namespace gradsync
