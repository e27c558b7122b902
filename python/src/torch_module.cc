// gradsync.torch._backend: ProcessGroupGradsync as a Python class (torch's ProcessGroup is its
// base, so torch.distributed takes it wherever it takes ProcessGroupGloo), and the function
// torch.distributed's backend registry calls to build one per process group.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <optional>
#include <string_view>

#include "torch_backend.h"

namespace py = pybind11;
using gradsync::torch_backend::ProcessGroupGradsync;

namespace {

c10::intrusive_ptr<ProcessGroupGradsync> make_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int world_size,
                                                    std::chrono::milliseconds timeout) {
  return c10::make_intrusive<ProcessGroupGradsync>(store, rank, world_size, timeout);
}

}  // namespace

PYBIND11_MODULE(_backend, m) {
  // torch.distributed registers the Store and ProcessGroup classes this module builds on.
  py::module_::import("torch.distributed");
  m.attr("built_for_torch") = TORCH_VERSION;

  py::class_<ProcessGroupGradsync, GRADSYNC_C10D_BASE, c10::intrusive_ptr<ProcessGroupGradsync>>(
      m, "ProcessGroupGradsync",
      "torch.distributed process group over gradsync (CPU tensors), as ProcessGroupGloo is over "
      "Gloo. Its ranks meet through `store`; `timeout` bounds the rendezvous and every call.")
      .def(py::init(&make_group), py::arg("store"), py::arg("rank"), py::arg("world_size"),
           py::arg("timeout") = std::chrono::milliseconds(std::chrono::minutes(30)),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("topology",
                             [](ProcessGroupGradsync& pg) { return pg.context().topology(); })
      .def_property_readonly("cost_model",
                             [](ProcessGroupGradsync& pg) { return pg.context().cost_model(); })
      .def("_take_records",
           [](ProcessGroupGradsync& pg) {
             py::list out;
             for (const auto& r : pg.take_records()) {
               out.append(py::make_tuple(r.op, r.bytes, r.issued_us, r.started_us, r.done_us,
                                         r.sent_bytes));
             }
             return out;
           })
      .def("_write_timeline", &ProcessGroupGradsync::write_timeline, py::arg("path") = "",
           py::call_guard<py::gil_scoped_release>())
      .def("_compressed_allreduce", &ProcessGroupGradsync::compressed_allreduce,
           py::arg("compressor"), py::arg("bucket"), py::arg("names"), py::arg("counts"),
           py::arg("rows"), py::arg("skip_non_finite") = false,
           py::call_guard<py::gil_scoped_release>());

  using gradsync::compress::BucketCompressor;
  py::class_<BucketCompressor, std::shared_ptr<BucketCompressor>>(
      m, "BucketCompressor",
      "A codec for DDP buckets, its error-feedback state kept per parameter (see compress.h).")
      .def(py::init<std::string_view>(), py::arg("spec"))
      .def_property_readonly("spec", [](const BucketCompressor& c) { return c.codec().spec(); })
      .def("save_state",
           [](const BucketCompressor& c) {
             const auto bytes = c.save_state();
             return py::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
           })
      .def("load_state",
           [](BucketCompressor& c, const py::bytes& state) {
             const std::string_view view = state;
             c.load_state({reinterpret_cast<const std::uint8_t*>(view.data()), view.size()});
           })
      .def(
          "held_back",
          [](const BucketCompressor& c, const std::string& parameter) -> std::optional<at::Tensor> {
            const auto held = c.held_back(parameter);
            if (held.empty()) return std::nullopt;
            // A copy: the residual changes with the parameter's next bucket.
            return at::tensor(at::ArrayRef<float>(held.data(), held.size()));
          },
          py::arg("parameter"),
          "A copy of what error feedback holds back for `parameter` (flat float32), or None.");

  m.def("codec_names", &gradsync::compress::codec_names, "The codecs a hook spec may name.");

  // The creator torch.distributed.Backend.register_backend takes: (store, rank, size, timeout).
  m.def("_create_process_group", &make_group, py::arg("store"), py::arg("rank"),
        py::arg("world_size"), py::arg("timeout"), py::call_guard<py::gil_scoped_release>());
}
