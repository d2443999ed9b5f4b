// EfficientNetB0 (timm's efficientnet_b0 in LibTorch, with memlean's Swish variants).
#include "experiments/models/efficientnet.h"

#include <ATen/ATen.h>
#include <torch/nn/modules/container/modulelist.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

namespace memlean::models {
namespace {

using torch::nn::Conv2dOptions;
using Modules = std::vector<std::shared_ptr<torch::nn::Module>>;

// One stage of B0: repeats, kernel, stride of the first block, expand ratio, out channels.
struct StageSpec {
  int64_t repeats, kernel, stride, expand, out;
};

constexpr StageSpec kB0[] = {
    {1, 3, 1, 1, 16},  {2, 3, 2, 6, 24},  {2, 5, 2, 6, 40},  {3, 3, 2, 6, 80},
    {3, 5, 1, 6, 112}, {4, 5, 2, 6, 192}, {1, 3, 1, 6, 320},
};
constexpr int64_t kStem = 32;
constexpr int64_t kHead = 1280;

torch::nn::Conv2d conv(int64_t in, int64_t out, int64_t kernel, int64_t stride = 1,
                       int64_t groups = 1, bool bias = false) {
  return torch::nn::Conv2d(Conv2dOptions(in, out, kernel)
                               .stride(stride)
                               .padding(((stride - 1) + (kernel - 1)) / 2)
                               .groups(groups)
                               .bias(bias));
}

// timm's DropPath: each sample's branch is kept with probability 1 - p and scaled by 1/(1-p).
at::Tensor drop_path(const at::Tensor& x, double p, bool training) {
  if (p <= 0 || !training) return x;
  const double keep = 1.0 - p;
  std::vector<int64_t> shape(x.dim(), 1);
  shape[0] = x.size(0);
  at::Tensor mask = at::empty(shape, x.options()).bernoulli_(keep);
  if (keep > 0) mask.div_(keep);
  return x * mask;
}

}  // namespace

int64_t round_channels(double channels, double multiplier) {
  const double v = channels * multiplier;
  constexpr int64_t kDivisor = 8;
  int64_t rounded = std::max<int64_t>(kDivisor, static_cast<int64_t>(v + kDivisor / 2.0) / kDivisor * kDivisor);
  if (static_cast<double>(rounded) < 0.9 * v) rounded += kDivisor;
  return rounded;
}

SqueezeExciteImpl::SqueezeExciteImpl(int64_t channels, int64_t reduced, Activation activation)
    : torch::nn::Module("SqueezeExcite"), activation_(activation) {
  conv_reduce = register_module("conv_reduce", conv(channels, reduced, 1, 1, 1, /*bias=*/true));
  conv_expand = register_module("conv_expand", conv(reduced, channels, 1, 1, 1, /*bias=*/true));
}

at::Tensor SqueezeExciteImpl::forward(const at::Tensor& x) {
  at::Tensor s = conv_expand(activate(conv_reduce(x.mean({2, 3}, /*keepdim=*/true)), activation_));
  return x * s.sigmoid();
}

MBConvImpl::MBConvImpl(int64_t in, int64_t out, int64_t kernel, int64_t stride,
                       int64_t expand_ratio, double drop_connect, Activation activation)
    : torch::nn::Module("MBConv"),
      expand_(expand_ratio != 1),
      residual_(stride == 1 && in == out),
      drop_connect_(drop_connect),
      activation_(activation) {
  const int64_t mid = in * expand_ratio;
  const int64_t reduced = std::max<int64_t>(1, in / 4);
  if (expand_) {
    conv_pw = register_module("conv_pw", conv(in, mid, 1));
    bn1 = register_module("bn1", BatchNorm2d(mid));
    conv_dw = register_module("conv_dw", conv(mid, mid, kernel, stride, mid));
    bn2 = register_module("bn2", BatchNorm2d(mid));
    se = register_module("se", SqueezeExcite(mid, reduced, activation));
    conv_pwl = register_module("conv_pwl", conv(mid, out, 1));
    bn3 = register_module("bn3", BatchNorm2d(out));
  } else {
    conv_dw = register_module("conv_dw", conv(in, in, kernel, stride, in));
    bn1 = register_module("bn1", BatchNorm2d(in));
    se = register_module("se", SqueezeExcite(in, reduced, activation));
    conv_pw = register_module("conv_pw", conv(in, out, 1));
    bn2 = register_module("bn2", BatchNorm2d(out));
  }
}

at::Tensor MBConvImpl::forward(const at::Tensor& x) {
  at::Tensor h;
  if (expand_) {
    h = activate(bn1(conv_pw(x)), activation_);
    h = activate(bn2(conv_dw(h)), activation_);
    h = bn3(conv_pwl(se(h)));
  } else {
    h = activate(bn1(conv_dw(x)), activation_);
    h = bn2(conv_pw(se(h)));
  }
  if (residual_) h = drop_path(h, drop_connect_, is_training()) + x;
  return h;
}

EfficientNetB0Impl::EfficientNetB0Impl(const EfficientNetOptions& options)
    : Model("EfficientNetB0"), options(options) {
  const double width = options.width_multiplier(), depth = options.depth_multiplier();
  TORCH_CHECK_VALUE(width > 0 && std::isfinite(width), "EfficientNetB0: width_multiplier must be > 0, got ", width);
  TORCH_CHECK_VALUE(depth > 0 && std::isfinite(depth), "EfficientNetB0: depth_multiplier must be > 0, got ", depth);
  TORCH_CHECK_VALUE(options.num_classes() >= 1, "EfficientNetB0: num_classes must be >= 1, got ",
                    options.num_classes());
  TORCH_CHECK_VALUE(options.dropout() >= 0 && options.dropout() < 1,
                    "EfficientNetB0: dropout must be in [0, 1), got ", options.dropout());
  TORCH_CHECK_VALUE(options.drop_connect() >= 0 && options.drop_connect() < 1,
                    "EfficientNetB0: drop_connect must be in [0, 1), got ", options.drop_connect());
  const Activation act = options.activation();

  const int64_t stem = round_channels(kStem, width);
  conv_stem = register_module("conv_stem", conv(3, stem, 3, 2));
  bn1 = register_module("bn1", BatchNorm2d(stem));
  stages_->push_back(Stage("stem", Modules{conv_stem.ptr(), bn1.ptr()},
                           [c = conv_stem, b = bn1, act](const at::Tensor& x) mutable {
                             return activate(b(c(x)), act);
                           }));

  int64_t total = 0;
  std::vector<int64_t> repeats;
  for (const auto& s : kB0) {
    repeats.push_back(static_cast<int64_t>(std::ceil(static_cast<double>(s.repeats) * depth)));
    total += repeats.back();
  }
  blocks = torch::nn::ModuleList();
  int64_t in = stem, index = 0;
  for (size_t i = 0; i < std::size(kB0); ++i) {
    const StageSpec& s = kB0[i];
    const int64_t out = round_channels(static_cast<double>(s.out), width);
    torch::nn::ModuleList stage;
    for (int64_t r = 0; r < repeats[i]; ++r, ++index) {
      MBConv block(in, out, s.kernel, r == 0 ? s.stride : 1, s.expand,
                   options.drop_connect() * static_cast<double>(index) / static_cast<double>(total),
                   act);
      stage->push_back(block);
      stages_->push_back(block);
      in = out;
    }
    blocks->push_back(stage);
  }
  register_module("blocks", blocks);

  const int64_t head = round_channels(kHead, width);
  conv_head = register_module("conv_head", conv(in, head, 1));
  bn2 = register_module("bn2", BatchNorm2d(head));
  stages_->push_back(Stage("head", Modules{conv_head.ptr(), bn2.ptr()},
                           [c = conv_head, b = bn2, act](const at::Tensor& x) mutable {
                             return activate(b(c(x)), act);
                           }));
  classifier = register_module("classifier", torch::nn::Linear(head, options.num_classes()));
  check_checkpointing(options.checkpoint(), static_cast<int64_t>(stages_->size()), "EfficientNetB0");

  // timm's _init_weight_goog.
  at::NoGradGuard no_grad;
  for (const auto& m : modules(/*include_self=*/false)) {
    if (auto* c = m->as<torch::nn::Conv2d>()) {
      const int64_t fan_out =
          c->weight.size(2) * c->weight.size(3) * c->options.out_channels() / c->options.groups();
      c->weight.normal_(0.0, std::sqrt(2.0 / static_cast<double>(fan_out)));
      if (c->bias.defined()) c->bias.zero_();
    } else if (auto* b = m->as<BatchNorm2d>()) {
      b->weight.fill_(1.0);
      b->bias.zero_();
    } else if (auto* l = m->as<torch::nn::Linear>()) {
      const double range = 1.0 / std::sqrt(static_cast<double>(l->weight.size(0)));
      l->weight.uniform_(-range, range);
      l->bias.zero_();
    }
  }
}

at::Tensor EfficientNetB0Impl::forward(const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() == 4 && x.size(1) == 3,
                    "EfficientNetB0: input must be [batch, 3, H, W], got ", x.sizes());
  at::Tensor f = run_stages(stages_, options.checkpoint(), x);
  f = at::adaptive_avg_pool2d(f, {1, 1}).flatten(1);
  if (options.dropout() > 0) f = at::dropout(f, options.dropout(), is_training());
  return classifier(f);
}

void EfficientNetB0Impl::pretty_print(std::ostream& stream) const {
  stream << "memlean::models::EfficientNetB0(num_classes=" << options.num_classes()
         << ", width_multiplier=" << options.width_multiplier()
         << ", depth_multiplier=" << options.depth_multiplier()
         << ", activation=" << to_string(options.activation())
         << ", checkpoint=" << to_string(options.checkpoint()) << ")";
}

}  // namespace memlean::models
