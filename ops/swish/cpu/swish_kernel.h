// CPU kernels for Swish-β, compiled once per CPU capability (see swish_kernel.cc).
#pragma once

#include <ATen/TensorIterator.h>

namespace memlean::swish_cpu {

// y = x * sigmoid(beta * x), written to iter's output; iter has inputs (x).
void forward_kernel(at::TensorIteratorBase& iter, double beta);
// grad_x = grad * s * (1 + beta * x * (1 - s)), s = sigmoid(beta * x); iter has inputs (grad, x).
void backward_kernel(at::TensorIteratorBase& iter, double beta);

// One copy of the kernels per capability; the entry points above pick one at run time
// from ATen's own choice (at::get_cpu_capability(), so ATEN_CPU_CAPABILITY applies).
namespace DEFAULT {
void forward_kernel(at::TensorIteratorBase& iter, double beta);
void backward_kernel(at::TensorIteratorBase& iter, double beta);
}  // namespace DEFAULT
namespace AVX2 {
void forward_kernel(at::TensorIteratorBase& iter, double beta);
void backward_kernel(at::TensorIteratorBase& iter, double beta);
}  // namespace AVX2

}  // namespace memlean::swish_cpu
