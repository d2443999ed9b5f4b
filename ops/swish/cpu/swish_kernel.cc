// Vectorized Swish-β kernels. This file is compiled twice: CPU_CAPABILITY=DEFAULT and
// CPU_CAPABILITY=AVX2 (-mavx2 -mfma -mf16c); at::vec puts Vectorized<T> in an inline
// namespace named after the capability, so the two copies never collide.
#include "ops/swish/cpu/swish_kernel.h"

#include <ATen/Dispatch.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/cpu/Loops.h>

#include <cmath>

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

}  // namespace

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
