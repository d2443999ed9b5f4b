// Tests of the models: shapes, parameter names and counts, a loss that falls, and the same
// loss curve (and gradients) for every activation variant and checkpoint mode.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "experiments/models/densenet.h"
#include "experiments/models/efficientnet.h"
#include "experiments/models/mlp.h"
#include "experiments/models/model.h"
#include "testing/expect_error.h"

namespace memlean::models {
namespace {

using ::memlean::testing::expect_error;

constexpr Activation kAllActivations[] = {Activation::kNaive, Activation::kMemoryEfficient,
                                          Activation::kInplace, Activation::kSilu,
                                          Activation::kSiluInplace};

// Losses of `steps` SGD steps on one fixed batch (MSE for one output column, else cross
// entropy against labels y).
std::vector<double> train(Model& model, const at::Tensor& x, const at::Tensor& y, int steps,
                          double lr) {
  torch::optim::SGD sgd(model.parameters(), torch::optim::SGDOptions(lr).momentum(0.9));
  std::vector<double> losses;
  model.train();
  for (int i = 0; i < steps; ++i) {
    sgd.zero_grad();
    const at::Tensor out = model.forward(x);
    const at::Tensor loss = y.scalar_type() == at::kLong ? at::cross_entropy_loss(out, y)
                                                         : at::mse_loss(out, y);
    loss.backward();
    sgd.step();
    losses.push_back(loss.item<double>());
  }
  return losses;
}

void expect_falls(const std::vector<double>& losses) {
  ASSERT_GE(losses.size(), 2u);
  for (double l : losses) ASSERT_TRUE(std::isfinite(l));
  EXPECT_LT(losses.back(), 0.8 * losses.front()) << "first " << losses.front() << " last " << losses.back();
}

void expect_same_curve(const std::vector<double>& a, const std::vector<double>& b,
                       double rtol, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i], b[i], rtol * std::abs(a[i]) + 1e-7) << what << " step " << i + 1;
  }
}

std::vector<std::string> parameter_names(const torch::nn::Module& m) {
  std::vector<std::string> names;
  for (const auto& p : m.named_parameters()) names.push_back(p.key());
  return names;
}

bool has(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// ---- choices ---------------------------------------------------------------------------

TEST(Choices, ParseAndPrintActivations) {
  for (Activation a : kAllActivations) EXPECT_EQ(parse_activation(to_string(a)), a);
  EXPECT_EQ(activation_names(), "naive, memory_efficient, inplace, silu, silu_inplace");
  expect_error([] { parse_activation("relu"); }, "unknown activation 'relu'; expected one of naive");
}

TEST(Choices, ParseAndPrintCheckpointing) {
  EXPECT_EQ(parse_checkpointing("none"), Checkpointing::none());
  EXPECT_EQ(parse_checkpointing("memlean"), Checkpointing::memlean());
  EXPECT_EQ(parse_checkpointing("segments:3"), Checkpointing::segments_of(3));
  EXPECT_EQ(to_string(Checkpointing::segments_of(12)), "segments:12");
  for (const char* bad : {"segments:", "segments:0", "segments:-1", "segments:2x", "segments:1.5"}) {
    expect_error([&] { parse_checkpointing(bad); }, "must be a positive integer");
  }
  expect_error([] { parse_checkpointing("official"); },
               "unknown checkpoint mode 'official'; expected none, memlean or segments:K");
}

TEST(Choices, ActivationsHaveTheSameForward) {
  const at::Tensor x = at::randn({1000}, at::kDouble);
  const at::Tensor want = x * at::sigmoid(x);
  for (Activation a : kAllActivations) {
    at::Tensor in = x.clone();
    EXPECT_TRUE(at::allclose(activate(in, a), want, 1e-12, 1e-12)) << to_string(a);
    const bool inplace = a == Activation::kInplace || a == Activation::kSiluInplace;
    EXPECT_EQ(at::equal(in, x), !inplace) << to_string(a);
  }
}

// ---- Mlp -------------------------------------------------------------------------------

TEST(Mlp, DefaultsAreTheSwishBlogPostSizes) {
  const MlpOptions o;
  EXPECT_EQ(o.in_features(), 128);
  EXPECT_EQ(o.hidden_features(), 1 << 20);
  EXPECT_EQ(o.out_features(), 1);
  EXPECT_EQ(o.activation(), Activation::kMemoryEfficient);
  EXPECT_EQ(o.checkpoint(), Checkpointing::none());
}

TEST(Mlp, ShapesNamesAndCount) {
  Mlp m(MlpOptions().in_features(6).hidden_features(32).out_features(3));
  EXPECT_EQ(m->forward(at::randn({5, 6})).sizes(), (std::vector<int64_t>{5, 3}));
  EXPECT_EQ(m->forward(at::randn({4, 1, 2, 3})).sizes(), (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(parameter_names(*m), (std::vector<std::string>{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}));
  EXPECT_EQ(m->num_parameters(), 6 * 32 + 32 + 32 * 3 + 3);
  EXPECT_EQ(m->stages()->size(), 2u);
  expect_error([] { Mlp(MlpOptions().hidden_features(0)); }, "Mlp: sizes must be >= 1");
  expect_error([] { Mlp(MlpOptions().in_features(2).hidden_features(2).checkpoint(Checkpointing::segments_of(3))); },
               "segments:3 asks for more segments than the model has stages (2)");
}

struct MlpRun {
  std::vector<double> losses;
  std::vector<at::Tensor> params;
};

MlpRun run_mlp(Activation a, Checkpointing c, int steps = 6) {
  at::manual_seed(0);
  Mlp m(MlpOptions().in_features(8).hidden_features(64).out_features(1).activation(a).checkpoint(c));
  const at::Tensor x = at::randn({32, 8});
  const at::Tensor y = at::tanh(x.sum(1, true));
  MlpRun r;
  r.losses = train(*m, x, y, steps, 0.05);
  for (const auto& p : m->parameters()) r.params.push_back(p.detach().clone());
  return r;
}

TEST(Mlp, LossFalls) { expect_falls(run_mlp(Activation::kMemoryEfficient, {}, 10).losses); }

TEST(Mlp, EveryActivationGivesTheSameLossCurve) {
  const auto ref = run_mlp(Activation::kNaive, {});
  for (Activation a : kAllActivations) {
    expect_same_curve(ref.losses, run_mlp(a, {}).losses, 1e-5, to_string(a));
  }
}

TEST(Mlp, CheckpointingGivesTheSameLossCurveAndWeights) {
  const auto ref = run_mlp(Activation::kInplace, {});
  for (Checkpointing c : {Checkpointing::memlean(), Checkpointing::segments_of(1),
                          Checkpointing::segments_of(2)}) {
    const auto r = run_mlp(Activation::kInplace, c);
    expect_same_curve(ref.losses, r.losses, 1e-6, to_string(c));
    for (size_t i = 0; i < r.params.size(); ++i) {
      EXPECT_TRUE(at::allclose(ref.params[i], r.params[i], 1e-5, 1e-6)) << to_string(c);
    }
  }
}

// ---- DenseNetBC ------------------------------------------------------------------------

DenseNetBCOptions tiny_densenet() { return DenseNetBCOptions().depth(10).growth_rate(4); }

TEST(DenseNetBC, DefaultsArePytorchCheckpointsDenseNet) {
  DenseNetBC m;  // depth 100, k = 12: DenseNet-BC (L=100, k=12), 0.8M parameters
  EXPECT_EQ(m->options.depth(), 100);
  EXPECT_EQ(m->options.growth_rate(), 12);
  EXPECT_EQ(m->options.compression(), 0.5);
  EXPECT_EQ(m->options.bottleneck(), 4);
  EXPECT_EQ(m->num_parameters(), 769162);
  EXPECT_EQ(m->stages()->size(), 7u);
  const auto names = parameter_names(*m);
  for (const char* n : {"features.conv0.weight", "features.denseblock1.denselayer1.norm1.weight",
                        "features.denseblock3.denselayer16.conv2.weight",
                        "features.transition2.conv.weight", "features.norm_final.bias",
                        "classifier.weight"}) {
    EXPECT_TRUE(has(names, n)) << n;
  }
  torch::NoGradGuard no_grad;
  m->eval();
  EXPECT_EQ(m->forward(at::randn({2, 3, 32, 32})).sizes(), (std::vector<int64_t>{2, 10}));
}

TEST(DenseNetBC, Shapes) {
  DenseNetBC m(tiny_densenet().num_classes(7));
  // conv0: 8 channels; block: + 4; transition: 6; block: 10 -> 5; block: 9.
  EXPECT_EQ(m->classifier->options.in_features(), 9);
  EXPECT_EQ(m->forward(at::randn({3, 3, 32, 32})).sizes(), (std::vector<int64_t>{3, 7}));
  EXPECT_EQ(m->forward(at::randn({2, 3, 4, 4})).sizes(), (std::vector<int64_t>{2, 7}));
}

TEST(DenseNetBC, Errors) {
  expect_error([] { DenseNetBC(DenseNetBCOptions().depth(12)); }, "depth must be 6 * n + 4");
  expect_error([] { DenseNetBC(tiny_densenet().compression(0)); }, "compression must be in (0, 1]");
  expect_error([] { DenseNetBC(tiny_densenet().checkpoint(Checkpointing::segments_of(8))); },
               "segments:8 asks for more segments than the model has stages (7)");
  DenseNetBC m(tiny_densenet());
  expect_error([&] { m->forward(at::randn({1, 1, 8, 8})); }, "input must be [batch, 3, H, W]");
}

struct Run {
  std::vector<double> losses;
  std::vector<at::Tensor> params, buffers;
};

Run run_densenet(Checkpointing c, int steps = 4) {
  at::manual_seed(1);
  DenseNetBC m(tiny_densenet().checkpoint(c));
  const at::Tensor x = at::randn({8, 3, 8, 8});
  const at::Tensor y = at::arange(8) % 10;
  Run r;
  r.losses = train(*m, x, y, steps, 0.1);
  for (const auto& p : m->parameters()) r.params.push_back(p.detach().clone());
  for (const auto& b : m->buffers()) r.buffers.push_back(b.clone());
  return r;
}

TEST(DenseNetBC, LossFalls) { expect_falls(run_densenet({}, 8).losses); }

TEST(DenseNetBC, CheckpointingGivesTheSameLossCurveWeightsAndRunningStats) {
  const auto ref = run_densenet({});
  for (Checkpointing c : {Checkpointing::memlean(), Checkpointing::segments_of(3),
                          Checkpointing::segments_of(7)}) {
    const auto r = run_densenet(c);
    expect_same_curve(ref.losses, r.losses, 1e-5, to_string(c));
    ASSERT_EQ(ref.params.size(), r.params.size());
    for (size_t i = 0; i < r.params.size(); ++i) {
      EXPECT_TRUE(at::allclose(ref.params[i], r.params[i], 1e-4, 1e-5)) << to_string(c) << " parameter " << i;
    }
    // memlean::BatchNorm2d updates its statistics once per step, recomputed or not.
    ASSERT_EQ(ref.buffers.size(), r.buffers.size());
    for (size_t i = 0; i < r.buffers.size(); ++i) {
      EXPECT_TRUE(at::allclose(ref.buffers[i].to(at::kDouble), r.buffers[i].to(at::kDouble), 1e-4, 1e-5))
          << to_string(c) << " buffer " << i;
    }
  }
}

// ---- EfficientNetB0 --------------------------------------------------------------------

EfficientNetOptions tiny_efficientnet() {
  return EfficientNetOptions().num_classes(10).width_multiplier(0.25).depth_multiplier(0.25);
}

TEST(EfficientNetB0, PublishedParameterCountAndTimmNames) {
  EfficientNetB0 m;
  // The published EfficientNet-B0 (and timm's / torchvision's): 5,288,548 = 5.29M.
  EXPECT_NEAR(static_cast<double>(m->num_parameters()), 5.29e6, 0.01 * 5.29e6);
  EXPECT_EQ(m->num_parameters(), 5288548);
  EXPECT_EQ(m->stages()->size(), 18u);  // stem, 16 blocks, head
  const auto names = parameter_names(*m);
  for (const char* n : {"conv_stem.weight", "bn1.weight", "blocks.0.0.conv_dw.weight",
                        "blocks.0.0.se.conv_reduce.bias", "blocks.0.0.conv_pw.weight",
                        "blocks.1.0.conv_pw.weight", "blocks.1.1.conv_pwl.weight",
                        "blocks.5.3.bn3.bias", "blocks.6.0.se.conv_expand.weight",
                        "conv_head.weight", "bn2.weight", "classifier.bias"}) {
    EXPECT_TRUE(has(names, n)) << n;
  }
  EXPECT_EQ(m->named_parameters()["blocks.1.0.se.conv_reduce.weight"].sizes(),
            (std::vector<int64_t>{4, 96, 1, 1}));  // SE to in / 4 channels
  EXPECT_EQ(m->named_parameters()["blocks.2.0.conv_dw.weight"].sizes(),
            (std::vector<int64_t>{144, 1, 5, 5}));
  torch::NoGradGuard no_grad;
  m->eval();
  EXPECT_EQ(m->forward(at::randn({1, 3, 64, 64})).sizes(), (std::vector<int64_t>{1, 1000}));
}

TEST(EfficientNetB0, RoundChannelsAsTimm) {
  EXPECT_EQ(round_channels(32, 1.0), 32);
  EXPECT_EQ(round_channels(1280, 1.0), 1280);
  EXPECT_EQ(round_channels(16, 0.25), 8);
  EXPECT_EQ(round_channels(40, 1.1), 48);   // 44 -> 48
  EXPECT_EQ(round_channels(112, 1.1), 120);  // 123.2 -> 120 (>= 90%)
  EXPECT_EQ(round_channels(320, 2.0), 640);
}

TEST(EfficientNetB0, Shapes) {
  EfficientNetB0 m(tiny_efficientnet());
  EXPECT_EQ(m->stages()->size(), 9u);  // one block per stage
  EXPECT_EQ(m->forward(at::randn({2, 3, 32, 32})).sizes(), (std::vector<int64_t>{2, 10}));
  EXPECT_EQ(m->forward(at::randn({2, 3, 17, 23})).sizes(), (std::vector<int64_t>{2, 10}));
  expect_error([] { EfficientNetB0(tiny_efficientnet().width_multiplier(0)); },
               "width_multiplier must be > 0");
  expect_error([] { EfficientNetB0(tiny_efficientnet().checkpoint(Checkpointing::segments_of(10))); },
               "segments:10 asks for more segments than the model has stages (9)");
}

Run run_efficientnet(Activation a, Checkpointing c, int steps = 4, double drop = 0.2,
                     at::ScalarType dtype = at::kFloat, int64_t size = 16) {
  at::manual_seed(2);
  EfficientNetB0 m(tiny_efficientnet().activation(a).checkpoint(c).dropout(drop).drop_connect(drop));
  m->to(dtype);
  const at::Tensor x = at::randn({8, 3, size, size}, dtype);
  const at::Tensor y = at::arange(8) % 10;
  Run r;
  r.losses = train(*m, x, y, steps, 0.01);
  for (const auto& p : m->parameters()) r.params.push_back(p.detach().clone());
  for (const auto& b : m->buffers()) r.buffers.push_back(b.clone());
  return r;
}

TEST(EfficientNetB0, LossFalls) {
  expect_falls(run_efficientnet(Activation::kMemoryEfficient, {}, 10, 0.0).losses);
}

TEST(EfficientNetB0, EveryActivationGivesTheSameLossCurve) {
  // In float64 the five are the same function to rounding; in float32 batch norm over few
  // values amplifies the last-bit differences of the naive composition a little.
  for (auto [dtype, rtol, size] : {std::tuple{at::kDouble, 1e-6, 8}, std::tuple{at::kFloat, 3e-3, 16}}) {
    const auto ref = run_efficientnet(Activation::kNaive, {}, 4, 0.2, dtype, size);
    for (Activation a : kAllActivations) {
      expect_same_curve(ref.losses, run_efficientnet(a, {}, 4, 0.2, dtype, size).losses, rtol,
                        to_string(a) + " " + c10::toString(dtype));
    }
  }
}

TEST(EfficientNetB0, CheckpointingGivesTheSameLossCurveWeightsAndRunningStats) {
  // Dropout and stochastic depth on: the recompute must draw the same masks.
  const auto ref = run_efficientnet(Activation::kInplace, {});
  for (Checkpointing c : {Checkpointing::memlean(), Checkpointing::segments_of(4),
                          Checkpointing::segments_of(9)}) {
    const auto r = run_efficientnet(Activation::kInplace, c);
    expect_same_curve(ref.losses, r.losses, 1e-5, to_string(c));
    for (size_t i = 0; i < r.params.size(); ++i) {
      EXPECT_TRUE(at::allclose(ref.params[i], r.params[i], 1e-4, 1e-5)) << to_string(c) << " parameter " << i;
    }
    for (size_t i = 0; i < r.buffers.size(); ++i) {
      EXPECT_TRUE(at::allclose(ref.buffers[i].to(at::kDouble), r.buffers[i].to(at::kDouble), 1e-4, 1e-5))
          << to_string(c) << " buffer " << i;
    }
  }
}

}  // namespace
}  // namespace memlean::models
