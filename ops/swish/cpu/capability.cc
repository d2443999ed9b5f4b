// Picks the CPU kernels' copy for this CPU, the way ATen picks its own.
//
// Why not ATen's DispatchStub (DECLARE_DISPATCH / REGISTER_DISPATCH): its per-capability
// members and the function that chooses among them are declared under the
// HAVE_<CAPABILITY>_CPU_DEFINITION macros of torch's own build, which the installed headers
// do not carry; an out-of-tree library would have to guess them, and a wrong guess changes
// the layout of a class libtorch also compiled (a silent ABI mismatch across torch 2.11 to
// 2.14). What DispatchStub decides is reused instead: at::get_cpu_capability().
#include <ATen/Version.h>

#include <string>

#include "ops/swish/cpu/swish_kernel.h"

namespace memlean::swish_cpu {

const Kernels& kernels() {
  static const Kernels& chosen = []() -> const Kernels& {
    const std::string name = at::get_cpu_capability();  // "DEFAULT", "AVX2" or "AVX512"
    return name == "AVX512" ? AVX512::kKernels
           : name == "AVX2" ? AVX2::kKernels
                            : DEFAULT::kKernels;
  }();
  return chosen;
}

}  // namespace memlean::swish_cpu
