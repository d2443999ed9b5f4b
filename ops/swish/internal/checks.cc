// Argument checks shared by the CPU, Meta and CUDA kernels of //ops/swish.
#include "ops/swish/internal/checks.h"

#include <ATen/MemoryOverlap.h>
#include <c10/core/SymInt.h>

#include <cmath>
#include <limits>

#include "ops/swish/internal/constants.h"

namespace memlean::swish_detail {

void check_input(const at::Tensor& x, const char* name, const char* op) {
  TORCH_CHECK(x.defined(), op, ": ", name, " is an undefined tensor");
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf, op,
              ": ", name, " must be float32, float64, bfloat16 or float16, got ", t);
}

void check_beta(double beta, const at::Tensor& x, const char* op) {
  TORCH_CHECK(std::isfinite(beta), op, ": beta must be finite, got ", beta);
  // Other dtypes are computed in float: a larger beta would become inf there, and inf * 0
  // a NaN.
  TORCH_CHECK(x.scalar_type() == at::kDouble ||
                  std::abs(beta) <= static_cast<double>(std::numeric_limits<float>::max()),
              op, ": beta=", beta, " is beyond float's range (", std::numeric_limits<float>::max(),
              "), in which a ", x.scalar_type(), " x is computed");
}

namespace {

// grad and the saved tensor (named `name`: x, or the in-place variant's output y).
void check_grad_and_saved(const at::Tensor& grad, const at::Tensor& x, double beta,
                          const char* name, const char* op) {
  check_input(x, name, op);
  check_input(grad, "grad", op);
  check_beta(beta, x, op);
  TORCH_CHECK(grad.scalar_type() == x.scalar_type(), op, ": grad has dtype ", grad.scalar_type(),
              " but ", name, " has dtype ", x.scalar_type());
  TORCH_CHECK(grad.sym_sizes() == x.sym_sizes(), op, ": grad has shape ", grad.sym_sizes(),
              " but ", name, " has shape ", x.sym_sizes());
  TORCH_CHECK(grad.device() == x.device(), op, ": grad is on ", grad.device(), " but ", name,
              " is on ", x.device());
}

// As above for the in-place variant's backward: y and its packed side bits.
void check_grad_y_and_mask(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                           double beta, const char* op) {
  check_grad_and_saved(grad, y, beta, "y", op);
  TORCH_CHECK(mask.defined() && mask.scalar_type() == at::kByte, op,
              ": mask must be a uint8 tensor of packed bits");
  // Symbolic sizes (torch.compile with dynamic shapes) compare through guards.
  const c10::SymInt expected = swish_constants::mask_bytes(y.sym_numel());
  TORCH_CHECK(mask.sym_numel() == expected, op, ": mask has ", mask.sym_numel(),
              " bytes but y has ", y.sym_numel(), " elements (expected ", expected, " bytes)");
  TORCH_CHECK(mask.device() == y.device(), op, ": mask is on ", mask.device(), " but y is on ",
              y.device());
}

// at::assert_no_overlap where addresses are known: a tensor with symbolic sizes or strides
// (torch.compile's FakeTensors with dynamic shapes) has none to compare (torch 2.13 throws).
void no_overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.unsafeGetTensorImpl()->has_symbolic_sizes_strides() ||
      b.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) {
    return;
  }
  at::assert_no_overlap(a, b);
}

// grad, to be overwritten with the gradient of `saved` (named `name`): the same strides,
// dense, no memory shared.
void check_writable_grad(const at::Tensor& grad, const at::Tensor& saved, const char* name,
                         const char* op) {
  TORCH_CHECK(saved.is_non_overlapping_and_dense() && grad.sym_strides() == saved.sym_strides(),
              op, ": grad must have ", name, "'s strides and ", name, " must be dense (grad has "
              "strides ", grad.sym_strides(), ", ", name, " ", saved.sym_strides(), ")");
  no_overlap(grad, saved);
}

}  // namespace

void check_backward_args(const at::Tensor& grad, const at::Tensor& x, double beta) {
  check_grad_and_saved(grad, x, beta, "x", "memlean::swish_backward");
}

void check_backward_into_args(const at::Tensor& grad, const at::Tensor& x, double beta) {
  constexpr const char* op = "memlean::_swish_backward_";
  check_grad_and_saved(grad, x, beta, "x", op);
  check_writable_grad(grad, x, "x", op);
}

void check_inplace_backward_args(const at::Tensor& grad, const at::Tensor& y,
                                 const at::Tensor& mask, double beta) {
  check_grad_y_and_mask(grad, y, mask, beta, "memlean::_swish_inplace_backward");
}

void check_inplace_backward_into_args(const at::Tensor& grad, const at::Tensor& y,
                                      const at::Tensor& mask, double beta) {
  constexpr const char* op = "memlean::_swish_inplace_backward_";
  check_grad_y_and_mask(grad, y, mask, beta, op);
  check_writable_grad(grad, y, "y", op);
  no_overlap(grad, mask);
}

void check_inplace_input(const at::Tensor& x, double beta) {
  constexpr const char* op = "memlean::swish_";
  check_input(x, "x", op);
  check_beta(beta, x, op);
  at::assert_no_internal_overlap(x);
}

}  // namespace memlean::swish_detail
