// Tests of memlean::BatchNorm2d: a drop-in for torch::nn::BatchNorm2d whose running
// statistics are updated exactly once per training forward, checkpointed or not.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>

#include <sstream>
#include <string>
#include <vector>

#include "ops/checkpoint/batchnorm.h"
#include "ops/checkpoint/checkpoint.h"
#include "testing/expect_error.h"

namespace memlean {
namespace {

using ::memlean::testing::expect_error;
using Tensors = std::vector<at::Tensor>;
using torch::nn::BatchNorm2dOptions;

at::TensorOptions f64() { return at::TensorOptions(at::kDouble); }

std::vector<std::string> keys(const torch::nn::Module& m) {
  std::vector<std::string> k;
  for (const auto& p : m.named_parameters()) k.push_back(p.key());
  for (const auto& b : m.named_buffers()) k.push_back(b.key());
  return k;
}

void expect_same_state(const torch::nn::Module& a, const torch::nn::Module& b) {
  const auto pa = a.named_parameters(), pb = b.named_parameters();
  const auto ba = a.named_buffers(), bb = b.named_buffers();
  ASSERT_EQ(pa.size(), pb.size());
  ASSERT_EQ(ba.size(), bb.size());
  for (const auto& p : pa) EXPECT_TRUE(at::equal(p.value(), *pb.find(p.key()))) << p.key();
  for (const auto& x : ba) EXPECT_TRUE(at::equal(x.value(), *bb.find(x.key()))) << x.key();
}

// A memlean::BatchNorm2d and a torch::nn::BatchNorm2d with the same options and state.
struct Pair {
  BatchNorm2d ours;
  torch::nn::BatchNorm2d theirs;
  explicit Pair(const BatchNorm2dOptions& o) : ours(o), theirs(o) {
    ours->to(at::kDouble);
    theirs->to(at::kDouble);
    at::NoGradGuard no_grad;
    if (o.affine()) {
      ours->weight.copy_(at::rand({o.num_features()}, f64()) + 0.5);
      ours->bias.copy_(at::randn({o.num_features()}, f64()));
      theirs->weight.copy_(ours->weight);
      theirs->bias.copy_(ours->bias);
    }
  }
};

TEST(BatchNorm2d, SameOptionsParametersAndStateDictKeysAsTorch) {
  for (const auto& o : {BatchNorm2dOptions(5), BatchNorm2dOptions(3).affine(false),
                        BatchNorm2dOptions(4).track_running_stats(false).momentum(std::nullopt)}) {
    BatchNorm2d ours(o);
    torch::nn::BatchNorm2d theirs(o);
    EXPECT_EQ(keys(*ours), keys(*theirs));
    EXPECT_EQ(ours->options.num_features(), o.num_features());
    EXPECT_EQ(ours->options.momentum(), o.momentum());
    EXPECT_EQ(ours->options.eps(), o.eps());
  }
  EXPECT_EQ(keys(*BatchNorm2d(2)),
            (std::vector<std::string>{"weight", "bias", "running_mean", "running_var",
                                      "num_batches_tracked"}));
  std::ostringstream s;
  s << *BatchNorm2d(BatchNorm2dOptions(7).momentum(0.2));
  EXPECT_EQ(s.str(),
            "memlean::BatchNorm2d(7, eps=1e-05, momentum=0.2, affine=true, track_running_stats=true)");
  // Clone keeps the type and copies the state.
  auto copy = std::dynamic_pointer_cast<BatchNorm2dImpl>(BatchNorm2d(3)->clone());
  ASSERT_NE(copy, nullptr);
}

TEST(BatchNorm2d, BehavesAsTorchsOutsideCheckpoints) {
  for (const auto& o : {BatchNorm2dOptions(4), BatchNorm2dOptions(4).momentum(std::nullopt),
                        BatchNorm2dOptions(4).affine(false),
                        BatchNorm2dOptions(4).track_running_stats(false)}) {
    Pair p(o);
    for (int step = 0; step < 3; ++step) {
      const at::Tensor x = at::randn({6, 4, 3, 3}, f64());
      EXPECT_TRUE(at::equal(p.ours(x), p.theirs(x)));
    }
    {
      // A train-mode forward under no_grad still updates the statistics, as torch's does.
      at::NoGradGuard no_grad;
      const at::Tensor x = at::randn({6, 4, 3, 3}, f64());
      EXPECT_TRUE(at::equal(p.ours(x), p.theirs(x)));
    }
    expect_same_state(*p.ours, *p.theirs);
    if (o.track_running_stats()) {
      EXPECT_EQ(p.ours->num_batches_tracked.item<int64_t>(), 4);
    }
    p.ours->eval();
    p.theirs->eval();
    const at::Tensor x = at::randn({2, 4, 3, 3}, f64());
    EXPECT_TRUE(at::equal(p.ours(x), p.theirs(x)));
    expect_same_state(*p.ours, *p.theirs);
  }
}

// One training step of conv -> BN, the BN inside a checkpoint in pytorch-checkpoint's form
// (docs/sources.md): the running statistics, num_batches_tracked and the gradients equal
// those of the step without it.
TEST(BatchNorm2d, StatisticsAfterACheckpointedStepEqualThePlainStep) {
  for (auto momentum : {std::optional<double>(0.1), std::optional<double>()}) {
    Pair p(BatchNorm2dOptions(4).momentum(momentum));
    BatchNorm2d plain_bn = p.ours;
    BatchNorm2d ckpt_bn = std::dynamic_pointer_cast<BatchNorm2dImpl>(p.ours->clone());
    const at::Tensor x = at::randn({8, 4, 5, 5}, f64()).requires_grad_(true);
    const at::Tensor x2 = x.detach().clone().requires_grad_(true);

    plain_bn(x).relu().pow(2).sum().backward();
    auto f = [&](const Tensors& in) { return Tensors{ckpt_bn(in[0]).relu()}; };
    checkpoint(f, 1, {x2, ckpt_bn->weight, ckpt_bn->bias})[0].pow(2).sum().backward();

    EXPECT_EQ(ckpt_bn->num_batches_tracked.item<int64_t>(), 1);
    expect_same_state(*ckpt_bn, *plain_bn);
    EXPECT_TRUE(at::equal(x2.grad(), x.grad()));
    EXPECT_TRUE(at::equal(ckpt_bn->weight.grad(), plain_bn->weight.grad()));
    EXPECT_TRUE(at::equal(ckpt_bn->bias.grad(), plain_bn->bias.grad()));
  }
}

// torch's own BatchNorm2d inside the same checkpoint counts the step twice: the bug
// memlean::BatchNorm2d exists for.
TEST(BatchNorm2d, TorchsBatchNormInAFunctionCheckpointIsUpdatedTwice) {
  torch::nn::BatchNorm2d bn(4);
  bn->to(at::kDouble);
  const at::Tensor x = at::randn({8, 4, 5, 5}, f64()).requires_grad_(true);
  checkpoint([&](const Tensors& in) { return Tensors{bn(in[0])}; }, 1, {x, bn->weight, bn->bias})[0]
      .sum()
      .backward();
  EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), 2);
}

TEST(BatchNorm2d, EvalModeInsideACheckpointIsUnaffected) {
  Pair p(BatchNorm2dOptions(4));
  // Some statistics first.
  p.ours(at::randn({8, 4, 3, 3}, f64()));
  p.theirs(at::randn({8, 4, 3, 3}, f64()));
  {
    at::NoGradGuard no_grad;
    p.theirs->running_mean.copy_(p.ours->running_mean);
    p.theirs->running_var.copy_(p.ours->running_var);
  }
  p.ours->eval();
  p.theirs->eval();
  const at::Tensor x = at::randn({8, 4, 3, 3}, f64()).requires_grad_(true);
  const at::Tensor y = checkpoint([&](const Tensors& in) { return Tensors{p.ours(in[0])}; }, 1,
                                  {x, p.ours->weight, p.ours->bias})[0];
  y.sum().backward();
  EXPECT_TRUE(at::equal(y, p.theirs(x)));
  expect_same_state(*p.ours, *p.theirs);
  EXPECT_EQ(p.ours->num_batches_tracked.item<int64_t>(), 1);
}

TEST(BatchNorm2d, BadInput) {
  BatchNorm2d bn(3);
  expect_error([&] { bn(at::randn({2, 3})); }, "memlean::BatchNorm2d: expected 4D input (got 2D input)");
  expect_error([&] { bn(at::randn({1, 3, 1, 1})); }, "Expected more than 1 value per channel");
}

}  // namespace
}  // namespace memlean
