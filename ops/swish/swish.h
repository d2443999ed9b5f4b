// Swish-β, y = x * sigmoid(beta * x): the C++ API of //ops/swish.
//
// memlean::swish is differentiable and memory-efficient: its backward saves only x and
// recomputes sigmoid(beta * x), where the autograd composition x * sigmoid(beta * x)
// saves both x and sigmoid(beta * x). It runs through the dispatcher as
// torch.ops.memlean.swish(Tensor x, float beta=1.0) -> Tensor.
//
// Dtypes: float32, float64, bfloat16, float16 (math in float for the 16-bit types).
// beta: any finite value (beta = 0 gives x / 2, beta = 1 is SiLU).
#pragma once

#include <ATen/core/Tensor.h>

namespace memlean {

// Differentiable Swish-β; saves only x for backward.
at::Tensor swish(const at::Tensor& x, double beta = 1.0);

// The kernels without autograd: the forward, and the gradient with respect to x given
// the gradient of the output. Both check their arguments and name them in errors.
at::Tensor swish_forward(const at::Tensor& x, double beta = 1.0);
at::Tensor swish_backward(const at::Tensor& grad, const at::Tensor& x, double beta = 1.0);

}  // namespace memlean
