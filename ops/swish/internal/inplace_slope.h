// The slope g'(t) of the in-place variant's backward in float, for one element: the pieces of
// tools/fit_slope.py (swish_constants.h), as cpu/swish_kernel.cc's slope_fast evaluates them
// for whole vectors. Host and device code: the CUDA kernels call it, and
// //ops/swish:inplace_slope_test checks it on the host against float64.
#pragma once

#include <cmath>
#include <cstddef>
#include <utility>

#include "ops/swish/internal/constants.h"

#if defined(__CUDACC__)
#define MEMLEAN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MEMLEAN_HOST_DEVICE inline
#endif

namespace memlean::swish_constants {

// Horner's scheme in float fused multiply-adds for the coefficients A (a constexpr array of
// double, lowest order first), read in constant expressions so that device code can use
// them (the array itself is host memory; its elements, read at compile time, are not).
template <const auto& A, std::size_t... J>
MEMLEAN_HOST_DEVICE float horner_float(float z, std::index_sequence<J...>) {
  constexpr float c[] = {static_cast<float>(A[J])...};
  constexpr int n = static_cast<int>(sizeof...(J));
  float r = c[n - 1];
#pragma unroll
  for (int j = n - 2; j >= 0; --j) r = fmaf(r, z, c[j]);
  return r;
}

template <const auto& A>
MEMLEAN_HOST_DEVICE float horner_float(float z) {
  return horner_float<A>(z, std::make_index_sequence<sizeof(A) / sizeof(A[0])>());
}

// g'(t) for u = g(t) = t * sigmoid(t) (u = beta * y, at most slope_clamp<float>()) and the
// side of t* (left: t < t*). NaN gives NaN.
MEMLEAN_HOST_DEVICE float inplace_slope(float u, bool left) {
  const float d = u - static_cast<float>(kGStar);
  const float s = sqrtf(d < 0.f ? 0.f : d);  // (not fmaxf, which would turn NaN into 0)
  if (left) {
    if (u > static_cast<float>(kSlopeLeftSplit)) {
      // u in (kSlopeLeftSplit, 0]: v = 1 / log(-u) in [V0, 0] (u = 0: log = -inf, v = -0).
#if defined(__CUDA_ARCH__)
      const float v = 1.f / __logf(-u);
#else
      const float v = 1.f / std::log(-u);
#endif
      return u * horner_float<kSlopeL2>(
                     fmaf(v, static_cast<float>(kSlopeL2Scale), static_cast<float>(kSlopeL2Shift)));
    }
    return s * horner_float<kSlopeL1>(
                    fmaf(s, static_cast<float>(kSlopeL1Scale), static_cast<float>(kSlopeL1Shift)));
  }
  if (u > static_cast<float>(kSlopeRightSplit)) {
    // Past kSlopeRightEnd (z > 1), R2(1), within 1e-5 of g' there, as the CPU kernel does.
    return horner_float<kSlopeR2>(
        fminf(fmaf(s, static_cast<float>(kSlopeR2Scale), static_cast<float>(kSlopeR2Shift)), 1.f));
  }
  return s * horner_float<kSlopeR1>(
                 fmaf(s, static_cast<float>(kSlopeR1Scale), static_cast<float>(kSlopeR1Shift)));
}

}  // namespace memlean::swish_constants
