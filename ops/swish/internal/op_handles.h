// memlean's Swish operators as typed dispatcher handles (one signature each, spelled here
// once): the public API (swish.cc) and the autograd kernels (autograd/) call through them.
// Internal to //ops/swish.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace memlean::swish_detail {

using ForwardOp = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, double)>;
using BackwardOp = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)>;
using BackwardIntoOp = c10::TypedOperatorHandle<void(at::Tensor&, const at::Tensor&, double)>;
using InplaceOp = c10::TypedOperatorHandle<void(at::Tensor&, double)>;
using InplaceWithMaskOp = c10::TypedOperatorHandle<at::Tensor(at::Tensor&, double)>;
using InplaceBackwardOp = c10::TypedOperatorHandle<at::Tensor(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>;
using InplaceBackwardIntoOp = c10::TypedOperatorHandle<void(
    at::Tensor&, const at::Tensor&, const at::Tensor&, double)>;

const ForwardOp& forward_op();                   // memlean::swish
const BackwardOp& backward_op();                 // memlean::swish_backward
const BackwardIntoOp& backward_into_op();        // memlean::_swish_backward_
const InplaceOp& inplace_op();                   // memlean::swish_
const InplaceWithMaskOp& inplace_with_mask_op();  // memlean::_swish_inplace_with_mask
const InplaceBackwardOp& inplace_backward_op();  // memlean::_swish_inplace_backward
const InplaceBackwardIntoOp& inplace_backward_into_op();  // memlean::_swish_inplace_backward_

}  // namespace memlean::swish_detail
