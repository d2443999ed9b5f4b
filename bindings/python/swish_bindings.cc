// memlean._C: the Swish kernels without autograd (the operators are torch.ops.memlean.*).
#include "bindings/python/bindings.h"
#include "ops/swish/swish.h"

namespace memlean::python {

void init_swish(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("swish_forward", &memlean::swish_forward, py::arg("x"), py::arg("beta") = 1.0,
        "Swish-beta forward kernel, without autograd.");
  m.def("swish_backward", &memlean::swish_backward, py::arg("grad"), py::arg("x"),
        py::arg("beta") = 1.0, "Gradient of Swish-beta with respect to x, without autograd.");
}

}  // namespace memlean::python
