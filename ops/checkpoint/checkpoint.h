// memlean::checkpoint: run a segment of a model without keeping its activations, and
// recompute them in backward (the C++ API of //ops/checkpoint).
//
// The call form is pytorch-checkpoint's (docs/sources.md)
// CheckpointFunction.apply(function, n, *args):
//
//   auto out = memlean::checkpoint(
//       [&](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{conv(relu(bn(in[0])))}; },
//       /*n_inputs=*/1, {x, bn->weight, bn->bias, conv->weight, conv->bias});
//
// The first n_inputs entries of inputs_and_params are passed to `function`; the rest are
// the parameters the function uses (it reads them from its own closure). Forward runs
// `function` without recording a graph, so none of the segment's activations are kept;
// only the inputs and the parameters are saved. Backward recomputes the segment with
// grad mode on and asks autograd for the gradients of exactly those inputs and parameters,
// which it returns as the gradients of this node: it never walks past the segment, and
// every parameter's gradient is accumulated once, by the outer backward (so DDP's hooks
// fire once per parameter). The recomputed output and the incoming gradient are freed as
// soon as the segment's first nodes have used them, so backward through the segment holds
// what the plain backward holds there (as torch's non-reentrant checkpoint; a reentrant one
// holds both until the segment's backward ends). A function that uses a tensor requiring
// grad that is neither an input nor a listed parameter is an error in backward (its
// gradient would be lost).
//
// The RNG state (CPU, and that of every CUDA device holding an input or a parameter) is
// saved before the forward and restored for the recompute, so dropout drops the same
// units twice; the autocast state of the forward is restored for the recompute too.
//
// The outputs hang from one autograd node, memlean::CheckpointBackward (a plain Node: no
// per-call context object), which holds the saved tensors and the function until backward
// frees them (or the graph is freed). Each differentiable output is a new tensor sharing the
// storage of what the function returned, so an input returned as it is keeps its own
// history. The Python memlean.checkpoint is this checkpoint, run with a Python function.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace memlean {

struct CheckpointOptions {
  CheckpointOptions() {}  // NOLINT(modernize-use-equals-default): {} initialisation below
  // Save the RNG state before the forward and restore it for the recompute.
  TORCH_ARG(bool, preserve_rng_state) = true;
};

// A segment over tensors. Undefined tensors among the inputs are passed through as such.
using TensorFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// A segment over any values: non-tensor inputs (ints, doubles, strings, None ...) are
// passed through to the function as they are; non-tensor outputs are returned as they
// are. Tensors inside lists or tuples are not supported (return them at the top level).
using IValueFunction =
    std::function<std::vector<c10::IValue>(const std::vector<c10::IValue>&)>;

// Checkpointed function(inputs_and_params[0, n_inputs)). The parameters,
// inputs_and_params[n_inputs, end), must be defined tensors. Returns the function's
// outputs (a function that returns no floating-point tensor has nothing to recompute: its
// outputs are returned as they are). Without grad mode, or when no input or parameter
// requires grad, this simply calls the function. Double backward (create_graph) works: the
// recompute then keeps the inputs' history, and the gradients are differentiable.
std::vector<at::Tensor> checkpoint(const TensorFunction& function, int64_t n_inputs,
                                   const std::vector<at::Tensor>& inputs_and_params,
                                   const CheckpointOptions& options = {});

std::vector<c10::IValue> checkpoint(const IValueFunction& function, int64_t n_inputs,
                                    const std::vector<c10::IValue>& inputs_and_params,
                                    const CheckpointOptions& options = {});

// Checkpointed function(inputs), where `function` runs `module`: the parameters are
// module.parameters(), and the module's buffers are copied before the recompute and put
// back after it, so that a module that updates a buffer in forward (e.g. the running stats
// of torch::nn::BatchNorm2d) updates it exactly once per forward. (The copies live only
// while the segment is recomputed.) The recompute begins from the buffers' values at the
// forward's start where the forward changed them (but BatchNorm and InstanceNorm statistics,
// which a training forward updates without reading), so that a forward that reads a buffer
// it updates is recomputed as it ran: those copies are made before the forward and live
// until the segment's backward (the others are dropped after the forward).
std::vector<at::Tensor> checkpoint(const torch::nn::Module& module, const TensorFunction& function,
                                   const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options = {});

// A module whose buffers its training forward updates without reading them, as BatchNorm's
// running statistics (e.g. a layer holding a BatchNorm's buffers under its own name): a
// checkpoint of a module tree does not copy its buffers for the recompute (above).
// memlean::BatchNorm2d derives from it; torch::nn's BatchNorm{1,2,3}d and InstanceNorm{1,2,3}d
// are treated so without it.
class NormStatisticsHolder {
 public:
  virtual ~NormStatisticsHolder() = default;
};

// The buffers of `module`'s tree (each once) that a checkpoint of it begins its recompute from
// where its forward changed them: all but the statistics of torch::nn BatchNorm{1,2,3}d and
// InstanceNorm{1,2,3}d layers and of NormStatisticsHolder modules. A change is seen by the
// buffer's version counter, or, for one made through `.data()` or `variable_data()` (which
// leave it alone), by comparing the buffer with the copy the checkpoint made before the
// forward (on CUDA one synchronisation per checkpointed forward that has such buffers).
std::vector<at::Tensor> rewound_buffers(const torch::nn::Module& module);

// Which of `buffers` `run` changed without moving their version counters (through `.data()` /
// `variable_data()` in C++, `.data` in Python, which share the storage under a version counter
// of their own), one flag per buffer. Found by value: a copy of each buffer is made before
// `run` (so it costs the buffers' bytes once, outside what `run` measures), compared after; a
// NaN equals a NaN, a sparse buffer is compared densely, one whose shape, dtype or layout
// changed differs. A checkpoint sees such a change the same way (rewound_buffers), but
// memlean::fit (both languages) counts the copies a checkpoint keeps from its recorded step's
// version counters, so it checkpoints no module holding such a buffer.
std::vector<bool> unversioned_changes(const std::vector<at::Tensor>& buffers,
                                      const std::function<void()>& run);

// Checkpointed module->forward(input) for a module whose forward takes and returns one
// tensor, e.g. checkpoint(torch::nn::Sequential(...), x).
template <typename ModuleType>
at::Tensor checkpoint(const torch::nn::ModuleHolder<ModuleType>& module, const at::Tensor& input,
                      const CheckpointOptions& options = {}) {
  auto impl = module.ptr();
  return checkpoint(
      *impl,
      [impl](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{impl->forward(in[0])}; },
      {input}, options)[0];
}

// True while a checkpoint recomputes its forward on this thread (in backward). Modules
// with side effects in forward use it to apply them once: memlean::BatchNorm2d does not
// update its running statistics while this is true.
bool is_recomputing();

}  // namespace memlean
