"""Fits the polynomials of the in-place Swish backward's float path (ops/swish/internal/constants.h).

The in-place variant keeps y = g(t) / beta (g(t) = t * sigmoid(t), t = beta * x) and one bit:
the side of t* (the minimum of g). Its backward needs the slope g'(t) as a function of
(u = beta * y, side). In float that is computed without recovering t: piecewise polynomials,
in s = ±sqrt(u - g(t*)) (the sign: the side), smooth through t* where g is flat:

  right of t*, u <= 3:        g' = s * R1(z),  z = s / (SR1 / 2) - 1
  right of t*, 3 < u <= 16:   g' = R2(z),      z = (s - (SR1 + SR2) / 2) / ((SR2 - SR1) / 2)
  right of t*, u > 16:        g' = R2(1) (g' is within 2e-6 of 1 there)
  left of t*, u <= -0.1:      g' = |s| * L1(z), z = -s / (SL1 / 2) - 1
  left of t*, -0.1 < u < 0:   g' = u * L2(z),  z = 2 v / |V0| + 1, v = 1 / log(-u), V0 = 1 / log(0.1)

The log there is the CPU kernel's own (exponent bits plus LOG(f), f = mantissa - 1 in
[0, 1)); g' needs it to about 1e-3 only, and L2's error below is measured through it.

The degrees are as low as the error budget allows (each piece under 1e-5, see
fit_slope_test.py): on the CPU the kernel's time is its instruction count.

The truth is 40-digit mpmath, sampled by t. Prints the constants as C++; run with the
Python that has mpmath (torch's dependencies include it):
  python3 ops/swish/tools/fit_slope.py
and ops/swish:fit_slope_test checks internal/constants.h holds a fit of the same pieces: the same
functions to 1e-9 (the coefficients' last digits come from LAPACK, and differ between
machines), each within its error budget, its error comment true.
"""
import math
import re
import sys

import mpmath as mp
import numpy as np
from numpy.polynomial import chebyshev as cheb

mp.mp.dps = 40
R_SPLIT, R_END, L_SPLIT = 3.0, 16.0, -0.1
DEGREES = {"R1": 9, "R2": 10, "L1": 5, "L2": 3, "LOG": 3}


def sigmoid(t):
    return 1 / (1 + mp.e ** (-t))


def g(t):
    return t * sigmoid(t)


def g1(t):  # g'(t)
    s = sigmoid(t)
    return s * (1 + t * (1 - s))


T_STAR = mp.findroot(g1, -1.278)
G_STAR = g(T_STAR)


def samples(offsets, side):
    """(u, s, slope) in float64 for t = t* + side * offsets, from 40-digit arithmetic."""
    u, s, slope = [], [], []
    for d in offsets:
        t = T_STAR + side * mp.mpf(d)
        gt = g(t)
        u.append(float(gt))
        s.append(float(side * mp.sqrt(max(gt - G_STAR, 0))))
        slope.append(float(g1(t)))
    return np.array(u), np.array(s), np.array(slope)


def fit(z, y, degree, weight=None):
    """Least squares in Chebyshev polynomials of z in [-1, 1], returned as monomials in z."""
    return cheb.cheb2poly(cheb.chebfit(z, y, degree, w=weight))


def horner_float32(coef, z):
    """Evaluation as the kernels do it: float32 fused multiply-adds."""
    z = z.astype(np.float32)
    r = np.full_like(z, np.float32(coef[-1]))
    for c in coef[-2::-1]:
        r = (r.astype(np.float64) * z + np.float32(c)).astype(np.float32)
    return r.astype(np.float64)


def log_float32(x, log_coef):
    """The CPU kernel's log_fast in float32: exponent bits, plus LOG(f) of the mantissa."""
    bits = np.asarray(x, dtype=np.float32).view(np.int32)
    exponent = ((bits >> 23) - 127).astype(np.float32)
    f = ((bits & 0x007FFFFF) | 0x3F800000).view(np.float32) - np.float32(1)
    p = horner_float32(log_coef, f.astype(np.float64)).astype(np.float32)
    return (exponent.astype(np.float64) * np.float32(0.6931471805599453) + p).astype(np.float32)


def _data():
    """The 40-digit truth sampled on each side, and the pieces' interval constants."""
    ts = float(T_STAR)
    right = samples(np.geomspace(1e-6, 17.5, 6000), +1)
    left = samples(np.geomspace(1e-6, 104.0 + ts, 6000), -1)
    scalars = {
        "SR1": math.sqrt(R_SPLIT - float(G_STAR)),
        "SR2": math.sqrt(R_END - float(G_STAR)),
        "SL1": math.sqrt(L_SPLIT - float(G_STAR)),
        "V0": 1 / math.log(-L_SPLIT),
    }
    return right, left, scalars


def fit_pieces(data=None):
    """Least-squares fits of every piece: name -> monomial coefficients. Goes through
    numpy's LAPACK, so the last digits depend on the machine's BLAS kernels."""
    right, left, c = data or _data()
    pieces = {}
    u, s, y = right
    m = u <= R_SPLIT
    pieces["R1"] = fit(s[m] / (c["SR1"] / 2) - 1, y[m] / s[m], DEGREES["R1"])
    m = (u > R_SPLIT) & (u <= R_END)
    pieces["R2"] = fit((s[m] - (c["SR1"] + c["SR2"]) / 2) / ((c["SR2"] - c["SR1"]) / 2), y[m],
                       DEGREES["R2"])
    u, s, y = left
    m = u <= L_SPLIT
    # Per |s| (s < 0 here), as R1 is per s: both kernels multiply by sqrt(u - g*) >= 0.
    pieces["L1"] = fit(-s[m] / (c["SL1"] / 2) - 1, y[m] / -s[m], DEGREES["L1"])
    f = np.linspace(0, 1, 20001)
    log = fit(2 * f - 1, np.log1p(f), DEGREES["LOG"])
    # As monomials in f itself (f in [0, 1) is well scaled): compose with z = 2f - 1.
    pieces["LOG"] = np.polynomial.polynomial.Polynomial(log)(
        np.polynomial.polynomial.Polynomial([-1, 2])).coef
    m = (u > L_SPLIT) & (u < 0)
    z = 2 * (1 / np.log(-u[m])) / abs(c["V0"]) + 1
    # Weighted by |u|: the error of g' = u * L2 is |u| times L2's.
    pieces["L2"] = fit(z, y[m] / u[m], DEGREES["L2"], weight=np.abs(u[m]))
    return pieces


def piece_errors(pieces, data=None):
    """Max error of each piece as the kernels evaluate it (float32 Horner), against the
    40-digit truth: of g' for R1, R2, R3 (R2(1) past R_END), L1 and L2, and of log(1 + f)
    for LOG. Elementwise float arithmetic only: the same on every machine."""
    right, left, c = data or _data()
    errors = {}
    u, s, y = right
    m = u <= R_SPLIT
    z = s[m] / (c["SR1"] / 2) - 1
    errors["R1"] = np.abs(s[m] * horner_float32(pieces["R1"], z) - y[m]).max()
    m = (u > R_SPLIT) & (u <= R_END)
    z = (s[m] - (c["SR1"] + c["SR2"]) / 2) / ((c["SR2"] - c["SR1"]) / 2)
    errors["R2"] = np.abs(horner_float32(pieces["R2"], z) - y[m]).max()
    # Past R_END: R2 at the end of its interval (z clamped to 1).
    r2_end = horner_float32(pieces["R2"], np.array([1.0]))[0]
    errors["R3"] = np.abs(r2_end - y[u > R_END]).max()
    u, s, y = left
    m = u <= L_SPLIT
    z = -s[m] / (c["SL1"] / 2) - 1
    errors["L1"] = np.abs(-s[m] * horner_float32(pieces["L1"], z) - y[m]).max()
    f = np.linspace(0, 1, 20001)
    errors["LOG"] = np.abs(horner_float32(pieces["LOG"], f) - np.log1p(f)).max()
    m = (u > L_SPLIT) & (u < 0)
    z = 2 * (1 / np.log(-u[m])) / abs(c["V0"]) + 1
    # Measured as the CPU kernel computes it: through its own log (a GPU takes the exact one).
    v_kernel = 1 / log_float32(-u[m], pieces["LOG"]).astype(np.float64)
    errors["L2"] = max(
        np.abs(u[m] * horner_float32(pieces["L2"], z) - y[m]).max(),
        np.abs(u[m] * horner_float32(pieces["L2"], 2 * v_kernel / abs(c["V0"]) + 1) - y[m]).max())
    return errors


SCALAR_NAMES = {"SR1": "kSlopeSR1", "SR2": "kSlopeSR2", "SL1": "kSlopeSL1", "V0": "kSlopeV0"}
PIECE_NAMES = {"R1": "kSlopeR1", "R2": "kSlopeR2", "L1": "kSlopeL1", "L2": "kSlopeL2",
               "LOG": "kSlopeLog1p"}


def render(pieces, errors, scalars):
    """The C++ block of internal/constants.h for these pieces."""
    out = []
    out.append("// BEGIN fit_slope.py output (ops/swish/tools/fit_slope.py; do not edit by hand)")
    out.append("// Max |g' error| of each piece in float32 Horner, from 40-digit truth: " +
               ", ".join(f"{k} {errors[k]:.1e}" for k in ("R1", "R2", "R3", "L1", "L2")) +
               f"; log(1 + f) {errors['LOG']:.1e}.")
    out.append(f"constexpr double kSlopeRightSplit = {R_SPLIT!r};  // u")
    out.append(f"constexpr double kSlopeRightEnd = {R_END!r};    // u beyond: R2(1) (g' within 2e-6 of 1)")
    out.append(f"constexpr double kSlopeLeftSplit = {L_SPLIT!r};  // u")
    out.append(f"constexpr double kSlopeSR1 = {scalars['SR1']!r};  // s at kSlopeRightSplit")
    out.append(f"constexpr double kSlopeSR2 = {scalars['SR2']!r};  // s at kSlopeRightEnd")
    out.append(f"constexpr double kSlopeSL1 = {scalars['SL1']!r};  // -s at kSlopeLeftSplit")
    out.append(f"constexpr double kSlopeV0 = {scalars['V0']!r};  // 1 / log(-kSlopeLeftSplit)")
    for name in ("R1", "R2", "L1", "L2", "LOG"):
        coef = ", ".join(repr(float(c)) for c in pieces[name])
        out.append(f"constexpr double {PIECE_NAMES[name]}[{len(pieces[name])}] = {{{coef}}};")
    out.append("// END fit_slope.py output")
    return "\n".join(out) + "\n"


def parse(header):
    """(pieces, scalars, block) as written in a internal/constants.h: the inverse of render."""
    begin = header.index("// BEGIN fit_slope.py output")
    end = header.index("// END fit_slope.py output") + len("// END fit_slope.py output\n")
    block = header[begin:end]

    def value(cname, array):
        pattern = (rf"constexpr double {cname}\[\d+\] = \{{([^}}]*)\}};" if array
                   else rf"constexpr double {cname} = ([-+0-9.e]+);")
        found = re.search(pattern, block)
        if found is None:
            raise ValueError(f"{cname} is missing from the fit_slope.py block")
        if array:
            return np.array([float(v) for v in found.group(1).split(",")])
        return float(found.group(1))

    pieces = {name: value(cname, True) for name, cname in PIECE_NAMES.items()}
    scalars = {name: value(cname, False) for name, cname in SCALAR_NAMES.items()}
    return pieces, scalars, block


def fit_all():
    """Fits every piece; returns (pieces: name -> monomial coefficients, errors: name -> max
    error in float32 evaluation (of g', or of log(1 + f) for LOG), lines of C++)."""
    data = _data()
    pieces = fit_pieces(data)
    errors = piece_errors(pieces, data)
    return pieces, errors, render(pieces, errors, data[2])


def main():
    sys.stdout.write(fit_all()[2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
