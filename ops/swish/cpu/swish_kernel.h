// CPU kernels for Swish-β, compiled once per CPU capability (see swish_kernel.cc).
#pragma once

#include <ATen/TensorIterator.h>

// The kernels' declarations: once for the entry points, once per capability namespace.
//
// forward_kernel: y = x * sigmoid(beta * x), written to iter's output; iter has inputs (x).
// backward_kernel: grad_x = grad * s * (1 + beta * x * (1 - s)), s = sigmoid(beta * x);
//   iter has inputs (grad, x).
// The in-place variant, on contiguous tensors: inplace_forward_kernel overwrites x with y
// and, when mask is defined, writes one bit per element to it (ceil(n/8) bytes; bit i%8 of
// byte i/8 is element i): 1 when beta*x lies left of t*, the minimum of t*sigmoid(t).
// inplace_backward_kernel recovers x from (y, bit) and writes grad_x = grad * dy/dx.
// runs_in_parallel: whether this copy's at::parallel_for uses ATen's intra-op threads (false
// when torch's backend is OpenMP and the file was compiled without -fopenmp).
#define MEMLEAN_SWISH_CPU_KERNELS                                                            \
  bool runs_in_parallel();                                                                   \
  void forward_kernel(at::TensorIteratorBase& iter, double beta);                            \
  void backward_kernel(at::TensorIteratorBase& iter, double beta);                           \
  void inplace_forward_kernel(const at::Tensor& x, const at::Tensor& mask, double beta);     \
  void inplace_backward_kernel(const at::Tensor& grad, const at::Tensor& y,                  \
                               const at::Tensor& mask, const at::Tensor& grad_x, double beta);

namespace memlean::swish_cpu {

// The entry points pick one copy at run time from ATen's own choice
// (at::get_cpu_capability(), so ATEN_CPU_CAPABILITY applies).
MEMLEAN_SWISH_CPU_KERNELS

namespace DEFAULT {
MEMLEAN_SWISH_CPU_KERNELS
}  // namespace DEFAULT
namespace AVX2 {
MEMLEAN_SWISH_CPU_KERNELS
}  // namespace AVX2
namespace AVX512 {
MEMLEAN_SWISH_CPU_KERNELS
}  // namespace AVX512

}  // namespace memlean::swish_cpu
