// memlean._C: the pybind11 extension. Linking the op libraries registers their operators
// (torch.ops.memlean.*: the Swish kernels are reached only through them); each library
// that has Python-facing functions adds them from its own python/ binding.
#include <torch/csrc/utils/pybind.h>

#include "ops/checkpoint/python/checkpoint_bindings.h"
#include "ops/fit/python/fit_bindings.h"
#include "runtime/memstats/python/memstats_bindings.h"

#ifndef MEMLEAN_TORCH_VERSION
#error "MEMLEAN_TORCH_VERSION must name the torch version this extension is built against"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "memlean's C++ extension (operators are under torch.ops.memlean)";
  m.attr("TORCH_VERSION") = MEMLEAN_TORCH_VERSION;
  memlean::python::init_checkpoint(m);
  memlean::python::init_fit(m);
  memlean::python::init_memstats(m);
}
