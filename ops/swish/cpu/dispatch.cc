// Picks the kernel copy for this CPU, the way ATen picks its own.
#include <ATen/Version.h>

#include "ops/swish/cpu/swish_kernel.h"

namespace memlean::swish_cpu {
namespace {
enum class Capability { kDefault, kAvx2, kAvx512 };

Capability capability() {
  // "DEFAULT", "AVX2" or "AVX512"; honours ATEN_CPU_CAPABILITY. Decided once.
  static const Capability cap = [] {
    const std::string name = at::get_cpu_capability();
    return name == "AVX512" ? Capability::kAvx512
           : name == "AVX2" ? Capability::kAvx2
                            : Capability::kDefault;
  }();
  return cap;
}
}  // namespace

// Calls NS::fn(args...) for the capability in use.
#define MEMLEAN_SWISH_DISPATCH(fn, ...)                            \
  switch (capability()) {                                          \
    case Capability::kAvx512: return AVX512::fn(__VA_ARGS__);      \
    case Capability::kAvx2: return AVX2::fn(__VA_ARGS__);          \
    case Capability::kDefault: return DEFAULT::fn(__VA_ARGS__);    \
  }                                                                \
  __builtin_unreachable()

void forward_kernel(at::TensorIteratorBase& iter, double beta) {
  MEMLEAN_SWISH_DISPATCH(forward_kernel, iter, beta);
}

void backward_kernel(at::TensorIteratorBase& iter, double beta) {
  MEMLEAN_SWISH_DISPATCH(backward_kernel, iter, beta);
}

void inplace_forward_kernel(const at::Tensor& x, const at::Tensor& mask, double beta) {
  MEMLEAN_SWISH_DISPATCH(inplace_forward_kernel, x, mask, beta);
}

void inplace_backward_kernel(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                             const at::Tensor& grad_x, double beta) {
  MEMLEAN_SWISH_DISPATCH(inplace_backward_kernel, grad, y, mask, grad_x, beta);
}

bool runs_in_parallel() { MEMLEAN_SWISH_DISPATCH(runs_in_parallel); }

#undef MEMLEAN_SWISH_DISPATCH

}  // namespace memlean::swish_cpu
