// Test helper: ExpectRoundedOnce(reduced, wide): a bfloat16 result is a float32 one (the same
// computation on the same, exactly widened, inputs) rounded once to nearest even: NaN exactly
// where the float32 one is NaN, elsewhere within one bfloat16 step of the rounded float32
// value (two builds of a kernel may sum in another order) and equal to it for 90 % or more of
// the elements (a kernel that truncates matches about half).
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace memlean::testing {

inline void ExpectRoundedOnce(const at::Tensor& reduced, const at::Tensor& wide) {
  ASSERT_EQ(reduced.scalar_type(), at::kBFloat16);
  ASSERT_EQ(reduced.sizes(), wide.sizes());
  const at::Tensor got = reduced.to(at::kFloat);
  const at::Tensor rounded = wide.to(at::kFloat).to(at::kBFloat16).to(at::kFloat);
  EXPECT_TRUE(at::equal(got.isnan(), rounded.isnan()));
  const at::Tensor finite = rounded.isfinite();
  const at::Tensor a = got.masked_select(finite), r = rounded.masked_select(finite);
  ASSERT_GT(r.numel(), 0);
  // One bfloat16 step at r: 2^(exponent(r) - 7).
  const at::Tensor step = at::exp2(at::floor(at::log2(r.abs().clamp_min(1e-30))) - 7);
  EXPECT_TRUE(((a - r).abs() <= step).all().item<bool>());
  EXPECT_GE(a.eq(r).to(at::kDouble).mean().item<double>(), 0.9);
}

}  // namespace memlean::testing
