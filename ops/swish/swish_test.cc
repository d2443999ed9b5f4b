// Tests of memlean::swish against at::silu, the float64 formula and float64 autograd.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <vector>

#include "ops/swish/module.h"
#include "ops/swish/swish.h"
#include "testing/expect_error.h"

namespace memlean {
namespace {

using ::memlean::testing::expect_error;

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf};
const std::vector<double> kBetas = {0.0, 0.5, 1.0, 1.702, -2.0, 10.0};

double rtol(at::ScalarType t) {
  switch (t) {
    case at::kDouble: return 1e-12;
    case at::kFloat: return 1e-5;
    default: return 1e-2;  // one bf16/fp16 rounding of a float result
  }
}
double atol(at::ScalarType t) { return t == at::kDouble ? 1e-12 : t == at::kFloat ? 1e-6 : 1e-2; }

// The formula in float64, rounded to the input's dtype.
at::Tensor reference_forward(const at::Tensor& x, double beta) {
  const at::Tensor x64 = x.to(at::kDouble);
  return (x64 * at::sigmoid(beta * x64)).to(x.scalar_type());
}

// Shapes: empty, 0-dim, 1-d (odd length, so the vector tail runs), 2-d, 4-d large enough
// to be split over threads.
std::vector<at::Tensor> inputs(at::ScalarType t) {
  at::manual_seed(0);
  return {
      at::empty({0}, at::TensorOptions(t)),
      at::randn({}, at::TensorOptions(t)) * 3,
      at::randn({37}, at::TensorOptions(t)) * 4,
      at::randn({16, 33}, at::TensorOptions(t)) * 4,
      at::randn({4, 8, 32, 33}, at::TensorOptions(t)) * 4,
  };
}

TEST(SwishForward, EqualsAtenSiluForBetaOne) {
  for (auto t : kDtypes) {
    for (const auto& x : inputs(t)) {
      const at::Tensor y = swish(x);
      EXPECT_EQ(y.scalar_type(), t);
      EXPECT_EQ(y.sizes(), x.sizes());
      EXPECT_TRUE(at::allclose(y, at::silu(x), rtol(t), atol(t))) << t << " " << x.sizes();
    }
  }
}

TEST(SwishForward, EqualsFormulaForEveryBeta) {
  for (auto t : kDtypes) {
    for (double beta : kBetas) {
      for (const auto& x : inputs(t)) {
        EXPECT_TRUE(at::allclose(swish(x, beta), reference_forward(x, beta), rtol(t), atol(t)))
            << t << " beta=" << beta << " " << x.sizes();
      }
    }
  }
}

TEST(SwishForward, BetaZeroIsHalfX) {
  const at::Tensor x = at::randn({1000}, at::kDouble);
  EXPECT_TRUE(at::equal(swish(x, 0.0), x / 2));
}

TEST(SwishForward, NonContiguousInputs) {
  for (auto t : kDtypes) {
    const at::Tensor base = at::randn({64, 48}, at::TensorOptions(t)) * 3;
    for (const at::Tensor& x :
         {base.t(), base.slice(1, 0, 48, 3), base.unsqueeze(0).expand({3, 64, 48})}) {
      ASSERT_FALSE(x.is_contiguous());
      const at::Tensor y = swish(x, 1.3);
      EXPECT_TRUE(at::allclose(y, reference_forward(x, 1.3), rtol(t), atol(t))) << t;
    }
  }
}

TEST(SwishForward, ChannelsLastKeepsItsLayout) {
  const at::Tensor x =
      at::randn({2, 3, 5, 7}).contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor y = swish(x);
  EXPECT_TRUE(y.is_contiguous(at::MemoryFormat::ChannelsLast));
  EXPECT_TRUE(at::allclose(y, reference_forward(x, 1.0), 1e-5, 1e-6));
}

TEST(SwishForward, NanAndInfPropagateAsInTheFormula) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (auto t : kDtypes) {
    for (double beta : {1.0, -1.0, 0.0}) {
      // Repeated so that the special values hit both the vector body and the tail.
      const at::Tensor x =
          at::tensor({nan, inf, -inf, 0.0, -0.0, 1.0, -1.0, 100.0, -100.0}, at::kDouble)
              .repeat({5})
              .to(t);
      const at::Tensor y = swish(x, beta).to(at::kDouble);
      const at::Tensor ref = reference_forward(x, beta).to(at::kDouble);
      EXPECT_TRUE(at::equal(at::isnan(y), at::isnan(ref))) << t << " beta=" << beta;
      EXPECT_TRUE(at::equal(at::isinf(y), at::isinf(ref))) << t << " beta=" << beta;
      EXPECT_TRUE(at::allclose(y, ref, rtol(t), atol(t), /*equal_nan=*/true))
          << t << " beta=" << beta << "\n" << y << ref;
    }
  }
}

// Gradient of swish in dtype t against float64 autograd of x * sigmoid(beta * x).
void expect_backward_matches_float64_autograd(const at::Tensor& x_in, double beta) {
  const auto t = x_in.scalar_type();
  at::Tensor x = x_in.detach().clone().set_requires_grad(true);
  const at::Tensor grad_out = at::randn(x.sizes(), at::TensorOptions(t));
  swish(x, beta).backward(grad_out);

  at::Tensor x64 = x_in.detach().to(at::kDouble).set_requires_grad(true);
  (x64 * at::sigmoid(beta * x64)).backward(grad_out.to(at::kDouble));

  ASSERT_TRUE(x.grad().defined());
  EXPECT_EQ(x.grad().scalar_type(), t);
  EXPECT_TRUE(at::allclose(x.grad().to(at::kDouble), x64.grad(), rtol(t) * 2, atol(t) * 2))
      << t << " beta=" << beta << " " << x_in.sizes() << " max err "
      << (x.grad().to(at::kDouble) - x64.grad()).abs().max().item<double>();
}

TEST(SwishBackward, MatchesFloat64Autograd) {
  for (auto t : kDtypes) {
    for (double beta : kBetas) {
      for (const auto& x : inputs(t)) expect_backward_matches_float64_autograd(x, beta);
    }
  }
}

TEST(SwishBackward, NonContiguousInputAndGrad) {
  const at::Tensor x = (at::randn({40, 30}, at::kDouble) * 3).t().set_requires_grad(true);
  // An expanded gradient: what sum().backward() hands to the op.
  swish(x, 0.7).sum().backward();
  at::Tensor x64 = x.detach().clone().set_requires_grad(true);
  (x64 * at::sigmoid(0.7 * x64)).sum().backward();
  EXPECT_TRUE(at::allclose(x.grad(), x64.grad(), 1e-12, 1e-12));
}

TEST(SwishBackward, KernelChecksItsArguments) {
  const at::Tensor x = at::randn({4, 5});
  expect_error([&] { swish_backward(at::randn({4, 6}), x, 1.0); },
               "grad has shape [4, 6] but x has shape [4, 5]");
  expect_error([&] { swish_backward(at::randn({4, 5}, at::kDouble), x, 1.0); },
               "grad has dtype Double but x has dtype Float");
  const at::Tensor g = at::randn({4, 5});
  EXPECT_TRUE(at::allclose(swish_backward(g, x, 1.0),
                           g * (at::sigmoid(x) * (1 + x * (1 - at::sigmoid(x)))), 1e-5, 1e-6));
}

TEST(SwishErrors, IntegerAndBoolInputsNameTheDtype) {
  const std::vector<std::pair<at::ScalarType, std::string>> bad = {
      {at::kInt, "Int"}, {at::kLong, "Long"}, {at::kBool, "Bool"}, {at::kByte, "Byte"},
      {at::kComplexFloat, "ComplexFloat"}};
  for (const auto& [t, name] : bad) {
    const at::Tensor x = at::zeros({3}, at::TensorOptions(t));
    expect_error([&] { swish(x); },
                 "x must be float32, float64, bfloat16 or float16, got " + name);
  }
}

TEST(SwishErrors, NonFiniteBeta) {
  for (double beta : {std::numeric_limits<double>::infinity(),
                      std::numeric_limits<double>::quiet_NaN()}) {
    expect_error([&] { swish(at::randn({3}), beta); }, "beta must be finite");
  }
}

TEST(SwishErrors, BetaBeyondFloatRangeForFloatDtypes) {
  // float32/bfloat16/float16 are computed in float, where 1e300 is inf (and inf * 0 NaN).
  for (auto t : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const at::Tensor x = at::randn({3}).to(t);
    for (auto variant : {SwishVariant::kNaive, SwishVariant::kMemoryEfficient,
                         SwishVariant::kInplace}) {
      expect_error([&] { swish(x.clone(), 1e300, variant); }, "beta=1e+300 is beyond float's range");
      expect_error([&] { swish(x.clone(), -1e39, variant); }, "is beyond float's range");
    }
    expect_error([&] { swish_backward(x, x, 1e300); }, "memlean::swish_backward: beta=1e+300");
  }
  // float64 is computed in double: any finite beta.
  const at::Tensor x = at::tensor({-1.0, 0.0, 1e-300}, at::kDouble);
  EXPECT_TRUE(at::allclose(swish(x, 1e300), at::tensor({-0.0, 0.0, 1e-300 * (1 / (1 + std::exp(-1.0)))},
                                                       at::kDouble)));
}

// beta * x overflows (beta = 2, x = 2e38 in float): the gradient is float32 autograd's 1 (or
// 0 on the left), not inf * 0 = NaN; NaN still propagates. Every variant, every dtype.
TEST(SwishBackward, BetaTimesXOverflowGivesTheSaturatedSlope) {
  struct Case {
    at::ScalarType t;
    double big;
  };
  for (const Case& c : {Case{at::kFloat, 2e38}, Case{at::kBFloat16, 2e38}, Case{at::kHalf, 6e4},
                        Case{at::kDouble, 1e308}}) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    // Repeated so that the values reach the vector body and the tail.
    const at::Tensor x0 = at::tensor({c.big, -c.big, 1.0, nan}, at::kDouble).repeat({9}).to(c.t);
    for (double beta : {2.0, 1.0, -3.0}) {
      for (auto variant : {SwishVariant::kNaive, SwishVariant::kMemoryEfficient,
                           SwishVariant::kInplace}) {
        if (variant == SwishVariant::kNaive) continue;  // autograd's own formula; not ours
        const at::Tensor leaf = x0.clone().set_requires_grad(true);
        swish(leaf * 1, beta, variant).sum().backward();
        const at::Tensor g = leaf.grad().to(at::kDouble);
        // The exact slope: 1 where beta * x is huge and positive, 0 where huge and negative
        // (beyond double too, so not from autograd in double), the formula at x = 1.
        const double s1 = 1 / (1 + std::exp(-beta));
        const std::vector<double> exact = {beta > 0 ? 1.0 : 0.0, beta > 0 ? 0.0 : 1.0,
                                           s1 * (1 + beta * (1 - s1)), nan};
        for (int64_t i = 0; i < 36; ++i) {
          const double got = g[i].item<double>(), want = exact[i % 4];
          if (std::isnan(want)) {
            EXPECT_TRUE(std::isnan(got)) << c.t << " " << to_string(variant) << " beta=" << beta;
          } else {
            EXPECT_NEAR(got, want, 2e-2) << c.t << " " << to_string(variant) << " beta=" << beta
                                         << " x=" << x0[i].item<double>();
          }
        }
      }
    }
  }
}

TEST(SwishModule, ForwardsToTheOpAndPrints) {
  Swish m(SwishOptions(0.5));
  const at::Tensor x = at::randn({8, 3});
  EXPECT_TRUE(at::equal(m(x), swish(x, 0.5)));
  EXPECT_TRUE(m->parameters().empty());
  std::ostringstream s;
  s << *m;
  EXPECT_EQ(s.str(), "memlean::Swish(beta=0.5)");
  EXPECT_THROW(Swish(SwishOptions(std::numeric_limits<double>::infinity())), c10::Error);
}

TEST(SwishModule, MetaTensorsGiveShapesOnly) {
  const at::Tensor x = at::empty({5, 7}, at::TensorOptions(at::kHalf).device(at::kMeta));
  const at::Tensor y = swish(x, 2.0);
  EXPECT_TRUE(y.is_meta());
  EXPECT_EQ(y.sizes(), x.sizes());
  EXPECT_EQ(y.scalar_type(), at::kHalf);
}

}  // namespace
}  // namespace memlean
