// inplace_slope.h, the per-element float slope of the in-place backward that the CUDA
// kernels call, run here on the host: within the in-place variant's float bound of float64
// over the real line, and equal to what the CPU kernel computes for whole vectors.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <cmath>

#include "ops/swish/internal/constants.h"
#include "ops/swish/internal/inplace_slope.h"
#include "ops/swish/swish.h"

namespace memlean {
namespace {

namespace sc = swish_constants;

// x over [-110, 110], densely around t*, and the special values.
at::Tensor sweep() {
  return at::cat({at::linspace(-110, 110, 2'000'001, at::kFloat),
                  at::linspace(sc::kTStar - 0.05, sc::kTStar + 0.05, 200'001, at::kFloat),
                  at::tensor({0.f, -0.f, 1e-30f, -1e-30f, -1e-45f, 200.f, -200.f, 3e38f})});
}

at::Tensor with_mask(at::Tensor& y) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("memlean::_swish_inplace_with_mask", "")
                             .typed<at::Tensor(at::Tensor&, double)>();
  return op.call(y, 1.0);
}

at::Tensor cpu_slope(const at::Tensor& y, const at::Tensor& mask) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memlean::_swish_inplace_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return op.call(at::ones_like(y), y, mask, 1.0);
}

TEST(InplaceSlope, MatchesFloat64AndTheCpuKernel) {
  const at::Tensor x = sweep();
  at::Tensor y = x.clone();
  const at::Tensor mask = with_mask(y);  // y = swish(x) in float, as the forward leaves it
  const at::Tensor cpu = cpu_slope(y, mask);
  const at::Tensor x64 = x.to(at::kDouble);
  const at::Tensor s64 = at::sigmoid(x64);
  const at::Tensor reference = s64 * (1 + x64 * (1 - s64));

  const float* yp = y.const_data_ptr<float>();
  const uint8_t* bits = mask.const_data_ptr<uint8_t>();
  const float* cp = cpu.const_data_ptr<float>();
  const double* rp = reference.const_data_ptr<double>();
  double worst_reference = 0, worst_cpu = 0, worst_cpu_tail = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const bool left = (bits[i / 8] >> (i % 8)) & 1;
    const float u = std::min(yp[i], sc::slope_clamp<float>());
    const float slope = sc::inplace_slope(u, left);
    ASSERT_TRUE(std::isfinite(slope)) << "x=" << x[i].item<float>();
    worst_reference = std::max(worst_reference, std::abs(slope - rp[i]));
    // The left tail evaluates L2 at 1 / log(-u): here the exact log, the CPU kernel its own.
    double& worst = left && u > float(sc::kSlopeLeftSplit) ? worst_cpu_tail : worst_cpu;
    worst = std::max(worst, std::abs(double(slope) - cp[i]));
  }
  EXPECT_LE(worst_reference, 2e-4);  // the float bound of the in-place variant
  EXPECT_LE(worst_cpu, 1e-6);        // the same pieces
  EXPECT_LE(worst_cpu_tail, 1.1e-5);  // the same pieces, two logs: L2 within 5.5e-6 through each
  RecordProperty("max_error_vs_float64", std::to_string(worst_reference));
  RecordProperty("max_difference_vs_cpu", std::to_string(worst_cpu));
  RecordProperty("max_difference_vs_cpu_left_tail", std::to_string(worst_cpu_tail));
}

TEST(InplaceSlope, NanStaysNan) {
  EXPECT_TRUE(std::isnan(sc::inplace_slope(NAN, false)));
  EXPECT_TRUE(std::isnan(sc::inplace_slope(NAN, true)));
}

}  // namespace
}  // namespace memlean
