// CPU kernels for Swish-β, compiled once per CPU capability (see swish_kernel.cc); each copy
// exports a table of its entry points, and capability.cc picks the table for this CPU.
#pragma once

#include <ATen/TensorIterator.h>

namespace memlean::swish_cpu {

// forward: y = x * sigmoid(beta * x), written to iter's output; iter has inputs (x).
// backward: grad_x = grad * s * (1 + beta * x * (1 - s)), s = sigmoid(beta * x); iter has
//   inputs (grad, x).
// The in-place variant, on contiguous tensors: inplace_forward overwrites x with y and, when
// mask is defined, writes one bit per element to it (ceil(n/8) bytes; bit i%8 of byte i/8 is
// element i): 1 when beta*x lies left of t*, the minimum of t*sigmoid(t). inplace_backward
// recovers x from (y, bit) and writes grad_x = grad * dy/dx.
// runs_in_parallel: whether this copy's at::parallel_for uses ATen's intra-op threads (false
// when torch's backend is OpenMP and the file was compiled without -fopenmp).
struct Kernels {
  bool (*runs_in_parallel)();
  void (*forward)(at::TensorIteratorBase& iter, double beta);
  void (*backward)(at::TensorIteratorBase& iter, double beta);
  void (*inplace_forward)(const at::Tensor& x, const at::Tensor& mask, double beta);
  void (*inplace_backward)(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                           const at::Tensor& grad_x, double beta);
};

namespace DEFAULT {
extern const Kernels kKernels;
}  // namespace DEFAULT
namespace AVX2 {
extern const Kernels kKernels;
}  // namespace AVX2
namespace AVX512 {
extern const Kernels kKernels;
}  // namespace AVX512

// The copy for this CPU, from ATen's own choice (at::get_cpu_capability(), so
// ATEN_CPU_CAPABILITY applies); decided once.
const Kernels& kernels();

}  // namespace memlean::swish_cpu
