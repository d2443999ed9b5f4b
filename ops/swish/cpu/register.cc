// Swish-β's CPU kernels as the dispatcher calls them: checks, outputs, and the vectorized
// kernels of cpu/swish_kernel.cc (picked per CPU capability by cpu/capability.cc).
#include <ATen/ATen.h>
#include <ATen/TensorIterator.h>
#include <torch/library.h>

#include "ops/swish/cpu/swish_kernel.h"
#include "ops/swish/internal/checks.h"
#include "ops/swish/internal/layout.h"
#include "ops/swish/swish.h"

namespace memlean::swish_detail {
namespace {

at::Tensor forward_cpu(const at::Tensor& x, double beta) {
  check_input(x, "x", "memlean::swish");
  check_beta(beta, x, "memlean::swish");
  at::Tensor y = at::empty_like(x);
  auto iter = at::TensorIteratorConfig().add_output(y).add_const_input(x).build();
  swish_cpu::kernels().forward(iter, beta);
  return y;
}

// grad_x = swish'(x) * grad, elementwise; grad_x may be grad itself (TensorIterator allows an
// output that is exactly an input: each element is read before it is written).
void run_backward_cpu(const at::Tensor& grad_x, const at::Tensor& grad, const at::Tensor& x,
                      double beta) {
  auto iter = at::TensorIteratorConfig()
                  .add_output(grad_x)
                  .add_const_input(grad)
                  .add_const_input(x)
                  .build();
  swish_cpu::kernels().backward(iter, beta);
}

at::Tensor backward_cpu(const at::Tensor& grad, const at::Tensor& x, double beta) {
  check_backward_args(grad, x, beta);
  at::Tensor grad_x = at::empty_like(x);
  run_backward_cpu(grad_x, grad, x, beta);
  return grad_x;
}

// The same, grad_x written over grad.
void backward_into_cpu(at::Tensor& grad, const at::Tensor& x, double beta) {
  check_backward_into_args(grad, x, beta);
  run_backward_cpu(grad, grad, x, beta);
}

// The in-place kernels walk memory order (layout.h): no copy for any dense layout.
void run_inplace_cpu(at::Tensor& x, const at::Tensor& mask, double beta) {
  swish_detail::inplace_in_memory_order(
      x, [&](const at::Tensor& flat) { swish_cpu::kernels().inplace_forward(flat, mask, beta); });
}

void inplace_cpu(at::Tensor& x, double beta) {
  check_inplace_input(x, beta);
  run_inplace_cpu(x, at::Tensor(), beta);
}

at::Tensor inplace_with_mask_cpu(at::Tensor& x, double beta) {
  check_inplace_input(x, beta);
  at::Tensor mask = at::empty({swish_inplace_mask_bytes(x.numel())}, x.options().dtype(at::kByte));
  run_inplace_cpu(x, mask, beta);
  return mask;
}

at::Tensor inplace_backward_cpu(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                                double beta) {
  check_inplace_backward_args(grad, y, mask, beta);
  const at::Tensor m = mask.contiguous();
  return swish_detail::backward_in_memory_order(
      grad, y, [&](const at::Tensor& g, const at::Tensor& yf, const at::Tensor& out) {
        swish_cpu::kernels().inplace_backward(g, yf, m, out, beta);
      });
}

// The same, grad_x written over grad (same strides as y, checked): the kernel reads each
// element of grad before it writes it, and nothing else.
void inplace_backward_into_cpu(at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                               double beta) {
  check_inplace_backward_into_args(grad, y, mask, beta);
  const at::Tensor g = memory_order(grad);
  swish_cpu::kernels().inplace_backward(g, memory_order(y), mask.contiguous(), g, beta);
}

}  // namespace
}  // namespace memlean::swish_detail

TORCH_LIBRARY_IMPL(memlean, CPU, m) {
  m.impl("swish", &memlean::swish_detail::forward_cpu);
  m.impl("swish_backward", &memlean::swish_detail::backward_cpu);
  m.impl("_swish_backward_", &memlean::swish_detail::backward_into_cpu);
  m.impl("swish_", &memlean::swish_detail::inplace_cpu);
  m.impl("_swish_inplace_with_mask", &memlean::swish_detail::inplace_with_mask_cpu);
  m.impl("_swish_inplace_backward", &memlean::swish_detail::inplace_backward_cpu);
  m.impl("_swish_inplace_backward_", &memlean::swish_detail::inplace_backward_into_cpu);
}

