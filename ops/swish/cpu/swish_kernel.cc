// Vectorized Swish-β kernels. This file is compiled twice: CPU_CAPABILITY=DEFAULT and
// CPU_CAPABILITY=AVX2 (-mavx2 -mfma -mf16c); at::vec puts Vectorized<T> in an inline
// namespace named after the capability, so the two copies never collide.
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

#include "ops/swish/swish_constants.h"

#ifndef CPU_CAPABILITY
#error "CPU_CAPABILITY must be defined (DEFAULT or AVX2)"
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
    const T s = T(1) / (T(1) + std::exp(-beta * x));
    return g * s * (T(1) + beta * x * (T(1) - s));
  }
  Vectorized<T> forward(Vectorized<T> x) const {
    return x / (Vectorized<T>(T(1)) + (x * Vectorized<T>(-beta)).exp());
  }
  Vectorized<T> backward(Vectorized<T> g, Vectorized<T> x) const {
    const Vectorized<T> one(T(1));
    const Vectorized<T> s = one / (one + (x * Vectorized<T>(-beta)).exp());
    return g * s * (one + Vectorized<T>(beta) * x * (one - s));
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

template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

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

// t from u = g(t) = t * sigmoid(t) and the side of t* (left: lanes of `left` set).
//
// With s = ±sqrt(u - g*) (sign: the side), t is a smooth function of s, even at t*, where
// g itself is flat. Near t* (|s| < kSeriesRadius) t comes from a series in s: evaluating
// g(t) - g* there would cancel to rounding noise. Elsewhere, Newton's method on
// h(t) = ±sqrt(g(t) - g*), whose step is (a - b) * 2a / g'(t) with a = sqrt(g(t) - g*) and
// b = |s|, starting from the quadratic model near t*, u itself for large u (t ~ u), and
// t ~ log(-u) - log(-log(-u)) in the left tail (u ~ t e^t); each step keeps t on its side.
template <typename acc_t>
Vectorized<acc_t> inverse_g(Vectorized<acc_t> u, Vectorized<acc_t> left) {
  namespace sc = swish_constants;
  using V = Vectorized<acc_t>;
  const V zero(acc_t(0)), one(acc_t(1)), ts(acc_t(sc::kTStar)), gs(acc_t(sc::kGStar));
  const V d = at::vec::maximum(u - gs, zero);
  const V b = d.sqrt();
  const V s = V::blendv(b, b.neg(), left);
  const V near = b < V(acc_t(sc::kSeriesRadius));
  V series(acc_t(sc::kInverseSeries[5]));
  for (int k = 4; k >= 0; --k) series = V(acc_t(sc::kInverseSeries[k])) + s * series;
  const V t_near = ts + s * series;

  const V r = (d * V(acc_t(2 / sc::kG2Star))).sqrt();
  const V t_right = V::blendv(ts + r, u, u > V(acc_t(2)));
  const V log_neg_u = at::vec::maximum(u.neg(), V(std::numeric_limits<acc_t>::min())).log();
  const V t_tail = log_neg_u - at::vec::maximum(log_neg_u.neg(), V(acc_t(1e-3))).log();
  const V t_left = V::blendv(ts - r, t_tail, u > V(acc_t(-0.2)));
  V t = V::blendv(V::blendv(t_right, t_left, left), t_near, near);

  const V inv_h1(acc_t(std::sqrt(2 / sc::kG2Star)));  // 1 / h'(t*)
  // float: 3 steps reach the rounding floor; double converges further.
  const int iterations = std::is_same_v<acc_t, double> ? 2 * sc::kInverseIterations
                                                       : sc::kInverseIterations;
  for (int k = 0; k < iterations; ++k) {
    const V sig = one / (one + t.neg().exp());
    const V g = t * sig;
    const V slope = sig * (one + t * (one - sig));
    const V a = at::vec::maximum(g - gs, zero).sqrt();
    // An iterate that strays close to t* gets 1 / h'(t*) instead of the noisy 2a / g'(t).
    const V close = (t - ts).abs() < V(acc_t(0.02));
    const V inv_slope = V::blendv(V(acc_t(2)) * a / slope, inv_h1, close);
    const V stepped = t - (a - b) * inv_slope;
    t = V::blendv(at::vec::maximum(stepped, ts), at::vec::minimum(stepped, ts), left);
    t = V::blendv(t, t_near, near);
  }
  return t;
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

template <typename scalar_t>
void inplace_backward_typed(const at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                            const at::Tensor& grad_x, double beta) {
  using acc_t = acc_type<scalar_t>;
  using V = Vectorized<acc_t>;
  const scalar_t* g_data = grad.const_data_ptr<scalar_t>();
  const scalar_t* y_data = y.const_data_ptr<scalar_t>();
  const uint8_t* bits = mask.const_data_ptr<uint8_t>();
  scalar_t* out = grad_x.data_ptr<scalar_t>();
  const int64_t n = y.numel();
  const acc_t b = static_cast<acc_t>(beta);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  // About ten times the arithmetic of the forward per element: smaller grains.
  at::parallel_for(0, blocks, at::internal::GRAIN_SIZE / kBlock / 8, [&](int64_t b0, int64_t b1) {
    alignas(64) acc_t gbuf[kBlock];
    alignas(64) acc_t ybuf[kBlock];
    alignas(64) acc_t lbuf[kBlock];
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t start = blk * kBlock;
      const int64_t len = std::min(kBlock, n - start);
      load_block(g_data + start, gbuf, len);
      load_block(y_data + start, ybuf, len);
      if (b == acc_t(0)) {  // y = x / 2
        for (int64_t i = 0; i < len; ++i) ybuf[i] = gbuf[i] * acc_t(0.5);
        store_block(ybuf, out + start, len);
        continue;
      }
      for (int64_t i = 0; i < len; ++i) {
        const int64_t e = start + i;
        lbuf[i] = (bits[e >> 3] >> (e & 7)) & 1 ? acc_t(1) : acc_t(0);
      }
      const V zero(acc_t(0)), one(acc_t(1)), half(acc_t(0.5));
      for (int64_t i = 0; i < len; i += V::size()) {
        const int64_t c = std::min<int64_t>(V::size(), len - i);
        const V u = V(b) * V::loadu(ybuf + i, c);
        const V left = V::loadu(lbuf + i, c) > half;
        const V t = inverse_g<acc_t>(u, left);
        const V s = one / (one + t.neg().exp());
        V slope = s * (one + t * (one - s));
        // Left of t* with y == 0: x was so negative that y underflowed; dy/dx ~ 0 there.
        slope = V::blendv(slope, zero, left & (u == zero));
        (V::loadu(gbuf + i, c) * slope).store(ybuf + i, c);
      }
      store_block(ybuf, out + start, len);
    }
  });
}

}  // namespace

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

}  // namespace memlean::swish_cpu::CPU_CAPABILITY
