// memlean._C: the pybind11 extension. Linking the op libraries registers their operators
// (torch.ops.memlean.*); the functions here are the few that are not operators.
#include <torch/csrc/utils/pybind.h>

#include "ops/swish/swish.h"

#ifndef MEMLEAN_TORCH_VERSION
#error "MEMLEAN_TORCH_VERSION must name the torch version this extension is built against"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "memlean's C++ extension (operators are under torch.ops.memlean)";
  m.attr("TORCH_VERSION") = MEMLEAN_TORCH_VERSION;
  m.def("swish_forward", &memlean::swish_forward, pybind11::arg("x"), pybind11::arg("beta") = 1.0,
        "Swish-beta forward kernel, without autograd.");
  m.def("swish_backward", &memlean::swish_backward, pybind11::arg("grad"), pybind11::arg("x"),
        pybind11::arg("beta") = 1.0, "Gradient of Swish-beta with respect to x, without autograd.");
}
