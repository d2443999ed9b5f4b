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

// Newton iterations of the in-place backward's double path (float needs none: it evaluates
// the slope from the kSlope* pieces below).
constexpr int kInverseIterations = 6;

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

// The float path of the in-place backward on the CPU (cpu/swish_kernel.cc): g'(t) as
// piecewise polynomials of (u, side), no t. The pieces: ops/swish/tools/fit_slope.py.
// BEGIN fit_slope.py output (ops/swish/tools/fit_slope.py; do not edit by hand)
// Max |g' error| of each piece in float32 Horner, from 40-digit truth: R1 3.1e-06, R2 3.5e-06, R3 1.6e-06, L1 1.9e-06, L2 6.8e-09; log(1 + f) 2.2e-05.
constexpr double kSlopeRightSplit = 3.0;  // u
constexpr double kSlopeRightEnd = 16.0;    // u beyond: g' = 1
constexpr double kSlopeLeftSplit = -0.05;  // u
constexpr double kSlopeSR1 = 1.8106530707899495;  // s at kSlopeRightSplit
constexpr double kSlopeSR2 = 4.034657921405614;  // s at kSlopeRightEnd
constexpr double kSlopeSL1 = 0.47797964680629845;  // -s at kSlopeLeftSplit
constexpr double kSlopeV0 = -0.33380820069533407;  // 1 / log(-kSlopeLeftSplit)
constexpr double kSlopeR1[10] = {0.9460731332334729, -0.17134775184709602, -0.3461970460885663, 0.15061696380312206, 0.03478287430469162, -0.008235923797733915, -0.00564576278453335, -0.0021796693012392492, 0.0002490887706613118, 0.00039094886860787845};
constexpr double kSlopeR2[11] = {1.0018681103529237, -0.010454477639153446, 0.026366621838370335, -0.03818382459051913, 0.032862967704216026, -0.011980628726350017, -0.01282372194922872, 0.024360028958397957, -0.010957032350703444, -0.0055841949113721884, 0.004531940418217596};
constexpr double kSlopeL1[9] = {0.4074208033402151, -0.2900500504090512, -0.036809797166954664, 0.0005191130229217763, -0.00026693451882665794, -6.55657939313717e-05, -6.505478699491656e-05, -0.00035084491878038034, -0.00020866883705040679};
constexpr double kSlopeL2[6] = {0.8759368031409333, 0.10685712145187645, 0.004450130344932041, 0.01025511028638996, 0.003185331936149216, 0.0005560909957921819};
constexpr double kSlopeLog1p[6] = {2.2117031200197257e-05, 0.9990104466294588, -0.48915684720230435, 0.28330432451740856, -0.13011941539126315, 0.03010262501167511};
// END fit_slope.py output

// Each piece's polynomial variable, z = x * Scale + Shift, mapping its interval onto [-1, 1]
// as fit_slope.py does; x is s = sqrt(u - g*) >= 0 for R1, R2 and L1, v = 1 / log(-u) for
// L2. The CPU vector kernel and inplace_slope.h (CUDA, host) both use these.
constexpr double kSlopeR1Scale = 2 / kSlopeSR1, kSlopeR1Shift = -1;
constexpr double kSlopeL1Scale = 2 / kSlopeSL1, kSlopeL1Shift = -1;
constexpr double kSlopeR2Scale = 2 / (kSlopeSR2 - kSlopeSR1);
constexpr double kSlopeR2Shift = -(kSlopeSR1 + kSlopeSR2) / (kSlopeSR2 - kSlopeSR1);
constexpr double kSlopeL2Scale = 2 / -kSlopeV0, kSlopeL2Shift = 1;

}  // namespace memlean::swish_constants
