// Picks the kernel copy for this CPU, the way ATen picks its own.
#include <ATen/Version.h>

#include "ops/swish/cpu/swish_kernel.h"

namespace memlean::swish_cpu {
namespace {
bool use_avx2() {
  // "DEFAULT", "AVX2" or "AVX512"; honours ATEN_CPU_CAPABILITY. Decided once.
  static const bool avx2 = [] {
    const std::string cap = at::get_cpu_capability();
    return cap == "AVX2" || cap == "AVX512";
  }();
  return avx2;
}
}  // namespace

void forward_kernel(at::TensorIteratorBase& iter, double beta) {
  use_avx2() ? AVX2::forward_kernel(iter, beta) : DEFAULT::forward_kernel(iter, beta);
}

void backward_kernel(at::TensorIteratorBase& iter, double beta) {
  use_avx2() ? AVX2::backward_kernel(iter, beta) : DEFAULT::backward_kernel(iter, beta);
}

void inplace_forward_kernel(const at::Tensor& x, const at::Tensor& mask, double beta) {
  use_avx2() ? AVX2::inplace_forward_kernel(x, mask, beta)
             : DEFAULT::inplace_forward_kernel(x, mask, beta);
}

void inplace_backward_kernel(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                             const at::Tensor& grad_x, double beta) {
  use_avx2() ? AVX2::inplace_backward_kernel(grad, y, mask, grad_x, beta)
             : DEFAULT::inplace_backward_kernel(grad, y, mask, grad_x, beta);
}

}  // namespace memlean::swish_cpu
