// CPU kernels for Swish-β, compiled once per CPU capability (see swish_kernel.cc).
#pragma once

#include <ATen/TensorIterator.h>

namespace memlean::swish_cpu {

// y = x * sigmoid(beta * x), written to iter's output; iter has inputs (x).
void forward_kernel(at::TensorIteratorBase& iter, double beta);
// grad_x = grad * s * (1 + beta * x * (1 - s)), s = sigmoid(beta * x); iter has inputs (grad, x).
void backward_kernel(at::TensorIteratorBase& iter, double beta);

// The in-place variant, on contiguous tensors. Forward overwrites x with y and writes one
// bit per element to mask (ceil(n/8) bytes; bit i%8 of byte i/8 is element i): 1 when
// beta*x lies left of t*, the minimum of t*sigmoid(t). Backward recovers x from (y, bit)
// and writes grad_x = grad * dy/dx.
void inplace_forward_kernel(const at::Tensor& x, const at::Tensor& mask, double beta);
void inplace_backward_kernel(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                             const at::Tensor& grad_x, double beta);

// One copy of the kernels per capability; the entry points above pick one at run time
// from ATen's own choice (at::get_cpu_capability(), so ATEN_CPU_CAPABILITY applies).
namespace DEFAULT {
void forward_kernel(at::TensorIteratorBase& iter, double beta);
void backward_kernel(at::TensorIteratorBase& iter, double beta);
void inplace_forward_kernel(const at::Tensor& x, const at::Tensor& mask, double beta);
void inplace_backward_kernel(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                             const at::Tensor& grad_x, double beta);
}  // namespace DEFAULT
namespace AVX2 {
void forward_kernel(at::TensorIteratorBase& iter, double beta);
void backward_kernel(at::TensorIteratorBase& iter, double beta);
void inplace_forward_kernel(const at::Tensor& x, const at::Tensor& mask, double beta);
void inplace_backward_kernel(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                             const at::Tensor& grad_x, double beta);
}  // namespace AVX2
namespace AVX512 {
void forward_kernel(at::TensorIteratorBase& iter, double beta);
void backward_kernel(at::TensorIteratorBase& iter, double beta);
void inplace_forward_kernel(const at::Tensor& x, const at::Tensor& mask, double beta);
void inplace_backward_kernel(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                             const at::Tensor& grad_x, double beta);
}  // namespace AVX512

}  // namespace memlean::swish_cpu
