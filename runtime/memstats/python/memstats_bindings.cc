// memlean._C.memstats: the C++ memory accounting (runtime/memstats) for memlean.memstats.
#include "runtime/memstats/python/memstats_bindings.h"

#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>

#include <memory>
#include <string>
#include <vector>

#include "runtime/memstats/memstats.h"

namespace memlean::python {

void init_memstats(pybind11::module_& m) {
  namespace py = pybind11;
  namespace ms = memlean::memstats;
  using torch::wrap_pybind_function;
  using Tensors = std::vector<at::Tensor>;

  py::module_ s = m.def_submodule("memstats", "Exact tensor memory accounting (C++ side).");

  s.def("enable", wrap_pybind_function([] { ms::enable(); }),
        "Install the counting CPU allocator (idempotent).");
  s.def("enabled", wrap_pybind_function([] { return ms::enabled(); }));
  s.def("parse_device",
        wrap_pybind_function([](const std::string& d) { return ms::parse_device(d).str(); }),
        py::arg("device"));
  s.def("memory_allocated", wrap_pybind_function([](const std::string& d) {
          return ms::memory_allocated(ms::parse_device(d));
        }),
        py::arg("device") = "cpu");
  s.def("max_memory_allocated", wrap_pybind_function([](const std::string& d) {
          return ms::max_memory_allocated(ms::parse_device(d));
        }),
        py::arg("device") = "cpu");
  s.def("memory_reserved", wrap_pybind_function([](const std::string& d) {
          return ms::memory_reserved(ms::parse_device(d));
        }),
        py::arg("device") = "cpu");
  s.def("allocated_bytes_of", wrap_pybind_function([](const Tensors& tensors, const std::string& d) {
          return ms::allocated_bytes_of(tensors, ms::parse_device(d));
        }),
        py::arg("tensors"), py::arg("device"),
        "What memory_allocated(device) counts for the storages of `tensors` on `device`, each "
        "once: on CUDA the caching allocator's blocks.");
  s.def("mark", wrap_pybind_function([](const std::string& name) { return ms::mark(name); }),
        py::arg("name"));

  py::class_<ms::Mark>(s, "Mark")
      .def_readonly("name", &ms::Mark::name)
      .def_readonly("step", &ms::Mark::step)
      .def_readonly("current", &ms::Mark::current)
      .def_readonly("peak", &ms::Mark::peak)
      .def_property_readonly("kept",
                             [](const ms::Mark& x) -> py::object {
                               if (x.kept < 0) return py::none();
                               return py::int_(x.kept);
                             })
      .def_readonly("reserved", &ms::Mark::reserved)
      .def_readonly("seconds", &ms::Mark::seconds)
      .def("__repr__", [](const ms::Mark& x) {
        return "Mark(name=" + std::string(py::repr(py::str(x.name))) +
               ", step=" + std::to_string(x.step) + ", current=" + std::to_string(x.current) +
               ", peak=" + std::to_string(x.peak) +
               ", kept=" + (x.kept < 0 ? std::string("None") : std::to_string(x.kept)) +
               ", reserved=" + std::to_string(x.reserved) + ")";
      });

  py::class_<ms::Categories>(s, "Categories")
      .def_readonly("parameters", &ms::Categories::parameters)
      .def_readonly("buffers", &ms::Categories::buffers)
      .def_readonly("gradients", &ms::Categories::gradients)
      .def_readonly("optimizer_state", &ms::Categories::optimizer_state)
      .def_readonly("activations", &ms::Categories::activations)
      .def_readonly("other", &ms::Categories::other)
      .def_readonly("allocator_rounding", &ms::Categories::allocator_rounding)
      .def_readonly("total", &ms::Categories::total)
      .def_readonly("untracked", &ms::Categories::untracked)
      .def("str", &ms::Categories::str, py::arg("bytes") = false)
      .def("json", &ms::Categories::json)
      .def("__str__", [](const ms::Categories& c) { return c.str(); });

  py::class_<ms::Tracker>(s, "Tracker")
      .def(py::init(wrap_pybind_function(
               [](const std::string& d) { return std::make_unique<ms::Tracker>(d); })),
           py::arg("device") = "cpu")
      .def_property_readonly("device", [](const ms::Tracker& t) { return t.device().str(); })
      .def_property_readonly("running", &ms::Tracker::running)
      .def_property_readonly("current", wrap_pybind_function(
                                            [](const ms::Tracker& t) { return t.current(); }))
      .def_property_readonly(
          "peak", wrap_pybind_function([](const ms::Tracker& t) { return t.peak(); }))
      .def_property_readonly("reserved", wrap_pybind_function(
                                             [](const ms::Tracker& t) { return t.reserved(); }))
      .def("reset_peak", wrap_pybind_function([](ms::Tracker& t) { t.reset_peak(); }))
      .def("mark",
           wrap_pybind_function([](ms::Tracker& t, const std::string& n) { return t.mark(n); }),
           py::arg("name"))
      .def("marks", &ms::Tracker::marks)
      .def("stop", wrap_pybind_function([](ms::Tracker& t) { t.stop(); }))
      .def("table", wrap_pybind_function([](const ms::Tracker& t, bool bytes,
                                            const std::string& value) {
             ms::TableOptions o;
             o.bytes = bytes;
             o.value = ms::parse_table_value(value);
             return t.table(o);
           }),
           py::arg("bytes") = false, py::arg("value") = "current")
      .def("csv", &ms::Tracker::csv)
      .def("json", wrap_pybind_function([](const ms::Tracker& t) { return t.json(); }))
      .def("categories",
           wrap_pybind_function([](const ms::Tracker& t, Tensors parameters, Tensors buffers,
                                   Tensors gradients, Tensors optimizer_state,
                                   const std::string& forward_mark) {
             ms::Tracker::Tensors x{std::move(parameters), std::move(buffers),
                                    std::move(gradients), std::move(optimizer_state)};
             return t.categories(x, forward_mark);
           }),
           py::arg("parameters"), py::arg("buffers"), py::arg("gradients"),
           py::arg("optimizer_state"), py::arg("forward_mark") = "");
}

}  // namespace memlean::python
