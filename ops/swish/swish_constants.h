// Constants of g(t) = t * sigmoid(t), the shape of every Swish-β (y = g(βx) / β), shared by
// the CPU and CUDA kernels of the in-place variant.
#pragma once

namespace memlean::swish_constants {

// Bytes of the in-place variant's mask, one bit per element (Int: int64_t, or c10::SymInt
// for the Meta kernels and checks under torch.compile).
template <typename Int>
Int mask_bytes(const Int& numel) {
  return (numel + 7) / 8;
}

// g has one minimum, at t* (g'(t*) = 0); g is strictly decreasing left of it and strictly
// increasing right of it, so g(t) and the side of t* determine t.
constexpr double kTStar = -1.2784645427610738;
constexpr double kGStar = -0.27846454276107385;  // g(t*)
constexpr double kG2Star = 0.2178117057198001;   // g''(t*)
// |t| beyond which g'(t) = sigmoid(t) * (1 + t * (1 - sigmoid(t))) is 1 (right) or 0 (left)
// to the last bit: the gradient kernels clamp t = beta * x there, so that a beta * x that
// overflows to ±inf gives 1 or 0 rather than inf * 0 = NaN. float: exp(-128) underflows
// to 0; double: exp(-800) does.
constexpr double kSlopeClampFloat = 128.0;
constexpr double kSlopeClampDouble = 800.0;
template <typename T>
constexpr T slope_clamp() {
  return static_cast<T>(sizeof(T) == sizeof(double) ? kSlopeClampDouble : kSlopeClampFloat);
}

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

// The float fast path of the in-place backward (see cpu/swish_kernel.cc): least-squares
// polynomial fits, made with float64 bisection as the truth.
// Right of t*, u <= 2:   t = t* + s * P(s), s = sqrt(u - g*) in [0, 1.51]; |error| < 5e-6.
constexpr double kRightPoly[11] = {
    3.0302150840260875,  -2.060133866310111, 2.8861616670914896, -3.8303067720169506,
    5.097165480980006,   -5.8262908984866515, 5.227287716956814, -3.3896572882004947,
    1.4657128462840145,  -0.37446487777796766, 0.04249327255218255};
// Left of t*, u <= -0.2: t = t* + s * P(s), s = -sqrt(u - g*) in [-0.28, 0]; |error| < 2e-7.
constexpr double kLeftPoly[9] = {3.03022184801817,   -2.0606632606582833, 2.907375438774664,
                                 -3.775710116360155, 9.49965305799668,    22.43693971508989,
                                 183.22308937764748, 456.45585673049965,  658.380735975352};
// Left tail, -0.2 < u < 0: with L = log(-u), t = L - log(-L) + P(1/L) within 0.01, then
// a Newton step on g (error < 2e-6; a second step would reach 1e-12 in float64).
constexpr double kTailPoly[7] = {-1.4321451734353674e-02, 3.4734476197615249e+00,
                                 2.0729319238985017e+01,  9.2833394340512456e+01,
                                 2.4329735101547584e+02,  3.2020646457900756e+02,
                                 1.6558858307610149e+02};
// Right, u > 2: t = u (1 + e^-u), then a Newton step on g (error < 2e-5).

}  // namespace memlean::swish_constants
