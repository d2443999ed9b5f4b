// What the models of //experiments/models share: the activation choice (memlean's Swish
// variants or torch's SiLU), the checkpointing choice, the Model interface and Stage, a link
// of a model's chain of stages.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace memlean::models {

// Swish with beta = 1 (= SiLU), computed five ways with the same forward:
//   kNaive            memlean kNaive: x * sigmoid(x) by autograd (saves x and sigmoid(x))
//   kMemoryEfficient  memlean kMemoryEfficient: saves only x
//   kInplace          memlean kInplace: overwrites x, saves one bit per element
//   kSilu             torch's at::silu (torch.nn.SiLU())
//   kSiluInplace      torch's at::silu_ (torch.nn.SiLU(inplace=True): autograd keeps a copy of x)
enum class Activation { kNaive, kMemoryEfficient, kInplace, kSilu, kSiluInplace };

// "naive", "memory_efficient", "inplace", "silu", "silu_inplace"; anything else is an error
// (c10::Error) listing the names.
Activation parse_activation(std::string_view name);
std::string to_string(Activation activation);
// The names above, comma separated.
std::string activation_names();
// activation(x). The in-place kinds overwrite x and return it.
at::Tensor activate(const at::Tensor& x, Activation activation);

// What a model checkpoints (memlean's checkpoint; the activations inside a checkpointed part
// are recomputed in backward instead of kept):
//   none         nothing
//   memlean      the model's own memlean mode: DenseNet-BC's "efficient" bottlenecks
//                (cat -> BatchNorm -> ReLU -> 1x1 conv of every dense layer, seed 003); for
//                the MLP its hidden layer; for EfficientNet-B0 round(sqrt(n)) segments of its
//                n stages (Chen et al. 2016)
//   segments:K   the model's chain of stages cut into K (nearly) equal segments, each but
//                the last checkpointed (memlean::checkpoint_sequential); 1 <= K <= stages
struct Checkpointing {
  enum class Kind { kNone, kMemlean, kSegments };
  Kind kind = Kind::kNone;
  int64_t segments = 0;  // for kSegments

  static Checkpointing none() { return {}; }
  static Checkpointing memlean() { return {Kind::kMemlean, 0}; }
  static Checkpointing segments_of(int64_t k) { return {Kind::kSegments, k}; }
  bool operator==(const Checkpointing&) const = default;
};

// "none", "memlean", "segments:K" (K a positive integer); anything else is an error.
Checkpointing parse_checkpointing(std::string_view text);
std::string to_string(const Checkpointing& checkpointing);

// A model of this folder: a torch::nn::Module with a one-tensor forward, whose body is a
// chain of stages (what segments:K cuts).
class Model : public torch::nn::Module {
 public:
  using torch::nn::Module::Module;
  virtual at::Tensor forward(const at::Tensor& x) = 0;
  // The stages of the chain, in order (not registered as submodules: their modules are
  // registered by the model under their own names).
  virtual torch::nn::Sequential stages() const = 0;
  // Elements of all parameters.
  int64_t num_parameters() const;
};

// A link of a model's chain: a function of one tensor over some modules of the model, which
// the stage registers as its children "0", "1", ... so that stage->parameters() and
// stage->buffers() are theirs (memlean::checkpoint_sequential keeps and restores those).
class StageImpl : public torch::nn::Module {
 public:
  using Function = std::function<at::Tensor(const at::Tensor&)>;
  StageImpl(std::string name, std::vector<std::shared_ptr<torch::nn::Module>> modules,
            Function function);
  at::Tensor forward(const at::Tensor& x) { return function_(x); }
  void pretty_print(std::ostream& stream) const override;

 private:
  std::string name_;
  Function function_;
};

TORCH_MODULE(Stage);

// Runs `stages` on x with `checkpointing` resolved to segment starts: kNone runs them plainly,
// kSegments in K segments, kMemlean in round(sqrt(n)) segments.
at::Tensor run_stages(const torch::nn::Sequential& stages, const Checkpointing& checkpointing,
                      const at::Tensor& x);

// Checks that a segments:K asks for 1 <= K <= n_stages (c10::Error naming the model).
void check_checkpointing(const Checkpointing& checkpointing, int64_t n_stages,
                         const std::string& model);

}  // namespace memlean::models
