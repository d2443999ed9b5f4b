// EfficientNetB0: EfficientNet-B0 (Tan & Le 2019) with MBConv blocks and squeeze-excitation,
// the Swish of every block chosen among memlean's variants and torch's SiLU. Module and
// parameter names, widths, depths and the initialisation are timm's efficientnet_b0, so a
// state dict moves between the two; 5,288,548 parameters at 1000 classes.
#pragma once

#include <torch/arg.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>

#include "experiments/models/model.h"
#include "ops/checkpoint/batchnorm.h"

namespace memlean::models {

struct EfficientNetOptions {
  TORCH_ARG(int64_t, num_classes) = 1000;
  // Channels are scaled by width_multiplier and rounded to multiples of 8 (timm's
  // round_channels); the repeats of each stage by depth_multiplier, rounded up. B0: 1 and 1.
  TORCH_ARG(double, width_multiplier) = 1.0;
  TORCH_ARG(double, depth_multiplier) = 1.0;
  // Dropout before the classifier.
  TORCH_ARG(double, dropout) = 0.2;
  // Stochastic depth of the residual blocks: block i of n drops its branch with probability
  // drop_connect * i / n (timm's drop_path_rate).
  TORCH_ARG(double, drop_connect) = 0.2;
  TORCH_ARG(Activation, activation) = Activation::kMemoryEfficient;
  // memlean: round(sqrt(n)) segments of the n stages (stem, each block, head); segments:K.
  TORCH_ARG(Checkpointing, checkpoint);
};

// Squeeze-excitation: x * sigmoid(conv_expand(act(conv_reduce(mean over H, W of x)))).
class SqueezeExciteImpl : public torch::nn::Module {
 public:
  SqueezeExciteImpl(int64_t channels, int64_t reduced, Activation activation);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Conv2d conv_reduce{nullptr}, conv_expand{nullptr};

 private:
  Activation activation_;
};

TORCH_MODULE(SqueezeExcite);

// MBConv. expand_ratio 1 (timm's DepthwiseSeparableConv): conv_dw -> bn1 -> act -> se ->
// conv_pw -> bn2. Otherwise (timm's InvertedResidual): conv_pw -> bn1 -> act -> conv_dw -> bn2
// -> act -> se -> conv_pwl -> bn3. A residual (with stochastic depth) when stride is 1 and
// the channels stay the same. The SE reduces to max(1, in / 4) channels.
class MBConvImpl : public torch::nn::Module {
 public:
  MBConvImpl(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t expand_ratio,
             double drop_connect, Activation activation);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Conv2d conv_pw{nullptr}, conv_dw{nullptr}, conv_pwl{nullptr};
  BatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
  SqueezeExcite se{nullptr};

 private:
  bool expand_;
  bool residual_;
  double drop_connect_;
  Activation activation_;
};

TORCH_MODULE(MBConv);

// Input [batch, 3, H, W] (224 x 224 for ImageNet; CIFAR's 32 x 32 works: the last feature map
// is then 1 x 1), output [batch, num_classes] logits. Parameters: conv_stem, bn1,
// blocks.{stage}.{block}.*, conv_head, bn2, classifier (timm's names).
// BatchNorms are memlean::BatchNorm2d (eps 1e-5, momentum 0.1, as timm's efficientnet_b0).
class EfficientNetB0Impl : public Model {
 public:
  explicit EfficientNetB0Impl(const EfficientNetOptions& options = {});
  at::Tensor forward(const at::Tensor& x) override;
  // [stem, every block, head].
  torch::nn::Sequential stages() const override { return stages_; }
  void pretty_print(std::ostream& stream) const override;

  EfficientNetOptions options;
  torch::nn::Conv2d conv_stem{nullptr}, conv_head{nullptr};
  BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::ModuleList blocks{nullptr};  // of ModuleLists of MBConv, one per stage
  torch::nn::Linear classifier{nullptr};

 private:
  torch::nn::Sequential stages_;
};

TORCH_MODULE(EfficientNetB0);

// timm's round_channels: channels * multiplier to a multiple of 8, at least 8, and not below
// 90% of the unrounded value.
int64_t round_channels(double channels, double multiplier);

}  // namespace memlean::models
