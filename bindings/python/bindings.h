// memlean._C is one extension; each component adds its Python-facing functions to it
// from its own file with an init function declared here.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace memlean::python {

void init_checkpoint(pybind11::module_& m);  // checkpoint_bindings.cc
void init_memstats(pybind11::module_& m);  // memstats_bindings.cc

}  // namespace memlean::python
