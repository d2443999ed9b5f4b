// Tests of memlean::lean_conv2d (C++ API; under ASan/UBSan in CI): torch's forward exactly,
// gradients of a depthwise convolution equal to float64 autograd's for strides 1 and 2 and
// asymmetric padding, contiguous and channels_last, the input gradient the one tensor of the
// input's size its backward allocates (memstats' exact CPU bytes), torch's path where it does
// not apply.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <string>
#include <vector>

#include "ops/checkpoint/lean_conv.h"
#include "runtime/memstats/live_bytes.h"

namespace memlean {
namespace {

struct Case {
  int64_t stride_h, stride_w, pad_h, pad_w, dilation, kernel;
};

class LeanConvTest : public ::testing::TestWithParam<Case> {};

TEST_P(LeanConvTest, ForwardIsTorchsGradientsAreFloat64s) {
  const Case k = GetParam();
  at::manual_seed(0);
  const at::Tensor x = at::randn({3, 4, 11, 9});
  const at::Tensor w0 = at::randn({4, 1, k.kernel, k.kernel}), b0 = at::randn({4});
  ASSERT_TRUE(lean_conv2d_applies(x, w0, 4));
  const std::vector<int64_t> stride{k.stride_h, k.stride_w}, padding{k.pad_h, k.pad_w},
      dilation{k.dilation};
  const at::Tensor xs = x.clone().requires_grad_(), w = w0.clone().requires_grad_(),
                   b = b0.clone().requires_grad_();
  const at::Tensor y = lean_conv2d(xs, w, b, stride, padding, dilation, 4);
  EXPECT_NE(y.grad_fn()->name().find("LeanConvFunction"), std::string::npos);
  EXPECT_TRUE(at::equal(y, at::conv2d(x, w0, b0, stride, padding, dilation, 4)));
  const at::Tensor dy = at::randn(y.sizes());
  const auto g = torch::autograd::grad({y}, {xs, w, b}, {dy});
  const at::Tensor x64 = x.to(at::kDouble).requires_grad_(),
                   w64 = w0.to(at::kDouble).requires_grad_(),
                   b64 = b0.to(at::kDouble).requires_grad_();
  const auto r = torch::autograd::grad(
      {at::conv2d(x64, w64, b64, stride, padding, dilation, 4)}, {x64, w64, b64},
      {dy.to(at::kDouble)});
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(at::allclose(g[i].to(at::kDouble), r[i], 1e-5, 1e-5)) << "gradient " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Geometry, LeanConvTest,
                         ::testing::Values(Case{1, 1, 1, 1, 1, 3}, Case{2, 2, 1, 1, 1, 3},
                                           Case{2, 1, 2, 0, 1, 5}, Case{1, 2, 2, 2, 2, 3}),
                         [](const auto& info) {
                           const Case& k = info.param;
                           return "Stride" + std::to_string(k.stride_h) + "x" +
                                  std::to_string(k.stride_w) + "Pad" + std::to_string(k.pad_h) +
                                  "x" + std::to_string(k.pad_w) + "Dilation" +
                                  std::to_string(k.dilation) + "Kernel" +
                                  std::to_string(k.kernel);
                         });

TEST(LeanConv, ChannelsLastGradientsAreFloat64sInItsLayout) {
  at::manual_seed(1);
  const at::Tensor x = at::randn({2, 6, 9, 8}).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor w0 = at::randn({6, 1, 5, 5}), b0 = at::randn({6});
  ASSERT_TRUE(lean_conv2d_applies(x, w0, 6));
  const at::Tensor xs = x.clone().requires_grad_(), w = w0.clone().requires_grad_(),
                   b = b0.clone().requires_grad_();
  const at::Tensor y = lean_conv2d(xs, w, b, {2, 1}, {2, 1}, {1}, 6);
  EXPECT_NE(y.grad_fn()->name().find("LeanConvFunction"), std::string::npos);
  const at::Tensor dy = at::randn(y.sizes());
  const auto g = torch::autograd::grad({y}, {xs, w, b}, {dy});
  EXPECT_EQ(g[0].strides(), x.strides());
  const at::Tensor x64 = x.to(at::kDouble).requires_grad_(),
                   w64 = w0.to(at::kDouble).requires_grad_(),
                   b64 = b0.to(at::kDouble).requires_grad_();
  const auto r = torch::autograd::grad({at::conv2d(x64, w64, b64, {2, 1}, {2, 1}, {1}, 6)},
                                       {x64, w64, b64}, {dy.to(at::kDouble)});
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(at::allclose(g[i].to(at::kDouble), r[i], 1e-5, 1e-5)) << "gradient " << i;
  }
}

TEST(LeanConv, BackwardAllocatesTheInputGradientAndNoOtherTensorOfItsSize) {
  const at::Tensor x0 = at::randn({8, 16, 32, 32});
  const int64_t nbytes = x0.numel() * 4;
  const at::Tensor w = at::randn({16, 1, 3, 3}).requires_grad_();
  const at::Tensor h = x0.clone().requires_grad_();
  const at::Tensor y = lean_conv2d(h, w, std::nullopt, {2}, {1}, {1}, 16);
  const at::Tensor dy = at::ones_like(y);
  LiveBytes live;  // counts from zero: the backward's own allocations
  torch::autograd::backward({y}, {dy});
  // The input gradient, and the weight gradient as double then float (12 bytes an element).
  EXPECT_GE(live.peak(), nbytes);
  EXPECT_LE(live.peak(), nbytes + 12 * w.numel() + 256);
  ASSERT_TRUE(h.grad().defined());
  ASSERT_TRUE(w.grad().defined());
}

TEST(LeanConv, WhereItDoesNotApplyItIsTorchs) {
  const at::Tensor x = at::randn({2, 4, 6, 6}).requires_grad_();
  const at::Tensor dense = at::randn({4, 4, 3, 3});
  EXPECT_FALSE(lean_conv2d_applies(x, dense, 1));
  EXPECT_EQ(lean_conv2d(x, dense, std::nullopt, {1}, {1}, {1}, 1).grad_fn()->name(),
            "ConvolutionBackward0");
  const at::Tensor half = x.detach().to(at::kBFloat16).requires_grad_();
  const at::Tensor w = at::randn({4, 1, 3, 3}, at::kBFloat16);
  EXPECT_FALSE(lean_conv2d_applies(half, w, 4));
  EXPECT_EQ(lean_conv2d(half, w, std::nullopt, {1}, {1}, {1}, 4).grad_fn()->name(),
            "ConvolutionBackward0");
  // torch's own errors for bad arguments.
  EXPECT_THROW(lean_conv2d(x, w.to(at::kFloat), std::nullopt, {0}, {1}, {1}, 4), c10::Error);
  EXPECT_THROW(lean_conv2d(x, at::randn({4, 1, 9, 9}), std::nullopt, {1}, {0}, {1}, 4),
               c10::Error);
}

}  // namespace
}  // namespace memlean
