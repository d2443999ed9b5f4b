// Argument checks shared by the CPU, Meta and CUDA kernels of //ops/swish: each names the
// argument and the operator in its error.
#pragma once

#include <ATen/core/Tensor.h>

namespace memlean::swish_detail {

// x: defined, float32/float64/bfloat16/float16.
void check_input(const at::Tensor& x, const char* name, const char* op);
// beta: finite, and for float32/bfloat16/float16 x (computed in float) within float's range.
void check_beta(double beta, const at::Tensor& x, const char* op);
// grad and x: valid inputs of the same dtype, shape and device.
void check_backward_args(const at::Tensor& grad, const at::Tensor& x, double beta);
// As above, for the variant that writes grad_x over grad (memlean::_swish_backward_): grad
// also has x's strides, x is dense, and grad shares no memory with x.
void check_backward_into_args(const at::Tensor& grad, const at::Tensor& x, double beta);
// As check_backward_args, and mask: uint8 with ceil(numel / 8) bytes, on y's device.
void check_inplace_backward_args(const at::Tensor& grad, const at::Tensor& y,
                                 const at::Tensor& mask, double beta);
// As check_inplace_backward_args, for the variant that writes grad_x over grad
// (memlean::_swish_inplace_backward_): grad also has y's strides, y is dense, and grad shares
// no memory with y or mask.
void check_inplace_backward_into_args(const at::Tensor& grad, const at::Tensor& y,
                                      const at::Tensor& mask, double beta);
// x: a valid input whose elements do not share memory.
void check_inplace_input(const at::Tensor& x, double beta);

}  // namespace memlean::swish_detail
