// Reading and writing bfloat16 elements by their bits, for the lean backwards' CPU kernels
// (lean_batchnorm.cc, lean_conv.cc).
//
// The kernels read an element as Element<S> (the tensor's type S, but bfloat16 as Bf16Bits)
// and compute in A (at::opmath_type<S>: float for bfloat16 and half). bfloat16 is the top half
// of a float's bits, so widening is a shift and rounding (to nearest even, NaN to a quiet NaN:
// what c10::BFloat16's constructor does) is integer arithmetic, which the compiler vectorizes
// in the loops that call them; c10::BFloat16's own conversions, called element by element,
// are not (measured: the bfloat16 BatchNorm backward in 1.77x torch's time before, 1.12-1.17x
// after, AMD EPYC with AVX2, 2026-11-28). Other types are static_cast.
#ifndef MEMLEAN_OPS_CHECKPOINT_INTERNAL_REDUCED_BITS_H_
#define MEMLEAN_OPS_CHECKPOINT_INTERNAL_REDUCED_BITS_H_

#include <c10/util/BFloat16.h>

#include <bit>
#include <cstdint>
#include <type_traits>

namespace memlean::reduced_bits {

struct Bf16Bits {
  uint16_t bits;
};

// The element type the kernels read for a tensor of type S.
template <typename S>
using Element = std::conditional_t<std::is_same_v<S, c10::BFloat16>, Bf16Bits, S>;

template <typename A, typename T>
inline A widen(T v) {
  if constexpr (std::is_same_v<T, Bf16Bits>) {
    return std::bit_cast<float>(static_cast<uint32_t>(v.bits) << 16);
  } else {
    return static_cast<A>(v);
  }
}

template <typename T, typename A>
inline T narrow(A v) {
  if constexpr (std::is_same_v<T, Bf16Bits>) {
    const uint32_t u = std::bit_cast<uint32_t>(v);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return Bf16Bits{static_cast<uint16_t>(v != v ? 0x7fc0u : rounded)};
  } else {
    return static_cast<T>(v);
  }
}

// A tensor's data as the kernels read it.
template <typename S>
inline const Element<S>* elements(const S* p) {
  static_assert(sizeof(Element<S>) == sizeof(S));
  return reinterpret_cast<const Element<S>*>(p);
}

template <typename S>
inline Element<S>* elements(S* p) {
  static_assert(sizeof(Element<S>) == sizeof(S));
  return reinterpret_cast<Element<S>*>(p);
}

}  // namespace memlean::reduced_bits

#endif  // MEMLEAN_OPS_CHECKPOINT_INTERNAL_REDUCED_BITS_H_
