// An MLP computed slice by slice of its hidden features, and recomputed that way in backward,
// which keeps its input alone (and the parameters): `fc2(act(fc1(x)))` (a ViT's or a
// transformer's MLP) and the gated `down(act(gate(x)) * up(x))` (SwiGLU, GeGLU), whose hidden
// tensors (4x the width of x in a ViT) never exist whole. Hidden feature j depends on row j of
// the first weight(s) alone, and the output is the sum over slices of the last weight's columns
// times that slice, so each slice's part is added into the output, and backward recomputes
// each slice, takes its gradients and drops it before the next. docs/checkpoint.md.
//
//   at::Tensor y = memlean::sliced_mlp(x, fc1->weight, fc1->bias, gelu, fc2->weight, fc2->bias);
//
// memlean.sliced_mlp and memlean.sliced_gated_mlp (Python) run this with the Python modules'
// forward as the activation; memlean::fit slices a Sequential's Linear, activation, Linear
// layers with it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>

namespace memlean {

// The activation(s) between the first Linear(s) and the last, on one slice of the hidden
// features at a time: elementwise (a slice's result depends on that slice alone), e.g. GELU,
// SiLU, memlean::swish. It may write its input (an in-place Swish, ReLU(inplace)): say so in
// SlicedMlpOptions::act_writes_input. An empty function: no activation.
using SliceActivation = std::function<at::Tensor(const at::Tensor&)>;

// About this many bytes of the hidden tensor per slice, by default.
inline constexpr int64_t kSliceBytes = int64_t{1} << 20;

struct SlicedMlpOptions {
  // How many slices of the hidden features (1..hidden); 0: sliced_mlp_slices' default.
  int64_t slices = 0;
  // The activation writes its input: backward runs it on a copy of the recomputed slice (whose
  // gradient it takes).
  bool act_writes_input = false;
  // With slices 0: about one slice per this many bytes of the hidden tensor (in the dtype the
  // MLP computes in: autocast's, in a region), sliced_mlp_slices' rule.
  int64_t slice_bytes = kSliceBytes;
};

// Where the sliced path runs: x a CPU strided tensor of float32, float64, bfloat16 or float16.
// (The functions below check their arguments and then compute the MLP with torch's ops in
// turn where this is false.) In a CPU autocast region the MLP computes as at::linear does
// there: x, weights and biases cast to autocast's dtype (the weights' copies from its cache;
// float64 ones as they are), the output of that dtype. bfloat16 and float16 slices add their
// partial sums (the output's, the input gradient's) in float32 and round once.
bool sliced_mlp_applies(const at::Tensor& x);

// The default number of slices for a hidden tensor of `hidden_bytes` bytes and `features`
// features: about one per `slice_bytes` of it, at most 16 and at most one per feature, at
// least 1. The one slice-count rule: Python's memlean.sliced_mlp and memlean.sliced_chain (one
// per channel there) count with it too (their tests pass a smaller `slice_bytes`). c10::Error
// for a `slice_bytes` below 1 or a negative `hidden_bytes` or `features`.
int64_t sliced_mlp_slices(int64_t hidden_bytes, int64_t features,
                          int64_t slice_bytes = kSliceBytes);

// fc2(act(fc1(x))) with fc1 = (w1 [hidden, in], b1 [hidden]) and fc2 = (w2 [out, hidden],
// b2 [out]): x [..., in] -> [..., out]. Gradients for x and every weight and bias that needs
// one, equal to autograd's through the layers in turn; differentiable once (a backward with
// create_graph gives first gradients; differentiating those raises). The output is a tensor
// of its own (not a view made inside the function), so the caller may write it in place.
// c10::Error naming the argument for shapes, dtypes or devices that do not fit, slices out of
// 1..hidden.
at::Tensor sliced_mlp(const at::Tensor& x, const at::Tensor& w1,
                      const std::optional<at::Tensor>& b1, const SliceActivation& act,
                      const at::Tensor& w2, const std::optional<at::Tensor>& b2,
                      SlicedMlpOptions options = {});

// down(act(gate(x)) * up(x)), gate = (wg, bg), up = (wu, bu), down = (wd, bd): a SwiGLU or
// GeGLU MLP. wu undefined: gate packs both (timm's GluMlp, `g, u = w12(x).chunk(2, -1)`): wg
// [2 * hidden, in], the gate's rows first where gate_first, else up's; the gradient of wg (and
// bg) then holds both ranges. Otherwise as sliced_mlp.
at::Tensor sliced_gated_mlp(const at::Tensor& x, const at::Tensor& wg,
                            const std::optional<at::Tensor>& bg, const SliceActivation& act,
                            const at::Tensor& wu, const std::optional<at::Tensor>& bu,
                            const at::Tensor& wd, const std::optional<at::Tensor>& bd,
                            bool gate_first = true, SlicedMlpOptions options = {});

}  // namespace memlean
