// memlean::lean_batch_norm: training-mode batch normalization whose backward keeps less.
//
// The forward is torch's (at::native_batch_norm: the same output, batch statistics and
// running-statistics update) and saves what torch's does (the input, weight, batch mean and
// inverse standard deviation). The backward differs: torch's CPU batch-norm backward
// allocates the input gradient and a temporary of the input's size beside the incoming
// gradient; this one computes the two per-channel sums (of dy and of dy * (x - mean)) in one
// pass that allocates nothing of the input's size, and then writes dx over dy when autograd
// alone holds dy (memlean::grad_owned_alone), else into one new tensor. At a backward's
// peak that is up to two tensors of the input's size less (memlean.fit swaps it in: the
// floor of a checkpointed EfficientNet is a BatchNorm backward, docs/fit.md).
//
// Where it applies: CPU tensors of float32, float64, bfloat16 or float16, of 2 or more
// dimensions, contiguous or channels_last (4-d); for bfloat16 and float16 (a reduced-precision
// model, or a CPU autocast region, where the convolutions hand BatchNorm their bfloat16 output
// and its float32 weight) the sums and the formula run in float32 and the input gradient is
// rounded once, as torch's kernel does. Everything else (CUDA, other layouts, eval mode) runs
// torch's at::batch_norm unchanged. The gradients equal torch's to float tolerance
// (another order of summation); double backward (create_graph=True) works, through a
// differentiable form of the same formula.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace memlean {

// at::batch_norm(input, weight, bias, running_mean, running_var, /*training=*/true,
// momentum, eps, ...) with the lean backward above where it applies. input: (N, C, ...);
// weight, bias, running_mean, running_var: (C) or absent; the running statistics are updated
// in place as torch's are (momentum is the factor of the new batch's statistics).
at::Tensor lean_batch_norm(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& running_mean,
                           const std::optional<at::Tensor>& running_var, double momentum,
                           double eps);

// Whether lean_batch_norm runs the lean backward for this input (else torch's batch_norm).
bool lean_batch_norm_applies(const at::Tensor& input);

}  // namespace memlean
