// Swish-β: argument checks, the autograd function that saves only x, and the operator
// registrations (schema, CPU and Meta kernels, Autograd kernel).
#include "ops/swish/swish.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/TensorIterator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cmath>

#include "ops/swish/cpu/swish_kernel.h"
#include "ops/swish/layout.h"
#include "ops/swish/swish_checks.h"

namespace memlean {
namespace {

using swish_detail::check_backward_args;
using swish_detail::check_beta;
using swish_detail::check_inplace_backward_args;
using swish_detail::check_inplace_input;
using swish_detail::check_input;

// ---- kernels registered per dispatch key ----------------------------------------

at::Tensor forward_cpu(const at::Tensor& x, double beta) {
  check_input(x, "x", "memlean::swish");
  check_beta(beta, x, "memlean::swish");
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

// The in-place kernels walk memory order (layout.h): no copy for any dense layout.
void run_inplace_cpu(at::Tensor& x, const at::Tensor& mask, double beta) {
  swish_detail::inplace_in_memory_order(
      x, [&](const at::Tensor& flat) { swish_cpu::inplace_forward_kernel(flat, mask, beta); });
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
        swish_cpu::inplace_backward_kernel(g, yf, m, out, beta);
      });
}

void inplace_meta(at::Tensor& x, double beta) { check_inplace_input(x, beta); }

at::Tensor inplace_with_mask_meta(at::Tensor& x, double beta) {
  check_inplace_input(x, beta);
  return at::empty_symint({swish_constants::mask_bytes(x.sym_numel())}, x.options().dtype(at::kByte));
}

at::Tensor inplace_backward_meta(const at::Tensor& grad, const at::Tensor& y,
                                 const at::Tensor& mask, double beta) {
  check_inplace_backward_args(grad, y, mask, beta);
  return at::empty_like(y);
}

at::Tensor forward_meta(const at::Tensor& x, double beta) {
  check_input(x, "x", "memlean::swish");
  check_beta(beta, x, "memlean::swish");
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

const auto& inplace_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("memlean::swish_", "")
                             .typed<void(at::Tensor&, double)>();
  return op;
}

const auto& inplace_with_mask_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("memlean::_swish_inplace_with_mask", "")
                             .typed<at::Tensor(at::Tensor&, double)>();
  return op;
}

const auto& inplace_backward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memlean::_swish_inplace_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
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

// Overwrites x with y; saves y (the output, alive anyway) and the packed side bits.
class SwishInplaceFunction : public torch::autograd::Function<SwishInplaceFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x, double beta) {
    at::Tensor mask;
    {
      // Function::apply runs forward with grad mode off. Functionalization (torch.compile,
      // torch.export) records a mutation made with grad mode off as one autograd need not
      // see, and AOTAutograd then copies a mutated graph input back under no_grad, cutting
      // its gradient. The mutation is differentiable (mark_dirty below), so say so: grad
      // mode on, autograd keys excluded (nothing is recorded twice); ADInplaceOrView still
      // bumps x's version.
      at::AutoGradMode grad_mode(true);
      at::AutoDispatchBelowAutograd guard;
      mask = inplace_with_mask_op().call(x, beta);
    }
    ctx->mark_dirty({x});
    ctx->save_for_backward({x, mask});
    ctx->saved_data["beta"] = beta;
    return x;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "memlean::swish_: double backward (create_graph=True) is not supported by the "
                "in-place variant; use the memory_efficient variant");
    const auto saved = ctx->get_saved_variables();  // fails if y was modified since
    const double beta = ctx->saved_data["beta"].toDouble();
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    return {inplace_backward_op().call(grads[0], saved[0], saved[1], beta), at::Tensor()};
  }
};

// The graph is rebased onto x itself (mark_dirty), so the op needs no return value.
void inplace_autograd(at::Tensor& x, double beta) {
  if (!at::GradMode::is_enabled() || !x.requires_grad()) {
    at::AutoDispatchBelowAutograd guard;
    inplace_op().call(x, beta);
    return;
  }
  TORCH_CHECK(!x.is_leaf(),
              "memlean::swish_: x is a leaf tensor that requires grad, and an in-place op would "
              "overwrite it; use the memory_efficient variant (memlean::swish) for it");
  SwishInplaceFunction::apply(x, beta);
}

// In-place ops bump the version counter of what they modify: saved copies of x elsewhere
// in the graph then fail loudly in backward instead of being used with the new values.
void inplace_ad_inplace_or_view(at::Tensor& x, double beta) {
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    inplace_op().call(x, beta);
  }
  x.unsafeGetTensorImpl()->bump_version();
}

at::Tensor inplace_with_mask_ad_inplace_or_view(at::Tensor& x, double beta) {
  at::Tensor mask;
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    mask = inplace_with_mask_op().call(x, beta);
  }
  x.unsafeGetTensorImpl()->bump_version();
  return mask;
}

}  // namespace

SwishVariant parse_swish_variant(std::string_view name) {
  if (name == "naive") return SwishVariant::kNaive;
  if (name == "memory_efficient") return SwishVariant::kMemoryEfficient;
  if (name == "inplace") return SwishVariant::kInplace;
  TORCH_CHECK(false, "memlean::swish: unknown variant \"", std::string(name),
              "\"; expected \"naive\", \"memory_efficient\" or \"inplace\"");
}

std::string to_string(SwishVariant variant) {
  switch (variant) {
    case SwishVariant::kNaive: return "naive";
    case SwishVariant::kMemoryEfficient: return "memory_efficient";
    case SwishVariant::kInplace: return "inplace";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown SwishVariant ", static_cast<int>(variant));
}

at::Tensor swish(const at::Tensor& x, double beta, SwishVariant variant) {
  switch (variant) {
    case SwishVariant::kNaive:
      check_input(x, "x", "memlean::swish");
      check_beta(beta, x, "memlean::swish");
      return x * at::sigmoid(beta == 1.0 ? x : x * beta);
    case SwishVariant::kMemoryEfficient: return forward_op().call(x, beta);
    case SwishVariant::kInplace: return swish_(x, beta);
  }
  TORCH_INTERNAL_ASSERT(false, "unknown SwishVariant ", static_cast<int>(variant));
}

const at::Tensor& swish_(const at::Tensor& x, double beta) {
  inplace_op().call(const_cast<at::Tensor&>(x), beta);
  return x;
}

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
  // No return value: functionalization (torch.compile, torch.export) supports mutating
  // custom ops only when their outputs do not alias inputs. memlean::swish_ returns x.
  m.def("swish_(Tensor(a!) x, float beta=1.0) -> ()");
  m.def("_swish_inplace_with_mask(Tensor(a!) x, float beta) -> Tensor");
  m.def("_swish_inplace_backward(Tensor grad, Tensor y, Tensor mask, float beta) -> Tensor");
}

TORCH_LIBRARY_IMPL(memlean, CPU, m) {
  m.impl("swish", &memlean::forward_cpu);
  m.impl("swish_backward", &memlean::backward_cpu);
  m.impl("swish_", &memlean::inplace_cpu);
  m.impl("_swish_inplace_with_mask", &memlean::inplace_with_mask_cpu);
  m.impl("_swish_inplace_backward", &memlean::inplace_backward_cpu);
}

TORCH_LIBRARY_IMPL(memlean, Meta, m) {
  m.impl("swish", &memlean::forward_meta);
  m.impl("swish_backward", &memlean::backward_meta);
  m.impl("swish_", &memlean::inplace_meta);
  m.impl("_swish_inplace_with_mask", &memlean::inplace_with_mask_meta);
  m.impl("_swish_inplace_backward", &memlean::inplace_backward_meta);
}

TORCH_LIBRARY_IMPL(memlean, Autograd, m) {
  m.impl("swish", &memlean::forward_autograd);
  m.impl("swish_", &memlean::inplace_autograd);
}

TORCH_LIBRARY_IMPL(memlean, ADInplaceOrView, m) {
  m.impl("swish_", &memlean::inplace_ad_inplace_or_view);
  m.impl("_swish_inplace_with_mask", &memlean::inplace_with_mask_ad_inplace_or_view);
}
