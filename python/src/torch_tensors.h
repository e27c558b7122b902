// The tensor side of the torch backend's calls: torch dtypes and reduce ops as gradsync's,
// the checks every call makes before it queues anything, contiguous staging, and the shapes
// ranks must agree on. Every refusal is a gradsync::Error(kInvalidArgument) naming the call.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <vector>

#include "gradsync/gradsync.h"

namespace gradsync::torch_backend {

[[noreturn]] void refuse(const std::string& what, int rank, const char* op);

DataType dtype_of(const at::Tensor& t, int rank, const char* op);
ReduceOp op_of(const c10d::ReduceOp& op, int rank, const char* name);

// Every tensor a CPU dense tensor of one dtype; returns the dtype.
DataType check_tensors(const std::vector<at::Tensor>& tensors, int rank, const char* op);
void expect_one(const std::vector<at::Tensor>& tensors, int rank, const char* op);

// "[2, 3]"
std::string shape_of(const at::Tensor& t);

// The tensors of one call whose shapes every rank's call must match (all_reduce's tensor,
// all_gather's input...). Their fingerprint goes into every collective of the call, so a
// rank passing [2, 3] where another passes [3, 2] fails with kMismatch although the counts
// agree; describe() names them in that error.
class Shapes {
 public:
  Shapes() = default;  // nothing to match (all_to_all: shapes differ by design)
  explicit Shapes(const std::vector<at::Tensor>& tensors);
  std::uint32_t fingerprint() const { return fingerprint_; }
  // "float32 [2, 3]", "float32 [4], [2, 2]": made only for an error, from the tensors held.
  std::string describe() const;

 private:
  std::vector<at::Tensor> tensors_;  // handles: a copy costs reference counts, not sizes
  std::uint32_t fingerprint_ = 0;
};

// torch's timeout where one was set, and the shapes' fingerprint.
CallOptions call_options(std::chrono::milliseconds timeout, const Shapes& shapes);

// A contiguous buffer for `user`: the tensor itself when it is contiguous, else a copy that
// write_back() copies into it.
struct Staged {
  at::Tensor user;
  at::Tensor buffer;
  explicit Staged(const at::Tensor& t) : user(t), buffer(t.is_contiguous() ? t : t.contiguous()) {}
  void write_back() const {
    if (!buffer.is_same(user)) user.copy_(buffer);
  }
  void* data() const { return buffer.data_ptr(); }
  std::size_t count() const { return static_cast<std::size_t>(buffer.numel()); }
};

// One flat contiguous tensor holding `tensors` back to back (their dtype).
at::Tensor flatten(const std::vector<at::Tensor>& tensors);
// Copies consecutive pieces of `flat` into `tensors`.
void unflatten(const at::Tensor& flat, const std::vector<at::Tensor>& tensors);

// The one list of `size` tensors a per-rank call takes (all_gather's outputs, reduce_scatter's
// inputs), each of `like`'s dtype and element count. `role`: "output" or "input".
const std::vector<at::Tensor>& rank_blocks(const std::vector<std::vector<at::Tensor>>& lists,
                                           const at::Tensor& like, DataType dtype, int size,
                                           int rank, const char* op, const std::string& role);

// Element counts per rank for alltoall_base: `splits` (rows of dim 0 per rank) or equal.
std::vector<std::size_t> split_counts(const at::Tensor& t, const std::vector<std::int64_t>& splits,
                                      int size, int rank, const char* what);

}  // namespace gradsync::torch_backend
