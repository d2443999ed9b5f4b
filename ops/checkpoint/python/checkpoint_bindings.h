// The checkpoint's Python binding: adds its functions to memlean._C
// (bindings/python/module.cc calls it). Not for C++ users.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace memlean::python {

void init_checkpoint(pybind11::module_& m);

}  // namespace memlean::python
