// Vectorized Swish-β kernels. This file is compiled three times, as ATen compiles its own:
// CPU_CAPABILITY=DEFAULT, AVX2 (-mavx2 -mfma -mf16c) and AVX512; at::vec puts Vectorized<T>
// in an inline namespace named after the capability, so the copies never collide.
#include "ops/swish/cpu/swish_kernel.h"

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/cpu/Loops.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "ops/swish/internal/constants.h"

#ifndef CPU_CAPABILITY
#error "CPU_CAPABILITY must be defined (DEFAULT, AVX2 or AVX512)"
#endif

namespace memlean::swish_cpu::CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;

// Math in T for float/double; in float for the 16-bit types.
template <typename T>
struct SwishMath {
  T beta;
  T forward(T x) const { return x / (T(1) + std::exp(-beta * x)); }
  T backward(T g, T x) const {
    constexpr T L = swish_constants::slope_clamp<T>();
    T t = beta * x;
    if (!std::isnan(t)) t = std::clamp(t, -L, L);  // overflowed to ±inf: slope 0 or 1
    const T s = T(1) / (T(1) + std::exp(-t));
    return g * s * (T(1) + t * (T(1) - s));
  }
  Vectorized<T> forward(Vectorized<T> x) const {
    return x / (Vectorized<T>(T(1)) + (x * Vectorized<T>(-beta)).exp());
  }
  Vectorized<T> backward(Vectorized<T> g, Vectorized<T> x) const {
    const Vectorized<T> one(T(1));
    constexpr T L = swish_constants::slope_clamp<T>();
    // ±inf (beta * x overflowed) becomes ±L; NaN stays NaN (clamp is min(L, max(-L, t)),
    // which returns its second operand, t, when that is NaN: two instructions).
    const Vectorized<T> t =
        at::vec::clamp(x * Vectorized<T>(beta), Vectorized<T>(-L), Vectorized<T>(L));
    const Vectorized<T> s = one / (one + t.neg().exp());
    return g * s * (one + t * (one - s));
  }
};

template <typename scalar_t>
void forward_typed(at::TensorIteratorBase& iter, double beta) {
  using Vec = Vectorized<scalar_t>;
  if constexpr (at::vec::is_reduced_floating_point_v<scalar_t>) {
    const SwishMath<float> m{static_cast<float>(beta)};
    at::native::cpu_kernel_vec(
        iter, [m](scalar_t x) -> scalar_t { return m.forward(static_cast<float>(x)); },
        [m](Vec x) -> Vec {
          auto [x0, x1] = at::vec::convert_to_float<scalar_t>(x);
          return at::vec::convert_from_float<scalar_t>(m.forward(x0), m.forward(x1));
        });
  } else {
    const SwishMath<scalar_t> m{static_cast<scalar_t>(beta)};
    at::native::cpu_kernel_vec(
        iter, [m](scalar_t x) -> scalar_t { return m.forward(x); },
        [m](Vec x) -> Vec { return m.forward(x); });
  }
}

template <typename scalar_t>
void backward_typed(at::TensorIteratorBase& iter, double beta) {
  using Vec = Vectorized<scalar_t>;
  if constexpr (at::vec::is_reduced_floating_point_v<scalar_t>) {
    const SwishMath<float> m{static_cast<float>(beta)};
    at::native::cpu_kernel_vec(
        iter,
        [m](scalar_t g, scalar_t x) -> scalar_t {
          return m.backward(static_cast<float>(g), static_cast<float>(x));
        },
        [m](Vec g, Vec x) -> Vec {
          auto [g0, g1] = at::vec::convert_to_float<scalar_t>(g);
          auto [x0, x1] = at::vec::convert_to_float<scalar_t>(x);
          return at::vec::convert_from_float<scalar_t>(m.backward(g0, x0), m.backward(g1, x1));
        });
  } else {
    const SwishMath<scalar_t> m{static_cast<scalar_t>(beta)};
    at::native::cpu_kernel_vec(
        iter, [m](scalar_t g, scalar_t x) -> scalar_t { return m.backward(g, x); },
        [m](Vec g, Vec x) -> Vec { return m.backward(g, x); });
  }
}

// ---- the in-place variant ----------------------------------------------------------
//
// Elements are processed in blocks of kBlock (a whole number of mask bytes, so that
// threads never share a byte), converted to the math type in a small buffer.

constexpr int64_t kBlock = 256;
static_assert(kBlock % 64 == 0, "a block must fill whole mask bytes and whole vectors");
constexpr int kInterleave = 4;  // vectors per step of the in-place backward

template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// Row b holds the 8 bits of the byte b as lane masks (all bits set, or none) of the integer
// type U (as wide as the math type), for unpacking the side mask 8 lanes at a time: a row,
// loaded as a vector, is a blend mask as a comparison makes one.
template <typename U>
struct BitsToMasks {
  U rows[256][8];
  constexpr BitsToMasks() : rows() {
    for (int b = 0; b < 256; ++b)
      for (int j = 0; j < 8; ++j) rows[b][j] = (b >> j) & 1 ? ~U(0) : U(0);
  }
};
template <typename T>
constexpr BitsToMasks<at::vec::int_same_size_t<T>> kBitsToMasks{};

template <typename scalar_t, typename acc_t>
void load_block(const scalar_t* src, acc_t* buf, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    std::copy(src, src + n, buf);
  } else {
    using Vec = Vectorized<scalar_t>;
    using fVec = Vectorized<float>;
    int64_t i = 0;
    for (; i + Vec::size() <= n; i += Vec::size()) {
      auto [a, b] = at::vec::convert_to_float<scalar_t>(Vec::loadu(src + i));
      a.store(buf + i);
      b.store(buf + i + fVec::size());
    }
    for (; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  }
}

template <typename scalar_t, typename acc_t>
void store_block(const acc_t* buf, scalar_t* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    std::copy(buf, buf + n, dst);
  } else {
    using Vec = Vectorized<scalar_t>;
    using fVec = Vectorized<float>;
    int64_t i = 0;
    for (; i + Vec::size() <= n; i += Vec::size()) {
      at::vec::convert_from_float<scalar_t>(fVec::loadu(buf + i), fVec::loadu(buf + i + fVec::size()))
          .store(dst + i);
    }
    for (; i < n; ++i) dst[i] = static_cast<scalar_t>(buf[i]);
  }
}

template <typename V>
bool any_lane(const V& m) {
  return m.zero_mask() != (1 << V::size()) - 1;
}

// Whether any lane of any of the K masks is set (one test for all K).
template <typename V, int K>
bool any_lane(const V (&m)[K]) {
  V all = m[0];
#pragma GCC unroll 8
  for (int k = 1; k < K; ++k) all = all | m[k];
  return any_lane(all);
}

// Horner's scheme on K vectors at once, step by step: K independent chains of fused
// multiply-adds keep the FMA units busy where one chain would wait on each step's latency.
template <typename V, size_t N, int K>
void horner_fma(const double (&c)[N], const V (&z)[K], V (&r)[K]) {
  using T = typename V::value_type;
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) r[k] = V(static_cast<T>(c[N - 1]));
#pragma GCC unroll 16
  for (int j = static_cast<int>(N) - 2; j >= 0; --j) {
    const V cj(static_cast<T>(c[j]));
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) r[k] = at::vec::fmadd(r[k], z[k], cj);
  }
}

// Two polynomials, a on za and b on zb (a of no lower degree), as 2K interleaved chains.
template <typename V, size_t Na, size_t Nb, int K>
void horner_fma2(const double (&a)[Na], const V (&za)[K], V (&ra)[K], const double (&b)[Nb],
                 const V (&zb)[K], V (&rb)[K]) {
  static_assert(Na >= Nb, "the first polynomial is the longer one");
  using T = typename V::value_type;
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) ra[k] = V(static_cast<T>(a[Na - 1]));
#pragma GCC unroll 16
  for (int j = static_cast<int>(Na) - 2; j >= static_cast<int>(Nb) - 1; --j) {
    const V aj(static_cast<T>(a[j]));
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) ra[k] = at::vec::fmadd(ra[k], za[k], aj);
  }
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) rb[k] = V(static_cast<T>(b[Nb - 1]));
#pragma GCC unroll 16
  for (int j = static_cast<int>(Nb) - 2; j >= 0; --j) {
    const V aj(static_cast<T>(a[j])), bj(static_cast<T>(b[j]));
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) {
      ra[k] = at::vec::fmadd(ra[k], za[k], aj);
      rb[k] = at::vec::fmadd(rb[k], zb[k], bj);
    }
  }
}

// log(x) for x >= 0 to about 2e-5, from the exponent bits and a polynomial of the mantissa
// (cheaper than Sleef's log; the left tail needs it to 1e-3 only). x = 0 and subnormal x
// give about log(2^-127): any value below -80 serves there.
inline Vectorized<float> log_fast(const Vectorized<float>& x) {
  using V = Vectorized<float>;
  using I = Vectorized<int32_t>;
  static_assert(V::size() == I::size(), "float and int32 vectors of one width");
  const I bits = at::vec::cast<int32_t>(x);
  const V exponent = at::vec::convert_to_fp_of_same_size<float>((bits >> I(23)) - I(127));
  const V f = at::vec::cast<float>((bits & I(0x007FFFFF)) | I(0x3F800000)) - V(1.f);
  V p[1];
  horner_fma(swish_constants::kSlopeLog1p, {f}, p);
  return at::vec::fmadd(exponent, V(0.6931471805599453f), p[0]);
}

// The float path: the slope g'(t) straight from (u, side), without recovering t. Piecewise
// polynomials fitted by ops/swish/tools/fit_slope.py (the pieces and their errors are listed
// there and in swish_constants.h): in s = ±sqrt(u - g*) on each side of t*, in u's log in the
// left tail; far right, R2 at the end of its interval (within 1e-5 of 1). No exp, no
// division, no iteration; the left tail's log and the right's second piece run only for steps
// where some lane needs them. NaN stays NaN (every comparison with it is false, so it keeps
// the s-polynomial, which propagates it).
//
// Written for the instruction count: on the cores this runs on it is bound by the number of
// vector instructions (square roots run beside them in their own unit), not by the chains'
// latency; hence one clamp instruction (clamp_min keeps a NaN), one product s * (the side's
// polynomial: R1 and L1 are both per |s|), one test for the K vectors' tails.
template <int K>
void slope_fast(const Vectorized<float> (&u)[K], const Vectorized<float> (&left)[K],
                Vectorized<float> (&slope)[K]) {
  namespace sc = swish_constants;
  using V = Vectorized<float>;
  const V zero(0.f), one(1.f), gs(float(sc::kGStar));
  const V r_split(float(sc::kSlopeRightSplit)), l_split(float(sc::kSlopeLeftSplit));
  // Both sides' polynomials for every lane, as 2K chains, then the side picks one.
  V s[K], zr[K], zl[K], pr[K], pl[K];
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) {
    s[k] = at::vec::clamp_min(u[k] - gs, zero).sqrt();
    zr[k] = at::vec::fmadd(s[k], V(float(sc::kSlopeR1Scale)), V(float(sc::kSlopeR1Shift)));
    zl[k] = at::vec::fmadd(s[k], V(float(sc::kSlopeL1Scale)), V(float(sc::kSlopeL1Shift)));
  }
  horner_fma2(sc::kSlopeR1, zr, pr, sc::kSlopeL1, zl, pl);
  V right_far[K], left_tail[K];
#pragma GCC unroll 8
  for (int k = 0; k < K; ++k) {
    slope[k] = s[k] * V::blendv(pr[k], pl[k], left[k]);
    right_far[k] = V::blendv(u[k] > r_split, zero, left[k]);
    left_tail[k] = left[k] & (u[k] > l_split);
  }
  if (any_lane(right_far)) {
    V z2[K], r2[K];
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) {
      // Past kSlopeRightEnd (z > 1), R2(1): g' is within 2e-6 of 1 there and R2(1) within 1e-5.
      z2[k] = at::vec::clamp_max(
          at::vec::fmadd(s[k], V(float(sc::kSlopeR2Scale)), V(float(sc::kSlopeR2Shift))), one);
    }
    horner_fma(sc::kSlopeR2, z2, r2);
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) slope[k] = V::blendv(slope[k], r2[k], right_far[k]);
  }
  if (any_lane(left_tail)) {
    V zt[K], l2[K];
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) {
      // u in (kSlopeLeftSplit, 0]: v = 1 / log(-u) in [V0, 0] (u = 0: log = -inf, v = -0).
      const V v = log_fast(u[k].neg()).reciprocal();
      zt[k] = at::vec::fmadd(v, V(float(sc::kSlopeL2Scale)), V(float(sc::kSlopeL2Shift)));
    }
    horner_fma(sc::kSlopeL2, zt, l2);
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) slope[k] = V::blendv(slope[k], u[k] * l2[k], left_tail[k]);
  }
}

// The double path: t from u = g(t) = t * sigmoid(t) and the side of t* (left: lanes of
// `left` set); the slope follows from t. (In float, slope_fast above needs no t.)
//
// With s = ±sqrt(u - g*) (sign: the side), t is a smooth function of s, even at t*, where
// g itself is flat. Near t* (|s| < kSeriesRadius) t comes from a series in s: evaluating
// g(t) - g* there would cancel to rounding noise. Elsewhere, Newton's method on
// h(t) = ±sqrt(g(t) - g*), whose step is (a - b) * 2a / g'(t) with a = sqrt(g(t) - g*) and
// b = |s|, starting from the quadratic model near t*, u itself for large u (t ~ u), and
// t ~ log(-u) - log(-log(-u)) in the left tail (u ~ t e^t); each step keeps t on its side.
//
// K independent vectors go through each step together: the chain of exp, divisions and
// square roots is long, and interleaving K chains keeps the core busy. Work no lane needs
// (the tail guess, the series, Newton steps) is skipped.
template <typename acc_t, int K>
void inverse_g(const Vectorized<acc_t> (&u)[K], const Vectorized<acc_t> (&left)[K],
               Vectorized<acc_t> (&t)[K]) {
  namespace sc = swish_constants;
  using V = Vectorized<acc_t>;
  const V zero(acc_t(0)), one(acc_t(1)), ts(acc_t(sc::kTStar)), gs(acc_t(sc::kGStar));
  V d[K], b[K], s[K], near[K], t_near[K];
  bool any_near = false, all_near = true, any_tail = false;
  for (int k = 0; k < K; ++k) {
    d[k] = at::vec::maximum(u[k] - gs, zero);
    b[k] = d[k].sqrt();
    s[k] = V::blendv(b[k], b[k].neg(), left[k]);
    near[k] = b[k] < V(acc_t(sc::kSeriesRadius));
    const bool n = any_lane(near[k]);
    any_near |= n;
    all_near &= n && near[k].zero_mask() == 0;
    any_tail |= any_lane(left[k] & (u[k] > V(acc_t(-0.2))));
  }
  if (any_near) {
    for (int k = 0; k < K; ++k) {
      V series(acc_t(sc::kInverseSeries[5]));
      for (int j = 4; j >= 0; --j) series = V(acc_t(sc::kInverseSeries[j])) + s[k] * series;
      t_near[k] = ts + s[k] * series;
    }
  }
  if (all_near) {
    for (int k = 0; k < K; ++k) t[k] = t_near[k];
    return;
  }
  for (int k = 0; k < K; ++k) {
    const V r = (d[k] * V(acc_t(2 / sc::kG2Star))).sqrt();
    const V t_right = V::blendv(ts + r, u[k], u[k] > V(acc_t(2)));
    V t_left = ts - r;
    if (any_tail) {
      const V log_neg_u = at::vec::maximum(u[k].neg(), V(std::numeric_limits<acc_t>::min())).log();
      const V t_tail = log_neg_u - at::vec::maximum(log_neg_u.neg(), V(acc_t(1e-3))).log();
      t_left = V::blendv(t_left, t_tail, u[k] > V(acc_t(-0.2)));
    }
    t[k] = V::blendv(t_right, t_left, left[k]);
  }

  const V inv_h1(acc_t(std::sqrt(2 / sc::kG2Star)));  // 1 / h'(t*)
  static_assert(std::is_same_v<acc_t, double>, "float takes slope_fast, not t");
  const int iterations = sc::kInverseIterations;
  for (int it = 0; it < iterations; ++it) {
    for (int k = 0; k < K; ++k) {
      const V sig = one / (one + t[k].neg().exp());
      const V g = t[k] * sig;
      const V slope = sig * (one + t[k] * (one - sig));
      const V a = at::vec::maximum(g - gs, zero).sqrt();
      // An iterate that strays close to t* gets 1 / h'(t*) instead of the noisy 2a / g'(t).
      const V close = (t[k] - ts).abs() < V(acc_t(0.02));
      const V inv_slope = V::blendv(V(acc_t(2)) * a / slope, inv_h1, close);
      const V stepped = t[k] - (a - b[k]) * inv_slope;
      t[k] = V::blendv(at::vec::maximum(stepped, ts), at::vec::minimum(stepped, ts), left[k]);
    }
  }
  if (any_near) {
    for (int k = 0; k < K; ++k) t[k] = V::blendv(t[k], t_near[k], near[k]);
  }
}

template <typename scalar_t>
void inplace_forward_typed(const at::Tensor& x, const at::Tensor& mask, double beta) {
  using acc_t = acc_type<scalar_t>;
  using V = Vectorized<acc_t>;
  scalar_t* data = x.data_ptr<scalar_t>();
  uint8_t* bits = mask.defined() ? mask.data_ptr<uint8_t>() : nullptr;
  const int64_t n = x.numel();
  const acc_t b = static_cast<acc_t>(beta);
  const acc_t t_star = static_cast<acc_t>(swish_constants::kTStar);
  const SwishMath<acc_t> m{b};
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, at::internal::GRAIN_SIZE / kBlock, [&](int64_t b0, int64_t b1) {
    alignas(64) acc_t buf[kBlock];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t start = blk * kBlock;
      const int64_t len = std::min(kBlock, n - start);
      load_block(data + start, buf, len);
      if (bits != nullptr) {
        uint8_t* out = bits + start / 8;
        for (int64_t byte = 0; byte * 8 < len; ++byte) {
          uint8_t v = 0;
          const int64_t e = std::min<int64_t>(8, len - byte * 8);
          for (int64_t j = 0; j < e; ++j) v |= uint8_t(b * buf[byte * 8 + j] < t_star) << j;
          out[byte] = v;
        }
      }
      for (int64_t i = 0; i < len; i += V::size()) {
        const int64_t c = std::min<int64_t>(V::size(), len - i);
        m.forward(V::loadu(buf + i, c)).store(buf + i, c);
      }
      store_block(buf, data + start, len);
    }
  });
}

// The side mask of the V::size() elements from `first` (a multiple of V::size()) on.
template <typename V>
V side_mask(const uint8_t* bits, int64_t first) {
  using T = typename V::value_type;
  const auto& rows = kBitsToMasks<T>.rows;
  if constexpr (V::size() <= 8) {
    return V::loadu(rows[bits[first / 8]] + first % 8);
  } else {
    alignas(64) at::vec::int_same_size_t<T> masks[V::size()];
    for (int j = 0; j < V::size() / 8; ++j) {
      std::copy_n(rows[bits[first / 8 + j]], 8, masks + 8 * j);
    }
    return V::loadu(masks);
  }
}

// grad_x = grad * g'(t) for one block: g, y and the block's packed side bits in, out.
template <typename acc_t>
void backward_block(const acc_t* g, const acc_t* y, const uint8_t* bits, acc_t* out,
                    int64_t len, acc_t beta) {
  using V = Vectorized<acc_t>;
  const V zero(acc_t(0)), one(acc_t(1));
  constexpr int K = kInterleave;
  static_assert(kBlock % (K * V::size()) == 0, "whole steps per block");
  // Lanes past len (last block) are computed from zeros and never stored.
  for (int64_t i = 0; i < len; i += K * V::size()) {
    V u[K], left[K], slope[K];
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) {
      // Right of t*, t = u once u > L (g(t) = t there): a u that overflowed to inf
      // becomes L, whose slope is 1, instead of inf * 0 = NaN. NaN stays NaN.
      u[k] = at::vec::clamp_max(V(beta) * V::loadu(y + i + k * V::size()),
                                V(swish_constants::slope_clamp<acc_t>()));
      left[k] = side_mask<V>(bits, i + k * V::size());
    }
    if constexpr (std::is_same_v<acc_t, float>) {
      slope_fast<K>(u, left, slope);
    } else {
      V t[K];
      inverse_g<acc_t, K>(u, left, t);
#pragma GCC unroll 8
      for (int k = 0; k < K; ++k) {
        const V s = one / (one + t[k].neg().exp());
        slope[k] = s * (one + t[k] * (one - s));
        // Left of t* with y == 0: x was so negative that y underflowed; dy/dx ~ 0 there.
        slope[k] = V::blendv(slope[k], zero, left[k] & (u[k] == zero));
      }
    }
    const int64_t rest = len - i;
#pragma GCC unroll 8
    for (int k = 0; k < K; ++k) {
      const V r = V::loadu(g + i + k * V::size()) * slope[k];
      if (rest >= (k + 1) * V::size()) {
        r.store(out + i + k * V::size());
      } else if (rest > k * V::size()) {
        r.store(out + i + k * V::size(), static_cast<int>(rest - k * V::size()));
      }
    }
  }
}

template <typename scalar_t>
void inplace_backward_typed(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                            const at::Tensor& grad_x, double beta) {
  using acc_t = acc_type<scalar_t>;
  constexpr bool kSameType = std::is_same_v<scalar_t, acc_t>;
  const scalar_t* g_data = grad.const_data_ptr<scalar_t>();
  const scalar_t* y_data = y.const_data_ptr<scalar_t>();
  const uint8_t* bits = mask.const_data_ptr<uint8_t>();
  scalar_t* out = grad_x.data_ptr<scalar_t>();
  const int64_t n = y.numel();
  const acc_t b = static_cast<acc_t>(beta);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  // A few times the arithmetic of the forward per element: smaller grains.
  at::parallel_for(0, blocks, at::internal::GRAIN_SIZE / kBlock / 4, [&](int64_t b0, int64_t b1) {
    alignas(64) acc_t gbuf[kBlock];
    alignas(64) acc_t ybuf[kBlock];
    alignas(64) acc_t obuf[kBlock];
    alignas(64) uint8_t bbuf[kBlock / 8];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t start = blk * kBlock;
      const int64_t len = std::min(kBlock, n - start);
      // Whole blocks of float or double are read and written in place; 16-bit types and the
      // last, partial block go through the buffers (zero past len, so every lane is defined).
      const bool direct = kSameType && len == kBlock;
      const acc_t* gp = gbuf;
      const acc_t* yp = ybuf;
      acc_t* op = obuf;
      if constexpr (kSameType) {
        if (direct) {
          gp = reinterpret_cast<const acc_t*>(g_data + start);
          yp = reinterpret_cast<const acc_t*>(y_data + start);
          op = reinterpret_cast<acc_t*>(out + start);
        }
      }
      if (!direct) {
        load_block(g_data + start, gbuf, len);
        load_block(y_data + start, ybuf, len);
        std::fill(gbuf + len, gbuf + kBlock, acc_t(0));
        std::fill(ybuf + len, ybuf + kBlock, acc_t(0));
      }
      if (b == acc_t(0)) {  // y = x / 2
        for (int64_t i = 0; i < len; ++i) op[i] = gp[i] * acc_t(0.5);
      } else {
        // The block's mask bytes, zero past the mask's end (lanes past len read them).
        const int64_t mask_len = swish_constants::mask_bytes(len);
        std::copy_n(bits + start / 8, mask_len, bbuf);
        std::fill(bbuf + mask_len, bbuf + kBlock / 8, uint8_t(0));
        backward_block(gp, yp, bbuf, op, len, b);
      }
      if (!direct) store_block(obuf, out + start, len);
    }
  });
}

bool runs_in_parallel() {
#ifdef INTRA_OP_PARALLEL  // ATen/Parallel.h: set by its OpenMP header under -fopenmp, or native
  return true;
#else
  return false;
#endif
}

void inplace_forward_kernel(const at::Tensor& x, const at::Tensor& mask, double beta) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(),
                                  "memlean_swish_inplace_cpu",
                                  [&] { inplace_forward_typed<scalar_t>(x, mask, beta); });
}

void inplace_backward_kernel(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                             const at::Tensor& grad_x, double beta) {
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, y.scalar_type(), "memlean_swish_inplace_backward_cpu",
      [&] { inplace_backward_typed<scalar_t>(grad, y, mask, grad_x, beta); });
}

void forward_kernel(at::TensorIteratorBase& iter, double beta) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, iter.common_dtype(), "memlean_swish_cpu",
                                  [&] { forward_typed<scalar_t>(iter, beta); });
}

void backward_kernel(at::TensorIteratorBase& iter, double beta) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, iter.common_dtype(),
                                  "memlean_swish_backward_cpu",
                                  [&] { backward_typed<scalar_t>(iter, beta); });
}

}  // namespace

// This copy's entry points, found by capability.cc.
extern const Kernels kKernels = {&runs_in_parallel, &forward_kernel, &backward_kernel,
                                 &inplace_forward_kernel, &inplace_backward_kernel};

}  // namespace memlean::swish_cpu::CPU_CAPABILITY
