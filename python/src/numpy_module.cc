// gradsync._gradsync: the public C++ API on numpy arrays. Thin by design: it maps Python
// arguments to the C++ calls, keeps arrays alive while an async call uses them, and releases
// the GIL while a call runs. Every check and every error message is the C++ library's.
#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gradsync/gradsync.h"
#include "gradsync/timeline.h"

namespace py = pybind11;
using gradsync::Context;
using gradsync::DataType;
using gradsync::ReduceOp;

namespace {

// A numpy array as the C++ calls see it: base pointer, element count, dtype.
struct Buffer {
  void* data = nullptr;
  std::size_t count = 0;
  DataType dtype = DataType::kFloat32;
};

std::optional<DataType> dtype_of(const py::dtype& dt) {
  if (dt.is(py::dtype::of<float>())) return DataType::kFloat32;
  if (dt.is(py::dtype::of<double>())) return DataType::kFloat64;
  if (dt.is(py::dtype::of<std::int32_t>())) return DataType::kInt32;
  if (dt.is(py::dtype::of<std::int64_t>())) return DataType::kInt64;
  if (dt.is(py::dtype::of<std::uint8_t>())) return DataType::kUInt8;
  // numpy's own spellings for what pybind11 has no C++ type for.
  const std::string name = py::str(dt.attr("name"));
  if (name == "float16") return DataType::kFloat16;
  return gradsync::parse_dtype(name);
}

// The rank of the call being checked, for errors raised before the C++ call is made.
thread_local int calling_rank = gradsync::Error::kUnknownRank;

[[noreturn]] void refuse(const std::string& what, const char* op) {
  throw gradsync::Error(gradsync::ErrorKind::kInvalidArgument, what, calling_rank,
                        gradsync::Error::kNoPeer, op);
}

// Names `ctx`'s rank in the argument errors of one call.
struct CallOf {
  explicit CallOf(const Context& ctx) { calling_rank = ctx.rank(); }
  ~CallOf() { calling_rank = gradsync::Error::kUnknownRank; }
  CallOf(const CallOf&) = delete;
  CallOf& operator=(const CallOf&) = delete;
};

// `as`: the element type when the array's own does not say it (bfloat16 travels in uint16
// arrays, as numpy has no bfloat16).
Buffer buffer_of(py::array array, bool writable, const char* op,
                 const std::optional<std::string>& as = std::nullopt) {
  if (!(array.flags() & py::array::c_style)) {
    refuse("arrays must be C-contiguous (np.ascontiguousarray makes one)", op);
  }
  if (writable && !array.writeable()) refuse("the output array is read-only", op);
  Buffer b;
  b.count = static_cast<std::size_t>(array.size());
  std::optional<DataType> dtype;
  if (as) {
    dtype = gradsync::parse_dtype(*as);
    if (!dtype) refuse("unknown dtype '" + *as + "'", op);
    if (gradsync::dtype_size(*dtype) != static_cast<std::size_t>(array.itemsize())) {
      refuse("dtype '" + *as + "' has " + std::to_string(gradsync::dtype_size(*dtype)) +
                 "-byte elements, the array " + std::to_string(array.itemsize()) + "-byte ones",
             op);
    }
  } else {
    dtype = dtype_of(array.dtype());
    if (!dtype) {
      refuse("numpy dtype " + std::string(py::str(array.dtype())) + " has no gradsync dtype", op);
    }
  }
  b.dtype = *dtype;
  b.data = writable ? array.mutable_data() : const_cast<void*>(array.data());
  return b;
}

ReduceOp op_of(const std::string& name, const char* op) {
  auto parsed = gradsync::parse_op(name);
  if (!parsed) refuse("unknown reduce op '" + name + "'", op);
  return *parsed;
}

void same_dtype(const Buffer& a, const Buffer& b, const char* op) {
  if (a.dtype != b.dtype) {
    refuse(std::string("send is ") + gradsync::to_string(a.dtype) + ", recv " +
               gradsync::to_string(b.dtype),
           op);
  }
}

// `whole` (named `whole_name`) must hold one `block` per rank.
void one_block_per_rank(const Buffer& whole, const char* whole_name, const Buffer& block,
                        const char* block_name, int ranks, const char* op) {
  if (whole.count != block.count * static_cast<std::size_t>(ranks)) {
    refuse(std::string(whole_name) + " has " + std::to_string(whole.count) +
               " elements, not size() x " + block_name + "'s " + std::to_string(block.count),
           op);
  }
}

// An async call: its C++ handle, and the arrays it reads and writes, kept alive until the
// handle is dropped (a caller who drops it early must not free what the call still uses).
class PyWork {
 public:
  PyWork(gradsync::Work work, py::tuple arrays)
      : work_(std::move(work)), arrays_(std::move(arrays)) {}
  void wait(std::optional<double> timeout_s) {
    py::gil_scoped_release release;
    if (!timeout_s) {
      work_.wait();
      return;
    }
    const auto limit = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::duration<double>(*timeout_s));
    if (!work_.wait(limit)) {
      throw gradsync::Error(gradsync::ErrorKind::kTimeout,
                            "the call is still running after " + std::to_string(*timeout_s) +
                                " s (it goes on; its arrays stay in use)");
    }
  }
  bool test() const { return work_.test(); }
  bool skipped() {
    py::gil_scoped_release release;
    return work_.skipped();
  }
  py::object result() {
    wait(std::nullopt);
    return arrays_.size() ? arrays_[arrays_.size() - 1] : py::none();
  }

 private:
  gradsync::Work work_;
  py::tuple arrays_;  // the output last
};

// Runs `call` blocking (returns the output) or async (returns a Work owning the arrays).
template <class Call>
py::object issue(bool async_op, py::tuple arrays, Call call) {
  if (async_op) {
    gradsync::Work w;
    {
      py::gil_scoped_release release;
      w = call(true);
    }
    return py::cast(PyWork(std::move(w), std::move(arrays)));
  }
  {
    py::gil_scoped_release release;
    call(false).wait();
  }
  return arrays.size() ? py::object(arrays[arrays.size() - 1]) : py::none();
}

gradsync::CallOptions call_options(std::optional<double> timeout_s) {
  gradsync::CallOptions o;
  if (timeout_s) {
    o.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::duration<double>(*timeout_s));
  }
  return o;
}

// Maps gradsync::Error to gradsync.Error with its fields as attributes.
void register_error(py::module_& m) {
  // Held for the life of the process: the translator may run until the interpreter ends.
  static PyObject* error_type =
      py::exception<gradsync::Error>(m, "Error", PyExc_RuntimeError).release().ptr();
  py::handle(error_type).attr("__module__") = "gradsync";  // its public name: gradsync.Error
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const gradsync::Error& e) {
      py::object instance = py::handle(error_type)(e.what());
      instance.attr("kind") = gradsync::to_string(e.kind());
      instance.attr("rank") = e.rank();
      instance.attr("peer") = e.peer();
      instance.attr("op") = e.op();
      instance.attr("bytes") = e.bytes();
      instance.attr("detail") = e.detail();
      PyErr_SetObject(error_type, instance.ptr());
    }
  });
}

}  // namespace

PYBIND11_MODULE(_gradsync, m) {
  m.doc() = "gradsync on numpy arrays: init(), then collectives on a Context";
  register_error(m);

  py::class_<PyWork>(m, "Work", "Handle of an async call; keeps its arrays alive.")
      .def("wait", &PyWork::wait, py::arg("timeout") = py::none(),
           "Blocks until the call is done and raises its error. With a timeout in seconds, "
           "raises gradsync.Error (kind 'timeout') if it is still running then.")
      .def("test", &PyWork::test, "True once the call is done. Never blocks.")
      .def("is_completed", &PyWork::test)
      .def("skipped", &PyWork::skipped)
      .def("result", &PyWork::result, "Waits, then returns the output array.");

  py::class_<Context, std::shared_ptr<Context>> ctx(m, "Context");
  ctx.def_property_readonly("rank", &Context::rank)
      .def_property_readonly("size", &Context::size)
      .def_property_readonly("local_rank", &Context::local_rank)
      .def_property_readonly("local_size", &Context::local_size)
      .def_property_readonly("hosts", &Context::hosts)
      .def_property_readonly("topology", &Context::topology)
      .def_property_readonly("cost_model", &Context::cost_model)
      .def("transport_name", &Context::transport_name, py::arg("peer"))
      .def(
          "traffic",
          [](const Context& c) {
            const auto t = c.total_traffic();
            return py::dict(py::arg("bytes_sent") = t.bytes_sent,
                            py::arg("bytes_received") = t.bytes_received,
                            py::arg("messages_sent") = t.messages_sent,
                            py::arg("messages_received") = t.messages_received);
          },
          "Bytes and messages sent and received since the context was made, over every peer.");

  ctx.def(
      "allreduce",
      [](Context& c, py::array data, const std::string& op, std::optional<py::array> out,
         bool async_op, std::optional<std::string> dtype, std::optional<double> timeout) {
        const CallOf call_of(c);
        const char* name = "allreduce";
        py::array target = out ? *out : data;
        const Buffer in = buffer_of(data, false, name, dtype);
        const Buffer res = buffer_of(target, true, name, dtype);
        same_dtype(in, res, name);
        if (in.count != res.count) {
          refuse("out has " + std::to_string(res.count) + " elements, data " +
                     std::to_string(in.count),
                 name);
        }
        const ReduceOp rop = op_of(op, name);
        const auto options = call_options(timeout);
        return issue(async_op, py::make_tuple(data, target), [&](bool async) {
          return async ? c.allreduce_async(in.data, res.data, in.count, in.dtype, rop, options)
                       : (c.allreduce(in.data, res.data, in.count, in.dtype, rop, options),
                          gradsync::Work());
        });
      },
      py::arg("data"), py::arg("op") = "sum", py::arg("out") = py::none(),
      py::arg("async_op") = false, py::arg("dtype") = py::none(), py::arg("timeout") = py::none(),
      "Reduces `data` over every rank, in place (or into `out`). Returns the result array, or a "
      "Work with async_op=True.");

  ctx.def(
      "reduce_scatter",
      [](Context& c, py::array send, py::array recv, const std::string& op, bool async_op,
         std::optional<std::string> dtype, std::optional<double> timeout) {
        const CallOf call_of(c);
        const char* name = "reduce_scatter";
        const Buffer in = buffer_of(send, false, name, dtype);
        const Buffer res = buffer_of(recv, true, name, dtype);
        same_dtype(in, res, name);
        one_block_per_rank(in, "send", res, "recv", c.size(), name);
        const ReduceOp rop = op_of(op, name);
        const auto options = call_options(timeout);
        return issue(async_op, py::make_tuple(send, recv), [&](bool async) {
          return async
                     ? c.reduce_scatter_async(in.data, res.data, res.count, in.dtype, rop, options)
                     : (c.reduce_scatter(in.data, res.data, res.count, in.dtype, rop, options),
                        gradsync::Work());
        });
      },
      py::arg("send"), py::arg("recv"), py::arg("op") = "sum", py::arg("async_op") = false,
      py::arg("dtype") = py::none(), py::arg("timeout") = py::none(),
      "Rank r receives block r of the sum over ranks of `send` (size() blocks of recv.size).");

  ctx.def(
      "allgather",
      [](Context& c, py::array send, py::array recv, bool async_op,
         std::optional<std::string> dtype, std::optional<double> timeout) {
        const CallOf call_of(c);
        const char* name = "allgather";
        const Buffer in = buffer_of(send, false, name, dtype);
        const Buffer res = buffer_of(recv, true, name, dtype);
        same_dtype(in, res, name);
        one_block_per_rank(res, "recv", in, "send", c.size(), name);
        const auto options = call_options(timeout);
        return issue(async_op, py::make_tuple(send, recv), [&](bool async) {
          return async ? c.allgather_async(in.data, res.data, in.count, in.dtype, options)
                       : (c.allgather(in.data, res.data, in.count, in.dtype, options),
                          gradsync::Work());
        });
      },
      py::arg("send"), py::arg("recv"), py::arg("async_op") = false, py::arg("dtype") = py::none(),
      py::arg("timeout") = py::none(), "recv holds every rank's send, in rank order.");

  ctx.def(
      "allgatherv",
      [](Context& c, py::array send, py::array recv, std::vector<std::size_t> counts, bool async_op,
         std::optional<std::string> dtype, std::optional<double> timeout) {
        const CallOf call_of(c);
        const char* name = "allgatherv";
        const Buffer in = buffer_of(send, false, name, dtype);
        const Buffer res = buffer_of(recv, true, name, dtype);
        same_dtype(in, res, name);
        std::size_t total = 0;
        for (std::size_t n : counts) total += n;
        if (res.count != total) {
          refuse("recv has " + std::to_string(res.count) + " elements, the counts sum to " +
                     std::to_string(total),
                 name);
        }
        const auto options = call_options(timeout);
        return issue(async_op, py::make_tuple(send, recv), [&](bool async) {
          return async ? c.allgatherv_async(in.data, res.data, counts, in.dtype, options)
                       : (c.allgatherv(in.data, res.data, counts, in.dtype, options),
                          gradsync::Work());
        });
      },
      py::arg("send"), py::arg("recv"), py::arg("counts"), py::arg("async_op") = false,
      py::arg("dtype") = py::none(), py::arg("timeout") = py::none(),
      "Rank r contributes counts[r] elements; recv holds them packed in rank order.");

  ctx.def(
      "broadcast",
      [](Context& c, py::array data, int root, bool async_op, std::optional<std::string> dtype,
         std::optional<double> timeout) {
        const CallOf call_of(c);
        const Buffer b = buffer_of(data, true, "broadcast", dtype);
        const auto options = call_options(timeout);
        return issue(async_op, py::make_tuple(data), [&](bool async) {
          return async ? c.broadcast_async(b.data, b.count, b.dtype, root, options)
                       : (c.broadcast(b.data, b.count, b.dtype, root, options), gradsync::Work());
        });
      },
      py::arg("data"), py::arg("root") = 0, py::arg("async_op") = false,
      py::arg("dtype") = py::none(), py::arg("timeout") = py::none(),
      "Every rank's `data` becomes root's.");

  ctx.def(
      "reduce",
      [](Context& c, py::array send, std::optional<py::array> recv, int root, const std::string& op,
         bool async_op, std::optional<std::string> dtype, std::optional<double> timeout) {
        const CallOf call_of(c);
        const char* name = "reduce";
        const Buffer in = buffer_of(send, false, name, dtype);
        Buffer res;
        if (recv) {
          res = buffer_of(*recv, true, name, dtype);
          same_dtype(in, res, name);
          if (res.count != in.count) {
            refuse("recv has " + std::to_string(res.count) + " elements, send " +
                       std::to_string(in.count),
                   name);
          }
        }
        const ReduceOp rop = op_of(op, name);
        const auto options = call_options(timeout);
        py::tuple arrays = recv ? py::make_tuple(send, *recv) : py::make_tuple(send);
        return issue(async_op, arrays, [&](bool async) {
          return async ? c.reduce_async(in.data, res.data, in.count, in.dtype, rop, root, options)
                       : (c.reduce(in.data, res.data, in.count, in.dtype, rop, root, options),
                          gradsync::Work());
        });
      },
      py::arg("send"), py::arg("recv") = py::none(), py::arg("root") = 0, py::arg("op") = "sum",
      py::arg("async_op") = false, py::arg("dtype") = py::none(), py::arg("timeout") = py::none(),
      "Root's recv receives the reduction of every rank's send; others may pass no recv.");

  ctx.def(
      "gather",
      [](Context& c, py::array send, std::optional<py::array> recv, int root, bool async_op,
         std::optional<std::string> dtype, std::optional<double> timeout) {
        const CallOf call_of(c);
        const char* name = "gather";
        const Buffer in = buffer_of(send, false, name, dtype);
        Buffer res;
        if (recv) {
          res = buffer_of(*recv, true, name, dtype);
          same_dtype(in, res, name);
          one_block_per_rank(res, "recv", in, "send", c.size(), name);
        }
        const auto options = call_options(timeout);
        py::tuple arrays = recv ? py::make_tuple(send, *recv) : py::make_tuple(send);
        return issue(async_op, arrays, [&](bool async) {
          return async ? c.gather_async(in.data, res.data, in.count, in.dtype, root, options)
                       : (c.gather(in.data, res.data, in.count, in.dtype, root, options),
                          gradsync::Work());
        });
      },
      py::arg("send"), py::arg("recv") = py::none(), py::arg("root") = 0,
      py::arg("async_op") = false, py::arg("dtype") = py::none(), py::arg("timeout") = py::none(),
      "Root's recv receives every rank's send in rank order; others may pass no recv.");

  ctx.def(
      "scatter",
      [](Context& c, std::optional<py::array> send, py::array recv, int root, bool async_op,
         std::optional<std::string> dtype, std::optional<double> timeout) {
        const CallOf call_of(c);
        const char* name = "scatter";
        const Buffer res = buffer_of(recv, true, name, dtype);
        Buffer in;
        if (send) {
          in = buffer_of(*send, false, name, dtype);
          same_dtype(in, res, name);
          one_block_per_rank(in, "send", res, "recv", c.size(), name);
        }
        const auto options = call_options(timeout);
        py::tuple arrays = send ? py::make_tuple(*send, recv) : py::make_tuple(recv);
        return issue(async_op, arrays, [&](bool async) {
          return async ? c.scatter_async(in.data, res.data, res.count, res.dtype, root, options)
                       : (c.scatter(in.data, res.data, res.count, res.dtype, root, options),
                          gradsync::Work());
        });
      },
      py::arg("send"), py::arg("recv"), py::arg("root") = 0, py::arg("async_op") = false,
      py::arg("dtype") = py::none(), py::arg("timeout") = py::none(),
      "Rank r receives block r of root's send; others may pass send=None.");

  ctx.def(
      "alltoall",
      [](Context& c, py::array send, py::array recv,
         std::optional<std::vector<std::size_t>> send_counts,
         std::optional<std::vector<std::size_t>> recv_counts, bool async_op,
         std::optional<std::string> dtype, std::optional<double> timeout) {
        const CallOf call_of(c);
        const char* name = "alltoall";
        const Buffer in = buffer_of(send, false, name, dtype);
        const Buffer res = buffer_of(recv, true, name, dtype);
        same_dtype(in, res, name);
        const auto n = static_cast<std::size_t>(c.size());
        if (send_counts.has_value() != recv_counts.has_value()) {
          refuse("give both send_counts and recv_counts, or neither", name);
        }
        std::vector<std::size_t> sc =
            send_counts.value_or(std::vector<std::size_t>(n, in.count / n));
        std::vector<std::size_t> rc =
            recv_counts.value_or(std::vector<std::size_t>(n, res.count / n));
        std::size_t st = 0, rt = 0;
        for (auto x : sc) st += x;
        for (auto x : rc) rt += x;
        if (st != in.count || rt != res.count) {
          refuse("the counts cover " + std::to_string(st) + " of send's " +
                     std::to_string(in.count) + " and " + std::to_string(rt) + " of recv's " +
                     std::to_string(res.count) + " elements",
                 name);
        }
        const auto options = call_options(timeout);
        return issue(async_op, py::make_tuple(send, recv), [&](bool async) {
          return async ? c.alltoallv_async(in.data, sc, res.data, rc, in.dtype, options)
                       : (c.alltoallv(in.data, sc, res.data, rc, in.dtype, options),
                          gradsync::Work());
        });
      },
      py::arg("send"), py::arg("recv"), py::arg("send_counts") = py::none(),
      py::arg("recv_counts") = py::none(), py::arg("async_op") = false,
      py::arg("dtype") = py::none(), py::arg("timeout") = py::none(),
      "Block j of send goes to rank j; recv's block i came from rank i. Equal blocks unless "
      "send_counts and recv_counts give each rank's (elements, in rank order).");

  // send and recv take the same arguments: one reads the array, the other writes it.
  for (const bool is_send : {true, false}) {
    const char* name = is_send ? "send" : "recv";
    ctx.def(
        name,
        [is_send, name](Context& c, py::array data, int peer, int tag, bool async_op,
                        std::optional<std::string> dtype, std::optional<double> timeout) {
          const CallOf call_of(c);
          const Buffer b = buffer_of(data, !is_send, name, dtype);
          const auto options = call_options(timeout);
          return issue(async_op, py::make_tuple(data), [&](bool async) {
            if (is_send) {
              return async
                         ? c.send_async(b.data, b.count, b.dtype, peer, tag, options)
                         : (c.send(b.data, b.count, b.dtype, peer, tag, options), gradsync::Work());
            }
            return async ? c.recv_async(b.data, b.count, b.dtype, peer, tag, options)
                         : (c.recv(b.data, b.count, b.dtype, peer, tag, options), gradsync::Work());
          });
        },
        py::arg("data"), py::arg("peer"), py::arg("tag") = 0, py::arg("async_op") = false,
        py::arg("dtype") = py::none(), py::arg("timeout") = py::none(),
        is_send ? "Sends `data` to `peer`, whose recv with the same tag takes it (see gradsync.h "
                  "for the order sends and receives must keep with collectives)."
                : "Receives into `data` what `peer` sends with the same tag.");
  }

  ctx.def(
      "barrier",
      [](Context& c, bool async_op, std::optional<double> timeout) {
        const CallOf call_of(c);
        const auto options = call_options(timeout);
        return issue(async_op, py::tuple(), [&](bool async) {
          return async ? c.barrier_async(options) : (c.barrier(options), gradsync::Work());
        });
      },
      py::arg("async_op") = false, py::arg("timeout") = py::none());

  m.def(
      "init",
      [](std::optional<int> rank, std::optional<int> size, std::optional<std::string> master_addr,
         std::optional<int> master_port, std::optional<std::string> transport,
         std::optional<std::string> algorithm, std::optional<double> timeout,
         std::optional<std::string> token) {
        gradsync::Options o;
        if (rank) o.rank = *rank;
        if (size) o.size = *size;
        if (master_addr) o.master_addr = *master_addr;
        if (master_port) o.master_port = *master_port;
        if (transport) o.transport = *transport;
        if (token) o.token = *token;
        if (algorithm) {
          auto a = gradsync::parse_algorithm(*algorithm);
          if (!a) refuse("unknown algorithm '" + *algorithm + "'", "init");
          o.algorithm = *a;
        }
        if (timeout) {
          o.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(
              std::chrono::duration<double>(*timeout));
        }
        py::gil_scoped_release release;
        return std::shared_ptr<Context>(gradsync::init(o));
      },
      py::kw_only(), py::arg("rank") = py::none(), py::arg("size") = py::none(),
      py::arg("master_addr") = py::none(), py::arg("master_port") = py::none(),
      py::arg("transport") = py::none(), py::arg("algorithm") = py::none(),
      py::arg("timeout") = py::none(), py::arg("token") = py::none(),
      "Joins the job: every argument left out is read from the environment as the C++ "
      "init() reads it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, GRADSYNC_*). Blocks until "
      "every rank has joined. timeout is in seconds.");

  // The linked library's version, as gradsync::version() and every tool's --version say it.
  m.attr("__version__") = gradsync::version();

  m.def("now_us", &gradsync::timeline::now_us,
        "Microseconds on the clock of gradsync's timeline and call records (CLOCK_MONOTONIC).");
  m.def(
      "timeline_record",
      [](std::string name, const std::string& category, std::int64_t start_us,
         std::int64_t end_us) {
        // The timeline keeps a category's pointer: only the ones gradsync knows.
        static const char* const kKnown[] = {"compute", "comm",      "pack",
                                             "wait",    "optimizer", "step"};
        const char* cat = "compute";
        for (const char* k : kKnown) {
          if (category == k) cat = k;
        }
        gradsync::timeline::record(std::move(name), cat, start_us, end_us);
      },
      py::arg("name"), py::arg("category"), py::arg("start_us"), py::arg("end_us"),
      "Records a span of this thread (when GRADSYNC_TIMELINE is set).");
  m.def("timeline_enabled", &gradsync::timeline::enabled);
  m.def(
      "timeline_write",
      [](Context& c, const std::string& path) {
        const CallOf call_of(c);
        py::gil_scoped_release release;
        return gradsync::timeline::write(c, path);
      },
      py::arg("ctx"), py::arg("path") = "");
}
