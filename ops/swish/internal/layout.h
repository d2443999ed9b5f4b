// How the Swish kernels walk tensors of any layout (CPU and CUDA wrappers, not kernels).
//
// Outputs and gradients take the input's layout (at::empty_like semantics, which the Meta
// kernels promise too). A dense tensor (contiguous, channels_last, channels_last_3d, a dense
// transpose ...) fills one block of memory, so the raw kernels walk that block as a 1-D array
// in memory order, with no copy; the in-place variant's mask bits follow the same memory
// order, which its backward finds again because the saved output is the input itself (same
// strides). Only a tensor that is not dense (a strided slice) goes through a contiguous copy,
// and then the mask is in logical order on both sides.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

namespace memlean::swish_detail {

// `t`'s elements as a 1-D tensor in memory order (t must be non-overlapping and dense).
inline at::Tensor memory_order(const at::Tensor& t) { return t.as_strided({t.numel()}, {1}); }

// `t` with `like`'s (dense) layout: t itself when it has it, else one copy.
inline at::Tensor with_layout_of(const at::Tensor& t, const at::Tensor& like) {
  if (t.strides() == like.strides()) return t;
  return at::empty_like(like).copy_(t);
}

// Runs kernel(x) on the memory of x when x is dense, else on a contiguous copy written back.
template <typename Kernel>
void inplace_in_memory_order(at::Tensor& x, Kernel&& kernel) {
  if (x.is_non_overlapping_and_dense()) {
    kernel(memory_order(x));
  } else {
    at::Tensor tmp = x.contiguous();
    kernel(tmp);
    x.copy_(tmp);
  }
}

// y = f(x) in x's layout: kernel(x, y) receives 1-D tensors in x's memory order.
template <typename Kernel>
at::Tensor forward_in_memory_order(const at::Tensor& x, Kernel&& kernel) {
  at::Tensor y = at::empty_like(x);
  if (x.is_non_overlapping_and_dense()) {
    kernel(memory_order(x), memory_order(y));
  } else {
    at::Tensor out = at::empty(x.sizes(), x.options());
    kernel(x.contiguous().view(-1), out.view(-1));
    y.copy_(out);
  }
  return y;
}

// grad_x = f(grad, y) in y's layout (y: the saved input, or the in-place variant's output):
// kernel(grad, y, grad_x) receives 1-D tensors in y's memory order (grad moved to that
// layout when it arrives in another one).
template <typename Kernel>
at::Tensor backward_in_memory_order(const at::Tensor& grad, const at::Tensor& y, Kernel&& kernel) {
  at::Tensor grad_x = at::empty_like(y);
  if (y.is_non_overlapping_and_dense()) {
    kernel(memory_order(with_layout_of(grad, y)), memory_order(y), memory_order(grad_x));
  } else {
    at::Tensor out = at::empty(y.sizes(), y.options());
    kernel(grad.contiguous().view(-1), y.contiguous().view(-1), out.view(-1));
    grad_x.copy_(out);
  }
  return grad_x;
}

}  // namespace memlean::swish_detail
