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
// Max |g' error| of each piece in float32 Horner, from 40-digit truth: R1 3.1e-06, R2 3.5e-06, R3 4.5e-06, L1 4.7e-06, L2 5.3e-06; log(1 + f) 9.3e-04.
constexpr double kSlopeRightSplit = 3.0;  // u
constexpr double kSlopeRightEnd = 16.0;    // u beyond: R2(1) (g' within 2e-6 of 1)
constexpr double kSlopeLeftSplit = -0.1;  // u
constexpr double kSlopeSR1 = 1.8106530707899495;  // s at kSlopeRightSplit
constexpr double kSlopeSR2 = 4.034657921405614;  // s at kSlopeRightEnd
constexpr double kSlopeSL1 = 0.4224506394374067;  // -s at kSlopeLeftSplit
constexpr double kSlopeV0 = -0.43429448190325187;  // 1 / log(-kSlopeLeftSplit)
constexpr double kSlopeR1[10] = {0.9460731332334729, -0.17134775184709602, -0.3461970460885663, 0.15061696380312206, 0.03478287430469162, -0.008235923797733915, -0.00564576278453335, -0.0021796693012392492, 0.0002490887706613118, 0.00039094886860787845};
constexpr double kSlopeR2[11] = {1.0018681103529237, -0.010454477639153446, 0.026366621838370335, -0.03818382459051913, 0.032862967704216026, -0.011980628726350017, -0.01282372194922872, 0.024360028958397957, -0.010957032350703444, -0.0055841949113721884, 0.004531940418217596};
constexpr double kSlopeL1[6] = {-0.4406177678186381, 0.24877375019389444, 0.028885874682903125, -0.00045904476085062754, 0.00016616855788719584, 0.00013747592000811648};
constexpr double kSlopeL2[4] = {0.8439556450449678, 0.1384993006201956, -0.008268695926365114, 0.008170732587452243};
constexpr double kSlopeLog1p[4] = {0.0009250321113060123, 0.9797534129748467, -0.39353580230191654, 0.10668473260368821};
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
