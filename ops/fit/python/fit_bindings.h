// The fit planner's Python binding: adds memlean._C.fit (bindings/python/module.cc calls it).
// Not for C++ users.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace memlean::python {

void init_fit(pybind11::module_& m);

}  // namespace memlean::python
