// Swish-β's Autograd and ADInplaceOrView kernels: the autograd function that saves only x
// (memory_efficient), the in-place one that saves y and one bit per element, and the
// version bumps of the in-place ops. They call the operators below autograd through the
// typed handles of internal/op_handles.h. Both backwards write the input gradient over the
// incoming one when autograd alone holds it (grad_owned_alone, third_party/torch/grads.h):
// a tensor of x's size less.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "ops/swish/internal/op_handles.h"
#include "third_party/torch/grads.h"

namespace memlean {
namespace {

using swish_detail::backward_into_op;
using swish_detail::backward_op;
using swish_detail::forward_op;
using swish_detail::inplace_backward_into_op;
using swish_detail::inplace_backward_op;
using swish_detail::inplace_op;
using swish_detail::inplace_with_mask_op;

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

  // grads by reference, as SwishInplaceFunction's (below).
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list& grads) {
    const at::Tensor x = ctx->get_saved_variables()[0];
    const double beta = ctx->saved_data["beta"].toDouble();
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    at::Tensor grad = std::move(grads[0]);
    if (at::GradMode::is_enabled()) {
      // create_graph=True: build the gradient from differentiable ops so that it can be
      // differentiated again.
      const at::Tensor s = at::sigmoid(x * beta);
      return {grad * s * (1 + beta * x * (1 - s)), at::Tensor()};
    }
    if (grad_owned_alone(grad, x)) {  // nothing else sees grad's memory: grad_x over it
      backward_into_op().call(grad, x, beta);
      return {std::move(grad), at::Tensor()};
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

  // grads by reference: autograd's CppNode hands over the list it built from the incoming
  // gradients (moved, not copied), so a gradient nobody else holds has one reference here
  // (grad_owned_alone).
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list& grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "memlean::swish_: double backward (create_graph=True) is not supported by the "
                "in-place variant; use the memory_efficient variant");
    const auto saved = ctx->get_saved_variables();  // fails if y was modified since
    const double beta = ctx->saved_data["beta"].toDouble();
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor()};
    at::Tensor grad = std::move(grads[0]);
    if (grad_owned_alone(grad, saved[0])) {
      // Nothing else sees grad's memory: write grad_x over it, and the backward allocates
      // nothing (one tensor of y's size less at its peak).
      inplace_backward_into_op().call(grad, saved[0], saved[1], beta);
      return {std::move(grad), at::Tensor()};
    }
    return {inplace_backward_op().call(grad, saved[0], saved[1], beta), at::Tensor()};
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
}  // namespace memlean

TORCH_LIBRARY_IMPL(memlean, Autograd, m) {
  m.impl("swish", &memlean::forward_autograd);
  m.impl("swish_", &memlean::inplace_autograd);
}

TORCH_LIBRARY_IMPL(memlean, ADInplaceOrView, m) {
  m.impl("swish_", &memlean::inplace_ad_inplace_or_view);
  m.impl("_swish_inplace_with_mask", &memlean::inplace_with_mask_ad_inplace_or_view);
}
