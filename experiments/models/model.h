// What the models of //experiments/models share: the Model interface, Stage (a link of a
// model's chain of stages) and running that chain with the chosen checkpointing.
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

#include "experiments/models/choices.h"

namespace memlean::models {

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
