// Swish-β: argument checks, the autograd function that saves only x, and the operator
// registrations (schema, CPU and Meta kernels, Autograd kernel).
#include "ops/swish/swish.h"

#include <ATen/ATen.h>
#include <ATen/TensorIterator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cmath>

#include "ops/swish/cpu/swish_kernel.h"

namespace memlean {
namespace {

void check_input(const at::Tensor& x, const char* name, const char* op) {
  TORCH_CHECK(x.defined(), op, ": ", name, " is an undefined tensor");
  const auto t = x.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf, op,
              ": ", name, " must be float32, float64, bfloat16 or float16, got ", t);
}

void check_beta(double beta, const char* op) {
  TORCH_CHECK(std::isfinite(beta), op, ": beta must be finite, got ", beta);
}

void check_backward_args(const at::Tensor& grad, const at::Tensor& x, double beta) {
  constexpr const char* op = "memlean::swish_backward";
  check_input(x, "x", op);
  check_input(grad, "grad", op);
  check_beta(beta, op);
  TORCH_CHECK(grad.scalar_type() == x.scalar_type(), op, ": grad has dtype ", grad.scalar_type(),
              " but x has dtype ", x.scalar_type());
  TORCH_CHECK(grad.sizes() == x.sizes(), op, ": grad has shape ", grad.sizes(),
              " but x has shape ", x.sizes());
  TORCH_CHECK(grad.device() == x.device(), op, ": grad is on ", grad.device(), " but x is on ",
              x.device());
}

// ---- kernels registered per dispatch key ----------------------------------------

at::Tensor forward_cpu(const at::Tensor& x, double beta) {
  check_input(x, "x", "memlean::swish");
  check_beta(beta, "memlean::swish");
  at::Tensor y = at::empty_like(x);
  auto iter = at::TensorIteratorConfig().add_output(y).add_const_input(x).build();
  swish_cpu::forward_kernel(iter, beta);
  return y;
}

at::Tensor backward_cpu(const at::Tensor& grad, const at::Tensor& x, double beta) {
  check_backward_args(grad, x, beta);
  at::Tensor grad_x = at::empty_like(x);
  auto iter = at::TensorIteratorConfig()
                  .add_output(grad_x)
                  .add_const_input(grad)
                  .add_const_input(x)
                  .build();
  swish_cpu::backward_kernel(iter, beta);
  return grad_x;
}

at::Tensor forward_meta(const at::Tensor& x, double beta) {
  check_input(x, "x", "memlean::swish");
  check_beta(beta, "memlean::swish");
  return at::empty_like(x);
}

at::Tensor backward_meta(const at::Tensor& grad, const at::Tensor& x, double beta) {
  check_backward_args(grad, x, beta);
  return at::empty_like(x);
}

const auto& forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("memlean::swish", "")
                             .typed<at::Tensor(const at::Tensor&, double)>();
  return op;
}

const auto& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memlean::swish_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op;
}

// Saves x only; backward recomputes sigmoid(beta * x) inside the kernel.
class SwishFunction : public torch::autograd::Function<SwishFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            double beta) {
    ctx->saved_data["beta"] = beta;
    ctx->save_for_backward({x});
    at::AutoDispatchBelowADInplaceOrView guard;
    return forward_op().call(x, beta);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const double beta = ctx->saved_data["beta"].toDouble();
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return {at::Tensor(), at::Tensor()};
    if (at::GradMode::is_enabled()) {
      // create_graph=True: build the gradient from differentiable ops so that it can be
      // differentiated again.
      const at::Tensor s = at::sigmoid(x * beta);
      return {grad * s * (1 + beta * x * (1 - s)), at::Tensor()};
    }
    return {backward_op().call(grad, x, beta), at::Tensor()};
  }
};

at::Tensor forward_autograd(const at::Tensor& x, double beta) {
  return SwishFunction::apply(x, beta);
}

}  // namespace

at::Tensor swish(const at::Tensor& x, double beta) { return forward_op().call(x, beta); }

at::Tensor swish_forward(const at::Tensor& x, double beta) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return forward_op().call(x, beta);
}

at::Tensor swish_backward(const at::Tensor& grad, const at::Tensor& x, double beta) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return backward_op().call(grad, x, beta);
}

}  // namespace memlean

// A fragment, so that every memlean op library (swish, checkpoint, ...) adds its own
// operators to the one `memlean` namespace, loaded together or alone.
TORCH_LIBRARY_FRAGMENT(memlean, m) {
  m.def("swish(Tensor x, float beta=1.0) -> Tensor");
  m.def("swish_backward(Tensor grad, Tensor x, float beta) -> Tensor");
}

TORCH_LIBRARY_IMPL(memlean, CPU, m) {
  m.impl("swish", &memlean::forward_cpu);
  m.impl("swish_backward", &memlean::backward_cpu);
}

TORCH_LIBRARY_IMPL(memlean, Meta, m) {
  m.impl("swish", &memlean::forward_meta);
  m.impl("swish_backward", &memlean::backward_meta);
}

TORCH_LIBRARY_IMPL(memlean, Autograd, m) { m.impl("swish", &memlean::forward_autograd); }
