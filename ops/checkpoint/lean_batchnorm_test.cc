// Tests of memlean::lean_batch_norm (C++ API; under ASan/UBSan in CI): torch's forward and
// running statistics exactly, gradients equal to float64 autograd of the batch-norm formula,
// contiguous and channels_last, bfloat16 and float16 no further from float64 than torch's, the
// bfloat16 input gradient the float32 one rounded once, no
// tensor of the input's size allocated when it may overwrite the incoming gradient (memstats'
// exact CPU bytes), torch's path where it does not apply.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <limits>
#include <string>
#include <vector>

#include "ops/checkpoint/lean_batchnorm.h"
#include "runtime/memstats/live_bytes.h"
#include "testing/rounded_once.h"

namespace memlean {
namespace {

// Training-mode batch norm from float64 autograd ops.
at::Tensor reference(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, double eps) {
  const std::vector<int64_t> dims = {0, 2, 3};
  const at::Tensor mean = x.mean(dims, true);
  const at::Tensor var = (x - mean).pow(2).mean(dims, true);
  return (x - mean) / (var + eps).sqrt() * w.view({1, -1, 1, 1}) + b.view({1, -1, 1, 1});
}

class LeanBatchNormTest : public ::testing::TestWithParam<bool> {};

TEST_P(LeanBatchNormTest, ForwardIsTorchsGradientsAreFloat64s) {
  at::manual_seed(0);
  at::Tensor x = at::randn({4, 5, 6, 3}) * 2 + 1;
  if (GetParam()) x = x.contiguous(at::MemoryFormat::ChannelsLast);
  ASSERT_TRUE(lean_batch_norm_applies(x));
  const at::Tensor w0 = at::rand({5}) + 0.5, b0 = at::randn({5}), dy = at::randn({4, 5, 6, 3});
  at::Tensor rm = at::zeros({5}), rv = at::ones({5});
  at::Tensor rm_t = rm.clone(), rv_t = rv.clone();
  const at::Tensor xs = x.clone().requires_grad_(), w = w0.clone().requires_grad_(),
                   b = b0.clone().requires_grad_();
  const at::Tensor y = lean_batch_norm(xs, w, b, rm, rv, 0.2, 1e-3);
  const at::Tensor y_t = at::batch_norm(x, w0, b0, rm_t, rv_t, true, 0.2, 1e-3, false);
  EXPECT_TRUE(at::equal(y, y_t));
  EXPECT_TRUE(at::equal(rm, rm_t));
  EXPECT_TRUE(at::equal(rv, rv_t));
  const auto g = torch::autograd::grad({y}, {xs, w, b}, {dy});
  EXPECT_EQ(g[0].strides(), x.strides());
  const at::Tensor x64 = x.to(at::kDouble).requires_grad_(),
                   w64 = w0.to(at::kDouble).requires_grad_(),
                   b64 = b0.to(at::kDouble).requires_grad_();
  const auto r = torch::autograd::grad({reference(x64, w64, b64, 1e-3)}, {x64, w64, b64},
                                       {dy.to(at::kDouble)});
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(at::allclose(g[i].to(at::kDouble), r[i], 1e-4, 1e-4)) << "gradient " << i;
  }
}

TEST_P(LeanBatchNormTest, BackwardOverwritesTheGradientItOwns) {
  at::Tensor x0 = at::randn({8, 4, 32, 32});
  if (GetParam()) x0 = x0.contiguous(at::MemoryFormat::ChannelsLast);
  const int64_t nbytes = x0.numel() * 4;
  const at::Tensor w = at::ones({4}).requires_grad_(), b = at::zeros({4}).requires_grad_();
  const at::Tensor h = x0.clone().requires_grad_();
  const at::Tensor out = lean_batch_norm(h, w, b, std::nullopt, std::nullopt, 0.1, 1e-5) * 2;
  const at::Tensor dy = at::ones_like(x0);
  LiveBytes live;  // counts from zero: the backward's own allocations
  torch::autograd::backward({out}, {dy});
  // out = y * 2's backward makes dL/dy (one tensor of x's size, autograd's alone); the
  // batch-norm backward writes dL/dx over it: a few per-channel vectors more, no tensor.
  EXPECT_GE(live.peak(), nbytes);
  EXPECT_LT(live.peak(), nbytes + 64 * 4 * 8);
  ASSERT_TRUE(h.grad().defined());
}

INSTANTIATE_TEST_SUITE_P(Layouts, LeanBatchNormTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "ChannelsLast" : "Contiguous"; });

double error(const at::Tensor& a, const at::Tensor& reference) {
  return (a.to(at::kDouble) - reference).abs().max().item<double>();
}

// bfloat16 and float16 inputs with float32 weights (what a BatchNorm meets in a CPU autocast
// region) and with weights of the input's type: the lean backward runs, writes over the
// gradient it owns (exact bytes), and its gradients are no further from float64 autograd
// than torch's own backward's (twice its error, plus one unit in the last place).
TEST(LeanBatchNorm, ReducedPrecisionAsTorchsAndLean) {
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    for (const bool float_weights : {true, false}) {
      SCOPED_TRACE(std::string(c10::toString(dtype)) + (float_weights ? " float32 weights" : ""));
      at::manual_seed(5);
      const at::Tensor x = (at::randn({4, 6, 9, 7}) * 3 + 1).to(dtype);
      const at::Tensor dy = at::randn({4, 6, 9, 7}).to(dtype);
      const auto wtype = float_weights ? at::kFloat : dtype;
      const at::Tensor w0 = (at::rand({6}) + 0.5).to(wtype), b0 = at::randn({6}).to(wtype);
      ASSERT_TRUE(lean_batch_norm_applies(x));
      std::vector<at::Tensor> grads[2];
      for (const bool lean : {true, false}) {
        const at::Tensor xs = x.clone().requires_grad_(), w = w0.clone().requires_grad_(),
                         b = b0.clone().requires_grad_();
        const at::Tensor y = lean ? lean_batch_norm(xs, w, b, std::nullopt, std::nullopt, 0.1,
                                                    1e-3)
                                  : at::batch_norm(xs, w, b, {}, {}, true, 0.1, 1e-3, false);
        EXPECT_EQ(y.grad_fn()->name() == "NativeBatchNormBackward0", !lean);
        const at::Tensor out = y * 2;  // its gradient is autograd's alone: overwritten
        LiveBytes live;
        torch::autograd::backward({out}, {dy});
        if (lean) {
          EXPECT_GE(live.peak(), x.nbytes());
          EXPECT_LT(live.peak(), x.nbytes() + 64 * 6 * 8);
        }
        grads[lean ? 0 : 1] = {xs.grad(), w.grad(), b.grad()};
      }
      const at::Tensor x64 = x.to(at::kDouble).requires_grad_(),
                       w64 = w0.to(at::kDouble).requires_grad_(),
                       b64 = b0.to(at::kDouble).requires_grad_();
      const auto r = torch::autograd::grad({reference(x64, w64, b64, 1e-3) * 2}, {x64, w64, b64},
                                           {dy.to(at::kDouble)});
      const double bits = dtype == at::kBFloat16 ? 0x1p-7 : 0x1p-10;
      for (size_t i = 0; i < 3; ++i) {
        EXPECT_EQ(grads[0][i].scalar_type(), grads[1][i].scalar_type()) << "gradient " << i;
        const double ulp = r[i].abs().max().item<double>() * bits;
        EXPECT_LE(error(grads[0][i], r[i]), 2 * error(grads[1][i], r[i]) + ulp) << "gradient " << i;
      }
    }
  }
}

// The bfloat16 kernels widen and round bfloat16 by its bits (vectorized,
// internal/reduced_bits.h): the input gradient of a bfloat16 batch is the float32 kernel's from
// the same (exactly widened) values, rounded once to nearest even as c10::BFloat16 rounds: a
// NaN where float32 has one (a channel whose gradient holds a NaN), large values included.
TEST(LeanBatchNorm, BfloatInputGradientIsTheFloatOneRoundedOnce) {
  for (const bool channels_last : {false, true}) {
    SCOPED_TRACE(channels_last ? "channels_last" : "contiguous");
    at::manual_seed(11);
    at::Tensor x = (at::randn({4, 5, 8, 6}) * 3 + 1).to(at::kBFloat16);
    at::Tensor dy = at::randn({4, 5, 8, 6}).to(at::kBFloat16);
    dy.index_put_({1, 2, 3, 4}, std::numeric_limits<float>::quiet_NaN());  // channel 2: NaN
    dy.select(1, 4).mul_(1e36);  // channel 4: gradients near bfloat16's largest exponents
    if (channels_last) {
      x = x.contiguous(at::MemoryFormat::ChannelsLast);
      dy = dy.contiguous(at::MemoryFormat::ChannelsLast);
    }
    const at::Tensor w0 = at::rand({5}) + 0.5, b0 = at::randn({5});
    at::Tensor dx[2];
    for (const bool reduced : {true, false}) {
      const at::Tensor xs = (reduced ? x : x.to(at::kFloat)).clone().requires_grad_();
      ASSERT_TRUE(lean_batch_norm_applies(xs));
      const at::Tensor y = lean_batch_norm(xs, w0, b0, std::nullopt, std::nullopt, 0.1, 1e-3);
      torch::autograd::backward({y}, {reduced ? dy.clone() : dy.to(at::kFloat)});
      dx[reduced ? 0 : 1] = xs.grad();
    }
    testing::ExpectRoundedOnce(dx[0], dx[1]);
    EXPECT_TRUE(dx[0].isnan().select(1, 2).all().item<bool>());
    EXPECT_FALSE(dx[0].isnan().select(1, 0).any().item<bool>());
    EXPECT_GT(dx[0].select(1, 4).abs().max().item<float>(), 1e35);
  }
}

TEST(LeanBatchNorm, WhereItDoesNotApplyItIsTorchs) {
  const at::Tensor x = at::randn({4, 3, 10, 5}).slice(2, 0, 10, 2).requires_grad_();
  EXPECT_FALSE(lean_batch_norm_applies(x));
  const at::Tensor y = lean_batch_norm(x, std::nullopt, std::nullopt, std::nullopt,
                                       std::nullopt, 0.1, 1e-5);
  EXPECT_EQ(y.grad_fn()->name(), "NativeBatchNormBackward0");
  EXPECT_THROW(lean_batch_norm(at::randn({4, 3, 5}), at::ones({2}), std::nullopt, std::nullopt,
                               std::nullopt, 0.1, 1e-5),
               c10::Error);
}

}  // namespace
}  // namespace memlean
