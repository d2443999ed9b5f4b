// Swish-β, y = x * sigmoid(beta * x): the C++ API of //ops/swish.
//
// Three variants, one forward:
//   kNaive            the autograd composition x * sigmoid(beta * x); saves x and the sigmoid.
//   kMemoryEfficient  (default) saves only x and recomputes sigmoid(beta * x) in backward.
//                     Operator torch.ops.memlean.swish(Tensor x, float beta=1.0) -> Tensor.
//   kInplace          overwrites x with y and saves only one bit per element (which side of
//                     the minimum of swish beta*x lies on); backward recovers x from y and
//                     the bit. Operator torch.ops.memlean.swish_(Tensor(a!) x, float beta=1.0)
//                     -> () (no return value, so that torch.compile can functionalize it).
//
// Dtypes: float32, float64, bfloat16, float16 (math in float for the 16-bit types).
// beta: any finite value (beta = 0 gives x / 2, beta = 1 is SiLU).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <string_view>

namespace memlean {

enum class SwishVariant { kNaive, kMemoryEfficient, kInplace };

// "naive", "memory_efficient", "inplace"; anything else is an error listing the names.
SwishVariant parse_swish_variant(std::string_view name);
std::string to_string(SwishVariant variant);

// Differentiable Swish-β. With kInplace, x is overwritten and returned; where x is a view of
// all of a tensor and autograd records the op (a torch::nn::Linear output for a 3-d input),
// that tensor is overwritten and a view of it returned (the same memory; autograd's
// in-place-on-a-view bookkeeping would hold two more tensors of x's size at the backward).
at::Tensor swish(const at::Tensor& x, double beta = 1.0,
                 SwishVariant variant = SwishVariant::kMemoryEfficient);

// In-place Swish-β (the kInplace variant): overwrites x with y and returns it. As for any
// in-place op, a leaf that requires grad is refused, and if an earlier op saved x for its
// backward, that backward fails (version counter) instead of using the overwritten values.
// Double backward is not supported (use kMemoryEfficient for that).
const at::Tensor& swish_(const at::Tensor& x, double beta = 1.0);

// The kernels without autograd: the forward, and the gradient with respect to x given
// the gradient of the output. Both check their arguments and name them in errors.
at::Tensor swish_forward(const at::Tensor& x, double beta = 1.0);
at::Tensor swish_backward(const at::Tensor& grad, const at::Tensor& x, double beta = 1.0);

// Bytes of the mask the in-place variant saves for a tensor of numel elements.
int64_t swish_inplace_mask_bytes(int64_t numel);

}  // namespace memlean
