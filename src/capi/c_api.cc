// The C API (include/gradsync/gradsync_c.h) over the C++ one: each function checks what C
// cannot (null handles, enum values out of range, the options' size), calls the Context, and
// turns every exception into a result code and this thread's last error message.
#include <chrono>
#include <cstddef>
#include <exception>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <utility>

#include "gradsync/gradsync.h"
#include "gradsync/gradsync_c.h"

struct gradsync_comm {
  std::unique_ptr<gradsync::Context> context;
};

struct gradsync_work {
  gradsync::Work work;
};

namespace {

using gradsync::DataType;
using gradsync::Error;
using gradsync::ErrorKind;
using gradsync::ReduceOp;

// The C enums mirror the C++ ones value for value, so a conversion is a range check and a cast.
static_assert(GRADSYNC_FLOAT32 == static_cast<int>(DataType::kFloat32) &&
              GRADSYNC_FLOAT16 == static_cast<int>(DataType::kFloat16) &&
              GRADSYNC_BFLOAT16 == static_cast<int>(DataType::kBFloat16) &&
              GRADSYNC_INT64 == static_cast<int>(DataType::kInt64) &&
              GRADSYNC_INT16 == static_cast<int>(DataType::kInt16) &&
              GRADSYNC_BOOL == static_cast<int>(DataType::kBool));
static_assert(GRADSYNC_SUM == static_cast<int>(ReduceOp::kSum) &&
              GRADSYNC_AVG == static_cast<int>(ReduceOp::kAvg) &&
              GRADSYNC_PROD == static_cast<int>(ReduceOp::kProd) &&
              GRADSYNC_BXOR == static_cast<int>(ReduceOp::kBxor));
static_assert(GRADSYNC_ALGORITHM_AUTO == static_cast<int>(gradsync::Algorithm::kAuto) &&
              GRADSYNC_ALGORITHM_PARAMETER_SERVER ==
                  static_cast<int>(gradsync::Algorithm::kParameterServer) &&
              GRADSYNC_ALGORITHM_HIERARCHICAL ==
                  static_cast<int>(gradsync::Algorithm::kHierarchical));

thread_local std::string last_error;

gradsync_result result_of(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument:
      return GRADSYNC_ERROR_INVALID_ARGUMENT;
    case ErrorKind::kMismatch:
      return GRADSYNC_ERROR_MISMATCH;
    case ErrorKind::kPeerLost:
      return GRADSYNC_ERROR_PEER_LOST;
    case ErrorKind::kTimeout:
      return GRADSYNC_ERROR_TIMEOUT;
    case ErrorKind::kProtocol:
      return GRADSYNC_ERROR_PROTOCOL;
    case ErrorKind::kAborted:
      return GRADSYNC_ERROR_ABORTED;
    case ErrorKind::kSystem:
      return GRADSYNC_ERROR_SYSTEM;
  }
  return GRADSYNC_ERROR_INTERNAL;
}

gradsync_result failed(gradsync_result result, std::string message) {
  last_error = std::move(message);
  return result;
}

// Runs `call`; an exception becomes its result code, its message this thread's last error.
template <class Call>
gradsync_result guarded(Call&& call) noexcept {
  try {
    call();
    return GRADSYNC_SUCCESS;
  } catch (const Error& e) {
    return failed(result_of(e.kind()), e.what());
  } catch (const std::bad_alloc&) {
    return failed(GRADSYNC_ERROR_INTERNAL, "out of memory");
  } catch (const std::exception& e) {
    return failed(GRADSYNC_ERROR_INTERNAL, e.what());
  } catch (...) {
    return failed(GRADSYNC_ERROR_INTERNAL, "an unknown exception");
  }
}

void require(bool ok, const char* function, const char* what) {
  if (!ok) {
    throw Error(ErrorKind::kInvalidArgument, std::string(function) + ": " + what);
  }
}

gradsync::Context& context_of(gradsync_comm* comm, const char* function) {
  require(comm != nullptr && comm->context != nullptr, function, "comm is NULL");
  return *comm->context;
}

DataType dtype_of(gradsync_dtype dtype, const char* function) {
  const int value = static_cast<int>(dtype);
  require(value >= GRADSYNC_FLOAT32 && value <= GRADSYNC_BOOL, function,
          ("dtype " + std::to_string(value) + " is not a gradsync_dtype").c_str());
  return static_cast<DataType>(value);
}

ReduceOp op_of(gradsync_op op, const char* function) {
  const int value = static_cast<int>(op);
  require(value >= GRADSYNC_SUM && value <= GRADSYNC_BXOR, function,
          ("op " + std::to_string(value) + " is not a gradsync_op").c_str());
  return static_cast<ReduceOp>(value);
}

// One entry a rank, as allgatherv's and alltoallv's counts are.
std::span<const std::size_t> counts_of(const std::size_t* counts, const gradsync::Context& ctx,
                                       const char* function, const char* name) {
  require(counts != nullptr, function, (std::string(name) + " is NULL").c_str());
  return {counts, static_cast<std::size_t>(ctx.size())};
}

// Queues an async call and hands its handle to the caller.
template <class Start>
gradsync_result started(gradsync_work** work, const char* function, Start&& start) noexcept {
  return guarded([&] {
    require(work != nullptr, function, "work is NULL");
    *work = nullptr;
    auto handle = std::make_unique<gradsync_work>();
    handle->work = start();
    *work = handle.release();
  });
}

gradsync::Options options_of(const gradsync_options& o) {
  // A caller built against an older, shorter struct sets only the fields it knew.
  const auto has = [&](std::size_t offset, std::size_t size) {
    return o.struct_size >= offset + size;
  };
#define HAS_FIELD(field) has(offsetof(gradsync_options, field), sizeof(o.field))
  require(HAS_FIELD(rank), "gradsync_init",
          "options.struct_size is too small: initialise the options with GRADSYNC_OPTIONS_INIT");
  require(
      o.struct_size <= sizeof(gradsync_options), "gradsync_init",
      ("options of " + std::to_string(o.struct_size) +
       " bytes come from a newer gradsync than this library (" +
       std::to_string(sizeof(gradsync_options)) + " bytes, version " + gradsync::version() + ")")
          .c_str());
  gradsync::Options options;
  if (HAS_FIELD(rank)) options.rank = o.rank;
  if (HAS_FIELD(size)) options.size = o.size;
  if (HAS_FIELD(local_rank)) options.local_rank = o.local_rank;
  if (HAS_FIELD(local_size)) options.local_size = o.local_size;
  if (HAS_FIELD(master_addr) && o.master_addr) options.master_addr = o.master_addr;
  if (HAS_FIELD(master_port)) options.master_port = o.master_port;
  if (HAS_FIELD(token) && o.token) options.token = o.token;
  if (HAS_FIELD(transport) && o.transport) options.transport = o.transport;
  if (HAS_FIELD(algorithm)) {
    const int value = static_cast<int>(o.algorithm);
    require(
        value >= GRADSYNC_ALGORITHM_AUTO && value <= GRADSYNC_ALGORITHM_HIERARCHICAL,
        "gradsync_init",
        ("options.algorithm " + std::to_string(value) + " is not a gradsync_algorithm").c_str());
    options.algorithm = static_cast<gradsync::Algorithm>(value);
  }
  if (HAS_FIELD(timeout_ms)) {
    require(o.timeout_ms >= 0, "gradsync_init", "options.timeout_ms is negative");
    options.timeout = std::chrono::milliseconds(o.timeout_ms);
  }
#undef HAS_FIELD
  return options;
}

}  // namespace

extern "C" {

const char* gradsync_version_string(void) {
  return gradsync::version();
}

const char* gradsync_result_string(gradsync_result result) {
  switch (result) {
    case GRADSYNC_SUCCESS:
      return "success";
    case GRADSYNC_ERROR_INVALID_ARGUMENT:
      return "invalid argument";
    case GRADSYNC_ERROR_MISMATCH:
      return "mismatched call";
    case GRADSYNC_ERROR_PEER_LOST:
      return "peer lost";
    case GRADSYNC_ERROR_TIMEOUT:
      return "timeout";
    case GRADSYNC_ERROR_PROTOCOL:
      return "protocol error";
    case GRADSYNC_ERROR_ABORTED:
      return "aborted";
    case GRADSYNC_ERROR_SYSTEM:
      return "system error";
    case GRADSYNC_ERROR_INTERNAL:
      return "internal error";
  }
  return "not a gradsync_result";
}

const char* gradsync_last_error(void) {
  return last_error.c_str();
}

gradsync_result gradsync_init(const gradsync_options* options, gradsync_comm** comm) {
  return guarded([&] {
    require(comm != nullptr, "gradsync_init", "comm is NULL");
    *comm = nullptr;
    auto made = std::make_unique<gradsync_comm>();
    made->context = gradsync::init(options ? options_of(*options) : gradsync::Options{});
    *comm = made.release();
  });
}

gradsync_result gradsync_finalize(gradsync_comm* comm) {
  // Destroying the context finishes its queued calls; their errors were theirs to report.
  return guarded([&] { delete comm; });
}

#define COMM_GETTER(name, member)                                                           \
  gradsync_result gradsync_comm_##name(const gradsync_comm* comm, int* out) {               \
    return guarded([&] {                                                                    \
      require(out != nullptr, "gradsync_comm_" #name, #name " is NULL");                    \
      *out = context_of(const_cast<gradsync_comm*>(comm), "gradsync_comm_" #name).member(); \
    });                                                                                     \
  }
COMM_GETTER(rank, rank)
COMM_GETTER(size, size)
COMM_GETTER(local_rank, local_rank)
COMM_GETTER(local_size, local_size)
#undef COMM_GETTER

gradsync_result gradsync_allreduce(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                   gradsync_dtype dtype, gradsync_op op) {
  constexpr const char* f = "gradsync_allreduce";
  return guarded(
      [&] { context_of(comm, f).allreduce(send, recv, count, dtype_of(dtype, f), op_of(op, f)); });
}

gradsync_result gradsync_reduce_scatter(gradsync_comm* comm, const void* send, void* recv,
                                        size_t recv_count, gradsync_dtype dtype, gradsync_op op) {
  constexpr const char* f = "gradsync_reduce_scatter";
  return guarded([&] {
    context_of(comm, f).reduce_scatter(send, recv, recv_count, dtype_of(dtype, f), op_of(op, f));
  });
}

gradsync_result gradsync_allgather(gradsync_comm* comm, const void* send, void* recv,
                                   size_t send_count, gradsync_dtype dtype) {
  constexpr const char* f = "gradsync_allgather";
  return guarded(
      [&] { context_of(comm, f).allgather(send, recv, send_count, dtype_of(dtype, f)); });
}

gradsync_result gradsync_allgatherv(gradsync_comm* comm, const void* send, void* recv,
                                    const size_t* recv_counts, gradsync_dtype dtype) {
  constexpr const char* f = "gradsync_allgatherv";
  return guarded([&] {
    auto& ctx = context_of(comm, f);
    ctx.allgatherv(send, recv, counts_of(recv_counts, ctx, f, "recv_counts"), dtype_of(dtype, f));
  });
}

gradsync_result gradsync_broadcast(gradsync_comm* comm, void* data, size_t count,
                                   gradsync_dtype dtype, int root) {
  constexpr const char* f = "gradsync_broadcast";
  return guarded([&] { context_of(comm, f).broadcast(data, count, dtype_of(dtype, f), root); });
}

gradsync_result gradsync_reduce(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                gradsync_dtype dtype, gradsync_op op, int root) {
  constexpr const char* f = "gradsync_reduce";
  return guarded([&] {
    context_of(comm, f).reduce(send, recv, count, dtype_of(dtype, f), op_of(op, f), root);
  });
}

gradsync_result gradsync_barrier(gradsync_comm* comm) {
  return guarded([&] { context_of(comm, "gradsync_barrier").barrier(); });
}

gradsync_result gradsync_gather(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                gradsync_dtype dtype, int root) {
  constexpr const char* f = "gradsync_gather";
  return guarded([&] { context_of(comm, f).gather(send, recv, count, dtype_of(dtype, f), root); });
}

gradsync_result gradsync_scatter(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                 gradsync_dtype dtype, int root) {
  constexpr const char* f = "gradsync_scatter";
  return guarded([&] { context_of(comm, f).scatter(send, recv, count, dtype_of(dtype, f), root); });
}

gradsync_result gradsync_alltoall(gradsync_comm* comm, const void* send, void* recv, size_t count,
                                  gradsync_dtype dtype) {
  constexpr const char* f = "gradsync_alltoall";
  return guarded([&] { context_of(comm, f).alltoall(send, recv, count, dtype_of(dtype, f)); });
}

gradsync_result gradsync_alltoallv(gradsync_comm* comm, const void* send, const size_t* send_counts,
                                   void* recv, const size_t* recv_counts, gradsync_dtype dtype) {
  constexpr const char* f = "gradsync_alltoallv";
  return guarded([&] {
    auto& ctx = context_of(comm, f);
    ctx.alltoallv(send, counts_of(send_counts, ctx, f, "send_counts"), recv,
                  counts_of(recv_counts, ctx, f, "recv_counts"), dtype_of(dtype, f));
  });
}

gradsync_result gradsync_send(gradsync_comm* comm, const void* data, size_t count,
                              gradsync_dtype dtype, int peer, int tag) {
  constexpr const char* f = "gradsync_send";
  return guarded([&] { context_of(comm, f).send(data, count, dtype_of(dtype, f), peer, tag); });
}

gradsync_result gradsync_recv(gradsync_comm* comm, void* data, size_t count, gradsync_dtype dtype,
                              int peer, int tag) {
  constexpr const char* f = "gradsync_recv";
  return guarded([&] { context_of(comm, f).recv(data, count, dtype_of(dtype, f), peer, tag); });
}

gradsync_result gradsync_allreduce_async(gradsync_comm* comm, const void* send, void* recv,
                                         size_t count, gradsync_dtype dtype, gradsync_op op,
                                         gradsync_work** work) {
  constexpr const char* f = "gradsync_allreduce_async";
  return started(work, f, [&] {
    return context_of(comm, f).allreduce_async(send, recv, count, dtype_of(dtype, f), op_of(op, f));
  });
}

gradsync_result gradsync_reduce_scatter_async(gradsync_comm* comm, const void* send, void* recv,
                                              size_t recv_count, gradsync_dtype dtype,
                                              gradsync_op op, gradsync_work** work) {
  constexpr const char* f = "gradsync_reduce_scatter_async";
  return started(work, f, [&] {
    return context_of(comm, f).reduce_scatter_async(send, recv, recv_count, dtype_of(dtype, f),
                                                    op_of(op, f));
  });
}

gradsync_result gradsync_allgather_async(gradsync_comm* comm, const void* send, void* recv,
                                         size_t send_count, gradsync_dtype dtype,
                                         gradsync_work** work) {
  constexpr const char* f = "gradsync_allgather_async";
  return started(work, f, [&] {
    return context_of(comm, f).allgather_async(send, recv, send_count, dtype_of(dtype, f));
  });
}

gradsync_result gradsync_allgatherv_async(gradsync_comm* comm, const void* send, void* recv,
                                          const size_t* recv_counts, gradsync_dtype dtype,
                                          gradsync_work** work) {
  constexpr const char* f = "gradsync_allgatherv_async";
  return started(work, f, [&] {
    auto& ctx = context_of(comm, f);
    return ctx.allgatherv_async(send, recv, counts_of(recv_counts, ctx, f, "recv_counts"),
                                dtype_of(dtype, f));
  });
}

gradsync_result gradsync_broadcast_async(gradsync_comm* comm, void* data, size_t count,
                                         gradsync_dtype dtype, int root, gradsync_work** work) {
  constexpr const char* f = "gradsync_broadcast_async";
  return started(work, f, [&] {
    return context_of(comm, f).broadcast_async(data, count, dtype_of(dtype, f), root);
  });
}

gradsync_result gradsync_reduce_async(gradsync_comm* comm, const void* send, void* recv,
                                      size_t count, gradsync_dtype dtype, gradsync_op op, int root,
                                      gradsync_work** work) {
  constexpr const char* f = "gradsync_reduce_async";
  return started(work, f, [&] {
    return context_of(comm, f).reduce_async(send, recv, count, dtype_of(dtype, f), op_of(op, f),
                                            root);
  });
}

gradsync_result gradsync_barrier_async(gradsync_comm* comm, gradsync_work** work) {
  constexpr const char* f = "gradsync_barrier_async";
  return started(work, f, [&] { return context_of(comm, f).barrier_async(); });
}

gradsync_result gradsync_gather_async(gradsync_comm* comm, const void* send, void* recv,
                                      size_t count, gradsync_dtype dtype, int root,
                                      gradsync_work** work) {
  constexpr const char* f = "gradsync_gather_async";
  return started(work, f, [&] {
    return context_of(comm, f).gather_async(send, recv, count, dtype_of(dtype, f), root);
  });
}

gradsync_result gradsync_scatter_async(gradsync_comm* comm, const void* send, void* recv,
                                       size_t count, gradsync_dtype dtype, int root,
                                       gradsync_work** work) {
  constexpr const char* f = "gradsync_scatter_async";
  return started(work, f, [&] {
    return context_of(comm, f).scatter_async(send, recv, count, dtype_of(dtype, f), root);
  });
}

gradsync_result gradsync_alltoall_async(gradsync_comm* comm, const void* send, void* recv,
                                        size_t count, gradsync_dtype dtype, gradsync_work** work) {
  constexpr const char* f = "gradsync_alltoall_async";
  return started(work, f, [&] {
    return context_of(comm, f).alltoall_async(send, recv, count, dtype_of(dtype, f));
  });
}

gradsync_result gradsync_alltoallv_async(gradsync_comm* comm, const void* send,
                                         const size_t* send_counts, void* recv,
                                         const size_t* recv_counts, gradsync_dtype dtype,
                                         gradsync_work** work) {
  constexpr const char* f = "gradsync_alltoallv_async";
  return started(work, f, [&] {
    auto& ctx = context_of(comm, f);
    return ctx.alltoallv_async(send, counts_of(send_counts, ctx, f, "send_counts"), recv,
                               counts_of(recv_counts, ctx, f, "recv_counts"), dtype_of(dtype, f));
  });
}

gradsync_result gradsync_send_async(gradsync_comm* comm, const void* data, size_t count,
                                    gradsync_dtype dtype, int peer, int tag, gradsync_work** work) {
  constexpr const char* f = "gradsync_send_async";
  return started(work, f, [&] {
    return context_of(comm, f).send_async(data, count, dtype_of(dtype, f), peer, tag);
  });
}

gradsync_result gradsync_recv_async(gradsync_comm* comm, void* data, size_t count,
                                    gradsync_dtype dtype, int peer, int tag, gradsync_work** work) {
  constexpr const char* f = "gradsync_recv_async";
  return started(work, f, [&] {
    return context_of(comm, f).recv_async(data, count, dtype_of(dtype, f), peer, tag);
  });
}

gradsync_result gradsync_work_wait(gradsync_work* work) {
  return guarded([&] {
    require(work != nullptr, "gradsync_work_wait", "work is NULL");
    work->work.wait();
  });
}

gradsync_result gradsync_work_test(gradsync_work* work, int* done) {
  return guarded([&] {
    require(work != nullptr, "gradsync_work_test", "work is NULL");
    require(done != nullptr, "gradsync_work_test", "done is NULL");
    *done = work->work.test() ? 1 : 0;
    if (*done) {
      if (auto error = work->work.error()) std::rethrow_exception(error);
    }
  });
}

void gradsync_work_free(gradsync_work* work) {
  delete work;
}

}  // extern "C"
