// memlean._C: the pybind11 extension. Linking the op libraries registers their operators
// (torch.ops.memlean.*: the Swish kernels are reached only through them); the checkpoint and
// memstats add their functions through an init_* function.
#include "bindings/python/bindings.h"

#ifndef MEMLEAN_TORCH_VERSION
#error "MEMLEAN_TORCH_VERSION must name the torch version this extension is built against"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "memlean's C++ extension (operators are under torch.ops.memlean)";
  m.attr("TORCH_VERSION") = MEMLEAN_TORCH_VERSION;
  memlean::python::init_checkpoint(m);
  memlean::python::init_memstats(m);
}
