// memlean::grad_owned_alone(): whether a backward may write its input gradient over the
// incoming one; memlean::is_wrapped(): whether a tensor is not a plain one;
// memlean::views_all_of(): whether a view covers its base element for element. Shared by
// Swish's backwards and its in-place variant (ops/swish), the lean BatchNorm
// (ops/checkpoint/lean_batchnorm.h), the lean convolution (ops/checkpoint/lean_conv.h) and
// memlean::fit's in-place check (ops/fit). Internal to memlean.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

namespace memlean {

// Whether t is not a plain tensor: a tensor subclass, FakeTensor, functionalization or
// functorch wrapper (its memory is not what its data pointer says, or not ours to write).
inline bool is_wrapped(const at::Tensor& t) {
  static const c10::DispatchKeySet wrapped({c10::DispatchKey::Python,
                                            c10::DispatchKey::PythonTLSSnapshot,
                                            c10::DispatchKey::Functionalize,
                                            c10::DispatchKey::FuncTorchGradWrapper,
                                            c10::DispatchKey::FuncTorchBatched,
                                            c10::DispatchKey::Batched});
  return t.key_set().has_any(wrapped);
}

// Whether x views all of base, element for element: the same dtype, element count and start,
// both contiguous (a reshape of base: nn.Linear's output for a 3-d input is such a view of its
// 2-d matmul result, Unflatten's output one of its input). An in-place op may then write base
// instead of x (memlean::swish, kInplace; memlean::fit decides on it by the same test).
inline bool views_all_of(const at::TensorBase& x, const at::TensorBase& base) {
  return base.scalar_type() == x.scalar_type() && base.numel() == x.numel() &&
         base.storage_offset() == x.storage_offset() && base.is_contiguous() &&
         x.is_contiguous();
}

// Whether grad may be overwritten by a tensor laid out as `like` (the saved tensor whose
// gradient the backward computes): grad is its one reference (autograd handed it over by
// reference: torch::autograd::Function::backward(ctx, variable_list&)), and its storage's
// only tensor or a view of a base that only it holds (reshape's backward hands on such
// views); not a view of a gradient handed on elsewhere (e.g. cat's or add's backward), not
// kept by a hook or retain_grad, nor captured by torch.autograd.grad; it spans all of
// its storage, has like's dtype, device, sizes and strides (dense), and is a plain CPU or
// CUDA tensor (no tensor subclass, FakeTensor, functionalization or functorch wrapper, no
// TorchDispatchMode: under tracing the out-of-place op is recorded, as before).
inline bool grad_owned_alone(const at::Tensor& grad, const at::Tensor& like) {
  if (!grad.defined() || grad.use_count() != 1 || !grad.has_storage()) return false;
  // Its storage's only tensor, or a view whose base only the view holds: the gradient of a
  // reshape (a 3-d nn.Linear output is a view of its 2-d matmul result, and its backward
  // hands on grad.view(...)); below, grad must also span all of the storage.
  const auto holders = grad.storage().use_count();
  if (holders != 1 &&
      !(holders == 2 && grad.is_view() && grad._base().use_count() == 1 &&
        grad._base().has_storage() && grad._base().storage().is_alias_of(grad.storage()))) {
    return false;
  }
  if (is_wrapped(grad) || is_wrapped(like) ||
      c10::impl::TorchDispatchModeTLS::stack_len() > 0) {
    return false;
  }
  if (!(grad.device().is_cpu() || grad.device().is_cuda()) || grad.layout() != at::kStrided) {
    return false;
  }
  return grad.scalar_type() == like.scalar_type() && grad.device() == like.device() &&
         like.is_non_overlapping_and_dense() && grad.strides() == like.strides() &&
         grad.sizes() == like.sizes() &&
         grad.storage().nbytes() == static_cast<size_t>(grad.numel()) * grad.element_size() &&
         grad.storage_offset() == 0;
}

}  // namespace memlean
