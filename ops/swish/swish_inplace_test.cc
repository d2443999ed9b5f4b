// Tests of the in-place Swish variant (memlean::swish_): the gradient recovered from
// (y, one bit) against float64 autograd over the whole real line, and autograd semantics.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/autograd.h>
#include <gtest/gtest.h>

#include <vector>

#include "ops/swish/cpu/swish_kernel.h"
#include "ops/swish/internal/constants.h"
#include "ops/swish/swish.h"
#include "runtime/memstats/live_bytes.h"
#include "testing/expect_error.h"

namespace memlean {
namespace {

using ::memlean::testing::expect_error;

// The bounds the in-place variant promises: max |grad - float64 reference|.
double bound(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return 1e-8;
    case at::kFloat: return 2e-4;
    default: return 3e-2;
  }
}

// A dense sweep of beta*x over [-110, 110], a denser one around the minimum t*, and
// normal random data, all in x-space for the given beta.
at::Tensor sweep(double beta) {
  const double scale = beta == 0.0 ? 1.0 : 1.0 / std::abs(beta);
  const double x_star = beta == 0.0 ? 0.0 : swish_constants::kTStar / beta;
  at::manual_seed(1);
  return at::cat({at::linspace(-110, 110, 2'000'001, at::kDouble) * scale,
                  at::linspace(x_star - 0.05 * scale, x_star + 0.05 * scale, 1'000'001,
                               at::kDouble),
                  at::randn({1'000'000}, at::kDouble) * 3 * scale});
}

// Max |grad of swish_ in dtype t - float64 autograd of x*sigmoid(beta*x)| for grad = 1.
double max_grad_error(const at::Tensor& x64, at::ScalarType t, double beta) {
  const at::Tensor x0 = x64.to(t).clone();  // never an alias of x64
  at::Tensor leaf = x0.clone().set_requires_grad(true);
  at::Tensor x = leaf * 1;  // a non-leaf, as an activation is
  const at::Tensor y = swish_(x, beta);
  EXPECT_TRUE(y.is_same(x));
  y.backward(at::ones_like(y));

  at::Tensor r = x0.to(at::kDouble).clone().set_requires_grad(true);
  (r * at::sigmoid(beta * r)).backward(at::ones_like(r));
  if (!leaf.grad().defined() || !r.grad().defined()) {
    ADD_FAILURE() << "no gradient for " << t << " beta=" << beta;
    return 1e9;
  }
  return (leaf.grad().to(at::kDouble) - r.grad()).abs().max().item<double>();
}

TEST(SwishInplace, GradientWithinBoundOverTheRealLine) {
  for (double beta : {1.0, 0.5, 2.0, -1.5, 0.0}) {
    const at::Tensor x = sweep(beta);
    for (auto t : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
      const double err = max_grad_error(x, t, beta);
      EXPECT_LE(err, bound(t)) << t << " beta=" << beta;
      RecordProperty(std::string(c10::toString(t)) + "_beta" + std::to_string(beta),
                     std::to_string(err));
    }
  }
}

// The in-place kernels split their blocks with at::parallel_for, a header template: built
// without -fopenmp against torch's OpenMP backend it runs everything on one thread.
TEST(SwishInplace, KernelsUseAtenThreads) {
  EXPECT_TRUE(swish_cpu::kernels().runs_in_parallel())
      << "the CPU kernels' at::parallel_for is serial: compile them with OPENMP_COPTS";
}

TEST(SwishInplace, ForwardOverwritesXWithSwish) {
  for (auto t : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    const at::Tensor x0 = (at::randn({1000, 3}) * 4).to(t);
    at::Tensor x = x0.clone();
    const void* ptr = x.data_ptr();
    const at::Tensor y = swish_(x, 1.7);
    EXPECT_EQ(y.data_ptr(), ptr);
    // The same formula as the out-of-place kernel; vector and scalar exp may differ by an ulp.
    EXPECT_TRUE(at::allclose(x, swish(x0, 1.7), t == at::kDouble ? 1e-14 : 1e-6,
                             t == at::kDouble ? 1e-14 : 1e-6) ||
                at::allclose(x.to(at::kFloat), swish(x0, 1.7).to(at::kFloat), 1e-2, 1e-2))
        << t;
  }
}

TEST(SwishInplace, NonContiguousAndRandomGradients) {
  at::Tensor base = (at::randn({300, 200}, at::kDouble) * 5).to(at::kFloat);
  at::Tensor leaf = base.clone().set_requires_grad(true);
  at::Tensor x = (leaf * 1).t();  // non-contiguous non-leaf
  ASSERT_FALSE(x.is_contiguous());
  const at::Tensor g = at::randn(x.sizes());
  swish_(x, 1.0).backward(g);
  at::Tensor r = base.to(at::kDouble).set_requires_grad(true);
  at::Tensor rt = r.t();
  (rt * at::sigmoid(rt)).backward(g.to(at::kDouble));
  const at::Tensor err = (leaf.grad().to(at::kDouble) - r.grad()).abs();
  EXPECT_LE((err / at::clamp_min(g.t().abs().to(at::kDouble), 1.0)).max().item<double>(), 2e-4);
}

TEST(SwishInplace, LeafThatRequiresGradIsRefused) {
  at::Tensor x = at::randn({4}).set_requires_grad(true);
  expect_error([&] { swish_(x); }, "x is a leaf tensor that requires grad");
  // Without grad mode, or when nothing requires grad, in-place is fine.
  at::Tensor plain = at::randn({4});
  const at::Tensor expected = swish(plain);
  swish_(plain);
  EXPECT_TRUE(at::equal(plain, expected));
}

TEST(SwishInplace, ModifiedSavedTensorFailsLoudly) {
  // x is saved by an earlier op (x * x); overwriting it must make that backward fail.
  at::Tensor leaf = at::randn({16}).set_requires_grad(true);
  at::Tensor x = leaf * 2;
  at::Tensor sq = x * x;
  swish_(x);
  expect_error([&] { (sq.sum() + x.sum()).backward(); },
               "modified by an inplace operation");

  // y is modified after swish_: swish_'s own backward must refuse it.
  at::Tensor leaf2 = at::randn({16}).set_requires_grad(true);
  at::Tensor y = swish_(leaf2 * 2);
  y.mul_(3);
  expect_error([&] { y.sum().backward(); }, "modified by an inplace operation");
}

TEST(SwishInplace, VersionCounterIsBumped) {
  at::Tensor x = at::randn({8});
  const auto v = x._version();
  swish_(x);
  EXPECT_EQ(x._version(), v + 1);
}

TEST(SwishInplace, DoubleBackwardIsAClearError) {
  at::Tensor leaf = at::randn({8}, at::kDouble).set_requires_grad(true);
  at::Tensor y = swish_(leaf * 1);
  expect_error(
      [&] {
        torch::autograd::grad({y.sum()}, {leaf}, {}, /*retain_graph=*/true, /*create_graph=*/true);
      },
      "double backward (create_graph=True) is not supported by the in-place variant");
}

TEST(SwishInplace, BadInputs) {
  expect_error([&] { swish_(at::zeros({3}, at::kInt)); }, "x must be float32, float64, bfloat16 or float16, got Int");
  expect_error([&] { swish_(at::randn({3}), std::nan("")); }, "beta must be finite");
  at::Tensor expanded = at::randn({1, 4}).expand({3, 4});
  EXPECT_THROW(swish_(expanded), c10::Error);  // elements share memory
  const at::Tensor y = at::randn({20});
  expect_error(
      [&] {
        swish_backward(at::randn({20}), y);  // fine: the memory-efficient kernel
        at::Tensor bad_mask = at::zeros({2}, at::kByte);
        c10::Dispatcher::singleton()
            .findSchemaOrThrow("memlean::_swish_inplace_backward", "")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>()
            .call(at::randn({20}), y, bad_mask, 1.0);
      },
      "mask has 2 bytes but y has 20 elements (expected 3 bytes)");
}

TEST(SwishInplace, MaskIsOneBitPerElement) {
  EXPECT_EQ(swish_inplace_mask_bytes(0), 0);
  EXPECT_EQ(swish_inplace_mask_bytes(1), 1);
  EXPECT_EQ(swish_inplace_mask_bytes(8), 1);
  EXPECT_EQ(swish_inplace_mask_bytes(9), 2);
  const at::Tensor x = at::tensor({-3.0f, 0.0f, -1.0f, -1.3f, 2.0f, -100.0f, -1.27f, -1.29f, -5.0f});
  at::Tensor xc = x.clone();
  const at::Tensor mask =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memlean::_swish_inplace_with_mask", "")
          .typed<at::Tensor(at::Tensor&, double)>()
          .call(xc, 1.0);
  ASSERT_EQ(mask.numel(), 2);
  // Left of t* = -1.2785: elements 0, 3, 5, 7 and 8.
  EXPECT_EQ(mask[0].item<uint8_t>(), 0b10101001);
  EXPECT_EQ(mask[1].item<uint8_t>(), 0b1);
}

// A Linear's output for a 3-d input is a view of its 2-d matmul result. Autograd records an
// in-place op on a view as one on its base (CopySlices), whose backward held two more tensors
// of its size; swish(x, kInplace) overwrites the base instead and returns a view of it, and
// the backward writes the input gradient over the incoming one (reshape's backward hands on
// a view of a base nobody else holds): the backward peaks exactly as for the same batch in
// 2-d, with the same gradients, equal to the out-of-place variant's.
struct LinearSwishLinear {
  int64_t backward_peak = 0;
  std::vector<at::Tensor> grads;  // x's, w1's, w2's
};

LinearSwishLinear linear_swish_linear(const at::Tensor& x0, SwishVariant variant) {
  at::manual_seed(0);
  const int64_t d = x0.size(-1);
  at::Tensor w1 = at::randn({96, d}, at::kDouble).set_requires_grad(true);
  at::Tensor b1 = at::randn({96}, at::kDouble).set_requires_grad(true);
  at::Tensor w2 = at::randn({8, 96}, at::kDouble).set_requires_grad(true);
  at::Tensor x = x0.clone().set_requires_grad(true);
  const at::Tensor h = at::linear(x, w1, b1);
  const at::Tensor y = swish(h, 1.0, variant);
  if (variant == SwishVariant::kInplace) {
    EXPECT_EQ(y.data_ptr(), h.data_ptr());  // h's memory overwritten
    EXPECT_TRUE(at::equal(y, h));
  }
  const at::Tensor loss = at::linear(y, w2).square().sum();
  LinearSwishLinear out;
  {
    LiveBytes live;
    loss.backward();
    out.backward_peak = live.peak();
  }
  out.grads = {x.grad(), w1.grad(), w2.grad()};
  return out;
}

TEST(SwishInplace, AViewOfAWholeTensorBacksUpAsATensor) {
  if (!LiveBytes::available()) GTEST_SKIP() << "another memory reporter is active";
  at::manual_seed(1);
  const at::Tensor x3 = at::randn({4, 32, 16}, at::kDouble);
  ASSERT_TRUE(at::linear(x3, at::ones({96, 16}, at::kDouble).set_requires_grad(true),
                         at::ones({96}, at::kDouble))
                  .is_view());  // (the case in question)
  const LinearSwishLinear three = linear_swish_linear(x3, SwishVariant::kInplace);
  const LinearSwishLinear two = linear_swish_linear(x3.reshape({128, 16}), SwishVariant::kInplace);
  const LinearSwishLinear lean =
      linear_swish_linear(x3, SwishVariant::kMemoryEfficient);
  EXPECT_EQ(three.backward_peak, two.backward_peak);
  for (size_t i = 0; i < three.grads.size(); ++i) {
    EXPECT_TRUE(at::allclose(three.grads[i].reshape(two.grads[i].sizes()), two.grads[i], 1e-12,
                             1e-12))
        << i;
    EXPECT_TRUE(at::allclose(three.grads[i], lean.grads[i], 1e-7, 1e-8)) << i;
  }
  // A view of part of a tensor is overwritten itself (torch's CopySlices).
  at::Tensor whole = at::randn({8, 16}, at::kDouble).set_requires_grad(true) * 1;
  const at::Tensor part = whole.narrow(0, 0, 4);
  EXPECT_TRUE(swish(part, 1.0, SwishVariant::kInplace).is_same(part));
}

TEST(SwishVariants, ParseAndPrint) {
  for (auto v : {SwishVariant::kNaive, SwishVariant::kMemoryEfficient, SwishVariant::kInplace}) {
    EXPECT_EQ(parse_swish_variant(to_string(v)), v);
  }
  expect_error([&] { parse_swish_variant("fast"); },
               "unknown variant \"fast\"; expected \"naive\", \"memory_efficient\" or \"inplace\"");
}

TEST(SwishVariants, SameForwardAndGradient) {
  const at::Tensor x0 = at::randn({64, 17}, at::kDouble) * 3;
  std::vector<at::Tensor> grads;
  for (auto v : {SwishVariant::kNaive, SwishVariant::kMemoryEfficient, SwishVariant::kInplace}) {
    at::Tensor leaf = x0.clone().set_requires_grad(true);
    const at::Tensor y = swish(leaf * 1, 0.8, v);
    EXPECT_TRUE(at::allclose(y, x0 * at::sigmoid(0.8 * x0), 1e-12, 1e-12)) << to_string(v);
    y.sum().backward();
    grads.push_back(leaf.grad());
  }
  EXPECT_TRUE(at::allclose(grads[0], grads[1], 1e-12, 1e-12));
  EXPECT_TRUE(at::allclose(grads[0], grads[2], 1e-9, 1e-9));
}

}  // namespace
}  // namespace memlean
