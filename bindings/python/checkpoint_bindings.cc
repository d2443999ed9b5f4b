// memlean._C: the segment planner of //ops/checkpoint (memlean.plan_segments uses it), the
// segment-argument checks of checkpoint_sequential (one specification for C++ and Python) and
// the recompute flag (memlean.is_recomputing). The checkpoint itself is Python,
// memlean/checkpoint.py, since it runs Python callables; it marks its recomputes with the
// C++ flag, so that C++ modules (memlean::BatchNorm2d) and Python ones see one flag.
#include <torch/csrc/Exceptions.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bindings/python/bindings.h"
#include "ops/checkpoint/checkpoint.h"
#include "ops/checkpoint/sequential.h"

namespace memlean::python {
namespace {

std::vector<LayerCost> to_costs(const std::vector<int64_t>& input_bytes,
                                const std::vector<int64_t>& activation_bytes) {
  TORCH_CHECK(input_bytes.size() == activation_bytes.size(), "memlean: input_bytes has ",
              input_bytes.size(), " layers but activation_bytes has ", activation_bytes.size());
  std::vector<LayerCost> costs(input_bytes.size());
  for (size_t i = 0; i < costs.size(); ++i) costs[i] = {input_bytes[i], activation_bytes[i]};
  return costs;
}

// A memlean::RecomputeGuard held from __enter__ to __exit__ (on one thread: the flag is
// thread-local, and a `with` block enters and exits on its thread).
struct RecomputingScope {
  std::optional<RecomputeGuard> guard;
};

}  // namespace

void init_checkpoint(pybind11::module_& m) {
  namespace py = pybind11;
  m.def(
      "plan_segments",
      [](const std::vector<int64_t>& input_bytes, const std::vector<int64_t>& activation_bytes,
         std::optional<int64_t> budget_bytes) {
        const SegmentPlan plan = plan_segments(to_costs(input_bytes, activation_bytes), budget_bytes);
        return py::make_tuple(plan.starts, plan.estimated_peak_bytes, plan.fits_budget);
      },
      py::arg("input_bytes"), py::arg("activation_bytes"), py::arg("budget_bytes") = py::none(),
      "memlean::plan_segments: (starts, estimated_peak_bytes, fits_budget).");
  m.def(
      "estimate_peak_bytes",
      [](const std::vector<int64_t>& input_bytes, const std::vector<int64_t>& activation_bytes,
         const std::vector<int64_t>& starts) {
        return estimate_peak_bytes(to_costs(input_bytes, activation_bytes), starts);
      },
      py::arg("input_bytes"), py::arg("activation_bytes"), py::arg("starts"),
      "memlean::estimate_peak_bytes: the modelled activation peak of a segmentation.");
  m.def("sqrt_segment_starts", &sqrt_segment_starts, py::arg("n_layers"),
        "round(sqrt(n)) (nearly) equal segments over n layers.");
  // The argument checks of checkpoint_sequential, shared with memlean.checkpoint_sequential
  // (ValueErrors naming `op`).
  m.def("equal_segment_starts",
        torch::wrap_pybind_function([](int64_t n_layers, int64_t segments, const std::string& op) {
          return equal_segment_starts(n_layers, segments, op.c_str());
        }),
        py::arg("n_layers"), py::arg("segments"), py::arg("op"),
        "memlean::equal_segment_starts: `segments` (nearly) equal segments over n layers.");
  m.def("check_segment_starts",
        torch::wrap_pybind_function(
            [](const std::vector<int64_t>& starts, int64_t n_layers, const std::string& op) {
              check_segment_starts(starts, n_layers, op.c_str());
            }),
        py::arg("starts"), py::arg("n_layers"), py::arg("op"),
        "memlean::check_segment_starts: 0 first, increasing, < n_layers.");
  // The Python checkpoint's backward core: the unlisted-leaf check and the recompute's
  // gradients, in C++ (a fraction of torch.autograd.grad's Python cost per segment). The
  // GIL is released while the engine runs (it may run Python nodes on other threads).
  m.def("recomputed_grad",
        torch::wrap_pybind_function([](const std::vector<at::Tensor>& outputs,
                                       const std::vector<at::Tensor>& targets,
                                       const std::vector<at::Tensor>& grads, const std::string& op,
                                       const std::string& how_to_list) {
          py::gil_scoped_release no_gil;
          return recomputed_grad(outputs, targets, grads, op.c_str(), how_to_list.c_str());
        }),
        py::arg("outputs"), py::arg("targets"), py::arg("grads"), py::arg("op"),
        py::arg("how_to_list"),
        "memlean::recomputed_grad: gradients of outputs w.r.t. targets (None where unused), "
        "after checking that the graph reaches no other leaf that requires grad.");
  m.def("is_recomputing", &is_recomputing,
        "memlean::is_recomputing: a checkpoint (C++ or Python) recomputes on this thread.");
  // `with _C.Recomputing():` holds a memlean::RecomputeGuard on this thread.
  py::class_<RecomputingScope>(m, "Recomputing")
      .def(py::init<>())
      .def("__enter__",
           [](RecomputingScope& self) {
             TORCH_CHECK(!self.guard, "memlean: a Recomputing scope is entered once");
             self.guard.emplace();
           })
      .def("__exit__", [](RecomputingScope& self, const py::args&) { self.guard.reset(); });
}

}  // namespace memlean::python
