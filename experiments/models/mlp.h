// Mlp: the Swish blog post's reference network (docs/sources.md), Linear(in -> hidden) ->
// Swish -> Linear(hidden -> out).
#pragma once

#include <torch/arg.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

#include "experiments/models/model.h"

namespace memlean::models {

struct MlpOptions {
  // The Swish blog post's sizes: 128 -> 2^20 -> 1.
  TORCH_ARG(int64_t, in_features) = 128;
  TORCH_ARG(int64_t, hidden_features) = int64_t{1} << 20;
  TORCH_ARG(int64_t, out_features) = 1;
  TORCH_ARG(Activation, activation) = Activation::kMemoryEfficient;
  // memlean: the hidden layer (fc1 and the activation) is checkpointed, i.e. segments:2.
  TORCH_ARG(Checkpointing, checkpoint);
};

// Parameters fc1.{weight,bias}, fc2.{weight,bias} (torch's Linear initialisation). forward
// takes [batch, in_features] (any other shape is flattened from dimension 1) and returns
// [batch, out_features]. Stages: [fc1 -> activation, fc2].
class MlpImpl : public Model {
 public:
  explicit MlpImpl(const MlpOptions& options = {});
  at::Tensor forward(const at::Tensor& x) override;
  torch::nn::Sequential stages() const override { return stages_; }
  void pretty_print(std::ostream& stream) const override;

  MlpOptions options;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};

 private:
  torch::nn::Sequential stages_;
};

TORCH_MODULE(Mlp);

}  // namespace memlean::models
