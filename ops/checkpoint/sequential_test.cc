// Tests of checkpoint_sequential, the segment planner (against brute force over every
// segmentation) and the layer-cost measurement.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

#include <limits>
#include <random>
#include <vector>

#include "ops/checkpoint/batchnorm.h"
#include "runtime/memstats/live_bytes.h"
#include "ops/checkpoint/sequential.h"
#include "testing/expect_error.h"

namespace memlean {
namespace {

using ::memlean::testing::expect_error;
using Starts = std::vector<int64_t>;

at::TensorOptions f64() { return at::TensorOptions(at::kDouble); }

std::vector<at::Tensor> take_grads(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> grads;
  for (const auto& t : tensors) {
    grads.push_back(t.grad().defined() ? t.grad().clone() : at::Tensor());
    if (t.grad().defined()) t.mutable_grad().reset();
  }
  return grads;
}

// ---- segment starts and the peak model ---------------------------------------------

TEST(Segments, EqualAndSqrt) {
  EXPECT_EQ(equal_segment_starts(10, 3), (Starts{0, 3, 6}));
  EXPECT_EQ(equal_segment_starts(4, 4), (Starts{0, 1, 2, 3}));
  EXPECT_EQ(equal_segment_starts(7, 1), (Starts{0}));
  EXPECT_EQ(sqrt_segment_starts(16), (Starts{0, 4, 8, 12}));
  EXPECT_EQ(sqrt_segment_starts(100).size(), 10u);
  EXPECT_EQ(sqrt_segment_starts(1), (Starts{0}));
  EXPECT_EQ(sqrt_segment_starts(0), (Starts{}));
  expect_error([] { equal_segment_starts(4, 5); }, "segments must be between 1 and the number of layers (4), got 5");
  expect_error([] { equal_segment_starts(4, 0); }, "got 0");
}

TEST(Segments, PeakModel) {
  // in: 10 each, act: 1, 2, 3, 4
  std::vector<LayerCost> layers = {{10, 1}, {10, 2}, {10, 3}, {10, 4}};
  EXPECT_EQ(estimate_peak_bytes(layers, {0}), 10 + 10);               // no checkpoint
  EXPECT_EQ(estimate_peak_bytes(layers, {0, 2}), std::max(10 + 3, 10 + 10 + 7));
  EXPECT_EQ(estimate_peak_bytes(layers, {0, 1, 2, 3}), 30 + 10 + 4);
  expect_error([&] { estimate_peak_bytes(layers, {1}); }, "the first segment must start at layer 0");
  expect_error([&] { estimate_peak_bytes(layers, {0, 2, 2}); }, "segment starts must increase");
  expect_error([&] { estimate_peak_bytes(layers, {0, 4}); }, "be < the number of layers (4)");
  expect_error([&] { estimate_peak_bytes({{-1, 0}}, {0}); }, "layer 0 has a negative cost");
}

TEST(Segments, CostsThatOverflowInt64AreAnError) {
  // Each cost fits, their sum does not: the estimate used to wrap to 0 and "fit" any budget.
  constexpr int64_t big = int64_t{1} << 61;  // four of them: 2^63
  const std::vector<LayerCost> layers = {{big, big}, {big, big}};
  expect_error([&] { plan_segments(layers, int64_t{1} << 20); }, "add up to more than 2^63 - 1");
  expect_error([&] { plan_segments(layers, std::nullopt); }, "add up to more than 2^63 - 1");
  expect_error([&] { estimate_peak_bytes(layers, {0}); }, "(at layer 1: input_bytes=");
  // The largest costs that still add up: planned, peak exact.
  const int64_t max = std::numeric_limits<int64_t>::max();
  const SegmentPlan plan = plan_segments({{max / 2, 0}, {0, max / 2}}, std::nullopt);
  EXPECT_EQ(plan.estimated_peak_bytes, max / 2 + max / 2);
}

// Every segmentation of n layers (bit i set: a segment starts at layer i + 1).
std::vector<Starts> all_plans(int64_t n) {
  std::vector<Starts> plans;
  for (int64_t mask = 0; mask < (int64_t{1} << (n - 1)); ++mask) {
    Starts s = {0};
    for (int64_t i = 0; i + 1 < n; ++i) {
      if (mask >> i & 1) s.push_back(i + 1);
    }
    plans.push_back(s);
  }
  return plans;
}

int64_t kept_bytes(const std::vector<LayerCost>& layers, const Starts& s) {
  int64_t k = 0;
  for (size_t j = 0; j + 1 < s.size(); ++j) k += layers[s[j]].input_bytes;
  return k;
}

TEST(Planner, WithABudgetMatchesBruteForce) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t n = 1 + trial % 10;
    std::vector<LayerCost> layers;
    for (int64_t i = 0; i < n; ++i) {
      layers.push_back({static_cast<int64_t>(rng() % 50 + 1), static_cast<int64_t>(rng() % 100)});
    }
    const auto plans = all_plans(n);
    int64_t min_peak = std::numeric_limits<int64_t>::max(), max_peak = 0;
    for (const auto& p : plans) {
      min_peak = std::min(min_peak, estimate_peak_bytes(layers, p));
      max_peak = std::max(max_peak, estimate_peak_bytes(layers, p));
    }
    for (int64_t budget = 0; budget <= max_peak + 1; budget += 1 + max_peak / 23) {
      const SegmentPlan plan = plan_segments(layers, budget);
      EXPECT_EQ(plan.estimated_peak_bytes, estimate_peak_bytes(layers, plan.starts));
      if (budget < min_peak) {
        EXPECT_FALSE(plan.fits_budget);
        EXPECT_EQ(plan.estimated_peak_bytes, min_peak) << "trial " << trial;
        continue;
      }
      ASSERT_TRUE(plan.fits_budget) << "trial " << trial << " budget " << budget;
      EXPECT_LE(plan.estimated_peak_bytes, budget);
      // No fitting plan recomputes fewer layers, or as few while keeping fewer bytes.
      for (const auto& p : plans) {
        if (estimate_peak_bytes(layers, p) > budget) continue;
        EXPECT_GE(p.back(), plan.starts.back()) << "trial " << trial;
        if (p.back() == plan.starts.back()) {
          EXPECT_GE(kept_bytes(layers, p), kept_bytes(layers, plan.starts));
        }
      }
    }
  }
}

TEST(Planner, DefaultIsSqrtAndALargeBudgetNeedsNoCheckpoint) {
  std::vector<LayerCost> layers(16, LayerCost{100, 100});
  const SegmentPlan sqrt_plan = plan_segments(layers);
  EXPECT_EQ(sqrt_plan.starts, (Starts{0, 4, 8, 12}));
  EXPECT_TRUE(sqrt_plan.fits_budget);
  EXPECT_EQ(sqrt_plan.estimated_peak_bytes, 300 + 100 + 400);
  EXPECT_EQ(plan_segments(layers, 1 << 20).starts, (Starts{0}));
  EXPECT_EQ(plan_segments({}, 10).starts, (Starts{}));
  expect_error([&] { plan_segments(layers, -1); }, "budget_bytes must be >= 0");
}

// ---- checkpoint_sequential -----------------------------------------------------------

torch::nn::Sequential make_chain(int n, double dropout = 0.0) {
  torch::nn::Sequential seq;
  for (int i = 0; i < n; ++i) {
    seq->push_back(torch::nn::Linear(8, 8));
    seq->push_back(torch::nn::Tanh());
    if (dropout > 0) seq->push_back(torch::nn::Dropout(dropout));
  }
  seq->to(at::kDouble);
  return seq;
}

TEST(CheckpointSequential, GradientsEqualPlainWithDropout) {
  auto seq = make_chain(6, 0.3);
  const at::Tensor x = at::randn({16, 8}, f64()).requires_grad_(true);
  auto all = seq->parameters();
  all.push_back(x);
  at::manual_seed(5);
  seq->forward(x).pow(2).sum().backward();
  const auto plain = take_grads(all);
  for (int64_t segments : {1, 2, 3, 5, 18}) {
    at::manual_seed(5);
    checkpoint_sequential(seq, segments, x).pow(2).sum().backward();
    const auto got = take_grads(all);
    for (size_t i = 0; i < all.size(); ++i) {
      EXPECT_TRUE(at::equal(got[i], plain[i])) << segments << " segments, tensor " << i;
    }
  }
}

TEST(CheckpointSequential, KeepsTheSegmentInputsAndTheLastSegment) {
  constexpr int kBlocks = 12;
  auto seq = make_chain(kBlocks);  // 24 layers: Linear, Tanh, ...
  const at::Tensor x = at::randn({32, 8}, f64()).requires_grad_(true);
  const int64_t act = 32 * 8 * 8;
  const auto opts = CheckpointOptions().preserve_rng_state(false);
  {
    LiveBytes live;
    const at::Tensor y = seq->forward(x);
    EXPECT_EQ(live.live(), kBlocks * act);  // every Tanh's output
  }
  for (int64_t segments : {2, 3, 4, 6}) {
    LiveBytes live;
    const at::Tensor y = checkpoint_sequential(seq, segments, x, opts);
    // segments - 1 checkpointed segments keep their outputs (the next one's input); the last
    // segment, run as usual, keeps its Tanh outputs.
    const int64_t last_blocks = kBlocks / segments;
    EXPECT_EQ(live.live(), (segments - 1) * act + last_blocks * act) << segments << " segments";
  }
}

TEST(CheckpointSequential, BatchNormStatisticsEqualPlain) {
  auto make = [] {
    torch::nn::Sequential s;
    for (int i = 0; i < 4; ++i) {
      s->push_back(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 3, 3).padding(1)));
      s->push_back(BatchNorm2d(3));
      s->push_back(torch::nn::ReLU());
    }
    s->to(at::kDouble);
    return s;
  };
  at::manual_seed(1);
  auto plain = make();
  at::manual_seed(1);
  auto ckpt = make();
  const at::Tensor x = at::randn({4, 3, 6, 6}, f64());
  plain->forward(x).sum().backward();
  checkpoint_sequential(ckpt, 3, x).sum().backward();
  const auto bp = plain->named_buffers(), bc = ckpt->named_buffers();
  for (const auto& b : bp) EXPECT_TRUE(at::equal(b.value(), *bc.find(b.key()))) << b.key();
  const auto pp = plain->named_parameters(), pc = ckpt->named_parameters();
  for (const auto& p : pp) {
    EXPECT_TRUE(at::allclose(p.value().grad(), pc.find(p.key())->grad(), 1e-13, 1e-13)) << p.key();
  }
}

TEST(CheckpointSequential, BadSegments) {
  auto seq = make_chain(2);
  const at::Tensor x = at::randn({2, 8}, f64());
  expect_error([&] { checkpoint_sequential(seq, 0, x); }, "segments must be between 1 and the number of layers (4), got 0");
  expect_error([&] { checkpoint_sequential(seq, Starts{0, 3, 1}, x); }, "segment starts must increase");
  expect_error([&] { checkpoint_sequential(seq, Starts{}, x); }, "the first segment must start at layer 0");
  EXPECT_TRUE(at::equal(checkpoint_sequential(torch::nn::Sequential(), Starts{}, x), x));
}

// ---- measurement ---------------------------------------------------------------------

TEST(MeasureLayerCosts, ExactBytesAndNoSideEffects) {
  torch::nn::Sequential seq(torch::nn::Linear(8, 16), torch::nn::Tanh(),
                            torch::nn::Dropout(0.5), torch::nn::Linear(16, 4));
  seq->to(at::kDouble);
  const at::Tensor x = at::randn({10, 8}, f64());
  const at::Tensor before = at::detail::getDefaultCPUGenerator().get_state();
  const auto costs = measure_layer_costs(seq, x);
  EXPECT_TRUE(at::equal(at::detail::getDefaultCPUGenerator().get_state(), before));
  ASSERT_EQ(costs.size(), 4u);
  const int64_t h = 10 * 16 * 8;
  EXPECT_EQ(costs[0].input_bytes, 10 * 8 * 8);
  EXPECT_EQ(costs[0].activation_bytes, h);  // its output
  EXPECT_EQ(costs[1].input_bytes, h);
  EXPECT_EQ(costs[1].activation_bytes, h);  // its output, saved for backward
  // Dropout: its output and its mask (float64 in, so a float64 mask).
  EXPECT_EQ(costs[2].activation_bytes, 2 * h);
  EXPECT_EQ(costs[3].activation_bytes, 10 * 4 * 8);

  // Statistics are not updated by measuring.
  torch::nn::Sequential with_bn(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 3, 1)), BatchNorm2d(3));
  measure_layer_costs(with_bn, at::randn({4, 3, 5, 5}));
  EXPECT_EQ(with_bn->ptr<BatchNorm2dImpl>(1)->num_batches_tracked.item<int64_t>(), 0);

  const auto plan = plan_segments(costs);
  EXPECT_EQ(plan.starts, (Starts{0, 2}));
}

}  // namespace
}  // namespace memlean
