// memlean::checkpoint: the autograd function that recomputes its segment in backward,
// its argument checks, RNG/autocast preservation and the module forms.
#include "ops/checkpoint/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_set>
#include <utility>

#include "ops/checkpoint/checkpoint_internal.h"
#include "third_party/torch/compat.h"

namespace memlean {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

thread_local int recompute_depth = 0;

constexpr const char* kName = "memlean::checkpoint";
constexpr const char* kHowToList =
    "Pass it among the parameters, after the n_inputs inputs (a module's parameters: "
    "module->parameters()).";

// ---- autocast state ----------------------------------------------------------

struct AutocastState {
  static constexpr at::DeviceType kTypes[] = {at::kCPU, at::kCUDA};
  bool enabled[2] = {false, false};
  at::ScalarType dtype[2] = {at::kBFloat16, at::kHalf};

  static AutocastState capture() {
    AutocastState s;
    for (int i = 0; i < 2; ++i) {
      s.enabled[i] = at::autocast::is_autocast_enabled(kTypes[i]);
      s.dtype[i] = at::autocast::get_autocast_dtype(kTypes[i]);
    }
    return s;
  }
  void apply() const {
    for (int i = 0; i < 2; ++i) {
      at::autocast::set_autocast_enabled(kTypes[i], enabled[i]);
      at::autocast::set_autocast_dtype(kTypes[i], dtype[i]);
    }
  }
};

// Sets the forward's autocast state for the recompute, and puts the current one back.
class AutocastRestore {
 public:
  explicit AutocastRestore(const AutocastState& forward) : previous_(AutocastState::capture()) {
    forward.apply();
  }
  ~AutocastRestore() { previous_.apply(); }

 private:
  AutocastState previous_;
};

// Sets the forward's RNG state for the recompute, and puts the current one back.
class RngFork {
 public:
  explicit RngFork(const detail::RngState* forward) {
    if (forward == nullptr) return;
    previous_ = detail::RngState::capture(forward->devices);
    active_ = true;
    forward->restore();
  }
  ~RngFork() {
    if (active_) previous_.restore();
  }

 private:
  bool active_ = false;
  detail::RngState previous_;
};

// Copies the buffers before the recompute and puts the copies back after it, so that a
// module that updates a buffer in forward (torch's BatchNorm2d) updates it once. The copy
// goes back without bumping the buffers' version counters (like the in-kernel updates of
// batch norm's running statistics, which do not bump them either), so that graphs that
// saved a buffer stay valid.
class BufferRestore {
 public:
  explicit BufferRestore(const std::vector<at::Tensor>& buffers) : buffers_(buffers) {
    at::NoGradGuard no_grad;
    for (const auto& b : buffers_) copies_.push_back(b.clone());
  }
  ~BufferRestore() {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i].variable_data().copy_(copies_[i]);
  }

 private:
  const std::vector<at::Tensor>& buffers_;
  std::vector<at::Tensor> copies_;
};

// ---- values ----------------------------------------------------------------------

bool is_defined_tensor(const c10::IValue& v) { return v.isTensor() && v.toTensor().defined(); }

bool contains_tensor(const c10::IValue& v) {
  if (is_defined_tensor(v)) return true;
  if (v.isTensorList()) return !v.toTensorList().empty();
  if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) {
      if (contains_tensor(e)) return true;
    }
  }
  if (v.isTuple()) {
    for (const c10::IValue& e : v.toTupleRef().elements()) {
      if (contains_tensor(e)) return true;
    }
  }
  if (v.isGenericDict()) {
    for (const auto& kv : v.toGenericDict()) {
      if (contains_tensor(kv.key()) || contains_tensor(kv.value())) return true;
    }
  }
  return false;
}

std::string describe(const c10::IValue& v) {
  if (v.isTensor()) return v.toTensor().defined() ? "a tensor" : "an undefined tensor";
  if (v.isNone()) return "None";
  return std::string("a value of type ") + v.tagKind();
}

// Positions of the defined tensors among the outputs; checks that there is one and that
// none hides inside a container.
std::vector<int64_t> tensor_output_slots(const std::vector<c10::IValue>& outputs) {
  std::vector<int64_t> slots;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (is_defined_tensor(outputs[i])) {
      slots.push_back(static_cast<int64_t>(i));
    } else {
      TORCH_CHECK(!contains_tensor(outputs[i]), kName, ": output ", i,
                  " of the function is a container that holds tensors (", outputs[i].tagKind(),
                  "); return tensors at the top level of the output list so that they get "
                  "gradients");
    }
  }
  if (slots.empty()) {
    std::ostringstream got;
    for (size_t i = 0; i < outputs.size(); ++i) got << (i ? ", " : "") << describe(outputs[i]);
    TORCH_CHECK(false, kName, ": the function returned no tensor (it returned ", outputs.size(),
                " value", outputs.size() == 1 ? "" : "s",
                outputs.empty() ? "" : ": " + got.str(),
                "); a checkpointed function must return at least one defined tensor");
  }
  return slots;
}

// ---- backward: dependency check ----------------------------------------------------

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

// Walks the recomputed graph from its outputs and stops at the inputs and parameters; any
// other tensor requiring grad that it reaches would silently get no gradient.
void check_no_unlisted_dependency(const variable_list& outputs, const variable_list& targets,
                                  const char* op, const char* how_to_list) {
  using torch::autograd::AccumulateGrad;
  using torch::autograd::Node;
  // Leaves are known by their gradient accumulator: a saved parameter unpacked through
  // saved-tensor hooks is a new tensor that shares the parameter's accumulator.
  std::unordered_set<const Node*> target_nodes;
  for (const auto& t : targets) {
    target_nodes.insert(torch::autograd::impl::gradient_edge(t).function.get());
  }
  std::vector<std::pair<Node*, std::string>> stack;
  std::unordered_set<const Node*> seen;
  for (const auto& out : outputs) {
    Node* node = torch::autograd::impl::gradient_edge(out).function.get();
    if (node != nullptr && seen.insert(node).second) stack.emplace_back(node, "");
  }
  while (!stack.empty()) {
    auto [node, via] = std::move(stack.back());
    stack.pop_back();
    if (target_nodes.count(node)) continue;
    if (auto* acc = dynamic_cast<AccumulateGrad*>(node)) {
      TORCH_CHECK(false, op, ": the function uses a tensor that requires grad but is neither "
                  "one of its inputs nor one of the parameters given to the checkpoint (it reaches "
                  "a leaf of shape ", shape_of(acc->variable), via.empty() ? "" : " through " + via,
                  "); its gradient would be lost. ", how_to_list);
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.is_valid() && seen.insert(edge.function.get()).second) {
        stack.emplace_back(edge.function.get(), node->name());
      }
    }
  }
}

// ---- the autograd function ---------------------------------------------------------

// Everything the backward needs besides the saved tensors.
struct SegmentState : torch::CustomClassHolder {
  IValueFunction function;
  // The inputs with their tensors taken out (IValue() in those slots).
  std::vector<c10::IValue> inputs;
  std::vector<int64_t> input_tensor_slots;  // where the saved input tensors go
  // Outputs of the forward: the non-tensor ones (returned as they are), and where the
  // tensors were.
  std::vector<c10::IValue> outputs;
  std::vector<int64_t> output_tensor_slots;
  // Per parameter: whether it was listed before (it then gets no gradient of its own: the
  // engine would add both).
  std::vector<bool> repeated;
  std::optional<detail::RngState> rng;
  AutocastState autocast;
  // Buffers of the module(s) the function runs: restored after the recompute.
  std::vector<at::Tensor> buffers;
};

class CheckpointNode : public torch::autograd::Function<CheckpointNode> {
 public:
  // tensors: the input tensors, then the parameters.
  static variable_list forward(AutogradContext* ctx, const c10::intrusive_ptr<SegmentState>& state,
                               at::TensorList tensors) {
    ctx->set_materialize_grads(false);
    const size_t n_in = state->input_tensor_slots.size();
    std::vector<c10::IValue> inputs = state->inputs;
    std::vector<int64_t> versions;
    for (size_t i = 0; i < n_in; ++i) {
      inputs[state->input_tensor_slots[i]] = tensors[i];
      versions.push_back(tensors[i]._version());
    }

    std::vector<c10::IValue> outputs = state->function(inputs);

    for (size_t i = 0; i < n_in; ++i) {
      TORCH_CHECK(tensors[i]._version() == versions[i], kName, ": the function modified its ",
                  "input ", state->input_tensor_slots[i], " in place; a checkpointed function "
                  "must not modify its inputs (the recompute in backward would see the modified "
                  "values). Clone the input first, or start the segment after the in-place op.");
    }
    state->output_tensor_slots = tensor_output_slots(outputs);
    variable_list result;
    for (int64_t slot : state->output_tensor_slots) {
      result.push_back(outputs[slot].toTensor());
      outputs[slot] = c10::IValue();
    }
    state->outputs = std::move(outputs);
    ctx->save_for_backward(tensors.vec());
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return result;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto state = c10::static_intrusive_pointer_cast<SegmentState>(
        ctx->saved_data["state"].toCapsule());
    variable_list saved;
    try {
      saved = ctx->get_saved_variables();
    } catch (const c10::Error& e) {
      // Other errors (an input modified in place since the forward ...) say what they are.
      if (std::string(e.what()).find("backward through the graph a second time") ==
          std::string::npos) {
        throw;
      }
      TORCH_CHECK(false, kName, ": backward ran through this checkpoint a second time, but the "
                  "first backward freed the inputs it saved. Pass retain_graph=true to the "
                  "first backward to run backward twice.");
    }
    const bool create_graph = at::GradMode::is_enabled();
    const size_t n_in = state->input_tensor_slots.size();

    // Inputs: detached, so that the recomputed graph ends at them. Parameters: as they
    // are (the function reads them from its closure).
    std::vector<c10::IValue> inputs = state->inputs;
    variable_list args(saved.size());
    for (size_t i = 0; i < saved.size(); ++i) {
      if (i < n_in) {
        args[i] = saved[i].detach();
        args[i].requires_grad_(saved[i].requires_grad());
        inputs[state->input_tensor_slots[i]] = args[i];
      } else {
        args[i] = saved[i];
      }
    }

    std::vector<c10::IValue> outputs;
    {
      RngFork rng(state->rng ? &*state->rng : nullptr);
      AutocastRestore autocast(state->autocast);
      BufferRestore buffers(state->buffers);
      RecomputeGuard recomputing;
      at::AutoGradMode grad_mode(true);
      outputs = state->function(inputs);
    }
    TORCH_CHECK(outputs.size() == state->outputs.size(), kName, ": the function returned ",
                state->outputs.size(), " outputs in forward but ", outputs.size(),
                " when recomputed in backward; it must do the same both times");

    variable_list outs, grads;
    for (size_t k = 0; k < state->output_tensor_slots.size(); ++k) {
      const c10::IValue& v = outputs[state->output_tensor_slots[k]];
      TORCH_CHECK(is_defined_tensor(v), kName, ": output ", state->output_tensor_slots[k],
                  " was a tensor in forward but is ", describe(v),
                  " when recomputed in backward; the function must do the same both times");
      const at::Tensor& out = v.toTensor();
      if (out.requires_grad() && k < grad_outputs.size() && grad_outputs[k].defined()) {
        outs.push_back(out);
        grads.push_back(grad_outputs[k]);
      }
    }
    std::vector<size_t> target_index;
    variable_list targets;
    for (size_t i = 0; i < args.size(); ++i) {
      if (i >= n_in && state->repeated[i - n_in]) continue;
      if (args[i].requires_grad()) {
        target_index.push_back(i);
        targets.push_back(args[i]);
      }
    }

    variable_list result(1 + args.size());  // state, then one per tensor
    if (!outs.empty() && !targets.empty()) {
      variable_list g = recomputed_grad(outs, targets, grads, kName, kHowToList);
      for (size_t j = 0; j < g.size(); ++j) result[1 + target_index[j]] = g[j];
    }
    if (create_graph) mark_once_differentiable(result);
    return result;
  }

 private:
  // Like Python's @once_differentiable: with create_graph=true the gradients are returned,
  // but differentiating them again raises an error.
  static void mark_once_differentiable(variable_list& grads) {
    variable_list inputs;
    std::vector<size_t> where;
    for (size_t i = 0; i < grads.size(); ++i) {
      if (grads[i].defined() && grads[i].is_floating_point()) {
        inputs.push_back(grads[i].detach().requires_grad_(true));
        where.push_back(i);
      }
    }
    if (inputs.empty()) return;
    auto error = torch_compat::make_node<torch::autograd::DelayedError>(
        std::string(kName) + ": double backward (create_graph=true) through a checkpoint is not "
        "supported",
        static_cast<int64_t>(inputs.size()));
    variable_list wrapped = error->apply(std::move(inputs));
    for (size_t j = 0; j < where.size(); ++j) grads[where[j]] = wrapped[j];
  }
};

}  // namespace

bool is_recomputing() { return recompute_depth > 0; }

RecomputeGuard::RecomputeGuard() { ++recompute_depth; }
RecomputeGuard::~RecomputeGuard() { --recompute_depth; }

std::vector<at::Tensor> recomputed_grad(const std::vector<at::Tensor>& outputs,
                                        const std::vector<at::Tensor>& targets,
                                        const std::vector<at::Tensor>& grads, const char* op,
                                        const char* how_to_list) {
  check_no_unlisted_dependency(outputs, targets, op, how_to_list);
  return torch::autograd::grad(outputs, targets, grads, /*retain_graph=*/false,
                               /*create_graph=*/false, /*allow_unused=*/true);
}

namespace detail {

std::vector<c10::IValue> checkpoint_impl(const IValueFunction& function, int64_t n_inputs,
                                         const std::vector<c10::IValue>& inputs_and_params,
                                         const CheckpointOptions& options,
                                         const std::vector<at::Tensor>& buffers) {
  TORCH_CHECK(static_cast<bool>(function), kName, ": function is empty");
  const auto n_args = static_cast<int64_t>(inputs_and_params.size());
  TORCH_CHECK(n_inputs >= 0, kName, ": n_inputs must be >= 0, got ", n_inputs);
  TORCH_CHECK(n_inputs <= n_args, kName, ": n_inputs is ", n_inputs, " but only ", n_args,
              " argument", n_args == 1 ? " was" : "s were", " given (inputs_and_params holds the ",
              "n_inputs inputs, then the parameters)");
  for (int64_t i = n_inputs; i < n_args; ++i) {
    TORCH_CHECK(is_defined_tensor(inputs_and_params[i]), kName, ": parameter ", i - n_inputs,
                " (inputs_and_params[", i, "]) is ", describe(inputs_and_params[i]),
                ", not a tensor; everything after the first n_inputs=", n_inputs,
                " arguments must be a parameter tensor");
  }

  auto state = c10::make_intrusive<SegmentState>();
  std::vector<at::Tensor> tensors;
  std::unordered_set<const c10::TensorImpl*> params_seen;
  bool any_requires_grad = false;
  for (int64_t i = 0; i < n_args; ++i) {
    const c10::IValue& v = inputs_and_params[i];
    if (i < n_inputs) {
      if (is_defined_tensor(v)) {
        state->input_tensor_slots.push_back(i);
        tensors.push_back(v.toTensor());
        state->inputs.emplace_back();
      } else {
        state->inputs.push_back(v);
      }
    } else {
      tensors.push_back(v.toTensor());
      state->repeated.push_back(!params_seen.insert(v.toTensor().unsafeGetTensorImpl()).second);
    }
    if (is_defined_tensor(v) && v.toTensor().requires_grad()) any_requires_grad = true;
  }

  if (!at::GradMode::is_enabled() || !any_requires_grad) {
    // Nothing to differentiate: an ordinary call.
    std::vector<c10::IValue> inputs(inputs_and_params.begin(), inputs_and_params.begin() + n_inputs);
    std::vector<c10::IValue> outputs = function(inputs);
    tensor_output_slots(outputs);
    return outputs;
  }

  state->function = function;
  state->autocast = AutocastState::capture();
  if (options.preserve_rng_state()) state->rng = detail::RngState::capture(detail::rng_devices(tensors));

  state->buffers = buffers;
  variable_list wrapped = CheckpointNode::apply(state, at::TensorList(tensors));

  std::vector<c10::IValue> outputs = std::move(state->outputs);
  state->outputs.assign(outputs.size(), c10::IValue());  // keeps only the count for backward
  for (size_t k = 0; k < wrapped.size(); ++k) outputs[state->output_tensor_slots[k]] = wrapped[k];
  return outputs;
}

}  // namespace detail

std::vector<c10::IValue> checkpoint(const IValueFunction& function, int64_t n_inputs,
                                    const std::vector<c10::IValue>& inputs_and_params,
                                    const CheckpointOptions& options) {
  return detail::checkpoint_impl(function, n_inputs, inputs_and_params, options, {});
}

namespace {

IValueFunction to_ivalue_function(const TensorFunction& function) {
  TORCH_CHECK(static_cast<bool>(function), kName, ": function is empty");
  return [function](const std::vector<c10::IValue>& in) {
    std::vector<at::Tensor> tensors;
    tensors.reserve(in.size());
    for (const auto& v : in) tensors.push_back(v.isTensor() ? v.toTensor() : at::Tensor());
    std::vector<at::Tensor> out = function(tensors);
    return std::vector<c10::IValue>(out.begin(), out.end());
  };
}

std::vector<at::Tensor> to_tensors(const std::vector<c10::IValue>& values) {
  std::vector<at::Tensor> out;
  out.reserve(values.size());
  for (const auto& v : values) out.push_back(v.isTensor() ? v.toTensor() : at::Tensor());
  return out;
}

}  // namespace

std::vector<at::Tensor> checkpoint(const TensorFunction& function, int64_t n_inputs,
                                   const std::vector<at::Tensor>& inputs_and_params,
                                   const CheckpointOptions& options) {
  std::vector<c10::IValue> args(inputs_and_params.begin(), inputs_and_params.end());
  return to_tensors(
      detail::checkpoint_impl(to_ivalue_function(function), n_inputs, args, options, {}));
}

std::vector<at::Tensor> checkpoint(const torch::nn::Module& module, const TensorFunction& function,
                                   const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options) {
  std::vector<c10::IValue> args(inputs.begin(), inputs.end());
  for (const auto& p : module.parameters()) args.emplace_back(p);
  std::vector<at::Tensor> buffers;
  for (const auto& b : module.buffers()) {
    if (b.defined()) buffers.push_back(b);
  }
  return to_tensors(detail::checkpoint_impl(to_ivalue_function(function),
                                            static_cast<int64_t>(inputs.size()), args, options,
                                            buffers));
}

namespace detail {

namespace {

at::Tensor get_generator_state(const at::Generator& gen) {
  at::Generator g = gen;
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}

void set_generator_state(const at::Generator& gen, const at::Tensor& state) {
  at::Generator g = gen;
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}

const at::Generator& default_generator(const at::Device& device) {
  if (device.is_cpu()) return at::detail::getDefaultCPUGenerator();
  return at::globalContext().defaultGenerator(device);
}

}  // namespace

RngState RngState::capture(const std::vector<at::Device>& devices) {
  RngState s;
  s.devices = devices;
  for (const auto& d : devices) s.states.push_back(get_generator_state(default_generator(d)));
  return s;
}

void RngState::restore() const {
  for (size_t i = 0; i < devices.size(); ++i) {
    set_generator_state(default_generator(devices[i]), states[i]);
  }
}

std::vector<at::Device> rng_devices(at::TensorList tensors) {
  std::vector<at::Device> devices = {at::Device(at::kCPU)};
  for (const auto& t : tensors) {
    if (!t.defined() || !t.device().is_cuda()) continue;
    at::Device d = t.device();
    if (!d.has_index()) d = at::Device(at::kCUDA, 0);
    if (std::find(devices.begin(), devices.end(), d) == devices.end()) devices.push_back(d);
  }
  return devices;
}

}  // namespace detail

}  // namespace memlean
