// memlean::fit for a torch::nn::Sequential: choose which runs of layers to checkpoint so that
// one whole training step fits a memory budget, at the least recompute time, and check it by
// measuring the step.
//
//   auto plan = memlean::fit::fit(model, x, "6GiB", {.loss_fn = loss, .optimizer = &adam});
//   std::cout << plan.str();
//   at::Tensor y = plan.forward(x);  // in the training loop, instead of model->forward(x)
//
// The budget is the peak of one training step (forward, loss, backward, optimizer step, the
// gradients set to none) on the model's device, counted as: the bytes of the unique storages
// of the parameters, buffers, optimizer state and the example input at the start of the step
// (its gradients undefined), plus the most that memstats sees allocated above its value at the
// start (exact on the CPU; CUDA: the caching allocator's allocated bytes, and the storages are
// counted as its blocks, memstats::allocated_bytes_of, so the budget is what
// torch.cuda.max_memory_allocated counts above what else the process holds). On CUDA fit
// plans against the budget less a margin (cuda_margin, budget.h: which blocks the allocator
// hands out depends on its history, so a later step may peak a little above fit's own
// measurement), and a FitError's least peak includes twice that margin.
//
// What fit() does: measures the eager step; if it fits, returns the empty plan. Otherwise,
// cheapest first, the Swish layers, no recompute: each torch::nn::SiLU or memlean::Swish whose
// input it alone holds (no earlier op saved it, no view or other tensor shares its storage,
// it is not the example input; and no later layer writes its output in place, which the
// in-place Swish saves; checked on the forward, so autograd's version counter cannot fire)
// becomes memlean's in-place Swish (one bit per element kept instead of its input), and
// a naive memlean::Swish that cannot be in place the memory-efficient one; on the CPU, each
// torch::nn::BatchNorm{1,2,3}d in training mode gets memlean::lean_batch_norm's backward and
// each depthwise torch::nn::Conv2d with zero padding memlean::lean_conv2d's (up to two, and
// four to six, tensors of the input's size less at their backwards; ops/checkpoint). The
// swapped layers live in the plan's Sequential (plan.model(), which shares every other layer
// with `model`; a lean layer holds its layer's tensors under the same names and follows its
// training mode); `model` itself is not changed. If the step with them fits, that is the
// plan. Otherwise it
// runs the forward once layer by layer to measure what each layer keeps for backward (what
// it allocates, less its input when it does not save it) and its forward time, and one step
// with a hook on each layer's output to measure what backward holds at each layer; it plans
// with the planner of planner.h (every run of layers but those ending at the last, and those
// whose input a layer of theirs overwrites, which memlean::checkpoint refuses, or which hold a
// layer that changes a buffer through .data() unseen by a checkpoint's version check, found
// by value around the warm-up step, is a candidate,
// with what its recompute adds: its input where the first layer does not save it, its
// recomputed output, what its layers' forward held above what they left, the gradients
// backward brings to it) inside the search of search.h, the loop memlean.fit runs too: it
// measures one step under each plan; while the measured step exceeds the budget it plans again
// with the planner's budget lowered by the excess (then the least-peak plan); once a plan fits
// it bisects back up for a faster one, and returns the
// fastest plan measured to fit. When no plan of checkpoints fits, it slices the MLPs (a
// torch::nn::Linear that at least doubles its input's features, elementwise activations, a
// Linear back, whose hidden tensor is 1 MiB or more: computed and recomputed slice by slice
// of the hidden features with memlean::sliced_mlp, ops/checkpoint/sliced_mlp.h, keeping the
// MLP's input alone; the plan's Sequential holds them as one layer in fc1's place and layers
// that pass its output on in the others', each under its own name) and searches again. It
// never returns a plan whose measured step exceeds the
// budget: when none fits it throws FitError, naming the least peak measured. Everything the
// measurement steps touch is restored exactly before fit() returns or throws: parameters,
// buffers, gradients, the optimizer's state (its state objects are the same ones) and the
// RNG state (CPU and the model's device). While fit() runs, copies of the parameters, buffers
// and optimizer state are held on the CPU (host memory), so on CUDA fit needs no device memory
// beyond its measured steps'; the steps update the optimizer's own state tensors, whose values
// it puts back. An optimizer state of a type without fixed fields (one of the caller's own:
// memstats::optimizer_state_fields) is moved out instead, untouched, and the steps make one of
// the same sizes: on the device, a second state while fit() runs. torch::optim::LBFGS, whose
// step() needs a closure (several forward and backward passes), is refused (options.optimizer).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace memlean::fit {

// No choice of checkpoints fits the budget: the message names budget_bytes and the least peak
// reached, in bytes and GiB.
class FitError : public std::invalid_argument {
 public:
  FitError(const std::string& message, int64_t budget_bytes, int64_t least_peak_bytes)
      : std::invalid_argument(message),
        budget_bytes(budget_bytes),
        least_peak_bytes(least_peak_bytes) {}
  int64_t budget_bytes;
  int64_t least_peak_bytes;  // measured: the least step peak fit() reached
};

struct FitOptions {
  // The loss of the model's output: a scalar floating tensor. Default: output.sum().
  std::function<at::Tensor(const at::Tensor& output)> loss_fn;
  // Its step (and its state) is part of the training step; nullptr: no optimizer step.
  // step() is called without a closure: torch::optim::LBFGS is refused.
  torch::optim::Optimizer* optimizer = nullptr;
  // The planner's resolution (planner.h).
  int resolution = 4096;
  // The training loop keeps the parameters' gradients allocated between steps
  // (optimizer.zero_grad(false), or gradient accumulation): each measured step begins with them
  // alive (zeroed; counted in fixed_bytes) and ends zeroing them, so the peak is that loop's
  // (higher by up to the gradients' bytes than with zero_grad(), whose step makes them in
  // backward). Default: false, LibTorch's zero_grad() (set_to_none = true).
  bool keep_grads = false;
};

// One change: a swapped Swish layer or a checkpointed run.
struct FitAction {
  std::string path;    // "layers 3-5", "layer 2", with the layers' names when they have some
  // "checkpoint", "sliced mlp", "inplace swish", "memory_efficient swish", "lean batchnorm"
  // or "lean depthwise conv"
  std::string action;
  // A checkpoint: predicted, the run's kept bytes minus its output. A sliced MLP: predicted,
  // what its layers but the last kept for backward. A swap: measured, the step's peak before
  // it less the swapped step's, split among the swapped layers by their inputs' bytes.
  int64_t bytes_saved = 0;
  // A checkpoint: the run's forward time, measured once; a sliced MLP: its first Linear's and
  // activations' (recomputed in backward); else 0.
  double recompute_seconds = 0;
};

// What fit() chose, and the runner of the Sequential under it.
class FitPlan {
 public:
  int64_t budget_bytes = 0;
  int64_t peak_bytes = 0;            // measured: one step under this plan
  int64_t predicted_peak_bytes = 0;  // the planner's model of that peak
  int64_t fixed_bytes = 0;           // parameters, buffers, optimizer state, example input
                                     // (and gradients, with FitOptions::keep_grads)
  int64_t eager_peak_bytes = 0;      // measured: one step before any change
  int64_t margin_bytes = 0;          // how far below budget_bytes fit planned: on CUDA
                                     // cuda_margin(budget_bytes) (budget.h), on the CPU 0
  std::vector<FitAction> actions;    // the swaps, the sliced MLPs, then the checkpoints, each
                                     // in forward order
  // [begin, end) runs, by begin; a run inside another (checkpoints nested in a checkpoint, which
  // its recompute runs) after it.
  std::vector<std::pair<int64_t, int64_t>> checkpointed;
  // [fc1, fc2 + 1) runs of layers computed as one sliced MLP (memlean::sliced_mlp), in order:
  // model()'s layer fc1 computes them, the others pass its output on.
  std::vector<std::pair<int64_t, int64_t>> sliced;

  // The plan's Sequential on x: each run [b, e) of `checkpointed` through memlean::checkpoint
  // (its layers' parameters and buffers given, so a BatchNorm updates its statistics once;
  // the runs inside it so again, in its forward and in its recompute), the other layers as
  // usual.
  at::Tensor forward(const at::Tensor& x) const;
  // A table for people: one row per action (what it saves; a checkpoint's recompute time; a
  // run nested in another indented under it), then the budget (with the margin on CUDA),
  // peak, predicted, eager and fixed lines.
  std::string str() const;
  // {"budget_bytes": ..., "peak_bytes": ..., "predicted_peak_bytes": ..., "fixed_bytes": ...,
  //  "eager_peak_bytes": ..., "margin_bytes": ..., "recompute_seconds": ..., "checkpointed": [[b, e], ...],
  //  "sliced": [[b, e], ...],
  //  "actions": [{"path": ..., "action": ..., "bytes_saved": ..., "recompute_seconds": ...}]}
  std::string to_json() const;
  // The plan to_json() wrote, read back: its figures, actions, checkpointed and sliced runs,
  // without a model (forward() refuses until apply_plan makes one). std::invalid_argument
  // naming plan_json (and the offset) for text that is not such JSON.
  static FitPlan from_json(const std::string& plan_json);

  // The Sequential the plan runs: the model given to fit(), or where fit() swapped layers a
  // new Sequential of the same names with those layers replaced and every other layer
  // the model's own (shared: parameters, buffers and training mode are the model's).
  torch::nn::Sequential model() const { return model_; }

 private:
  friend struct FitPlanAccess;  // fit.cc
  torch::nn::Sequential model_{nullptr};
  std::vector<torch::nn::Sequential> runs_;  // one per outermost checkpointed run: its layers
  std::vector<size_t> outermost_;             // those runs' indices in checkpointed
};

// Fits one training step of `model` on `example_input` into budget_bytes (see above).
// std::invalid_argument / c10::Error naming the argument for: budget_bytes <= 0, an empty
// model or one without parameters, an undefined example_input or one on another device than
// the parameters, a loss that is not a scalar floating tensor, resolution < 1. FitError
// (a std::invalid_argument) when no plan fits.
FitPlan fit(torch::nn::Sequential model, const at::Tensor& example_input, int64_t budget_bytes,
            FitOptions options = {});

// The same with a budget written as text ("6GiB", "512MiB": parse_budget(budget, "budget")).
FitPlan fit(torch::nn::Sequential model, const at::Tensor& example_input,
            const std::string& budget, FitOptions options = {});

// Applies a plan fit() made (FitPlan::from_json of its to_json(), or the plan itself) to `model`, a
// twin of the model it was made for (another rank of a data-parallel job, a job restarted), without
// fit()'s search, and checks it: it walks the layers as fit() does, slices the MLPs the plan slices
// (fit slices all it finds, or none), makes the swaps the plan makes (the same layers, each as
// fit() would swap it here: an in-place Swish only where the layer alone holds its input),
// checkpoints the plan's runs (each one fit() offers: no run whose input a layer of it overwrites,
// that splits a sliced MLP, holds a layer changing a buffer unseen, or ends at the last layer), and
// measures one step under it. Three steps and a forward (a forward more with sliced MLPs) where
// fit() measures one per plan it tries. The plan it returns has this step's figures (on the CPU the
// same bytes as the plan's for the same model, input and optimizer) and the plan's actions and
// runs, each checkpoint's and sliced MLP's recompute time measured in this step (the plan may
// come from another machine); `model` itself is not changed, and everything the steps change is
// put back. Throws
// std::invalid_argument naming "plan" where the plan does not match this model's step (another
// model; a run out of its layers), and FitError where the step under it peaks above
// plan.budget_bytes (less the CUDA margin); the arguments are checked as fit()'s.
FitPlan apply_plan(torch::nn::Sequential model, const at::Tensor& example_input,
                   const FitPlan& plan, FitOptions options = {});

}  // namespace memlean::fit
