// memlean::lean_conv2d: for a depthwise 2-d convolution whose backward keeps less.
//
// The forward is torch's (at::convolution: the same output) and saves what torch's does (the
// input and the weight). The backward differs: torch's CPU backward of a depthwise
// convolution on a contiguous (NCHW) input goes through im2col or oneDNN's reorders and
// allocates 4 to 6 tensors of the input's size at its peak (measured: 578 MB for a 154 MB
// input, EfficientNet-B0's blocks.1.0.conv_dw at batch 32; docs/checkpoint.md); this one
// walks the input once (each channel's planes, or each pixel's channels for channels_last),
// scattering the input gradient into one zeroed tensor of
// the input's size and summing the weight (and bias) gradients on the way, and allocates
// nothing else of the input's size. memlean.fit swaps it in: a depthwise convolution's
// backward set the least peak of a fitted EfficientNet (docs/fit.md).
//
// Where it applies: CPU tensors of float32, float64, bfloat16 or float16, a 4-d input
// (N, C, H, W), contiguous or channels_last, a weight (C, 1, KH, KW) (groups == C == output
// channels), zero padding; in a CPU autocast region too, where input, weight and bias are
// cast to autocast's dtype as torch's conv2d casts them there (the weight's copy from
// autocast's cache). For bfloat16 and float16 the products and sums run in float32 and each
// input-gradient element is rounded once. Everything else (CUDA, other layouts, other
// groups) runs torch's at::conv2d unchanged. The gradients equal torch's to float tolerance (another order of summation); double backward
// (create_graph=True) works, through torch's differentiable convolution backward.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>

namespace memlean {

// at::conv2d(input, weight, bias, stride, padding, dilation, groups) with the lean backward
// above where it applies (lean_depthwise_conv2d_applies), else torch's conv2d itself.
// stride, padding, dilation: one value or two (height, width), as at::conv2d's.
at::Tensor lean_conv2d(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                       at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups);

// Whether lean_conv2d runs the lean backward for these arguments: a depthwise convolution
// (groups == input.size(1) == weight.size(0), weight.size(1) == 1) of a CPU contiguous or
// channels_last 4-d input, plain tensors, input and weight of one type of float32, float64,
// bfloat16 or float16 (in a CPU autocast region of bfloat16 or float16: each float32,
// bfloat16 or float16, cast as torch's conv2d casts them). (Whether a gradient is wanted is
// the caller's.)
bool lean_conv2d_applies(const at::Tensor& input, const at::Tensor& weight, int64_t groups);

}  // namespace memlean
