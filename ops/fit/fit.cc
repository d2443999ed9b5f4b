// memlean::fit for a torch::nn::Sequential: measure, plan, check, restore.
#include "ops/fit/fit.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/lbfgs.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <type_traits>
#include <typeinfo>
#include <unordered_set>
#include <variant>

#include "ops/checkpoint/checkpoint.h"
#include "ops/checkpoint/lean_batchnorm.h"
#include "ops/checkpoint/lean_conv.h"
#include "ops/checkpoint/sliced_mlp.h"
#include "ops/fit/budget.h"
#include "ops/fit/fit_testing.h"
#include "ops/fit/planner.h"
#include "ops/fit/search.h"
#include "ops/swish/module.h"
#include "runtime/memstats/memstats.h"
#include "runtime/memstats/nn.h"
#include "runtime/memstats/report.h"
#include "third_party/torch/devices.h"
#include "third_party/torch/grads.h"
#include "third_party/torch/tensors.h"

namespace memlean::fit {

namespace {

// A checkpointed run inside another (a compound's nested checkpoint): its layers through
// memlean::checkpoint, as a layer of the outer run's Sequential.
class NestedRunImpl : public torch::nn::Module {
 public:
  explicit NestedRunImpl(torch::nn::Sequential run) : run_(register_module("run", run)) {}
  at::Tensor forward(const at::Tensor& x) { return memlean::checkpoint(run_, x); }

 private:
  torch::nn::Sequential run_;
};
TORCH_MODULE(NestedRun);

// How many of the runs before it each of `runs` (by begin, a run before the runs inside it)
// lies inside; -1 for one neither after nor inside the run before it (overlapping it, out of
// order, or the same run again).
std::vector<int> nesting_depths(const std::vector<std::pair<int64_t, int64_t>>& runs) {
  std::vector<int> depths;
  std::vector<std::pair<int64_t, int64_t>> around;  // the runs the next one may lie inside
  for (const auto& run : runs) {
    while (!around.empty() && around.back().second <= run.first) around.pop_back();
    const bool inside = around.empty() || (around.back().first <= run.first &&
                                           run.second <= around.back().second &&
                                           around.back() != run);
    depths.push_back(inside ? static_cast<int>(around.size()) : -1);
    around.push_back(run);
  }
  return depths;
}

}  // namespace

struct FitPlanAccess {
  // The plan's runs: one Sequential per outermost run of plan.checkpointed (sorted by begin, an
  // outer run before the runs inside it), each run inside it a NestedRun of its own layers.
  static void set_runner(FitPlan& plan, torch::nn::Sequential model) {
    plan.model_ = model;
    plan.runs_.clear();
    plan.outermost_.clear();
    size_t k = 0;
    while (k < plan.checkpointed.size()) {
      plan.outermost_.push_back(k);
      plan.runs_.push_back(layers(model, plan.checkpointed, k));
    }
  }

 private:
  // The layers of run k (shared: the model's own), the runs inside it nested; k moves past them.
  static torch::nn::Sequential layers(const torch::nn::Sequential& model,
                                      const std::vector<std::pair<int64_t, int64_t>>& runs,
                                      size_t& k) {
    const auto [b, e] = runs[k++];
    torch::nn::Sequential run;
    for (int64_t i = b; i < e;) {
      if (k < runs.size() && runs[k].first == i && runs[k].second <= e) {
        i = runs[k].second;
        run->push_back(NestedRun(layers(model, runs, k)));
      } else {
        run->push_back(model->begin()[i++]);
      }
    }
    return run;
  }
};

namespace {

using Clock = std::chrono::steady_clock;
using Runner = std::function<at::Tensor(const at::Tensor&)>;

// Of the buffers a checkpoint of `model`'s layers would rewind (rewound_buffers, checkpoint.h),
// those that `run` changes without moving their version counter (unversioned_changes,
// checkpoint.h). A checkpoint sees such a change by value (rewound_buffers), but fit's byte
// model counts no copy a checkpoint keeps of a buffer, and a layer that changes its buffers
// behind autograd's back is one fit leaves alone: it checkpoints no run holding one.
std::unordered_set<const c10::TensorImpl*> unversioned_changes(const torch::nn::Module& model,
                                                                const std::function<void()>& run) {
  const std::vector<at::Tensor> buffers = rewound_buffers(model);
  const std::vector<bool> changed = memlean::unversioned_changes(buffers, run);
  std::unordered_set<const c10::TensorImpl*> found;
  for (size_t i = 0; i < buffers.size(); ++i) {
    if (changed[i]) found.insert(buffers[i].unsafeGetTensorImpl());
  }
  return found;
}

int64_t storage_bytes(const at::Tensor& t) {
  if (!t.defined()) return 0;
  if (t.has_storage()) return static_cast<int64_t>(t.storage().nbytes());
  return static_cast<int64_t>(t.nbytes());
}

// The default generators of the CPU and of `device`, saved and put back.
class RngSnapshot {
 public:
  explicit RngSnapshot(c10::Device device) {
    generators_.push_back(at::detail::getDefaultCPUGenerator());
    if (!device.is_cpu()) generators_.push_back(at::globalContext().defaultGenerator(device));
    for (auto& g : generators_) {
      std::lock_guard<std::mutex> lock(g.mutex());
      states_.push_back(g.get_state());
    }
  }
  void restore() {
    for (size_t i = 0; i < generators_.size(); ++i) {
      std::lock_guard<std::mutex> lock(generators_[i].mutex());
      generators_[i].set_state(states_[i]);
    }
  }

 private:
  std::vector<at::Generator> generators_;
  std::vector<at::Tensor> states_;
};

// Everything a measured step changes, saved on construction and put back by restore() (also
// on destruction, so an exception leaves the model as it was). The values are copied to the
// CPU, so that on CUDA fit needs no device memory beyond its steps': the parameters' and
// buffers', and the optimizer's state where its type has fixed fields
// (memstats::optimizer_state_fields: Adam, AdamW, SGD, RMSprop, Adagrad), whose tensors the
// steps then update in place and restore() puts back into them (the state objects and their
// tensors stay the caller's, their step counts as they were; a state the steps made for a
// parameter that had none is dropped). A state of another type (one of the caller's own) is
// moved out instead (the optimizer starts from no state and the warm-up step makes one
// of the same sizes: on the device, twice its bytes while fit runs) and moved back, untouched.
class Snapshot {
 public:
  Snapshot(std::vector<at::Tensor> params, std::vector<at::Tensor> buffers,
           std::vector<at::Tensor> grad_holders, torch::optim::Optimizer* optimizer,
           c10::Device device)
      : params_(std::move(params)),
        buffers_(std::move(buffers)),
        grad_holders_(std::move(grad_holders)),
        optimizer_(optimizer),
        rng_(device) {
    at::NoGradGuard no_grad;
    for (const auto& p : params_) param_values_.push_back(on_cpu(p));
    for (const auto& b : buffers_) buffer_values_.push_back(on_cpu(b));
    for (const auto& t : grad_holders_) grads_.push_back(t.grad());
    if (optimizer_ == nullptr) return;
    auto& state = optimizer_->state();
    const bool fixed_fields = std::all_of(state.begin(), state.end(), [](const auto& entry) {
      return entry.second == nullptr ||
             memstats::optimizer_state_fields(*entry.second).has_value();
    });
    if (!fixed_fields) {
      moved_state_.swap(state);
      return;
    }
    for (const auto& [key, object] : state) {
      if (object == nullptr) continue;
      SavedState saved;
      saved.original = object->clone();  // (shallow: the same tensors, the counts as they are)
      const auto fields = memstats::optimizer_state_fields(*saved.original);
      for (const at::Tensor* t : fields->tensors) {
        saved.values.push_back(t->defined() ? on_cpu(*t) : at::Tensor());
      }
      saved_state_.emplace(key, std::move(saved));
    }
  }
  ~Snapshot() {
    try {
      restore();
    } catch (...) {  // NOLINT(bugprone-empty-catch): nothing better to do in a destructor
    }
  }
  Snapshot(const Snapshot&) = delete;
  Snapshot& operator=(const Snapshot&) = delete;

  void restore() {
    if (restored_) return;
    restored_ = true;
    {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < params_.size(); ++i) params_[i].copy_(param_values_[i]);
      for (size_t i = 0; i < buffers_.size(); ++i) {
        buffers_[i].variable_data().copy_(buffer_values_[i]);
      }
    }
    for (size_t i = 0; i < grad_holders_.size(); ++i) {
      grad_holders_[i].mutable_grad() = grads_[i];
    }
    if (optimizer_ != nullptr) restore_optimizer();
    rng_.restore();
  }

 private:
  // A state as it was: a shallow copy (its tensors, the ones the caller's state holds; its
  // counts) and its tensors' values on the CPU (undefined where the tensor is).
  struct SavedState {
    std::unique_ptr<torch::optim::OptimizerParamState> original;
    std::vector<at::Tensor> values;
  };

  static at::Tensor on_cpu(const at::Tensor& t) {
    return t.detach().to(t.options().device(c10::kCPU), /*non_blocking=*/false, /*copy=*/true);
  }

  void restore_optimizer() {
    auto& state = optimizer_->state();
    if (!moved_state_.empty() || saved_state_.empty()) {
      state.swap(moved_state_);  // (with no state saved: the empty one, the warm-up's dropped)
      moved_state_.clear();
      return;
    }
    std::vector<void*> made;  // states the steps made
    for (const auto& entry : state) {
      if (saved_state_.count(entry.first) == 0) made.push_back(entry.first);
    }
    for (void* key : made) state.erase(key);
    at::NoGradGuard no_grad;
    for (auto& [key, saved] : saved_state_) {
      const auto from = memstats::optimizer_state_fields(*saved.original);
      for (size_t i = 0; i < from->tensors.size(); ++i) {
        if (saved.values[i].defined()) from->tensors[i]->copy_(saved.values[i]);
      }
      auto live = state.find(key);
      const bool same_type = live != state.end() && live->second != nullptr &&
                             typeid(*live->second) == typeid(*saved.original);
      if (!same_type) {
        state[key] = std::move(saved.original);
        continue;
      }
      // The live object (the caller's) gets its tensors and counts back.
      const auto to = memstats::optimizer_state_fields(*live->second);
      for (size_t i = 0; i < to->tensors.size(); ++i) *to->tensors[i] = *from->tensors[i];
      for (size_t i = 0; i < to->counts.size(); ++i) *to->counts[i] = *from->counts[i];
    }
    saved_state_.clear();
  }

  std::vector<at::Tensor> params_, buffers_, grad_holders_;
  std::vector<at::Tensor> param_values_, buffer_values_, grads_;
  torch::optim::Optimizer* optimizer_;
  ska::flat_hash_map<void*, std::unique_ptr<torch::optim::OptimizerParamState>> moved_state_;
  ska::flat_hash_map<void*, SavedState> saved_state_;
  RngSnapshot rng_;
  bool restored_ = false;
};

// Autocast's cache of lower-precision weight copies emptied while alive and when it ends: with
// autocast on, the copies stay cached until clear_cache(), which a loop calls once per step, so
// each measured step (and the layer walk) makes them afresh and leaves none behind.
struct FreshAutocastCache {
  FreshAutocastCache() { at::autocast::clear_cache(); }
  ~FreshAutocastCache() { at::autocast::clear_cache(); }
  FreshAutocastCache(const FreshAutocastCache&) = delete;
  FreshAutocastCache& operator=(const FreshAutocastCache&) = delete;
};

// What a measured step needs.
struct Step {
  torch::nn::Sequential model{nullptr};
  at::Tensor input;
  std::function<at::Tensor(const at::Tensor&)> loss_fn;
  torch::optim::Optimizer* optimizer = nullptr;
  c10::Device device = c10::kCPU;
  std::vector<at::Tensor> params, buffers, grad_holders;
  // Bytes of the optimizer's state when its type is not one memstats knows (measured around
  // the warm-up step); -1: count its tensors.
  int64_t unknown_state_bytes = -1;

  // The loop keeps the parameters' gradients between steps (FitOptions::keep_grads).
  bool keep_grads = false;

  // Before and after each measured step: no gradient, or with keep_grads the parameters'
  // gradients zeroed (made where missing), as the loop's zero_grad leaves them.
  void clear_grads() const {
    at::NoGradGuard no_grad;
    for (const auto& t : grad_holders) {
      if (keep_grads && t.requires_grad() && !t.is_same(input)) {
        if (t.grad().defined()) {
          t.grad().zero_();
        } else {
          t.mutable_grad() = at::zeros_like(t);
        }
      } else if (t.grad().defined()) {
        t.mutable_grad().reset();
      }
    }
  }

  std::vector<at::Tensor> state_tensors() const {
    if (optimizer == nullptr || unknown_state_bytes >= 0) return {};
    return memstats::optimizer_state_tensors(*optimizer);
  }

  // The unique storages on the device of the parameters, buffers, optimizer state and input,
  // as memstats counts them (on CUDA, the allocator's blocks).
  int64_t fixed_bytes() const {
    std::vector<at::Tensor> resident = params;
    if (keep_grads) {
      for (const auto& p : params) resident.push_back(p.grad());
    }
    resident.insert(resident.end(), buffers.begin(), buffers.end());
    for (const auto& s : state_tensors()) resident.push_back(s);
    resident.push_back(input);
    return memstats::allocated_bytes_of(resident, device) +
           std::max<int64_t>(unknown_state_bytes, 0);
  }

  at::Tensor loss_of(const at::Tensor& output) const {
    at::Tensor loss = loss_fn ? loss_fn(output) : output.sum();
    if (!loss.defined() || loss.numel() != 1 || !loss.is_floating_point()) {
      std::ostringstream s;
      s << "memlean::fit: loss_fn must return a scalar floating tensor, got ";
      if (!loss.defined()) {
        s << "an undefined tensor";
      } else {
        s << "a " << loss.scalar_type() << " tensor of shape " << loss.sizes();
      }
      throw std::invalid_argument(s.str());
    }
    if (!loss.requires_grad()) {
      throw std::invalid_argument(
          "memlean::fit: loss_fn returned a loss that does not require grad (is grad mode off, "
          "or does the loss not depend on the model's output?)");
    }
    return loss;
  }

  // What backward holds at each layer (the step's bytes, as measure() counts them; -1 for a
  // layer whose output needs no gradient).
  struct BackwardLevels {
    std::vector<int64_t> highest;  // the most while backward runs the layer (from the gradient
                                   // of its output to that of its input)
    std::vector<int64_t> entry;    // when backward reaches it (its output's gradient made)
    // The most in the forward and the loss, and then in backward until it reaches the last
    // layer whose output needs a gradient (the loss's backward): what no layer's level holds.
    int64_t before_layers = 0;
    int64_t optimizer = 0;  // the most in the optimizer's step (gradients alive), or 0
  };

  // One step's forward and backward, layer by layer, with a hook on each layer's output.
  BackwardLevels backward_levels() const {
    at::AutoGradMode grad_mode(true);
    clear_grads();
    synchronize(device);
    const auto seq = model.ptr();
    const auto n = static_cast<int64_t>(seq->size());
    BackwardLevels levels{std::vector<int64_t>(n, -1), std::vector<int64_t>(n, -1)};
    const int64_t fixed = fixed_bytes();
    const FreshAutocastCache fresh;
    memstats::Tracker tracker(device);  // its peak restarts at each layer's backward
    const int64_t start = tracker.current();
    int64_t running = -1;               // the layer whose backward runs now
    bool reached = false;  // a layer's backward
    auto next_layer = [&](int64_t layer) {
      if (running >= 0) {
        levels.highest[running] =
            std::max(levels.highest[running], fixed + tracker.peak() - start);
      } else if (!reached) {
        levels.before_layers = fixed + tracker.peak() - start;  // (the forward's peak included)
        reached = true;
      }
      if (layer >= 0 && levels.entry[layer] < 0) {
        levels.entry[layer] = fixed + tracker.current() - start;
      }
      tracker.reset_peak();
      running = layer;
    };
    {
      at::Tensor h = input;
      for (int64_t i = 0; i < n; ++i) {
        h = seq->begin()[i].forward(h);
        if (h.requires_grad()) h.register_hook([&next_layer, i](const at::TensorBase&) { next_layer(i); });
      }
      at::Tensor loss = loss_of(h);
      loss.backward();  // (the output alive through it, as in measure())
    }
    synchronize(device);
    next_layer(-1);
    if (optimizer != nullptr) {  // (as measure() steps it: fit() puts the parameters back)
      tracker.reset_peak();
      optimizer->step();
      synchronize(device);
      levels.optimizer = fixed + tracker.peak() - start;
    }
    clear_grads();
    return levels;
  }

  // One training step through `run`, its peak as fit() counts it.
  int64_t measure(const Runner& run) const {
    at::AutoGradMode grad_mode(true);
    clear_grads();
    synchronize(device);
    const FreshAutocastCache fresh;
    const int64_t fixed = fixed_bytes();
    memstats::Tracker tracker(device);
    const int64_t start = tracker.current();
    {
      at::Tensor output = run(input);
      at::Tensor loss = loss_of(output);
      loss.backward();
    }
    if (optimizer != nullptr) optimizer->step();
    clear_grads();
    synchronize(device);
    tracker.stop();
    return fixed + (tracker.peak() - start);
  }
};

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

std::string path_of(int64_t b, int64_t e, const std::vector<std::string>& names) {
  std::string path = e - b == 1 ? "layer " + std::to_string(b)
                                : "layers " + std::to_string(b) + "-" + std::to_string(e - 1);
  bool named = false;
  for (int64_t i = b; i < e; ++i) named = named || !all_digits(names[i]);
  if (named) {
    path += " (" + names[b];
    if (e - b > 1) path += e - b == 2 ? ", " + names[e - 1] : " .. " + names[e - 1];
    path += ")";
  }
  return path;
}

// The parameters and buffers of `from` registered in `to` under the same names (the same
// tensors: state_dict keys and values are the layer's own).
void share_tensors(torch::nn::Module& to, const torch::nn::Module& from) {
  for (const auto& item : from.named_parameters(/*recurse=*/false)) {
    to.register_parameter(item.key(), item.value(), item.value().defined() && item.value().requires_grad());
  }
  for (const auto& item : from.named_buffers(/*recurse=*/false)) {
    to.register_buffer(item.key(), item.value());
  }
}

// Absent where undefined (an affine=false BatchNorm's weight, a Conv2d without bias).
std::optional<at::Tensor> if_defined(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// A layer with a lean backward in its place: it holds the layer's tensors under the same names
// and follows its training mode, either way round.
template <typename Layer>
class LeanLayer : public torch::nn::Module {
 public:
  LeanLayer(std::shared_ptr<Layer> layer, const std::string& name)
      : torch::nn::Module(name), layer_(std::move(layer)) {
    share_tensors(*this, *layer_);
  }

  void train(bool on) override {
    torch::nn::Module::train(on);
    layer_->train(on);
  }

  void pretty_print(std::ostream& stream) const override {
    stream << name() << "(";
    layer_->pretty_print(stream);
    stream << ")";
  }

 protected:
  std::shared_ptr<Layer> layer_;
};

// A torch::nn::BatchNorm{1,2,3}d with memlean::lean_batch_norm's backward in training where it
// applies (else, and in eval mode, the layer's own forward).
// (Its running statistics are a BatchNorm's: a checkpointed run holding it does not copy them
// for the recompute, NormStatisticsHolder.)
template <typename BatchNorm>
class LeanBatchNormImpl : public LeanLayer<BatchNorm>, public NormStatisticsHolder {
 public:
  explicit LeanBatchNormImpl(std::shared_ptr<BatchNorm> bn)
      : LeanLayer<BatchNorm>(std::move(bn), "memlean::fit::LeanBatchNorm") {}

  // Whether forward runs the lean backward for x (training mode, its dimensions the layer's).
  bool applies(const at::Tensor& x) const {
    const int64_t d = x.dim();
    const bool dims = std::is_same_v<BatchNorm, torch::nn::BatchNorm1dImpl> ? d == 2 || d == 3
                      : std::is_same_v<BatchNorm, torch::nn::BatchNorm2dImpl> ? d == 4
                                                                               : d == 5;
    return this->layer_->is_training() && dims && lean_batch_norm_applies(x);
  }

  at::Tensor forward(const at::Tensor& x) {
    const auto& bn = this->layer_;
    if (!applies(x)) return bn->forward(x);
    const auto& o = bn->options;
    double factor = o.momentum().value_or(0.0);  // as torch::nn::BatchNorm's forward
    if (o.track_running_stats() && bn->num_batches_tracked.defined()) {
      bn->num_batches_tracked += 1;
      if (!o.momentum().has_value()) factor = 1.0 / bn->num_batches_tracked.template item<double>();
    }
    return lean_batch_norm(x, if_defined(bn->weight), if_defined(bn->bias),
                           if_defined(bn->running_mean), if_defined(bn->running_var), factor,
                           o.eps());
  }
};

// A depthwise torch::nn::Conv2d (groups == in == out channels, zero padding given as numbers)
// with memlean::lean_conv2d's backward where it applies (else the layer's own forward).
class LeanConv2dImpl : public LeanLayer<torch::nn::Conv2dImpl> {
 public:
  explicit LeanConv2dImpl(std::shared_ptr<torch::nn::Conv2dImpl> conv)
      : LeanLayer(std::move(conv), "memlean::fit::LeanConv2d") {}

  bool applies(const at::Tensor& x) const {
    const auto& o = layer_->options;
    return o.groups() == o.in_channels() && o.groups() == o.out_channels() &&
           std::holds_alternative<torch::enumtype::kZeros>(o.padding_mode()) &&
           std::holds_alternative<torch::ExpandingArray<2>>(o.padding()) &&
           lean_conv2d_applies(x, layer_->weight, o.groups());
  }

  at::Tensor forward(const at::Tensor& x) {
    if (!applies(x)) return layer_->forward(x);
    const auto& o = layer_->options;
    const auto& padding = std::get<torch::ExpandingArray<2>>(o.padding());
    return lean_conv2d(x, layer_->weight, if_defined(layer_->bias), *o.stride(), *padding,
                       *o.dilation(), o.groups());
  }
};

// The lean layer fit gives `layer` for its input x on the CPU ("lean batchnorm", "lean
// depthwise conv"), or none.
std::optional<std::pair<torch::nn::AnyModule, std::string>> lean_layer(
    const torch::nn::AnyModule& layer, const at::Tensor& x) {
  const auto module = layer.ptr();
  auto lean_bn = [&](auto bn) -> std::optional<std::pair<torch::nn::AnyModule, std::string>> {
    using BatchNorm = typename decltype(bn)::element_type;
    auto lean = std::make_shared<LeanBatchNormImpl<BatchNorm>>(bn);
    if (!lean->applies(x)) return std::nullopt;
    return std::make_pair(torch::nn::AnyModule(lean), std::string("lean batchnorm"));
  };
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(module)) return lean_bn(bn);
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(module)) return lean_bn(bn);
  if (auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm3dImpl>(module)) return lean_bn(bn);
  if (auto conv = std::dynamic_pointer_cast<torch::nn::Conv2dImpl>(module)) {
    auto lean = std::make_shared<LeanConv2dImpl>(conv);
    if (!lean->applies(x)) return std::nullopt;
    return std::make_pair(torch::nn::AnyModule(lean), std::string("lean depthwise conv"));
  }
  return std::nullopt;
}

// ---- MLPs sliced (step 2 of fit): Linear, elementwise activations, Linear -----------------

constexpr int64_t kSliceMinBytes = int64_t{1} << 20;  // the least hidden tensor sliced

// Whether `layer` passes its input on unchanged in training: torch::nn::Identity, or a
// torch::nn::Dropout with p == 0.
bool passes_input_on(const torch::nn::AnyModule& layer) {
  const auto module = layer.ptr();
  if (std::dynamic_pointer_cast<torch::nn::IdentityImpl>(module)) return true;
  const auto dropout = std::dynamic_pointer_cast<torch::nn::DropoutImpl>(module);
  return dropout && dropout->options.p() == 0;
}

// For an elementwise activation layer (its output at each element depends on its input there
// alone): whether it writes its input (an inplace option, memlean's in-place Swish). Else none.
std::optional<bool> elementwise_writes(const torch::nn::AnyModule& layer) {
  const auto m = layer.ptr();
  using namespace torch::nn;  // NOLINT(build/namespaces): the activation layers' names
  if (std::dynamic_pointer_cast<SiLUImpl>(m) || std::dynamic_pointer_cast<GELUImpl>(m) ||
      std::dynamic_pointer_cast<TanhImpl>(m) || std::dynamic_pointer_cast<SigmoidImpl>(m) ||
      std::dynamic_pointer_cast<MishImpl>(m)) {
    return false;
  }
  if (const auto s = std::dynamic_pointer_cast<memlean::SwishImpl>(m)) {
    return s->options.variant() == SwishVariant::kInplace;
  }
  if (const auto r = std::dynamic_pointer_cast<ReLUImpl>(m)) return r->options.inplace();
  if (const auto r = std::dynamic_pointer_cast<ReLU6Impl>(m)) return r->options.inplace();
  if (const auto r = std::dynamic_pointer_cast<LeakyReLUImpl>(m)) return r->options.inplace();
  if (const auto r = std::dynamic_pointer_cast<ELUImpl>(m)) return r->options.inplace();
  if (const auto r = std::dynamic_pointer_cast<SELUImpl>(m)) return r->options.inplace();
  if (const auto r = std::dynamic_pointer_cast<CELUImpl>(m)) return r->options.inplace();
  if (const auto r = std::dynamic_pointer_cast<HardtanhImpl>(m)) return r->options.inplace();
  return std::nullopt;
}

// fc1 of a sliced MLP in the plan's Sequential: it computes fc2(acts(fc1(x))) with
// memlean::sliced_mlp in training where that applies (else the three in turn), holding fc1's
// tensors under their names; the layers after it (SlicedMlpPartImpl) pass its output on.
class SlicedMlpHeadImpl : public LeanLayer<torch::nn::LinearImpl> {
 public:
  SlicedMlpHeadImpl(std::shared_ptr<torch::nn::LinearImpl> fc1,
                    std::vector<torch::nn::AnyModule> acts,
                    std::shared_ptr<torch::nn::LinearImpl> fc2, bool act_writes_input)
      : LeanLayer(std::move(fc1), "memlean::fit::SlicedMlp"),
        acts_(std::move(acts)),
        fc2_(std::move(fc2)),
        act_writes_input_(act_writes_input) {}

  at::Tensor forward(const at::Tensor& x) {
    // (fc1's training mode: a model()->eval() or the model's own eval() both reach it)
    if (!layer_->is_training() || !sliced_mlp_applies(x) ||
        x.size(-1) != layer_->options.in_features()) {
      at::Tensor h = layer_->forward(x);
      for (auto& act : acts_) h = act.forward(h);
      return fc2_->forward(h);
    }
    SlicedMlpOptions options;
    options.act_writes_input = act_writes_input_;
    return sliced_mlp(
        x, layer_->weight, if_defined(layer_->bias),
        [acts = acts_](const at::Tensor& h) mutable {
          at::Tensor a = h;
          for (auto& act : acts) a = act.forward(a);
          return a;
        },
        fc2_->weight, if_defined(fc2_->bias), options);
  }

 private:
  std::vector<torch::nn::AnyModule> acts_;
  std::shared_ptr<torch::nn::LinearImpl> fc2_;
  bool act_writes_input_;
};

// A layer of a sliced MLP after its first (SlicedMlpHeadImpl computed it): passes its input
// on, holding the layer's tensors under their names and following its training mode.
class SlicedMlpPartImpl : public LeanLayer<torch::nn::Module> {
 public:
  explicit SlicedMlpPartImpl(std::shared_ptr<torch::nn::Module> layer)
      : LeanLayer(std::move(layer), "memlean::fit::SlicedMlpPart") {}
  at::Tensor forward(const at::Tensor& x) { return x; }
};

// What one attempt of fit's search found (fit(), below).
struct Attempt {
  std::optional<FitPlan> plan;  // the fastest plan measured to fit, if any
  int64_t least_measured = 0;   // else: the least peak measured, the planner's least
  int64_t least_predicted = 0;  // predicted, its checkpoints
  size_t least_checkpoints = 0;
  size_t swaps = 0, sliced = 0;  // layers swapped, MLPs sliced
  // Per layer (the walk's): what it keeps for backward, its output's bytes, its forward time.
  std::vector<int64_t> saved, output_bytes;
  std::vector<double> seconds;
};

// The model with its MLPs sliced (step 2 of fit), their [fc1, fc2 + 1) runs and actions.
struct SlicedMlps {
  torch::nn::Sequential model{nullptr};
  std::vector<std::pair<int64_t, int64_t>> runs;
  std::vector<FitAction> actions;
};

// Each run of layers fc1 (torch::nn::Linear), elementwise activations (or layers that pass
// their input on), fc2 (torch::nn::Linear taking fc1's features) where fc1 at least doubles its
// input's features and its output (`walked`: the first attempt's walk) is 1 MiB or more,
// sliced: SlicedMlpHeadImpl in fc1's place, SlicedMlpPartImpl in the others'. An action per
// run: what its layers but fc2 kept for backward (predicted: the sliced MLP keeps its input,
// which fc1 kept too), and fc1's and the activations' forward time (what backward recomputes).
SlicedMlps slice_mlps(const torch::nn::Sequential& model, const std::vector<std::string>& names,
                      const Attempt& walked) {
  SlicedMlps out;
  const std::vector<torch::nn::AnyModule> layers(model->begin(), model->end());
  const auto n = static_cast<int64_t>(layers.size());
  if (static_cast<int64_t>(walked.output_bytes.size()) != n ||
      static_cast<int64_t>(walked.saved.size()) != n) {
    return out;
  }
  std::vector<torch::nn::AnyModule> replaced = layers;
  const auto linear = [&](int64_t i) {
    return std::dynamic_pointer_cast<torch::nn::LinearImpl>(layers[i].ptr());
  };
  for (int64_t i = 0; i < n; ++i) {
    const auto fc1 = linear(i);
    if (!fc1 || fc1->options.out_features() < 2 * fc1->options.in_features() ||
        walked.output_bytes[i] < kSliceMinBytes) {
      continue;
    }
    std::vector<torch::nn::AnyModule> acts;
    bool writes = false;
    int64_t k = i + 1;
    for (; k < n && !linear(k); ++k) {
      if (passes_input_on(layers[k])) continue;
      const auto w = elementwise_writes(layers[k]);
      if (!w) break;
      acts.push_back(layers[k]);
      writes = writes || *w;
    }
    const auto fc2 = k < n ? linear(k) : nullptr;
    if (!fc2 || fc2->options.in_features() != fc1->options.out_features()) continue;
    replaced[i] = torch::nn::AnyModule(std::make_shared<SlicedMlpHeadImpl>(fc1, acts, fc2, writes));
    for (int64_t j = i + 1; j <= k; ++j) {
      replaced[j] = torch::nn::AnyModule(std::make_shared<SlicedMlpPartImpl>(layers[j].ptr()));
    }
    int64_t saved = 0;
    double seconds = 0;
    for (int64_t j = i; j < k; ++j) {
      saved += walked.saved[j];
      seconds += walked.seconds[j];
    }
    out.runs.emplace_back(i, k + 1);
    out.actions.push_back({path_of(i, k + 1, names), "sliced mlp", saved, seconds});
    i = k;
  }
  if (!out.runs.empty()) {
    out.model = torch::nn::Sequential();
    for (int64_t i = 0; i < n; ++i) out.model->push_back(names[i], replaced[i]);
  }
  return out;
}

// beta of a layer fit may swap for memlean's in-place or memory-efficient Swish:
// torch::nn::SiLU (beta 1) and memlean::Swish of another variant than in-place.
std::optional<double> swish_beta(const torch::nn::AnyModule& layer) {
  const auto module = layer.ptr();
  if (std::dynamic_pointer_cast<torch::nn::SiLUImpl>(module)) return 1.0;
  if (const auto s = std::dynamic_pointer_cast<memlean::SwishImpl>(module)) {
    if (s->options.variant() != SwishVariant::kInplace) return s->options.beta();
  }
  return std::nullopt;
}

bool is_naive_swish(const torch::nn::AnyModule& layer) {
  const auto s = std::dynamic_pointer_cast<memlean::SwishImpl>(layer.ptr());
  return s && s->options.variant() == SwishVariant::kNaive;
}

// Overwriting x, the input of a layer about to run, is invisible to autograd and to the rest
// of the step: x is held by this one handle alone (no op saved it, as SavedVariable holds the
// tensor or, for an op's own output, a second TensorImpl of its storage; no view of it or
// other tensor shares its storage; it is not the example input, a parameter or a buffer),
// and in a Sequential no later layer reads a layer's input. (Checked on the forward with the
// earlier swaps made: the in-place Swish saves its output, so of two Swish layers in a row
// only the first is overwritten in place.) Or x is a view of all of a tensor that only x holds
// (a torch::nn::Linear output for a 3-d input is a view of its 2-d matmul result), which the
// in-place Swish then overwrites (memlean::swish, kInplace).
bool only_holder(const at::Tensor& x) {
  if (!x.defined() || !x.has_storage() || x.use_count() != 1 ||
      (x.is_leaf() && x.requires_grad()) || !x.is_floating_point()) {
    return false;
  }
  const auto holders = x.storage().use_count();
  if (holders == 1) return true;
  if (holders != 2 || !x.is_view()) return false;
  const at::TensorBase& base = x._base();
  return base.use_count() == 1 && views_all_of(x, base);
}

// What one forward of a Sequential, layer by layer, found with fit's swaps made (step 1 of
// fit, below): each layer's kept and freed bytes, output, time, and whether it writes or
// hands on its input.
struct LayerWalk {
  std::vector<torch::nn::AnyModule> layers;  // the model's, or the swapped ones
  std::vector<std::string> swapped;          // the action, for a swapped layer
  std::vector<int64_t> input_bytes;          // a swapped layer's input's storage
  std::vector<bool> writes_input, passes_input;
  std::vector<double> seconds;
  std::vector<int64_t> kept, freed, output_bytes;
  // Whether layer i's output storage was held besides the output itself once the layer had
  // run (its graph saved it, as Tanh's does): else a later layer's saving it is what kept it.
  std::vector<bool> holds_output;
  // Bytes alive when layer i began (its input held) and the most while it ran.
  std::vector<int64_t> forward_start, forward_peak;
  // The most layer i's forward without grad holds above its input (its output, temporaries),
  // as a checkpoint nested in another's recompute runs it: measured on a copy of its input.
  std::vector<int64_t> no_grad_forward;
  // An in-place Swish whose output a later layer wrote in place: the walk stopped there, its
  // figures incomplete (-1: none, the walk is whole).
  int64_t written_in_place = -1;
};

// The forward of step 1: on the CPU, lean BatchNorm and depthwise-convolution layers; each
// Swish in place where only it holds its input and not_in_place does not forbid it, else a
// naive memlean::Swish made memory-efficient. Holds only the latest output, as a training
// forward does.
LayerWalk walk_layers(const torch::nn::Sequential& model, const at::Tensor& example_input,
                      const c10::Device& device, const std::vector<bool>& not_in_place) {
  const auto n = static_cast<int64_t>(model->size());
  LayerWalk w;
  w.layers.assign(model->begin(), model->end());
  w.swapped.assign(n, "");
  w.input_bytes.assign(n, 0);
  w.writes_input.assign(n, false);
  w.passes_input.assign(n, false);
  w.seconds.assign(n, 0.0);
  w.kept.assign(n, 0);
  w.freed.assign(n + 1, 0);
  w.output_bytes.assign(n, 0);
  w.holds_output.assign(n, false);
  w.forward_start.assign(n, 0);
  w.forward_peak.assign(n, 0);
  w.no_grad_forward.assign(n, 0);
  at::AutoGradMode grad_mode(true);
  const FreshAutocastCache fresh;  // each layer makes its weight copies, as in a step
  at::Tensor h = example_input;
  int64_t in_place_owner = -1;  // the in-place Swish whose output h's storage is, if any
  for (int64_t i = 0; i < n; ++i) {
    bool in_place_swish = false;
    if (device.is_cpu() && at::GradMode::is_enabled()) {
      if (auto lean = lean_layer(w.layers[i], h)) {
        w.layers[i] = std::move(lean->first);
        w.swapped[i] = std::move(lean->second);
        w.input_bytes[i] = storage_bytes(h);
      }
    }
    if (const auto beta = swish_beta(w.layers[i])) {
      in_place_swish = only_holder(h) && !not_in_place[i];
      if (in_place_swish || is_naive_swish(w.layers[i])) {
        const auto variant =
            in_place_swish ? SwishVariant::kInplace : SwishVariant::kMemoryEfficient;
        w.layers[i] = torch::nn::AnyModule(memlean::Swish(SwishOptions(*beta).variant(variant)));
        w.swapped[i] = to_string(variant) + " swish";
        w.input_bytes[i] = storage_bytes(h);
      }
    }
    if (h.defined()) {  // (a layer that writes its input writes the copy)
      at::NoGradGuard no_grad;
      const at::Tensor copy = h.clone();
      synchronize(device);
      const int64_t start = memstats::memory_allocated(device);
      memstats::Tracker tracker(device);
      w.layers[i].forward(copy);
      synchronize(device);
      w.no_grad_forward[i] = std::max<int64_t>(0, tracker.peak() - start);
      tracker.stop();
    }
    synchronize(device);
    const int64_t before = memstats::memory_allocated(device);
    const int64_t version = h._version();
    w.forward_start[i] = before;
    memstats::Tracker layer_tracker(device);  // (its figures are memory_allocated's)
    const auto t0 = Clock::now();
    at::Tensor out = w.layers[i].forward(h);
    synchronize(device);
    w.seconds[i] = std::chrono::duration<double>(Clock::now() - t0).count();
    w.forward_peak[i] = layer_tracker.peak();
    layer_tracker.stop();
    const int64_t after = memstats::memory_allocated(device);
    // A layer that writes its input (swapped here, or in place already) cannot begin a
    // checkpointed run (nor follow layers that hand their input on): memlean::checkpoint
    // refuses a function that overwrites its input.
    w.writes_input[i] = h._version() != version;
    w.passes_input[i] = out.defined() && h.defined() && out.has_storage() && h.has_storage() &&
                        out.storage().is_alias_of(h.storage());
    if (w.writes_input[i] && in_place_owner >= 0) {
      w.written_in_place = in_place_owner;
      return w;
    }
    in_place_owner = in_place_swish ? i : w.passes_input[i] ? in_place_owner : -1;
    h = at::Tensor();
    w.freed[i] = after - memstats::memory_allocated(device);
    w.kept[i] = after - before;
    w.output_bytes[i] = storage_bytes(out);
    w.holds_output[i] = out.defined() && out.has_storage() && out.storage().use_count() > 1;
    h = std::move(out);
  }
  return w;
}

}  // namespace

at::Tensor FitPlan::forward(const at::Tensor& x) const {
  TORCH_CHECK_VALUE(!model_.is_empty(),
                    "memlean::fit::FitPlan::forward: this plan has no model (made by fit())");
  const auto seq = model_.ptr();
  const auto n = static_cast<int64_t>(seq->size());
  at::Tensor h = x;
  int64_t i = 0;
  for (size_t k = 0; k < runs_.size(); ++k) {
    const auto [b, e] = checkpointed[outermost_[k]];
    for (; i < b; ++i) h = seq->begin()[i].forward(h);
    h = memlean::checkpoint(runs_[k], h);
    i = e;
  }
  for (; i < n; ++i) h = seq->begin()[i].forward(h);
  return h;
}

std::string FitPlan::str() const {
  std::ostringstream out;
  double seconds = 0;
  for (const auto& a : actions) seconds += a.recompute_seconds;
  const size_t swaps = actions.size() - checkpointed.size() - sliced.size();
  out << "memlean::fit: " << checkpointed.size()
      << (checkpointed.size() == 1 ? " checkpoint" : " checkpoints");
  if (swaps > 0) {
    out << ", " << swaps << (swaps == 1 ? " layer swapped" : " layers swapped");
  }
  if (!sliced.empty()) {
    out << ", " << sliced.size() << (sliced.size() == 1 ? " MLP sliced" : " MLPs sliced");
  }
  if (actions.empty()) out << " (the eager step fits the budget)";
  out << "\n";
  if (!actions.empty()) {
    // Each action's path, a checkpointed run inside others indented by two spaces per run
    // around it (the k-th checkpoint action is checkpointed[k]).
    const std::vector<int> depths = nesting_depths(checkpointed);
    std::vector<std::string> paths;
    size_t k = 0;
    for (const auto& a : actions) {
      const int depth = a.action == "checkpoint" && k < depths.size() ? depths[k++] : 0;
      paths.push_back(std::string(2 * std::max(0, depth), ' ') + a.path);
    }
    size_t w = 4, wa = 6;
    for (size_t i = 0; i < actions.size(); ++i) {
      w = std::max(w, paths[i].size());
      wa = std::max(wa, actions[i].action.size());
    }
    char line[640];
    std::snprintf(line, sizeof(line), "  %-*s  %-*s  %-44s  %s\n", static_cast<int>(w), "path",
                  static_cast<int>(wa), "action", "saves", "recompute");
    out << line;
    for (size_t i = 0; i < actions.size(); ++i) {
      const FitAction& a = actions[i];
      // (a checkpoint's and a sliced MLP's saving is the planner's; they recompute)
      const bool checkpoint = a.action == "checkpoint" || a.action == "sliced mlp";
      char recompute[32];
      std::snprintf(recompute, sizeof(recompute), "%.3g ms", a.recompute_seconds * 1e3);
      const std::string saves =
          describe_bytes(a.bytes_saved) + (checkpoint ? " predicted" : " measured");
      std::snprintf(line, sizeof(line), "  %-*s  %-*s  %-44s  %s\n", static_cast<int>(w),
                    paths[i].c_str(), static_cast<int>(wa), a.action.c_str(), saves.c_str(),
                    checkpoint ? recompute : "none");
      out << line;
    }
  }
  out << "  budget     " << describe_bytes(budget_bytes);
  if (margin_bytes > 0) {
    out << "  planned " << describe_bytes(margin_bytes)
        << " below it (CUDA: the allocator's blocks vary from step to step)";
  }
  out << "\n"
      << "  peak       " << describe_bytes(peak_bytes) << "  measured, one step under the plan\n"
      << "  predicted  " << describe_bytes(predicted_peak_bytes) << "\n"
      << "  eager      " << describe_bytes(eager_peak_bytes) << "  measured, before any change\n"
      << "  fixed      " << describe_bytes(fixed_bytes)
      << "  parameters, buffers, optimizer state, input\n";
  if (!checkpointed.empty() || !sliced.empty()) {
    char line[96];
    std::snprintf(line, sizeof(line), "  recompute  %.3g ms per step (forward times, measured once)\n",
                  seconds * 1e3);
    out << line;
  }
  return out.str();
}

std::string FitPlan::to_json() const {
  std::ostringstream out;
  double seconds = 0;
  for (const auto& a : actions) seconds += a.recompute_seconds;
  out << "{\"budget_bytes\": " << budget_bytes << ", \"peak_bytes\": " << peak_bytes
      << ", \"predicted_peak_bytes\": " << predicted_peak_bytes << ", \"fixed_bytes\": "
      << fixed_bytes << ", \"eager_peak_bytes\": " << eager_peak_bytes
      << ", \"margin_bytes\": " << margin_bytes
      << ", \"recompute_seconds\": " << memstats::json_number(seconds) << ", \"checkpointed\": [";
  for (size_t i = 0; i < checkpointed.size(); ++i) {
    out << (i ? ", " : "") << "[" << checkpointed[i].first << ", " << checkpointed[i].second << "]";
  }
  out << "], \"sliced\": [";
  for (size_t i = 0; i < sliced.size(); ++i) {
    out << (i ? ", " : "") << "[" << sliced[i].first << ", " << sliced[i].second << "]";
  }
  out << "], \"actions\": [";
  for (size_t i = 0; i < actions.size(); ++i) {
    const FitAction& a = actions[i];
    out << (i ? ", " : "") << "{\"path\": " << memstats::json_string(a.path)
        << ", \"action\": " << memstats::json_string(a.action) << ", \"bytes_saved\": "
        << a.bytes_saved
        << ", \"recompute_seconds\": " << memstats::json_number(a.recompute_seconds) << "}";
  }
  out << "]}";
  return out.str();
}

namespace {

// A JSON value, as FitPlan::from_json reads it (numbers kept as their text, so int64 values are
// exact).
struct JsonValue {
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject } kind = Kind::kNull;
  std::string text;  // a string's value, a number's text
  bool boolean = false;
  std::vector<JsonValue> items;
  std::vector<std::pair<std::string, JsonValue>> fields;
  const JsonValue* field(const std::string& key) const {
    for (const auto& [k, v] : fields) {
      if (k == key) return &v;
    }
    return nullptr;
  }
};

class JsonReader {
 public:
  explicit JsonReader(const std::string& s) : s_(s) {}

  JsonValue document() {
    JsonValue v = value(0);
    space();
    if (i_ != s_.size()) fail("text after the JSON value");
    return v;
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw std::invalid_argument("memlean::fit::FitPlan::from_json: plan_json is not the JSON of "
                                "a FitPlan (FitPlan::to_json): " + what + " at offset " +
                                std::to_string(i_));
  }

 private:
  void space() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) {
      ++i_;
    }
  }
  bool eat(char c) {
    space();
    if (i_ < s_.size() && s_[i_] == c) {
      ++i_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("'") + c + "' expected");
  }
  bool word(const char* w) {
    const size_t n = std::char_traits<char>::length(w);
    if (s_.compare(i_, n, w) != 0) return false;
    i_ += n;
    return true;
  }

  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      if (i_ >= s_.size()) fail("an unterminated string");
      const char c = s_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("a control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("an unterminated string");
      const char e = s_[i_++];
      switch (e) {
        case '"': case '\\': case '/': out += e; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          if (i_ + 4 > s_.size()) fail("a short \\u escape");
          unsigned code = 0;
          for (int k = 0; k < 4; ++k) {
            const char h = s_[i_++];
            code <<= 4;
            if (h >= '0' && h <= '9') code |= h - '0';
            else if (h >= 'a' && h <= 'f') code |= h - 'a' + 10;
            else if (h >= 'A' && h <= 'F') code |= h - 'A' + 10;
            else fail("a bad \\u escape");
          }
          if (code >= 0xD800 && code < 0xE000) fail("a surrogate \\u escape");  // (to_json writes none)
          if (code < 0x80) {
            out += static_cast<char>(code);
          } else if (code < 0x800) {
            out += static_cast<char>(0xC0 | (code >> 6));
            out += static_cast<char>(0x80 | (code & 0x3F));
          } else {
            out += static_cast<char>(0xE0 | (code >> 12));
            out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
            out += static_cast<char>(0x80 | (code & 0x3F));
          }
          break;
        }
        default: fail("a bad escape");
      }
    }
  }

  JsonValue value(int depth) {
    if (depth > 32) fail("values nested too deep");
    space();
    JsonValue v;
    if (i_ >= s_.size()) fail("a value expected");
    const char c = s_[i_];
    if (c == '{') {
      ++i_;
      v.kind = JsonValue::Kind::kObject;
      if (eat('}')) return v;
      do {
        space();
        std::string key = string();
        expect(':');
        v.fields.emplace_back(std::move(key), value(depth + 1));
      } while (eat(','));
      expect('}');
    } else if (c == '[') {
      ++i_;
      v.kind = JsonValue::Kind::kArray;
      if (eat(']')) return v;
      do {
        v.items.push_back(value(depth + 1));
      } while (eat(','));
      expect(']');
    } else if (c == '"') {
      v.kind = JsonValue::Kind::kString;
      v.text = string();
    } else if (word("true")) {
      v.kind = JsonValue::Kind::kBool;
      v.boolean = true;
    } else if (word("false")) {
      v.kind = JsonValue::Kind::kBool;
    } else if (word("null")) {
      v.kind = JsonValue::Kind::kNull;
    } else {
      const size_t start = i_;
      while (i_ < s_.size() && std::strchr("+-0123456789.eE", s_[i_]) != nullptr) ++i_;
      if (i_ == start) fail("a value expected");
      v.kind = JsonValue::Kind::kNumber;
      v.text = s_.substr(start, i_ - start);
    }
    return v;
  }

  const std::string& s_;
  size_t i_ = 0;
};

// The fields of a FitPlan's JSON, checked as read (JsonReader::fail names what is wrong).
struct PlanFields {
  const JsonReader& reader;
  const JsonValue& root;

  const JsonValue& need(const JsonValue& object, const std::string& key,
                        JsonValue::Kind kind) const {
    const JsonValue* v = object.field(key);
    if (v == nullptr) reader.fail("no \"" + key + "\"");
    if (v->kind != kind) reader.fail("\"" + key + "\" of another type");
    return *v;
  }
  int64_t integer(const JsonValue& v, const std::string& key) const {
    if (v.kind != JsonValue::Kind::kNumber) reader.fail("\"" + key + "\" is not a number");
    size_t used = 0;
    int64_t out = 0;
    try {
      out = std::stoll(v.text, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != v.text.size()) reader.fail("\"" + key + "\" is not an int64: " + v.text);
    return out;
  }
  int64_t integer(const std::string& key, bool required) const {
    const JsonValue* v = root.field(key);
    if (v == nullptr) {
      if (required) reader.fail("no \"" + key + "\"");
      return 0;
    }
    return integer(*v, key);
  }
  double number(const JsonValue& v, const std::string& key) const {
    if (v.kind != JsonValue::Kind::kNumber) reader.fail("\"" + key + "\" is not a number");
    char* end = nullptr;
    const double out = std::strtod(v.text.c_str(), &end);
    if (end != v.text.c_str() + v.text.size()) reader.fail("\"" + key + "\" is not a number");
    return out;
  }
  std::vector<std::pair<int64_t, int64_t>> runs(const std::string& key) const {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (const JsonValue& r : need(root, key, JsonValue::Kind::kArray).items) {
      if (r.kind != JsonValue::Kind::kArray || r.items.size() != 2) {
        reader.fail("\"" + key + "\" holds something other than [begin, end] pairs");
      }
      out.emplace_back(integer(r.items[0], key), integer(r.items[1], key));
    }
    return out;
  }
};

}  // namespace

FitPlan FitPlan::from_json(const std::string& plan_json) {
  JsonReader reader(plan_json);
  const JsonValue root = reader.document();
  if (root.kind != JsonValue::Kind::kObject) reader.fail("not an object");
  const PlanFields fields{reader, root};
  FitPlan plan;
  plan.budget_bytes = fields.integer("budget_bytes", true);
  plan.peak_bytes = fields.integer("peak_bytes", false);
  plan.predicted_peak_bytes = fields.integer("predicted_peak_bytes", false);
  plan.fixed_bytes = fields.integer("fixed_bytes", false);
  plan.eager_peak_bytes = fields.integer("eager_peak_bytes", false);
  plan.margin_bytes = fields.integer("margin_bytes", false);
  plan.checkpointed = fields.runs("checkpointed");
  plan.sliced = fields.runs("sliced");
  for (const JsonValue& a : fields.need(root, "actions", JsonValue::Kind::kArray).items) {
    if (a.kind != JsonValue::Kind::kObject) reader.fail("an action that is not an object");
    FitAction action;
    action.path = fields.need(a, "path", JsonValue::Kind::kString).text;
    action.action = fields.need(a, "action", JsonValue::Kind::kString).text;
    if (const JsonValue* b = a.field("bytes_saved")) action.bytes_saved = fields.integer(*b, "bytes_saved");
    if (const JsonValue* t = a.field("recompute_seconds")) {
      action.recompute_seconds = fields.number(*t, "recompute_seconds");
    }
    plan.actions.push_back(std::move(action));
  }
  return plan;
}

namespace {

// What every attempt of fit's search shares (fit(), below): the step it measures, the example
// input, the layers' names, the budget it plans against (the budget less the CUDA margin), the
// eager step's figures and the buffers a step changes unseen by autograd.
struct FitContext {
  Step& step;
  const at::Tensor& input;
  c10::Device device;
  const std::vector<std::string>& names;
  const FitPlan& eager;  // budget_bytes, margin_bytes, eager_peak_bytes, fixed_bytes
  int64_t planned = 0;
  int64_t resolution = 1;
  const std::unordered_set<const c10::TensorImpl*>& unversioned;
};

// Step 1's walk of `base`. memlean's in-place Swish saves its output (its input's storage): a
// later layer that writes that storage in place (a ReLU(inplace), directly or through layers
// that hand on a view of it) would make autograd's version check fire in backward. Such a
// Swish is not made in place, and the walk runs again (rare: once per such layer).
LayerWalk walk_safely(const FitContext& ctx, const torch::nn::Sequential& base) {
  std::vector<bool> not_in_place(base->size(), false);
  LayerWalk walk;
  do {
    walk = walk_layers(base, ctx.input, ctx.device, not_in_place);
    if (walk.written_in_place >= 0) not_in_place[walk.written_in_place] = true;
  } while (walk.written_in_place >= 0);
  return walk;
}

// The step with step 1's swaps made (and the MLPs sliced, where `sliced` has runs), no
// checkpoint: the model it runs (ctx.step runs it from here on) and its measured peak.
struct Swapped {
  torch::nn::Sequential work{nullptr};
  int64_t peak = 0;
  std::vector<FitAction> actions;  // the swaps', then the sliced MLPs'
  size_t swaps = 0;
};

Swapped swap_layers(const FitContext& ctx, const torch::nn::Sequential& base, const LayerWalk& walk,
                    const SlicedMlps& sliced) {
  Swapped out;
  out.work = base;
  ctx.step.model = base;
  const auto n = static_cast<int64_t>(walk.layers.size());
  const auto run = [&out](const at::Tensor& x) { return out.work->forward(x); };
  // The step without checkpoints: the eager step's, or the sliced one's (measured).
  out.peak = sliced.runs.empty() ? ctx.eager.eager_peak_bytes : ctx.step.measure(run);
  const auto is_swapped = [](const std::string& action) { return !action.empty(); };
  if (std::any_of(walk.swapped.begin(), walk.swapped.end(), is_swapped)) {
    out.work = torch::nn::Sequential();
    for (int64_t i = 0; i < n; ++i) out.work->push_back(ctx.names[i], walk.layers[i]);
    ctx.step.model = out.work;
    const int64_t before = out.peak;
    out.peak = ctx.step.measure(run);
    const int64_t saving = std::max<int64_t>(0, before - out.peak);
    int64_t total = 0;
    for (const int64_t b : walk.input_bytes) total += b;
    for (int64_t i = 0; i < n; ++i) {
      if (walk.swapped[i].empty()) continue;
      out.actions.push_back({path_of(i, i + 1, ctx.names), walk.swapped[i],
                             total > 0 ? saving * walk.input_bytes[i] / total : 0, 0.0});
    }
  }
  out.swaps = out.actions.size();
  out.actions.insert(out.actions.end(), sliced.actions.begin(), sliced.actions.end());
  return out;
}

// Which runs [b, e) of the walked layers a checkpoint may hold: why_not() is "" for one, else
// why not (fit's candidates and apply_plan's check).
class Checkpointable {
 public:
  Checkpointable(const LayerWalk& walk, const SlicedMlps& sliced,
                 const std::unordered_set<const c10::TensorImpl*>& unversioned)
      : walk_(walk), sliced_(sliced), holds_unversioned_(walk.layers.size(), false) {
    // A layer holding a buffer changed behind autograd's back (unversioned) is in no
    // checkpointed run.
    for (size_t i = 0; i < walk.layers.size() && !unversioned.empty(); ++i) {
      for (const auto& b : walk.layers[i].ptr()->buffers()) {
        if (unversioned.count(b.unsafeGetTensorImpl()) > 0) holds_unversioned_[i] = true;
      }
    }
  }

  std::string why_not(int64_t b, int64_t e) const {
    const auto n = static_cast<int64_t>(walk_.layers.size());
    if (b < 0 || e <= b || e > n) return "not a run of the model's layers";
    // (its backward comes first, right after it is recomputed: it saves nothing at the peak)
    if (e == n) return "it ends at the last layer";
    // memlean::checkpoint refuses a function that overwrites its input.
    for (int64_t i = b; i < e; ++i) {
      if (walk_.writes_input[i]) return "a layer of it overwrites the run's input";
      if (!walk_.passes_input[i]) break;
    }
    // A run holding part of a sliced MLP (its head computes the MLP with all its layers'
    // parameters; memlean::checkpoint takes only the run's).
    for (const auto& r : sliced_.runs) {
      if (b < r.second && e > r.first && (b > r.first || e < r.second)) {
        return "it splits a sliced MLP";
      }
    }
    for (int64_t i = b; i < e; ++i) {
      if (holds_unversioned_[i]) return "a layer of it changes a buffer unseen by autograd";
    }
    return "";
  }

 private:
  const LayerWalk& walk_;
  const SlicedMlps& sliced_;
  std::vector<bool> holds_unversioned_;
};

// Step 3's problem for the swapped step (ctx.step runs it; its peak without checkpoints
// `empty_peak`): what each layer keeps for backward, backward's own bytes there, and the runs
// of layers a checkpoint may hold, with their costs, then the compounds of them (`made`: one
// per compound candidate, after the plain ones). `optimizer_peak`: the step's most in the
// optimizer's step, which no plan changes (the search's floor).
Problem checkpoint_problem(const FitContext& ctx, const LayerWalk& walk, const SlicedMlps& sliced,
                           int64_t empty_peak, int64_t& optimizer_peak,
                           std::vector<Compound>& made) {
  const auto n = static_cast<int64_t>(walk.layers.size());
  const auto& freed = walk.freed;
  Problem problem;
  int64_t atoms = 0;
  for (int64_t i = 0; i < n; ++i) {
    problem.atom_saved_bytes.push_back(std::max<int64_t>(0, walk.kept[i] - freed[i + 1]));
    atoms += problem.atom_saved_bytes.back();
  }
  // base: what the step holds besides saved tensors where the per-layer backward extras below
  // do not count it, at its highest (in the forward and the loss, and in backward before it
  // reaches a layer), less all saved bytes. (Not the step's peak less all saved bytes: where
  // that peak comes inside backward, e.g. in a sliced MLP's backward, the saved bytes of the
  // layers after it are freed by then, and every plan was predicted that much too high; as
  // memlean.fit, 2026-11-28.) Without a layer reached (no layer's output needs a gradient):
  // the step's peak.
  const Step::BackwardLevels levels = ctx.step.backward_levels();
  const bool reached = std::any_of(levels.highest.begin(), levels.highest.end(),
                                   [](int64_t level) { return level >= 0; });
  problem.base_bytes = std::max<int64_t>(0, (reached ? levels.before_layers : empty_peak) - atoms);
  optimizer_peak = levels.optimizer;
  // Backward's own bytes at each layer above base and what layers 0..i saved (activation
  // gradients, temporaries, the parameter gradients made by then): where checkpointed steps
  // peak, in the backward of early, wide layers.
  // And what backward brings to each layer (its output's gradient, the parameter gradients
  // made by then): the bytes above base and what layers 0..i saved when it reaches layer i,
  // where layer i's output counts among layer i's saved bytes only if layer i holds it: one
  // that layer i + 1 saved is freed by then (layer i + 1's backward is done), although its
  // bytes are layer i's (a checkpoint ending at i recomputes it).
  std::vector<int64_t> output_kept(n, 0);
  for (int64_t i = 0; i < n; ++i) {
    output_kept[i] = std::max<int64_t>(0, walk.output_bytes[i] - freed[i + 1]);
  }
  std::vector<int64_t> brought(n, 0);
  {
    int64_t through = 0;
    for (int64_t i = 0; i < n; ++i) {
      through += problem.atom_saved_bytes[i];
      problem.atom_backward_extra_bytes.push_back(
          std::max<int64_t>(0, levels.highest[i] - problem.base_bytes - through));
      if (levels.entry[i] >= 0) {
        brought[i] = levels.entry[i] - problem.base_bytes - through +
                     (walk.holds_output[i] ? 0 : output_kept[i]);
      }
    }
  }
  // 3. Checkpoints. Candidates: every run [b, e) of layers. Checkpointed, it keeps its input
  // (which layer b may not have saved: freed_b more bytes) and its output where layer e or
  // layer e - 1 saved it (the output's bytes less freed_e; freed_e = 0 does not say which:
  // an activation that saves its output, such as Tanh, keeps it in the checkpoint's place
  // only when the next run is checkpointed too, else the prediction is that output's bytes
  // high, never low). While it is recomputed and backward runs through it, besides base, the
  // kept bytes before it and its layers' saved bytes: its input where layer b did not save
  // it (input_bytes); then first its recomputed output where no layer saved it (freed_e: one
  // that layer e - 1 or e saved is among the saved bytes already), what its forward held
  // above what it left at its highest (an intermediate alive while a layer makes its
  // output), what backward brings to it (the gradient of its output and the parameter
  // gradients made by then; above base, which may count more than was alive there) and the
  // copy of its layers' buffers that memlean::checkpoint puts back after the recompute
  // (BufferRestore): recompute_extra_bytes; later backward's own bytes there (the per-layer
  // extras). A run that ends at the last layer saves nothing at the peak (its backward comes
  // first, right after it is recomputed): not a candidate.
  std::vector<std::vector<at::Tensor>> layer_buffers(n);
  for (int64_t i = 0; i < n; ++i) layer_buffers[i] = walk.layers[i].ptr()->buffers();
  auto buffer_copy_bytes = [&](int64_t b, int64_t e) {  // as BufferRestore clones them
    std::vector<at::Tensor> run;
    for (int64_t i = b; i < e; ++i) {
      run.insert(run.end(), layer_buffers[i].begin(), layer_buffers[i].end());
    }
    int64_t total = 0;
    for (const auto& t : unique_tensors(run)) total += static_cast<int64_t>(t.nbytes());
    return total;
  };
  const Checkpointable checkpointable(walk, sliced, ctx.unversioned);
  for (Candidate c : chain_candidates(problem.atom_saved_bytes, output_kept, walk.seconds)) {
    if (!checkpointable.why_not(c.begin, c.end).empty()) continue;
    c.freed_bytes = std::max<int64_t>(0, c.freed_bytes - freed[c.begin]);
    if (c.freed_bytes == 0) continue;  // (it keeps all it held: no plan is lower with it)
    c.input_bytes = freed[c.begin];
    int64_t recompute = freed[c.end];
    const int64_t highest =
        *std::max_element(walk.forward_peak.begin() + c.begin, walk.forward_peak.begin() + c.end);
    recompute += std::max<int64_t>(0, highest - walk.forward_start[c.end]);
    const int64_t copies = buffer_copy_bytes(c.begin, c.end);
    c.recompute_extra_bytes = std::max<int64_t>(0, recompute + brought[c.end - 1]) + copies;
    // (As base counts it: below 0 where base counts more than was alive then.)
    c.recompute_held_bytes = std::max(-problem.base_bytes, brought[c.end - 1] + copies);
    // Nested in a compound's recompute, its forward runs without grad: at layer k, the input
    // of layer k (the output of k - 1, past its first layer) and what layer k holds without
    // grad above it (the walk measured it: with grad, a convolution's temporaries here were
    // larger, and every compound around one was predicted up to 5 % high).
    for (int k = c.begin; k < c.end; ++k) {
      c.forward_bytes =
          std::max(c.forward_bytes,
                   (k > c.begin ? walk.output_bytes[k - 1] : 0) + walk.no_grad_forward[k]);
    }
    problem.candidates.push_back(c);
  }
  // And compounds: runs checkpointed around the checkpointed runs inside them, which their
  // recompute runs (planner.h, as memlean.fit; each nested run checkpointable alone).
  return with_compounds(problem, {}, /*resolution=*/64, &made);
}

// The runs a plan's chosen candidate checkpoints: its own, or a compound's (`made`, after the
// problem's plain candidates) and those nested inside it.
void chosen_runs(const Problem& problem, const std::vector<Compound>& made, int c,
                 std::vector<int>& out) {
  const int plain = static_cast<int>(problem.candidates.size() - made.size());
  if (c < plain) {
    out.push_back(c);
    return;
  }
  out.push_back(made[c - plain].outer);
  for (const int inner : made[c - plain].inner) chosen_runs(problem, made, inner, out);
}

// The FitPlan of the swapped step (its swaps and sliced MLPs) with the checkpoints of plan p
// (an empty Plan: none); the optimizer's step peaks at `optimizer_peak`, whatever the plan.
FitPlan plan_of(const FitContext& ctx, const Problem& problem, const Plan& p,
                const Swapped& swapped, const SlicedMlps& sliced, int64_t optimizer_peak = 0,
                const std::vector<Compound>& made = {}) {
  FitPlan f = ctx.eager;
  f.predicted_peak_bytes = std::max(p.predicted_peak_bytes, optimizer_peak);
  f.actions = swapped.actions;
  f.sliced = sliced.runs;
  std::vector<int> runs;  // (plain candidates: a compound's own run and those inside it)
  for (const int c : p.chosen) chosen_runs(problem, made, c, runs);
  std::sort(runs.begin(), runs.end(), [&](int a, int b) {  // by begin, an outer run first
    const Candidate &x = problem.candidates[a], &y = problem.candidates[b];
    return x.begin != y.begin ? x.begin < y.begin : x.end > y.end;
  });
  for (const int c : runs) {
    const Candidate& cand = problem.candidates[c];
    f.checkpointed.emplace_back(cand.begin, cand.end);
    f.actions.push_back({path_of(cand.begin, cand.end, ctx.names), "checkpoint", cand.freed_bytes,
                         cand.seconds});
  }
  FitPlanAccess::set_runner(f, swapped.work);  // (after the checkpoints: it wraps them)
  return f;
}

// One attempt of fit's search on `base`: the model, or (2., in fit) the model with its MLPs
// sliced, whose actions (`sliced`) the plans carry after the swaps. 1. the swaps; if the
// swapped step fits, that plan; else 3. the checkpoints: the search both languages run
// (search.h): plan, measure, tighten, bisect back up.
testing::ProblemObserver& problem_observer() {
  static testing::ProblemObserver observer;
  return observer;
}

Attempt attempt(const FitContext& ctx, const torch::nn::Sequential& base,
                const SlicedMlps& sliced) {
  Attempt out;
  const LayerWalk walk = walk_safely(ctx, base);
  out.output_bytes = walk.output_bytes;
  out.seconds = walk.seconds;
  out.sliced = sliced.runs.size();
  const Swapped swapped = swap_layers(ctx, base, walk, sliced);
  out.swaps = swapped.swaps;
  if (swapped.peak <= ctx.planned) {  // (never the eager step: it does not fit)
    out.plan = plan_of(ctx, Problem{}, Plan{}, swapped, sliced);
    out.plan->peak_bytes = out.plan->predicted_peak_bytes = swapped.peak;
    return out;
  }
  int64_t optimizer_peak = 0;
  std::vector<Compound> made;
  const Problem problem =
      checkpoint_problem(ctx, walk, sliced, swapped.peak, optimizer_peak, made);
  out.saved = problem.atom_saved_bytes;
  auto measure = [&](const FitPlan& f) {
    return ctx.step.measure([&f](const at::Tensor& x) { return f.forward(x); });
  };
  if (problem_observer()) {
    testing::CheckpointProblem seen;
    for (const Candidate& c : problem.candidates) seen.runs.emplace_back(c.begin, c.end);
    seen.problem = problem;
    seen.nested.resize(problem.candidates.size());
    const size_t plain = problem.candidates.size() - made.size();
    for (size_t k = 0; k < made.size(); ++k) seen.nested[plain + k] = made[k].inner;
    seen.predict_and_measure = [&](const std::vector<int>& chosen) {
      Plan p;
      p.feasible = true;
      p.chosen = chosen;
      p.predicted_peak_bytes = predicted_peak(problem, chosen);
      const FitPlan f = plan_of(ctx, problem, p, swapped, sliced, optimizer_peak, made);
      return std::make_pair(f.predicted_peak_bytes, measure(f));
    };
    problem_observer()(seen);
  }
  SearchOptions search_options;
  search_options.resolution = ctx.resolution;
  const SearchResult found = search(
      problem, ctx.planned, /*floor_bytes=*/optimizer_peak, swapped.peak,
      [&](const Plan& p) { return measure(plan_of(ctx, problem, p, swapped, sliced, 0, made)); },
      search_options);
  if (found.fastest) {
    out.plan = plan_of(ctx, problem, *found.fastest, swapped, sliced, optimizer_peak, made);
    out.plan->peak_bytes = found.fastest_peak_bytes;
  }
  out.least_measured = found.least_measured_peak_bytes;
  out.least_predicted = std::max(found.least.predicted_peak_bytes, optimizer_peak);
  out.least_checkpoints = found.least.chosen.size();
  return out;
}

// What fit() and apply_plan() share: the arguments checked (`who` names the function in the
// errors), the step they measure, the training state saved (put back by snapshot->restore(),
// and on destruction, so an exception leaves the model as it was), the warm-up step made, the
// eager step measured after it and the layers' names.
struct Session {
  Session(const std::string& who, const torch::nn::Sequential& model,
          const at::Tensor& example_input, int64_t budget_bytes, const FitOptions& options) {
    if (model.is_empty()) {
      throw std::invalid_argument(who + ": model is an empty Sequential holder (nullptr)");
    }
    if (options.resolution < 1) {
      throw std::invalid_argument(who + ": options.resolution must be >= 1, got " +
                                  std::to_string(options.resolution));
    }
    if (dynamic_cast<const torch::optim::LBFGS*>(options.optimizer) != nullptr) {
      throw std::invalid_argument(
          who + ": options.optimizer is a torch::optim::LBFGS, whose step() needs a closure "
                "that evaluates the loss again (up to max_eval forward and backward passes per "
                "step); fit measures steps of one forward and backward and calls step() "
                "without one, so it cannot fit this optimizer's step");
    }
    std::vector<at::Tensor> params = model->parameters();
    if (params.empty()) {
      throw std::invalid_argument(who + ": model has no parameters (nothing to train)");
    }
    if (!example_input.defined()) {
      throw std::invalid_argument(who + ": example_input is an undefined tensor");
    }
    if (c10::InferenceMode::is_enabled()) {
      throw std::invalid_argument(
          who + ": called inside c10::InferenceMode, where no training step can run "
          "(autograd records nothing there); call fit outside it");
    }
    if (example_input.is_inference()) {
      throw std::invalid_argument(
          who + ": example_input was made in c10::InferenceMode, which autograd cannot use "
          "in a training step; make it outside");
    }
    const c10::Device device = params.front().device();
    if (example_input.device() != device) {
      throw std::invalid_argument(who + ": example_input is on " + example_input.device().str() +
                                  " but the model's parameters are on " + device.str());
    }
    memstats::check_device(device);

    step.model = model;
    step.input = example_input;
    step.loss_fn = options.loss_fn;
    step.optimizer = options.optimizer;
    step.device = device;
    step.keep_grads = options.keep_grads;
    if (options.optimizer != nullptr) {
      for (const auto& group : options.optimizer->param_groups()) {
        params.insert(params.end(), group.params().begin(), group.params().end());
      }
    }
    step.params = unique_tensors(params);
    step.buffers = unique_tensors(model->buffers());
    step.grad_holders = step.params;
    if (example_input.requires_grad() && example_input.is_leaf()) {
      step.grad_holders.push_back(example_input);
    }
    memstats::enable();
    snapshot = std::make_unique<Snapshot>(step.params, step.buffers, step.grad_holders,
                                          options.optimizer, device);
    // The caller's gradients stay in the snapshot, untouched (keep_grads zeroes gradients in
    // place: fit's own).
    for (const auto& t : step.grad_holders) {
      if (t.grad().defined()) t.mutable_grad().reset();
    }
    const Runner run = [m = model](const at::Tensor& x) mutable { return m->forward(x); };

    // Warm-up: the optimizer makes its state where it has none (or one was moved out: Snapshot),
    // and lazily allocated workspaces (cuBLAS's) are made before anything is measured.
    // (unversioned: the buffers that step changed through .data(), unversioned_changes)
    {
      step.clear_grads();
      const int64_t before = memstats::memory_allocated(device);
      unversioned = unversioned_changes(*model, [&] { (void)step.measure(run); });
      if (options.optimizer != nullptr) {
        try {
          memstats::optimizer_state_tensors(*options.optimizer);
        } catch (const c10::Error&) {
          // A state memstats does not know: its bytes are what the warm-up step kept.
          step.unknown_state_bytes =
              std::max<int64_t>(0, memstats::memory_allocated(device) - before);
        }
      }
    }

    // On CUDA every decision is made against the budget less a margin (cuda_margin): fit's
    // measured step is one history of the caching allocator, the caller's steps are others.
    eager.budget_bytes = budget_bytes;
    eager.margin_bytes = device.is_cpu() ? 0 : cuda_margin(budget_bytes);
    eager.eager_peak_bytes = step.measure(run);
    eager.fixed_bytes = step.fixed_bytes();
    for (const auto& item : model->named_children()) names.push_back(item.key());
    names.resize(model->size());
  }

  Step step;
  std::unique_ptr<Snapshot> snapshot;
  // The buffers the warm-up step changed through .data() (unversioned_changes).
  std::unordered_set<const c10::TensorImpl*> unversioned;
  // budget_bytes, margin_bytes, eager_peak_bytes and fixed_bytes: the eager step's figures.
  FitPlan eager;
  std::vector<std::string> names;  // the layers', in order
};

}  // namespace

FitPlan fit(torch::nn::Sequential model, const at::Tensor& example_input, int64_t budget_bytes,
            FitOptions options) {
  check_budget(budget_bytes, "budget_bytes");
  Session session("memlean::fit", model, example_input, budget_bytes, options);
  Step& step = session.step;
  Snapshot& snapshot = *session.snapshot;
  const c10::Device device = step.device;
  FitPlan result = session.eager;
  const int64_t planned = budget_bytes - result.margin_bytes;
  if (result.eager_peak_bytes <= planned) {
    result.peak_bytes = result.predicted_peak_bytes = result.eager_peak_bytes;
    FitPlanAccess::set_runner(result, model);
    snapshot.restore();
    return result;
  }

  // 1. Layers swapped, no recompute: each torch::nn::SiLU or memlean::Swish whose input only it
  // holds (only_holder) becomes memlean's in-place Swish (one bit per element kept instead of
  // its input); a naive memlean::Swish that cannot be in place becomes the memory-efficient one
  // (its input kept, not its sigmoid). On the CPU, a BatchNorm in training mode and a depthwise
  // Conv2d get memlean's lean backward (LeanBatchNormImpl, LeanConv2dImpl: up to two tensors
  // of the input's size less at their backward). The layers live in the plan's Sequential;
  // `model` keeps its own.
  //
  // What each layer keeps for backward, and its forward time: one forward, layer by layer, of
  // the swapped layers, holding only the latest output (as a training forward does). Layer i
  // allocates kept_i = (allocated after it) - (before it), its input still held; dropping that
  // input then frees what no layer saved (freed_i: layer i - 1's output when layer i does not
  // save it). What layer i keeps until backward is kept_i - freed_{i+1}. (measure_layer_costs
  // keeps every output alive, so it counts outputs that the next layer does not save, e.g. a
  // Linear's before a Tanh, and its sum exceeds what the forward keeps.)
  const auto n = static_cast<int64_t>(model->size());
  const std::vector<std::string>& names = session.names;
  const FitContext ctx{step, example_input, device, names, result, planned, options.resolution,
                       session.unversioned};
  // 1. and 3. with every layer as it is (but the swaps); if no plan fits, 2., and again.
  Attempt tried = attempt(ctx, model, {});
  if (!tried.plan) {
    // 2. MLPs sliced (memlean::sliced_mlp): a Linear that widens its input at least twice,
    // elementwise activations, a Linear back, whose hidden tensor is 1 MiB or more, becomes
    // one layer that computes the three slice by slice of the hidden features and recomputes
    // them so in backward, keeping its input alone (SlicedMlpHead; the others pass its output
    // on), when checkpoints alone do not reach the budget (as memlean.fit does).
    // (CPU only: sliced_mlp_applies; elsewhere the sliced layers would run in turn)
    const SlicedMlps sliced = device.is_cpu() ? slice_mlps(model, names, tried) : SlicedMlps{};
    if (!sliced.runs.empty()) {
      Attempt again = attempt(ctx, sliced.model, sliced);
      if (again.plan || again.least_measured < tried.least_measured) tried = std::move(again);
    }
  }
  if (tried.plan) {
    snapshot.restore();
    return std::move(*tried.plan);
  }

  // The step as it was (the empty plan, where it fits) bounds the least named.
  const int64_t measured = std::min(tried.least_measured, result.eager_peak_bytes);
  const int64_t best = measured + (device.is_cpu() ? 0 : 2 * cuda_margin(measured));
  snapshot.restore();
  std::ostringstream msg;
  msg << "memlean::fit: no choice of checkpoints" << (tried.sliced > 0 ? " and sliced MLPs" : "")
      << " fits budget_bytes = " << describe_bytes(budget_bytes)
      << ": the least peak reached is " << describe_bytes(best) << " (measured";
  if (!device.is_cpu()) {
    msg << ": " << describe_bytes(measured) << ", plus twice the margin fit keeps on CUDA";
  }
  msg << "; the planner's least predicted peak is "
      << describe_bytes(tried.least_predicted) << ", with " << tried.least_checkpoints
      << (tried.least_checkpoints == 1 ? " checkpointed run" : " checkpointed runs") << " of the "
      << n << " layers";
  if (tried.swaps > 0) {
    msg << ", " << tried.swaps << (tried.swaps == 1 ? " layer swapped" : " layers swapped");
  }
  if (tried.sliced > 0) {
    msg << ", " << tried.sliced << (tried.sliced == 1 ? " MLP sliced" : " MLPs sliced");
  }
  msg << "); the eager step peaks at " << describe_bytes(result.eager_peak_bytes)
      << ", of which " << describe_bytes(result.fixed_bytes)
      << " are parameters, buffers, optimizer state and input. Raise the budget to at least "
      << best << " bytes, or lower the batch size.";
  throw FitError(msg.str(), budget_bytes, best);
}

namespace {

[[noreturn]] void plan_mismatch(const std::string& what) {
  throw std::invalid_argument(
      "memlean::fit::apply_plan: plan does not match this model's training step: " + what +
      ". The plan was made for another model, input or setting; call memlean::fit::fit for "
      "this one");
}

bool is_swap(const std::string& action) {
  return action != "checkpoint" && action != "sliced mlp";
}

}  // namespace

FitPlan apply_plan(torch::nn::Sequential model, const at::Tensor& example_input,
                   const FitPlan& plan, FitOptions options) {
  check_budget(plan.budget_bytes, "plan.budget_bytes");
  Session session("memlean::fit::apply_plan", model, example_input, plan.budget_bytes, options);
  Step& step = session.step;
  const c10::Device device = step.device;
  FitPlan result = session.eager;
  const int64_t margin = result.margin_bytes;
  result.predicted_peak_bytes = plan.predicted_peak_bytes;
  result.actions = plan.actions;
  result.checkpointed = plan.checkpointed;
  result.sliced = plan.sliced;
  const auto n = static_cast<int64_t>(model->size());
  const std::vector<std::string>& names = session.names;
  const FitContext ctx{step,   example_input, device, names, result, plan.budget_bytes - margin,
                       options.resolution, session.unversioned};

  // 2. The MLPs fit sliced: all it finds, or none (on the CPU).
  torch::nn::Sequential base = model;
  SlicedMlps sliced;
  if (!plan.sliced.empty()) {
    const LayerWalk walk = walk_safely(ctx, model);
    Attempt walked;
    walked.output_bytes = walk.output_bytes;
    walked.saved.assign(walk.output_bytes.size(), 0);  // (the actions' bytes: the plan's)
    walked.seconds = walk.seconds;
    if (device.is_cpu()) sliced = slice_mlps(model, names, walked);
    if (sliced.runs != plan.sliced) {
      plan_mismatch(sliced.runs.empty() ? "it slices MLPs, and this step has none fit slices"
                                        : "it slices other MLPs than fit finds in this step");
    }
    base = sliced.model;
  }
  // 1. The swaps, as fit makes them on this step: the same layers, the same actions.
  const LayerWalk walk = walk_safely(ctx, base);
  std::vector<std::pair<std::string, std::string>> made, wanted;
  for (int64_t i = 0; i < n; ++i) {
    if (!walk.swapped[i].empty()) made.emplace_back(path_of(i, i + 1, names), walk.swapped[i]);
  }
  for (const FitAction& a : plan.actions) {
    if (is_swap(a.action)) wanted.emplace_back(a.path, a.action);
  }
  if (wanted != made) {
    std::string what;
    for (const auto& w : wanted) {
      if (what.empty() && std::find(made.begin(), made.end(), w) == made.end()) {
        what = "fit's " + w.second + " of " + w.first + " is not what fit makes here";
      }
    }
    for (const auto& m : made) {
      if (what.empty() && std::find(wanted.begin(), wanted.end(), m) == wanted.end()) {
        what = "fit makes a " + m.second + " of " + m.first + " here, which the plan does not";
      }
    }
    plan_mismatch(what.empty() ? "its swaps are in another order" : what);
  }
  torch::nn::Sequential work = base;
  if (!made.empty()) {
    work = torch::nn::Sequential();
    for (int64_t i = 0; i < n; ++i) work->push_back(names[i], walk.layers[i]);
  }
  // 3. The checkpointed runs: each one fit offers, by begin, each either after the runs
  // before it or inside one of them (nested: after it, the same layers not twice).
  const Checkpointable checkpointable(walk, sliced, session.unversioned);
  const std::vector<int> depths = nesting_depths(plan.checkpointed);
  for (size_t k = 0; k < plan.checkpointed.size(); ++k) {
    const auto [b, e] = plan.checkpointed[k];
    const std::string why = depths[k] < 0 ? "it overlaps the run before it, not inside it"
                                          : checkpointable.why_not(b, e);
    if (!why.empty()) {
      plan_mismatch("its checkpointed run [" + std::to_string(b) + ", " + std::to_string(e) +
                    ") is none fit offers here: " + why);
    }
  }
  // The plan's actions, each sliced MLP's and checkpoint's recompute time measured in this
  // step (the plan may come from another machine): as fit times them, from the walks.
  for (FitAction& a : result.actions) {
    for (const FitAction& m : sliced.actions) {
      if (a.action == m.action && a.path == m.path) a.recompute_seconds = m.recompute_seconds;
    }
    for (const auto& [b, e] : plan.checkpointed) {
      if (a.action != "checkpoint" || a.path != path_of(b, e, names)) continue;
      a.recompute_seconds = 0;
      for (int64_t i = b; i < e; ++i) a.recompute_seconds += walk.seconds[i];
    }
  }
  FitPlanAccess::set_runner(result, work);
  result.peak_bytes =
      step.measure([&result](const at::Tensor& x) { return result.forward(x); });
  if (result.peak_bytes > ctx.planned) {
    std::ostringstream msg;
    msg << "memlean::fit::apply_plan: the step under the plan peaks at "
        << describe_bytes(result.peak_bytes) << ", above the plan's budget_bytes = "
        << describe_bytes(plan.budget_bytes);
    if (margin > 0) msg << " less the " << describe_bytes(margin) << " fit keeps on CUDA";
    msg << ": the plan was made for another model, input or setting (fit measured "
        << describe_bytes(plan.peak_bytes) << "); call memlean::fit::fit for this one";
    throw FitError(msg.str(), plan.budget_bytes, result.peak_bytes);
  }
  session.snapshot->restore();
  return result;
}

void testing::set_problem_observer(ProblemObserver observer) {
  problem_observer() = std::move(observer);
}

FitPlan fit(torch::nn::Sequential model, const at::Tensor& example_input, const std::string& budget,
            FitOptions options) {
  return fit(std::move(model), example_input, parse_budget(budget, "budget"), std::move(options));
}

}  // namespace memlean::fit
