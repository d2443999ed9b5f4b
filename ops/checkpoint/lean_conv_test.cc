// Tests of memlean::lean_conv2d (C++ API; under ASan/UBSan in CI): torch's forward exactly,
// gradients of a depthwise convolution equal to float64 autograd's for strides 1 and 2 and
// asymmetric padding, contiguous and channels_last, bfloat16/float16 models and CPU autocast
// no further from float64 than torch's own, the bfloat16 input gradient the float32 one
// rounded once, the input gradient the one tensor of the input's
// size its backward allocates (memstats' exact CPU bytes), torch's path where it does not
// apply.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "ops/checkpoint/lean_conv.h"
#include "runtime/memstats/live_bytes.h"
#include "testing/autocast_region.h"
#include "testing/rounded_once.h"

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

double error(const at::Tensor& a, const at::Tensor& reference) {
  return (a.to(at::kDouble) - reference).abs().max().item<double>();
}

// A bfloat16/float16 model, and a float32 one in a CPU autocast region of either: the lean
// backward runs (its node), the forward is torch's exactly (the same casts, the same kernel),
// the gradients have torch's dtypes and are no further from float64 autograd (on the values
// rounded as the convolution sees them) than torch's own backward's: twice its error, plus one
// unit in the last place (its float32 accumulator is rounded once, as is each of ours).
TEST(LeanConv, ReducedPrecisionAndAutocastNoFurtherFromFloat64ThanTorchs) {
  for (const auto dtype : {at::kBFloat16, at::kHalf}) {
    for (const bool autocast : {false, true}) {
      for (const bool last : {false, true}) {
        for (const int64_t stride : {1, 2}) {
          SCOPED_TRACE(std::string(c10::toString(dtype)) + (autocast ? " autocast" : "") +
                       (last ? " channels_last" : "") + " stride " + std::to_string(stride));
          at::manual_seed(2);
          at::Tensor x = at::randn({3, 8, 13, 10});
          if (last) x = x.contiguous(at::MemoryFormat::ChannelsLast);
          at::Tensor w0 = at::randn({8, 1, 3, 3}), b0 = at::randn({8});
          if (!autocast) {
            x = x.to(dtype);
            w0 = w0.to(dtype);
            b0 = b0.to(dtype);
          }
          std::vector<at::Tensor> grads[2];
          at::Tensor ys[2], dy;
          for (const bool lean : {true, false}) {
            const at::Tensor xs = x.clone().requires_grad_(), w = w0.clone().requires_grad_(),
                             b = b0.clone().requires_grad_();
            at::Tensor y;
            {
              std::optional<testing::AutocastRegion> region;
              if (autocast) region.emplace(dtype);
              EXPECT_TRUE(lean_conv2d_applies(xs, w, 8));
              y = lean ? lean_conv2d(xs, w, b, {stride}, {1}, {1}, 8)
                       : at::conv2d(xs, w, b, {stride}, {1}, {1}, 8);
            }
            EXPECT_EQ(y.grad_fn()->name().find("LeanConvFunction") != std::string::npos, lean);
            EXPECT_EQ(y.scalar_type(), dtype);
            if (!dy.defined()) dy = at::randn(y.sizes()).to(dtype);
            grads[lean ? 0 : 1] = torch::autograd::grad({y}, {xs, w, b}, {dy});
            ys[lean ? 0 : 1] = y;
          }
          EXPECT_TRUE(at::equal(ys[0], ys[1]));
          EXPECT_EQ(grads[0][0].strides(), x.strides());
          // The values the convolution computed with, in float64.
          const auto seen = [&](const at::Tensor& t) {
            return t.to(dtype).to(at::kDouble).requires_grad_();
          };
          const at::Tensor x64 = seen(x), w64 = seen(w0), b64 = seen(b0);
          const auto r = torch::autograd::grad(
              {at::conv2d(x64, w64, b64, {stride}, {1}, {1}, 8)}, {x64, w64, b64},
              {dy.to(at::kDouble)});
          const double bits = dtype == at::kBFloat16 ? 0x1p-7 : 0x1p-10;
          for (size_t i = 0; i < 3; ++i) {
            EXPECT_EQ(grads[0][i].scalar_type(), grads[1][i].scalar_type()) << "gradient " << i;
            const double ulp = r[i].abs().max().item<double>() * bits;
            EXPECT_LE(error(grads[0][i], r[i]), 2 * error(grads[1][i], r[i]) + ulp)
                << "gradient " << i;
          }
        }
      }
    }
  }
}

// The bfloat16 kernels widen and round bfloat16 by its bits (vectorized,
// internal/reduced_bits.h): each input-gradient row of a bfloat16 convolution is the float32
// kernel's from the same (exactly widened) values, rounded once to nearest even as
// c10::BFloat16 rounds, a NaN in the output gradient included; contiguous and channels_last,
// strides 1 and 2.
TEST(LeanConv, BfloatInputGradientIsTheFloatOneRoundedOnce) {
  for (const bool last : {false, true}) {
    for (const int64_t stride : {1, 2}) {
      SCOPED_TRACE(std::string(last ? "channels_last" : "contiguous") + " stride " +
                   std::to_string(stride));
      at::manual_seed(7);
      at::Tensor x = at::randn({3, 8, 13, 10}, at::kBFloat16);
      if (last) x = x.contiguous(at::MemoryFormat::ChannelsLast);
      const at::Tensor w0 = at::randn({8, 1, 3, 3}, at::kBFloat16);
      at::Tensor dy;
      at::Tensor gi[2];
      for (const bool reduced : {true, false}) {
        const auto type = reduced ? at::kBFloat16 : at::kFloat;
        const at::Tensor xs = x.to(type).clone().requires_grad_();
        const at::Tensor w = w0.to(type).requires_grad_();
        const at::Tensor y = lean_conv2d(xs, w, std::nullopt, {stride}, {1}, {1}, 8);
        if (!dy.defined()) {
          dy = at::randn(y.sizes(), at::kBFloat16);
          dy.index_put_({1, 3, 2, 2}, std::numeric_limits<float>::quiet_NaN());
        }
        gi[reduced ? 0 : 1] = torch::autograd::grad({y}, {xs}, {dy.to(type)})[0];
      }
      testing::ExpectRoundedOnce(gi[0], gi[1]);
      EXPECT_TRUE(gi[0].isnan().any().item<bool>());
      EXPECT_FALSE(gi[0].isnan().select(1, 2).any().item<bool>());
    }
  }
}

TEST(LeanConv, ReducedPrecisionBackwardAllocatesTheInputGradientAlone) {
  const at::Tensor x0 = at::randn({8, 16, 32, 32}, at::kBFloat16);
  const int64_t nbytes = x0.numel() * 2;
  for (const bool last : {false, true}) {
    const at::Tensor w = at::randn({16, 1, 3, 3}, at::kBFloat16).requires_grad_();
    const at::Tensor h = (last ? x0.contiguous(at::MemoryFormat::ChannelsLast) : x0.clone())
                             .requires_grad_();
    const at::Tensor y = lean_conv2d(h, w, std::nullopt, {1}, {1}, {1}, 16);
    const at::Tensor dy = at::ones_like(y);
    LiveBytes live;
    torch::autograd::backward({y}, {dy});
    // The input gradient, and the weight gradient as double then bfloat16 (10 bytes an
    // element); its float rows are the kernel's own (not tensors).
    EXPECT_GE(live.peak(), nbytes);
    EXPECT_LE(live.peak(), nbytes + 10 * w.numel() + 256);
    ASSERT_TRUE(h.grad().defined());
  }
}

TEST(LeanConv, WhereItDoesNotApplyItIsTorchs) {
  const at::Tensor x = at::randn({2, 4, 6, 6}).requires_grad_();
  const at::Tensor dense = at::randn({4, 4, 3, 3});
  EXPECT_FALSE(lean_conv2d_applies(x, dense, 1));
  EXPECT_EQ(lean_conv2d(x, dense, std::nullopt, {1}, {1}, {1}, 1).grad_fn()->name(),
            "ConvolutionBackward0");
  const at::Tensor half = x.detach().to(at::kBFloat16).requires_grad_();
  const at::Tensor w = at::randn({4, 1, 3, 3});
  EXPECT_FALSE(lean_conv2d_applies(half, w, 4));  // two types: torch's (its error)
  EXPECT_THROW(lean_conv2d(half, w, std::nullopt, {1}, {1}, {1}, 4), c10::Error);
  {
    // float64 in an autocast region: torch's conv2d leaves it as it is.
    testing::AutocastRegion region(at::kBFloat16);
    const at::Tensor x64 = x.detach().to(at::kDouble).requires_grad_();
    const at::Tensor w64 = w.to(at::kDouble);
    EXPECT_FALSE(lean_conv2d_applies(x64, w64, 4));
    EXPECT_EQ(lean_conv2d(x64, w64, std::nullopt, {1}, {1}, {1}, 4).grad_fn()->name(),
              "ConvolutionBackward0");
  }
  // torch's own errors for bad arguments.
  EXPECT_THROW(lean_conv2d(x, w, std::nullopt, {0}, {1}, {1}, 4), c10::Error);
  EXPECT_THROW(lean_conv2d(x, at::randn({4, 1, 9, 9}), std::nullopt, {1}, {0}, {1}, 4),
               c10::Error);
}

}  // namespace
}  // namespace memlean
