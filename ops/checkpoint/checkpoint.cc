// memlean::checkpoint: the autograd function that recomputes its segment in backward,
// its argument checks, RNG/autocast preservation and the module forms.
#include "ops/checkpoint/checkpoint.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/instancenorm.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <sstream>
#include <string>
#include <typeinfo>
#include <unordered_set>
#include <utility>

#include "ops/checkpoint/internal/checkpoint.h"
#include "third_party/torch/compat.h"
#include "third_party/torch/once_differentiable.h"
#include "third_party/torch/tensors.h"

namespace memlean {
namespace {

using torch::autograd::variable_list;

thread_local int recompute_depth = 0;

// Marks this thread as recomputing (is_recomputing()) while alive; nests.
struct RecomputeGuard {
  RecomputeGuard() { ++recompute_depth; }
  ~RecomputeGuard() { --recompute_depth; }
  RecomputeGuard(const RecomputeGuard&) = delete;
  RecomputeGuard& operator=(const RecomputeGuard&) = delete;
};


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

// Sets the forward's autocast state for the recompute, and puts the current one back. The
// recompute is an autocast region of its own, as torch.autocast makes one: leaving it outside
// any other region (backward outside the user's, as PyTorch's docs advise) empties autocast's
// cache of weight copies. Left there, the copies of the weights as they were before the
// optimizer step stayed cached into the next step, whose forward then used them: training
// diverged from the plain loop's (checkpoint_test's
// test_autocast_loop_with_backward_outside_the_region_trains_as_without_checkpoint).
class AutocastRestore {
 public:
  explicit AutocastRestore(const AutocastState& forward) : previous_(AutocastState::capture()) {
    forward.apply();
    at::autocast::increment_nesting();
  }
  ~AutocastRestore() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    previous_.apply();
  }

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

// Whether t's shape is a plain list of sizes (not nested, not symbolic), which a recompute's
// output is compared against.
bool has_plain_sizes(const at::Tensor& t) {
  return !t.is_nested() && !t.unsafeGetTensorImpl()->has_symbolic_sizes_strides();
}

std::string describe(const c10::IValue& v) {
  if (v.isTensor()) return v.toTensor().defined() ? "a tensor" : "an undefined tensor";
  if (v.isNone()) return "None";
  return std::string("a value of type ") + v.tagKind();
}

// Positions of the defined tensors among the outputs; checks that none hides inside a
// container. (None at all is fine: there is then nothing to differentiate.)
std::vector<int64_t> tensor_output_slots(const std::vector<c10::IValue>& outputs,
                                         const std::string& name) {
  std::vector<int64_t> slots;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (is_defined_tensor(outputs[i])) {
      slots.push_back(static_cast<int64_t>(i));
    } else {
      TORCH_CHECK(!contains_tensor(outputs[i]), name, ": output ", i,
                  " of the function is a container that holds tensors (", outputs[i].tagKind(),
                  "); return tensors at the top level of the output list so that they get "
                  "gradients");
    }
  }
  return slots;
}

// ---- backward: dependency check ----------------------------------------------------

std::string shape_of(const at::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

// What one walk of a recomputed segment's graph finds, from its outputs to the targets (its
// inputs and parameters) and the leaves it ends at.
struct RecomputedGraph {
  // A node of torch.utils.checkpoint's reentrant checkpoint (use_reentrant=True, as
  // transformers' gradient_checkpointing_enable() makes it by default): its backward refuses
  // to run inside a backward given `inputs` (torch::autograd::grad, as recomputed_backward takes
  // the segment's), since its own backward accumulates its parameters' gradients into .grad.
  bool reaches_reentrant_checkpoint = false;
  // The first tensor requiring grad that is neither a target nor behind one (a leaf's shape
  // and the node it was reached through, for the error): empty if none. It would silently
  // get no gradient from recomputed_backward.
  std::string unlisted_leaf;
};

// One walk serves both questions (a checkpoint's backward walks the graph it recomputed once).
// Leaves are known by their gradient accumulator: a saved parameter unpacked through
// saved-tensor hooks is a new tensor that shares the parameter's accumulator. The walk stops
// at the first reentrant checkpoint node unless `all_leaves` (a double backward, which never
// takes the full-backward path that node calls for, needs the leaf check).
RecomputedGraph walk_recomputed_graph(const variable_list& outputs, const variable_list& targets,
                                      bool all_leaves) {
  using torch::autograd::AccumulateGrad;
  using torch::autograd::Node;
  RecomputedGraph found;
  // The edges are kept while the walk runs: a leaf's accumulator may be made here, and
  // live only as long as an edge holds it (a recomputed output that is an input itself).
  std::vector<torch::autograd::Edge> edges;
  edges.reserve(targets.size() + outputs.size());
  std::unordered_set<const Node*> target_nodes;
  for (const auto& t : targets) {
    edges.push_back(torch::autograd::impl::gradient_edge(t));
    target_nodes.insert(edges.back().function.get());
  }
  // (node, the node it was reached from: named only in the error)
  std::vector<std::pair<Node*, Node*>> stack;
  std::unordered_set<const Node*> seen;
  for (const auto& out : outputs) {
    edges.push_back(torch::autograd::impl::gradient_edge(out));
    Node* node = edges.back().function.get();
    if (node != nullptr && seen.insert(node).second) stack.emplace_back(node, nullptr);
  }
  while (!stack.empty()) {
    const auto [node, via] = stack.back();
    stack.pop_back();
    if (target_nodes.count(node)) continue;
    if (auto* acc = dynamic_cast<AccumulateGrad*>(node)) {
      if (found.unlisted_leaf.empty()) {
        found.unlisted_leaf =
            shape_of(acc->variable) + (via == nullptr ? "" : " through " + via->name());
      }
      continue;
    }
    // (A Python autograd Function's node is a PyNode, named after its class: the mangled type
    // name first, which costs nothing, before name(), which takes the GIL for a PyNode.)
    if (std::strstr(typeid(*node).name(), "PyNode") != nullptr &&
        node->name() == "CheckpointFunctionBackward") {
      found.reaches_reentrant_checkpoint = true;
      if (!all_leaves) return found;
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.is_valid() && seen.insert(edge.function.get()).second) {
        stack.emplace_back(edge.function.get(), node);
      }
    }
  }
  return found;
}

// The root of a recomputed segment's backward: it hands the incoming gradients on to the
// nodes of the recomputed outputs and keeps no copy of them. torch::autograd::grad keeps
// the outputs and the gradients (its caller's lists, and the engine's GraphRoot) until the
// whole segment's backward has run; with this root the gradients are freed as soon as the
// nodes that backward reaches first (those of the segment's last ops) have used them, and an
// output as soon as no node saved it, as in torch's non-reentrant checkpoint (ResNet-50,
// batch 8: a step's peak 2.5 % lower).
class HandOverRoot : public torch::autograd::Node {
 public:
  HandOverRoot(torch::autograd::edge_list edges, variable_list grads, const at::Tensor& token)
      : Node(std::move(edges)), grads_(std::move(grads)) {
    add_input_metadata(token);
  }
  std::string name() const override { return "memlean::CheckpointGradients"; }
  variable_list apply(variable_list&& /*token*/) override { return std::move(grads_); }

 private:
  variable_list grads_;
};

// The backward of a recomputed segment, from a HandOverRoot: with `targets`, their gradients
// are captured and returned (undefined for a target the outputs do not use; the walk found no
// unlisted leaf); with none, the backward runs in full and every leaf it reaches accumulates
// its gradient into .grad, as torch::autograd::backward does, and nothing is returned. `outputs` and `grads` are taken: the caller keeps no reference to them while
// the segment's backward runs. (torch::autograd::backward, as the full backward once ran,
// held them to its end: the least plan of transformers' GPT-2 with reentrant checkpointing,
// bfloat16, held the segment's output and its gradient, 1 MiB, above its prediction,
// 2026-11-30.) With create_graph (a double backward to come), the gradients keep their
// graph, which holds the recomputed one.
variable_list recomputed_backward(variable_list&& outputs, const variable_list& targets,
                                  variable_list&& grads, bool create_graph) {
  torch::autograd::edge_list roots, wanted;
  roots.reserve(outputs.size());
  wanted.reserve(targets.size());
  for (const auto& out : outputs) roots.push_back(torch::autograd::impl::gradient_edge(out));
  for (const auto& t : targets) wanted.push_back(torch::autograd::impl::gradient_edge(t));
  outputs.clear();  // freed now, unless a node of the recomputed graph saved one
  // The engine starts at a node given one input: an empty tensor on the gradients' device
  // (no allocation; its stream is the one the gradients were made on).
  const at::Tensor token = at::empty({0}, grads.front().options());
  torch::autograd::Edge root(
      torch_compat::make_node<HandOverRoot>(std::move(roots), std::move(grads), token), 0);
  return torch::autograd::Engine::get_default_engine().execute(
      {std::move(root)}, {token}, /*keep_graph=*/create_graph, create_graph,
      /*accumulate_grad=*/targets.empty(), wanted);
}

// ---- the autograd node -------------------------------------------------------------

// Everything a checkpoint's backward needs besides the saved tensors.
struct SegmentState {
  detail::Segment segment;
  // The inputs with their tensors taken out (IValue() in those slots).
  std::vector<c10::IValue> inputs;
  std::vector<int64_t> input_tensor_slots;  // where the saved input tensors go
  // How many values the function returned, and where its tensors were; per tensor output,
  // whether it is differentiable (it then is an input of the node, in order).
  size_t n_outputs = 0;
  std::vector<int64_t> output_tensor_slots;
  std::vector<bool> differentiable;
  // Per tensor output: its shape and dtype in forward (empty shape and Undefined where its
  // sizes are symbolic or it is nested: not compared), which the recompute must give again.
  std::vector<std::vector<int64_t>> output_sizes;
  std::vector<at::ScalarType> output_dtypes;
  // Per parameter: whether it was listed before (it then gets no gradient of its own: the
  // engine would add both).
  std::vector<bool> repeated;
  std::optional<detail::RngState> rng;
  AutocastState autocast;
  bool backward_in_full = false;
  // (buffer, its value at the forward's start) of each of segment.rewound that the forward
  // changed: the recompute begins from these values.
  std::vector<std::pair<at::Tensor, at::Tensor>> rewind;
};

// The node a checkpoint's outputs hang from. A plain autograd Node rather than a
// torch::autograd::Function: no context object, saved-data map or capsule per call, and it
// knows when the engine freed what it saved (release_variables), so a second backward is
// recognised by that, not by an error message's text.
class CheckpointBackward : public torch::autograd::Node {
 public:
  // tensors: the input tensors, then the parameters (the node's next edges, in order).
  CheckpointBackward(SegmentState state, const std::vector<at::Tensor>& tensors)
      : Node(torch::autograd::collect_next_edges(tensors)), state_(std::move(state)) {
    saved_.reserve(tensors.size());
    for (const auto& t : tensors) saved_.emplace_back(t, /*is_output=*/false);
  }

  std::string name() const override { return "memlean::CheckpointBackward"; }

  void release_variables() override {
    // Serialised with apply (torch's generated nodes do the same): a backward that frees the
    // graph must not free it under a backward running through it on another thread.
    std::lock_guard<std::mutex> lock(mutex_);
    released_ = true;
    saved_.clear();
    // The function (and whatever its closure holds) is not needed again.
    state_.segment.function = nullptr;
    state_.segment.buffers.clear();
    state_.segment.rewound.clear();
    state_.rewind.clear();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grad_outputs) override;

  const SegmentState& state() const { return state_; }

 private:
  SegmentState state_;
  std::vector<torch::autograd::SavedVariable> saved_;
  bool released_ = false;
};

variable_list CheckpointBackward::apply(variable_list&& grad_outputs) {
  // Two backward passes through one retained graph on two threads recompute one at a time.
  // The recompute takes the GIL only inside the function (a Python segment), after this lock.
  std::lock_guard<std::mutex> lock(mutex_);
  const SegmentState& state = state_;
  const std::string& name = state.segment.name;
  TORCH_CHECK(!released_, name, ": backward ran through this checkpoint a second time, but the "
              "first backward freed the inputs it saved. Keep the graph in the first backward "
              "(retain_graph) to run backward twice.");
  const bool create_graph = at::GradMode::is_enabled();
  const size_t n_in = state.input_tensor_slots.size();

  // Inputs: detached, so that the recomputed graph ends at them; but for a double backward
  // (create_graph) as they are, so that the gradients' graph reaches back through them (the
  // gradients are still taken with respect to them, so backward stops there). Parameters:
  // as they are (the function reads them from its closure).
  const bool double_backward = create_graph && !state.backward_in_full;
  const bool casts = state.autocast.enabled[0] || state.autocast.enabled[1];
  std::vector<c10::IValue> inputs = state.inputs;
  variable_list args(saved_.size());
  for (size_t i = 0; i < saved_.size(); ++i) {
    at::Tensor t = saved_[i].unpack();  // an error if it was modified in place since
    // Autocast caches its lower-precision copy of a float32 leaf that requires grad (meant
    // for weights). Were the recompute's detached input, a leaf, cached where the forward's
    // input (a layer's output, no leaf) was not, the recompute would cast it once for all its
    // uses and sum their gradients in the lower precision, where the forward cast it per use
    // and summed them in float32: a Llama MLP checkpointed under bfloat16 autocast gave input
    // gradients 5e-3 off (2026-11-28). The recompute then gets a view of it, which autocast
    // never caches, as it did not cache the forward's input.
    const bool uncached = casts && t.requires_grad() && (!t.is_leaf() || t.is_view());
    if (i < n_in && !double_backward) {
      args[i] = t.detach();
      args[i].requires_grad_(t.requires_grad());
    } else {
      args[i] = std::move(t);
    }
    if (i < n_in) {
      at::Tensor given = args[i];
      if (uncached && given.is_leaf()) {
        at::AutoGradMode grad_mode(true);
        given = given.view_as(given);
      }
      inputs[state.input_tensor_slots[i]] = std::move(given);
    }
  }

  std::vector<c10::IValue> outputs;
  {
    RngFork rng(state.rng ? &*state.rng : nullptr);
    AutocastRestore autocast(state.autocast);
    detail::BufferRestore buffers(state.segment.buffers);
    {
      at::NoGradGuard no_grad;  // (no version bump, as BufferRestore puts values back)
      for (const auto& [buffer, start] : state.rewind) buffer.variable_data().copy_(start);
    }
    RecomputeGuard recomputing;
    at::AutoGradMode grad_mode(true);
    outputs = state.segment.function(inputs);
  }
  TORCH_CHECK(outputs.size() == state.n_outputs, name, ": the function returned ",
              state.n_outputs, " outputs in forward but ", outputs.size(),
              " when recomputed in backward; it must do the same both times");

  // The recomputed outputs the incoming gradients belong to (the node's inputs are the
  // differentiable tensor outputs, in order).
  variable_list outs, grads;
  size_t input_nr = 0;
  for (size_t k = 0; k < state.output_tensor_slots.size(); ++k) {
    const c10::IValue& v = outputs[state.output_tensor_slots[k]];
    TORCH_CHECK(is_defined_tensor(v), name, ": output ", state.output_tensor_slots[k],
                " was a tensor in forward but is ", describe(v),
                " when recomputed in backward; the function must do the same both times");
    const at::Tensor& out = v.toTensor();
    // A recompute that computes something else (a forward reading state that changed since,
    // e.g. a key-value cache its first call appended to) is refused where its outputs show it,
    // rather than left to autograd's shape check or to silence (a dtype).
    const c10::IntArrayRef sizes(state.output_sizes[k]);
    TORCH_CHECK(state.output_dtypes[k] == at::ScalarType::Undefined || !has_plain_sizes(out) ||
                    (out.sizes() == sizes && out.scalar_type() == state.output_dtypes[k]),
                name, ": output ", state.output_tensor_slots[k], " was a ", state.output_dtypes[k],
                " tensor of shape ", sizes, " in forward but is a ", out.scalar_type(),
                " tensor of shape ", out.sizes(), " when recomputed in backward; the function "
                "must compute the same both times (does it read state its forward changed, such "
                "as a key-value cache: transformers' use_cache=True?)");
    if (!state.differentiable[k]) continue;
    at::Tensor& g = grad_outputs[input_nr++];
    if (out.requires_grad() && g.defined()) {
      outs.push_back(out);
      grads.push_back(std::move(g));
    }
  }
  // From here only outs and grads hold the recomputed outputs and the incoming gradients
  // (recomputed_backward takes both, to free them while the segment's backward runs).
  outputs.clear();
  grad_outputs.clear();

  variable_list result(args.size());
  std::vector<size_t> target_index;
  variable_list targets;
  for (size_t i = 0; i < args.size(); ++i) {
    if (i >= n_in && state.repeated[i - n_in]) continue;
    if (args[i].requires_grad()) {
      target_index.push_back(i);
      targets.push_back(args[i]);
    }
  }
  // (A double backward keeps the inputs undetached: the walk stops at them, and torch's
  // reentrant checkpoint has no double backward anyway.)
  RecomputedGraph graph;
  if (!state.backward_in_full && !outs.empty()) {
    graph = walk_recomputed_graph(outs, targets, /*all_leaves=*/double_backward);
  }
  if (state.backward_in_full || (!double_backward && graph.reaches_reentrant_checkpoint)) {
    // The recompute gathered leaves of its own (FSDP2's unsharded parameters), or ran
    // torch's reentrant checkpoint, whose backward runs only in a backward without `inputs`
    // (it accumulates the parameters inside it itself): run the recomputed graph's backward
    // in full, so that they accumulate as their owner expects, and return only the inputs'
    // gradients (the listed parameters get theirs from that backward, none from here).
    if (!outs.empty()) {
      recomputed_backward(std::move(outs), /*targets=*/{}, std::move(grads),
                          /*create_graph=*/false);
    }
    for (size_t i = 0; i < n_in; ++i) {
      if (args[i].requires_grad()) result[i] = args[i].grad();
    }
  } else if (!outs.empty() && !targets.empty()) {
    TORCH_CHECK(graph.unlisted_leaf.empty(), name, ": the function uses a tensor that requires "
                "grad but is neither one of its inputs nor one of the parameters given to the "
                "checkpoint (it reaches a leaf of shape ", graph.unlisted_leaf, "); its gradient "
                "would be lost. ", state.segment.how_to_list);
    variable_list g =
        recomputed_backward(std::move(outs), targets, std::move(grads), double_backward);
    for (size_t j = 0; j < g.size(); ++j) result[target_index[j]] = std::move(g[j]);
  }
  // FSDP2's full backward runs the recomputed graph's backward for its side effects (the
  // gathered parameters' gradients): no double backward through that.
  if (create_graph && !double_backward) {
    memlean::mark_once_differentiable(
        result, state_.segment.name + ": double backward (a backward with create_graph) "
        "through a checkpoint whose function called FSDP2 modules is not supported");
  }
  return result;
}

}  // namespace

bool is_recomputing() { return recompute_depth > 0; }

namespace detail {

std::vector<c10::IValue> checkpoint_impl(detail::Segment segment, int64_t n_inputs,
                                         const std::vector<c10::IValue>& inputs_and_params,
                                         const CheckpointOptions& options) {
  const std::string& name = segment.name;
  TORCH_CHECK(static_cast<bool>(segment.function), name, ": function is empty");
  const auto n_args = static_cast<int64_t>(inputs_and_params.size());
  TORCH_CHECK(n_inputs >= 0, name, ": n_inputs must be >= 0, got ", n_inputs);
  TORCH_CHECK(n_inputs <= n_args, name, ": n_inputs is ", n_inputs, " but only ", n_args,
              " argument", n_args == 1 ? " was" : "s were", " given (inputs_and_params holds the ",
              "n_inputs inputs, then the parameters)");
  for (int64_t i = n_inputs; i < n_args; ++i) {
    TORCH_CHECK(is_defined_tensor(inputs_and_params[i]), name, ": parameter ", i - n_inputs,
                " (inputs_and_params[", i, "]) is ", describe(inputs_and_params[i]),
                ", not a tensor; everything after the first n_inputs=", n_inputs,
                " arguments must be a parameter tensor");
  }

  SegmentState state;
  std::vector<at::Tensor> tensors;
  std::unordered_set<const c10::TensorImpl*> params_seen;
  tensors.reserve(inputs_and_params.size());
  state.inputs.reserve(n_inputs);
  state.repeated.reserve(n_args - n_inputs);
  bool any_requires_grad = false;
  for (int64_t i = 0; i < n_args; ++i) {
    const c10::IValue& v = inputs_and_params[i];
    if (i < n_inputs) {
      if (is_defined_tensor(v)) {
        state.input_tensor_slots.push_back(i);
        tensors.push_back(v.toTensor());
        state.inputs.emplace_back();
      } else {
        state.inputs.push_back(v);
      }
    } else {
      state.repeated.push_back(!params_seen.insert(v.toTensor().unsafeGetTensorImpl()).second);
      tensors.push_back(v.toTensor());
    }
    if (is_defined_tensor(v) && v.toTensor().requires_grad()) any_requires_grad = true;
  }

  if (!at::GradMode::is_enabled() || !any_requires_grad) {
    // Nothing to differentiate: an ordinary call.
    std::vector<c10::IValue> inputs(inputs_and_params.begin(), inputs_and_params.begin() + n_inputs);
    std::vector<c10::IValue> outputs = segment.function(inputs);
    tensor_output_slots(outputs, name);
    return outputs;
  }

  state.autocast = AutocastState::capture();
  if (options.preserve_rng_state()) state.rng = detail::RngState::capture(detail::rng_devices(tensors));

  // The forward, without recording a graph. The buffers to rewind are copied first; the
  // copies of those it leaves unchanged are dropped after it.
  std::vector<c10::IValue> outputs;
  {
    std::vector<c10::IValue> inputs = state.inputs;
    const size_t n_in = state.input_tensor_slots.size();
    std::vector<uint32_t> versions(n_in);
    for (size_t i = 0; i < n_in; ++i) {
      inputs[state.input_tensor_slots[i]] = tensors[i];
      versions[i] = tensors[i]._version();
    }
    at::AutoGradMode no_grad(false);
    std::vector<uint32_t> buffer_versions;
    for (const auto& b : segment.rewound) {
      state.rewind.emplace_back(b, b.clone());
      buffer_versions.push_back(b._version());
    }
    outputs = segment.function(inputs);
    for (size_t i = 0; i < n_in; ++i) {
      TORCH_CHECK(tensors[i]._version() == versions[i], name, ": the function modified its "
                  "input ", state.input_tensor_slots[i], " in place; a checkpointed function "
                  "must not modify its inputs (the recompute in backward would see the modified "
                  "values). Clone the input first, or start the segment after the in-place op.");
    }
    // Changed: its version counter moved, or (a change through `.data()`, which moves a
    // version counter of its own) its values differ from the copy.
    size_t kept = 0;
    for (size_t i = 0; i < state.rewind.size(); ++i) {
      const auto& [buffer, copy] = state.rewind[i];
      if (buffer._version() != buffer_versions[i] || !same_values(buffer, copy)) {
        state.rewind[kept++] = std::move(state.rewind[i]);
      }
    }
    state.rewind.resize(kept);
  }
  state.n_outputs = outputs.size();
  state.output_tensor_slots = tensor_output_slots(outputs, name);
  bool any_differentiable = false;
  for (int64_t slot : state.output_tensor_slots) {
    const at::Tensor& out = outputs[slot].toTensor();
    state.differentiable.push_back(torch::autograd::isDifferentiableType(out.scalar_type()));
    any_differentiable = any_differentiable || state.differentiable.back();
    const bool plain = has_plain_sizes(out);
    state.output_sizes.push_back(plain ? out.sizes().vec() : std::vector<int64_t>());
    state.output_dtypes.push_back(plain ? out.scalar_type() : at::ScalarType::Undefined);
  }
  // No output to differentiate (no tensor, as torch's checkpoint allows, or integer ones
  // only): nothing to recompute, the outputs are the function's.
  if (!any_differentiable) return outputs;
  state.backward_in_full = segment.backward_in_full && segment.backward_in_full();
  segment.backward_in_full = nullptr;  // asked once (it may hold what the function holds)
  state.segment = std::move(segment);

  // The outputs hang from the node. Each differentiable one is returned as a new tensor
  // sharing the function's output's storage and version counter: the tensor the function
  // made (or an input or parameter it returned as it is) keeps its own autograd state.
  auto node = torch_compat::make_node<CheckpointBackward>(std::move(state), tensors);
  const SegmentState& kept = node->state();
  for (size_t k = 0; k < kept.output_tensor_slots.size(); ++k) {
    if (!kept.differentiable[k]) continue;
    c10::IValue& v = outputs[kept.output_tensor_slots[k]];
    at::Tensor out = v.toTensor().detach();
    torch::autograd::create_gradient_edge(out, node);
    v = std::move(out);
  }
  return outputs;
}

}  // namespace detail

std::vector<c10::IValue> checkpoint(const IValueFunction& function, int64_t n_inputs,
                                    const std::vector<c10::IValue>& inputs_and_params,
                                    const CheckpointOptions& options) {
  return detail::checkpoint_impl({function}, n_inputs, inputs_and_params, options);
}

namespace {

IValueFunction to_ivalue_function(const TensorFunction& function) {
  TORCH_CHECK(static_cast<bool>(function), detail::kCheckpointName, ": function is empty");
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
      detail::checkpoint_impl({to_ivalue_function(function)}, n_inputs, args, options));
}

std::vector<at::Tensor> checkpoint(const torch::nn::Module& module, const TensorFunction& function,
                                   const std::vector<at::Tensor>& inputs,
                                   const CheckpointOptions& options) {
  std::vector<c10::IValue> args(inputs.begin(), inputs.end());
  for (const auto& p : module.parameters()) args.emplace_back(p);
  detail::Segment segment{to_ivalue_function(function)};
  // Each buffer once: a buffer two layers share is copied once.
  segment.buffers = unique_tensors(module.buffers());
  segment.rewound = detail::rewound_buffers(module, segment.buffers);
  return to_tensors(detail::checkpoint_impl(std::move(segment), static_cast<int64_t>(inputs.size()),
                                            args, options));
}

std::vector<at::Tensor> rewound_buffers(const torch::nn::Module& module) {
  return detail::rewound_buffers(module, unique_tensors(module.buffers()));
}

std::vector<bool> unversioned_changes(const std::vector<at::Tensor>& buffers,
                                      const std::function<void()>& run) {
  std::vector<at::Tensor> copies;
  std::vector<int64_t> versions;
  for (const auto& b : buffers) {
    copies.push_back(b.defined() ? b.detach().clone() : at::Tensor());
    versions.push_back(b.defined() ? b._version() : 0);
  }
  run();
  std::vector<bool> changed(buffers.size(), false);
  for (size_t i = 0; i < buffers.size(); ++i) {
    const at::Tensor& b = buffers[i];
    if (!b.defined() || b._version() != versions[i]) continue;  // seen by a checkpoint
    changed[i] = !detail::same_values(b, copies[i]);
  }
  return changed;
}

namespace detail {

bool same_values(const at::Tensor& now_in, const at::Tensor& then_in) {
  at::Tensor now = now_in.detach(), then = then_in.detach();
  if (now.sizes() != then.sizes() || now.scalar_type() != then.scalar_type() ||
      now.layout() != then.layout() || now.device() != then.device()) {
    return false;
  }
  if (now.layout() != at::kStrided) {
    now = now.to_dense();
    then = then.to_dense();
  }
  // at::equal first: on the CPU it allocates nothing (checkpoint forwards call this, inside
  // the bytes memlean::fit predicts); only where it says "differ" can a NaN be the reason.
  if (at::equal(now, then)) return true;
  return (now.is_floating_point() || now.is_complex()) &&
         at::where(now.isnan(), then.isnan(), now == then).all().item<bool>();
}

std::vector<at::Tensor> rewound_buffers(const torch::nn::Module& module,
                                        const std::vector<at::Tensor>& buffers) {
  std::unordered_set<const c10::TensorImpl*> statistics;
  for (const auto& m : module.modules()) {
    const torch::nn::Module* p = m.get();
    if (dynamic_cast<const torch::nn::BatchNorm1dImpl*>(p) != nullptr ||
        dynamic_cast<const torch::nn::BatchNorm2dImpl*>(p) != nullptr ||
        dynamic_cast<const torch::nn::BatchNorm3dImpl*>(p) != nullptr ||
        dynamic_cast<const torch::nn::InstanceNorm1dImpl*>(p) != nullptr ||
        dynamic_cast<const torch::nn::InstanceNorm2dImpl*>(p) != nullptr ||
        dynamic_cast<const torch::nn::InstanceNorm3dImpl*>(p) != nullptr ||
        dynamic_cast<const NormStatisticsHolder*>(p) != nullptr) {
      for (const auto& b : m->buffers(/*recurse=*/false)) statistics.insert(b.unsafeGetTensorImpl());
    }
  }
  std::vector<at::Tensor> rewound;
  for (const auto& b : buffers) {
    // (An inference tensor cannot change outside InferenceMode, and has no version counter.)
    if (b.defined() && !b.is_inference() && statistics.count(b.unsafeGetTensorImpl()) == 0) {
      rewound.push_back(b);
    }
  }
  return rewound;
}

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
  for (const auto& d : devices) {
    if (d.is_cpu()) {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      auto* cpu = at::check_generator<at::CPUGeneratorImpl>(gen);
      s.cpu_engine = cpu->engine();
      s.cpu_next_float_normal = cpu->next_float_normal_sample();
      s.cpu_next_double_normal = cpu->next_double_normal_sample();
      s.states.emplace_back();
    } else {
      s.states.push_back(get_generator_state(default_generator(d)));
    }
  }
  return s;
}

void RngState::restore() const {
  for (size_t i = 0; i < devices.size(); ++i) {
    if (devices[i].is_cpu()) {
      at::Generator gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      auto* cpu = at::check_generator<at::CPUGeneratorImpl>(gen);
      cpu->set_engine(cpu_engine);
      cpu->set_next_float_normal_sample(cpu_next_float_normal);
      cpu->set_next_double_normal_sample(cpu_next_double_normal);
    } else {
      set_generator_state(default_generator(devices[i]), states[i]);
    }
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
