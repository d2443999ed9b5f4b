// DenseNetBC (pytorch-checkpoint's efficient DenseNet demo, in LibTorch; docs/sources.md).
#include "experiments/models/densenet.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>
#include <ostream>
#include <string>

#include "ops/checkpoint/checkpoint.h"

namespace memlean::models {
namespace {

using torch::nn::Conv2dOptions;

}  // namespace

DenseLayerImpl::DenseLayerImpl(int64_t in_features, int64_t growth_rate, int64_t bottleneck,
                               double drop_rate, bool efficient)
    : torch::nn::Module("DenseLayer"), drop_rate_(drop_rate), efficient_(efficient) {
  norm1 = register_module("norm1", BatchNorm2d(in_features));
  conv1 = register_module(
      "conv1", torch::nn::Conv2d(Conv2dOptions(in_features, bottleneck * growth_rate, 1).bias(false)));
  norm2 = register_module("norm2", BatchNorm2d(bottleneck * growth_rate));
  conv2 = register_module("conv2", torch::nn::Conv2d(Conv2dOptions(bottleneck * growth_rate,
                                                                   growth_rate, 3)
                                                         .padding(1)
                                                         .bias(false)));
}

at::Tensor DenseLayerImpl::bottleneck(const std::vector<at::Tensor>& features) {
  const at::Tensor concatenated = features.size() == 1 ? features[0] : at::cat(features, 1);
  return conv1(norm1(concatenated).relu_());
}

at::Tensor DenseLayerImpl::forward(const std::vector<at::Tensor>& features) {
  at::Tensor b;
  if (efficient_) {
    // As in pytorch-checkpoint: args = prev_features + norm1's parameters + conv1's parameters.
    std::vector<at::Tensor> args = features;
    for (const auto& p : norm1->parameters()) args.push_back(p);
    for (const auto& p : conv1->parameters()) args.push_back(p);
    b = memlean::checkpoint(
        [this](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{bottleneck(in)}; },
        static_cast<int64_t>(features.size()), args)[0];
  } else {
    b = bottleneck(features);
  }
  at::Tensor out = conv2(norm2(b).relu_());
  if (drop_rate_ > 0) out = at::dropout(out, drop_rate_, is_training());
  return out;
}

DenseBlockImpl::DenseBlockImpl(int64_t n_layers, int64_t in_features, int64_t growth_rate,
                               int64_t bottleneck, double drop_rate, bool efficient)
    : torch::nn::Module("DenseBlock") {
  for (int64_t i = 0; i < n_layers; ++i) {
    layers.push_back(register_module(
        "denselayer" + std::to_string(i + 1),
        DenseLayer(in_features + i * growth_rate, growth_rate, bottleneck, drop_rate, efficient)));
  }
}

at::Tensor DenseBlockImpl::forward(const at::Tensor& x) {
  std::vector<at::Tensor> features = {x};
  features.reserve(layers.size() + 1);
  for (auto& layer : layers) features.push_back(layer->forward(features));
  return at::cat(features, 1);
}

TransitionImpl::TransitionImpl(int64_t in_features, int64_t out_features)
    : torch::nn::Module("Transition") {
  norm = register_module("norm", BatchNorm2d(in_features));
  conv = register_module("conv",
                         torch::nn::Conv2d(Conv2dOptions(in_features, out_features, 1).bias(false)));
}

at::Tensor TransitionImpl::forward(const at::Tensor& x) {
  return at::avg_pool2d(conv(norm(x).relu_()), {2, 2}, {2, 2});
}

DenseNetBCImpl::DenseNetBCImpl(const DenseNetBCOptions& options)
    : Model("DenseNetBC"), options(options) {
  const int64_t depth = options.depth();
  TORCH_CHECK_VALUE(depth >= 10 && (depth - 4) % 6 == 0,
                    "DenseNetBC: depth must be 6 * n + 4 with n >= 1 (e.g. 10, 40, 100, 190), got ",
                    depth);
  TORCH_CHECK_VALUE(options.growth_rate() >= 1, "DenseNetBC: growth_rate must be >= 1, got ",
                    options.growth_rate());
  TORCH_CHECK_VALUE(options.compression() > 0 && options.compression() <= 1,
                    "DenseNetBC: compression must be in (0, 1], got ", options.compression());
  TORCH_CHECK_VALUE(options.bottleneck() >= 1, "DenseNetBC: bottleneck must be >= 1, got ",
                    options.bottleneck());
  TORCH_CHECK_VALUE(options.init_features() >= 0, "DenseNetBC: init_features must be >= 0, got ",
                    options.init_features());
  TORCH_CHECK_VALUE(options.num_classes() >= 1, "DenseNetBC: num_classes must be >= 1, got ",
                    options.num_classes());
  TORCH_CHECK_VALUE(options.drop_rate() >= 0 && options.drop_rate() < 1,
                    "DenseNetBC: drop_rate must be in [0, 1), got ", options.drop_rate());
  const int64_t layers_per_block = (depth - 4) / 6;
  const int64_t growth = options.growth_rate();
  const bool efficient = options.checkpoint().kind == Checkpointing::Kind::kMemlean;
  int64_t channels = options.init_features() > 0 ? options.init_features() : 2 * growth;

  features = torch::nn::Sequential();
  features->push_back("conv0", torch::nn::Conv2d(Conv2dOptions(3, channels, 3).padding(1).bias(false)));
  for (int64_t i = 0; i < 3; ++i) {
    features->push_back("denseblock" + std::to_string(i + 1),
                        DenseBlock(layers_per_block, channels, growth, options.bottleneck(),
                                   options.drop_rate(), efficient));
    channels += layers_per_block * growth;
    if (i != 2) {
      const auto out = static_cast<int64_t>(std::floor(channels * options.compression()));
      TORCH_CHECK_VALUE(out >= 1, "DenseNetBC: compression ", options.compression(),
                        " leaves no channels after dense block ", i + 1);
      features->push_back("transition" + std::to_string(i + 1), Transition(channels, out));
      channels = out;
    }
  }
  features->push_back("norm_final", BatchNorm2d(channels));
  register_module("features", features);
  classifier = register_module("classifier", torch::nn::Linear(channels, options.num_classes()));
  check_checkpointing(options.checkpoint(), static_cast<int64_t>(features->size()), "DenseNetBC");

  // efficient_densenet_pytorch's initialisation.
  at::NoGradGuard no_grad;
  for (auto& p : named_parameters()) {
    const std::string& name = p.key();
    at::Tensor& w = p.value();
    const bool weight = name.find("weight") != std::string::npos;
    if (name.find("conv") != std::string::npos && weight) {
      const auto n = static_cast<double>(w.size(0) * w.size(2) * w.size(3));
      w.normal_(0.0, std::sqrt(2.0 / n));
    } else if (name.find("norm") != std::string::npos) {
      w.fill_(weight ? 1.0 : 0.0);
    } else if (name.find("classifier") != std::string::npos && !weight) {
      w.zero_();
    }
  }
}

at::Tensor DenseNetBCImpl::forward(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 4 && x.size(1) == 3 && x.size(2) >= 4 && x.size(3) >= 4,
                    "DenseNetBC: input must be [batch, 3, H, W] with H, W >= 4, got ", x.sizes());
  const Checkpointing& c = options.checkpoint();
  at::Tensor f = c.kind == Checkpointing::Kind::kSegments ? run_stages(features, c, x)
                                                          : features->forward(x);
  at::Tensor out = at::adaptive_avg_pool2d(f.relu_(), {1, 1}).flatten(1);
  return classifier(out);
}

void DenseNetBCImpl::pretty_print(std::ostream& stream) const {
  stream << "memlean::models::DenseNetBC(depth=" << options.depth()
         << ", growth_rate=" << options.growth_rate() << ", compression=" << options.compression()
         << ", bottleneck=" << options.bottleneck() << ", num_classes=" << options.num_classes()
         << ", checkpoint=" << to_string(options.checkpoint()) << ")";
}

}  // namespace memlean::models
