// DenseNetBC: DenseNet-BC for CIFAR-sized input (Huang et al. 2017), as in
// pytorch-checkpoint's demo (docs/sources.md), gpleiss/efficient_densenet_pytorch, with the
// same module and parameter names; its `efficient` mode checkpoints cat -> BatchNorm -> ReLU
// -> 1x1 conv with memlean's checkpoint.
#pragma once

#include <torch/arg.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <vector>

#include "experiments/models/model.h"
#include "ops/checkpoint/batchnorm.h"

namespace memlean::models {

struct DenseNetBCOptions {
  // depth = 6 * (layers per dense block) + 4; three dense blocks.
  TORCH_ARG(int64_t, depth) = 100;
  TORCH_ARG(int64_t, growth_rate) = 12;
  // A transition keeps floor(compression * channels) channels, 0 < compression <= 1.
  TORCH_ARG(double, compression) = 0.5;
  // The 1x1 bottleneck conv of a dense layer has bottleneck * growth_rate channels.
  TORCH_ARG(int64_t, bottleneck) = 4;
  // Channels of the first conv; 0 = 2 * growth_rate.
  TORCH_ARG(int64_t, init_features) = 0;
  TORCH_ARG(int64_t, num_classes) = 10;
  // Dropout after each dense layer (0 = none, as in the DenseNet-BC CIFAR runs).
  TORCH_ARG(double, drop_rate) = 0.0;
  // memlean: every dense layer's cat -> norm1 -> ReLU -> conv1 is checkpointed with
  // memlean::checkpoint (efficient_densenet_pytorch's efficient=True); segments:K cuts the
  // chain of features (conv0, denseblock1, transition1, ..., norm_final).
  TORCH_ARG(Checkpointing, checkpoint);
};

// One dense layer: conv2(relu(norm2(conv1(relu(norm1(cat(features))))))).
class DenseLayerImpl : public torch::nn::Module {
 public:
  DenseLayerImpl(int64_t in_features, int64_t growth_rate, int64_t bottleneck, double drop_rate,
                 bool efficient);
  at::Tensor forward(const std::vector<at::Tensor>& features);
  // cat -> norm1 -> ReLU -> conv1, pytorch-checkpoint's bn_function.
  at::Tensor bottleneck(const std::vector<at::Tensor>& features);

  BatchNorm2d norm1{nullptr}, norm2{nullptr};
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};

 private:
  double drop_rate_;
  bool efficient_;
};

TORCH_MODULE(DenseLayer);

// A dense block: each layer sees the concatenation of the block's input and all earlier
// layers' outputs; returns the concatenation of all of them.
class DenseBlockImpl : public torch::nn::Module {
 public:
  DenseBlockImpl(int64_t layers, int64_t in_features, int64_t growth_rate, int64_t bottleneck,
                 double drop_rate, bool efficient);
  at::Tensor forward(const at::Tensor& x);

  std::vector<DenseLayer> layers;
};

TORCH_MODULE(DenseBlock);

// norm -> ReLU -> 1x1 conv -> 2x2 average pool.
class TransitionImpl : public torch::nn::Module {
 public:
  TransitionImpl(int64_t in_features, int64_t out_features);
  at::Tensor forward(const at::Tensor& x);

  BatchNorm2d norm{nullptr};
  torch::nn::Conv2d conv{nullptr};
};

TORCH_MODULE(Transition);

// Input [batch, 3, H, W] (CIFAR: 32 x 32; any size >= 4 x 4 works), output [batch,
// num_classes] logits. Parameter names as efficient_densenet_pytorch's DenseNet:
// features.conv0, features.denseblock{1,2,3}.denselayer{i}.{norm1,conv1,norm2,conv2},
// features.transition{1,2}.{norm,conv}, features.norm_final, classifier.
// All BatchNorms are memlean::BatchNorm2d (running statistics updated once per step when
// checkpointed). Initialisation as efficient_densenet_pytorch's.
class DenseNetBCImpl : public Model {
 public:
  explicit DenseNetBCImpl(const DenseNetBCOptions& options = {});
  at::Tensor forward(const at::Tensor& x) override;
  torch::nn::Sequential stages() const override { return features; }
  void pretty_print(std::ostream& stream) const override;

  DenseNetBCOptions options;
  torch::nn::Sequential features{nullptr};
  torch::nn::Linear classifier{nullptr};
};

TORCH_MODULE(DenseNetBC);

}  // namespace memlean::models
