// Constants of g(t) = t * sigmoid(t), the shape of every Swish-β (y = g(βx) / β), shared by
// the CPU and CUDA kernels of the in-place variant.
#pragma once

namespace memlean::swish_constants {

// g has one minimum, at t* (g'(t*) = 0); g is strictly decreasing left of it and strictly
// increasing right of it, so g(t) and the side of t* determine t.
constexpr double kTStar = -1.2784645427610738;
constexpr double kGStar = -0.27846454276107385;  // g(t*)
constexpr double kG2Star = 0.2178117057198001;   // g''(t*)
// Newton iterations of the in-place backward in float (twice as many in double).
constexpr int kInverseIterations = 3;

// Near t*, t - t* as a series in s = ±sqrt(g(t) - g*) (sign: the side of t*):
// t - t* = sum_k kInverseSeries[k-1] * s^k, error < 1e-9 for |s| < kSeriesRadius.
// (Scalars as well as an array: device code may use constexpr scalars, not arrays.)
constexpr double kSeriesRadius = 0.03;
constexpr double kSeries1 = 3.0302216013580993996;
constexpr double kSeries2 = -2.0607476511124147578;
constexpr double kSeries3 = 2.9008178055701453436;
constexpr double kSeries4 = -3.9864452806038695946;
constexpr double kSeries5 = 6.0346691684603402629;
constexpr double kSeries6 = -9.4598395801732379568;
constexpr double kInverseSeries[6] = {kSeries1, kSeries2, kSeries3, kSeries4, kSeries5, kSeries6};

}  // namespace memlean::swish_constants
