// Tensor checks, staging and shapes of the torch backend's calls (torch_tensors.h).
#include "torch_tensors.h"

#include "gradsync/error.h"

namespace gradsync::torch_backend {

[[noreturn]] void refuse(const std::string& what, int rank, const char* op) {
  throw Error(ErrorKind::kInvalidArgument, what, rank, Error::kNoPeer, op);
}

DataType dtype_of(const at::Tensor& t, int rank, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DataType::kFloat32;
    case at::kDouble:
      return DataType::kFloat64;
    case at::kHalf:
      return DataType::kFloat16;
    case at::kBFloat16:
      return DataType::kBFloat16;
    case at::kInt:
      return DataType::kInt32;
    case at::kLong:
      return DataType::kInt64;
    case at::kByte:
      return DataType::kUInt8;
    case at::kChar:
      return DataType::kInt8;
    case at::kShort:
      return DataType::kInt16;
    case at::kBool:
      return DataType::kBool;
    default:
      refuse(std::string("gradsync has no dtype for torch.") + c10::toString(t.scalar_type()), rank,
             op);
  }
}

ReduceOp op_of(const c10d::ReduceOp& op, int rank, const char* name) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return ReduceOp::kSum;
    case c10d::ReduceOp::AVG:
      return ReduceOp::kAvg;
    case c10d::ReduceOp::PRODUCT:
      return ReduceOp::kProd;
    case c10d::ReduceOp::MIN:
      return ReduceOp::kMin;
    case c10d::ReduceOp::MAX:
      return ReduceOp::kMax;
    case c10d::ReduceOp::BAND:
      return ReduceOp::kBand;
    case c10d::ReduceOp::BOR:
      return ReduceOp::kBor;
    case c10d::ReduceOp::BXOR:
      return ReduceOp::kBxor;
    default:
      refuse("reduce op " + std::to_string(static_cast<int>(op.op_)) +
                 " (PREMUL_SUM, NCCL's alone) is not supported",
             rank, name);
  }
}

DataType check_tensors(const std::vector<at::Tensor>& tensors, int rank, const char* op) {
  if (tensors.empty()) refuse("no tensor given", rank, op);
  const DataType dtype = dtype_of(tensors.front(), rank, op);
  for (const auto& t : tensors) {
    if (!t.device().is_cpu()) {
      refuse("gradsync's torch backend takes CPU tensors; this one is on " + t.device().str(), rank,
             op);
    }
    if (t.layout() != c10::kStrided) refuse("sparse tensors are not supported", rank, op);
    if (dtype_of(t, rank, op) != dtype) {
      refuse(std::string("tensors of different dtypes: ") +
                 c10::toString(tensors.front().scalar_type()) + " and " +
                 c10::toString(t.scalar_type()),
             rank, op);
    }
  }
  return dtype;
}

void expect_one(const std::vector<at::Tensor>& tensors, int rank, const char* op) {
  if (tensors.size() != 1) {
    refuse("takes one tensor per call (a CPU process has one device); got " +
               std::to_string(tensors.size()),
           rank, op);
  }
}

CallOptions call_options(std::chrono::milliseconds timeout, const Shapes& shapes) {
  CallOptions o;
  if (timeout != c10d::kUnsetTimeout) o.timeout = timeout;
  o.fingerprint = shapes.fingerprint();
  return o;
}

at::Tensor flatten(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors) flat.push_back(t.reshape({-1}));
  return at::cat(flat);
}

void unflatten(const at::Tensor& flat, const std::vector<at::Tensor>& tensors) {
  std::int64_t offset = 0;
  for (const auto& t : tensors) {
    t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

std::string shape_of(const at::Tensor& t) {
  std::string s = "[";
  for (std::size_t i = 0; i < t.sizes().size(); ++i) {
    s += (i ? ", " : "") + std::to_string(t.sizes()[i]);
  }
  return s + "]";
}

const std::vector<at::Tensor>& rank_blocks(const std::vector<std::vector<at::Tensor>>& lists,
                                           const at::Tensor& like, DataType dtype, int size,
                                           int rank, const char* op, const std::string& role) {
  if (lists.size() != 1 || lists[0].size() != static_cast<std::size_t>(size)) {
    refuse("takes one list of " + std::to_string(size) + " " + role + " tensors", rank, op);
  }
  if (check_tensors(lists[0], rank, op) != dtype) {
    refuse(role + " tensors of another dtype than the " + shape_of(like) + " tensor's", rank, op);
  }
  for (const auto& t : lists[0]) {
    if (t.numel() != like.numel()) {
      refuse(role + " tensor of shape " + shape_of(t) + " with a tensor of shape " + shape_of(like),
             rank, op);
    }
  }
  return lists[0];
}

std::vector<std::size_t> split_counts(const at::Tensor& t, const std::vector<std::int64_t>& splits,
                                      int size, int rank, const char* what) {
  std::vector<std::size_t> counts(static_cast<std::size_t>(size));
  const std::int64_t rows = t.dim() ? t.size(0) : 1;
  const std::int64_t row = rows ? t.numel() / rows : 0;
  if (splits.empty()) {
    if (rows % size) {
      refuse(std::string(what) + " of shape " + shape_of(t) + " does not split into " +
                 std::to_string(size) + " equal parts",
             rank, "alltoall_base");
    }
    for (auto& c : counts) c = static_cast<std::size_t>(rows / size * row);
    return counts;
  }
  if (splits.size() != static_cast<std::size_t>(size)) {
    refuse(std::string(what) + " splits have " + std::to_string(splits.size()) + " entries for " +
               std::to_string(size) + " ranks",
           rank, "alltoall_base");
  }
  std::int64_t total = 0;
  for (std::size_t i = 0; i < counts.size(); ++i) {
    if (splits[i] < 0) refuse("negative split", rank, "alltoall_base");
    counts[i] = static_cast<std::size_t>(splits[i] * row);
    total += splits[i];
  }
  if (total != rows) {
    refuse(
        std::string(what) + " splits sum to " + std::to_string(total) + " rows of " + shape_of(t),
        rank, "alltoall_base");
  }
  return counts;
}

Shapes::Shapes(const std::vector<at::Tensor>& tensors) : tensors_(tensors) {
  // FNV-1a over the dims, each shape preceded by its rank: [6] and [2, 3] and [3, 2] differ.
  std::uint32_t h = 2166136261u;
  auto mix = [&h](std::int64_t v) {
    for (int i = 0; i < 8; ++i, v >>= 8) h = (h ^ static_cast<std::uint8_t>(v)) * 16777619u;
  };
  for (const auto& t : tensors) {
    mix(t.dim());
    for (std::int64_t d : t.sizes()) mix(d);
  }
  fingerprint_ = h ? h : 1;  // 0 means "none given"
}

std::string Shapes::describe() const {
  if (tensors_.empty()) return "";
  // The call checked the tensors already: a dtype gradsync has.
  std::string s = to_string(dtype_of(tensors_.front(), Error::kUnknownRank, ""));
  for (std::size_t i = 0; i < tensors_.size(); ++i) s += (i ? ", " : " ") + shape_of(tensors_[i]);
  return s;
}

}  // namespace gradsync::torch_backend
