// Swish-β CUDA kernels: each thread handles groups of 8 elements (one mask byte), loaded
// as whole vectors when aligned; float math for half and bfloat16, double for double.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "ops/swish/cuda/swish_kernel.h"
#include "ops/swish/internal/constants.h"
#include "ops/swish/internal/inplace_slope.h"

namespace memlean::swish_cuda {
namespace {

namespace sc = swish_constants;

constexpr int kGroup = 8;  // elements per thread step = bits per mask byte
constexpr int kThreads = 256;

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
__device__ __forceinline__ acc_t<T> to_acc(T v) {
  if constexpr (std::is_same_v<T, __half>) return __half2float(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v);
  else return v;
}

template <typename T>
__device__ __forceinline__ T from_acc(acc_t<T> v) {
  if constexpr (std::is_same_v<T, __half>) return __float2half_rn(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
  else return v;
}

template <typename T>
struct alignas(sizeof(T) * kGroup) Group {
  T v[kGroup];
};

// Loads elements [i, i + kGroup) (fewer at the end) into a; whole-vector load when aligned.
template <typename T>
__device__ __forceinline__ int load_group(const T* p, int64_t i, int64_t n, acc_t<T>* a) {
  const int count = n - i < kGroup ? static_cast<int>(n - i) : kGroup;
  if (count == kGroup && reinterpret_cast<uintptr_t>(p + i) % sizeof(Group<T>) == 0) {
    const Group<T> g = *reinterpret_cast<const Group<T>*>(p + i);
#pragma unroll
    for (int j = 0; j < kGroup; ++j) a[j] = to_acc(g.v[j]);
  } else {
    for (int j = 0; j < count; ++j) a[j] = to_acc(p[i + j]);
  }
  return count;
}

template <typename T>
__device__ __forceinline__ void store_group(T* p, int64_t i, int count, const acc_t<T>* a) {
  if (count == kGroup && reinterpret_cast<uintptr_t>(p + i) % sizeof(Group<T>) == 0) {
    Group<T> g;
#pragma unroll
    for (int j = 0; j < kGroup; ++j) g.v[j] = from_acc<T>(a[j]);
    *reinterpret_cast<Group<T>*>(p + i) = g;
  } else {
    for (int j = 0; j < count; ++j) p[i + j] = from_acc<T>(a[j]);
  }
}

template <typename A>
__device__ __forceinline__ A sigmoid(A t) {
  return A(1) / (A(1) + exp(-t));
}

template <typename A>
__device__ __forceinline__ A swish(A x, A beta) {
  return x / (A(1) + exp(-beta * x));
}

// sc::slope_clamp<A>() in device code (constexpr host functions are not callable there).
template <typename A>
__device__ __forceinline__ A slope_clamp() {
  return sizeof(A) == sizeof(double) ? A(sc::kSlopeClampDouble) : A(sc::kSlopeClampFloat);
}

template <typename A>
__device__ __forceinline__ A swish_grad(A x, A beta) {
  const A L = slope_clamp<A>();
  A t = beta * x;
  if (!isnan(t)) t = min(max(t, -L), L);  // overflowed to ±inf: slope 0 or 1, not NaN
  const A s = sigmoid(t);
  return s * (A(1) + t * (A(1) - s));
}

// Double only: t from u = t * sigmoid(t) and its side of t*, the same method as the CPU
// kernel's double path (ops/swish/cpu/swish_kernel.cc): a series in s = ±sqrt(u - g*) near
// t*, else Newton on h(t) = ±sqrt(g(t) - g*). Float (and half, bfloat16) need no t:
// inplace_slope.h.
template <typename A>
__device__ A inverse_g(A u, bool left) {
  // Device max/min on doubles are fmax/fmin, which drop a NaN operand (fmax(NaN, 0) == 0):
  // without this a NaN y would come out as t* and a finite slope. NaN in, NaN out, as on
  // the CPU (at::vec::maximum keeps NaN).
  if (isnan(u)) return u;
  const A ts = A(sc::kTStar), gs = A(sc::kGStar);
  const A d = max(u - gs, A(0));
  const A b = sqrt(d);
  const A s = left ? -b : b;
  if (b < A(sc::kSeriesRadius)) {
    const A series =
        A(sc::kSeries1) +
        s * (A(sc::kSeries2) +
             s * (A(sc::kSeries3) + s * (A(sc::kSeries4) + s * (A(sc::kSeries5) + s * A(sc::kSeries6)))));
    return ts + s * series;
  }
  const A r = sqrt(d * A(2 / sc::kG2Star));
  A t;
  if (left) {
    t = ts - r;
    if (u > A(-0.2)) {
      const A lnu = log(max(-u, A(1e-38)));
      t = lnu - log(max(-lnu, A(1e-3)));
    }
  } else {
    t = u > A(2) ? u : ts + r;
  }
  const A inv_h1 = A(1) / sqrt(A(sc::kG2Star / 2));
  static_assert(std::is_same_v<A, double>, "float takes inplace_slope, not t");
  const int iterations = sc::kInverseIterations;
  for (int k = 0; k < iterations; ++k) {
    const A sig = sigmoid(t);
    const A g = t * sig;
    const A slope = sig * (A(1) + t * (A(1) - sig));
    const A a = sqrt(max(g - gs, A(0)));
    const A inv_slope = abs(t - ts) < A(0.02) ? inv_h1 : A(2) * a / slope;
    const A stepped = t - (a - b) * inv_slope;
    t = left ? min(stepped, ts) : max(stepped, ts);
  }
  return t;
}

// The grid-stride walk of every kernel: each thread takes groups of kGroup elements (one
// mask byte), starting at group_first() and stepping by group_stride() until n; a grid
// smaller than n / kGroup threads makes further passes.
__device__ __forceinline__ int64_t group_first() {
  return (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) * kGroup;
}
__device__ __forceinline__ int64_t group_stride() {
  return int64_t(gridDim.x) * blockDim.x * kGroup;
}

template <typename T>
__global__ void forward_kernel(const T* x, T* y, int64_t n, acc_t<T> beta) {
  using A = acc_t<T>;
  for (int64_t i = group_first(); i < n; i += group_stride()) {
    A a[kGroup];
    const int c = load_group(x, i, n, a);
#pragma unroll
    for (int j = 0; j < kGroup; ++j) a[j] = swish(a[j], beta);
    store_group(y, i, c, a);
  }
}

template <typename T>
__global__ void backward_kernel(const T* grad, const T* x, T* grad_x, int64_t n, acc_t<T> beta) {
  using A = acc_t<T>;
  for (int64_t i = group_first(); i < n; i += group_stride()) {
    A g[kGroup], a[kGroup];
    const int c = load_group(grad, i, n, g);
    load_group(x, i, n, a);
#pragma unroll
    for (int j = 0; j < kGroup; ++j) a[j] = g[j] * swish_grad(a[j], beta);
    store_group(grad_x, i, c, a);
  }
}

template <typename T>
__global__ void inplace_forward_kernel(T* x, uint8_t* mask, int64_t n, acc_t<T> beta) {
  using A = acc_t<T>;
  for (int64_t i = group_first(); i < n; i += group_stride()) {
    A a[kGroup];
    const int c = load_group(x, i, n, a);
    uint8_t bits = 0;
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      if (j < c) bits |= uint8_t(beta * a[j] < A(sc::kTStar)) << j;
      a[j] = swish(a[j], beta);
    }
    store_group(x, i, c, a);
    if (mask != nullptr) mask[i / kGroup] = bits;
  }
}

template <typename T>
__global__ void inplace_backward_kernel(const T* grad, const T* y, const uint8_t* mask, T* grad_x,
                                        int64_t n, acc_t<T> beta) {
  using A = acc_t<T>;
  for (int64_t i = group_first(); i < n; i += group_stride()) {
    A g[kGroup], a[kGroup];
    const int c = load_group(grad, i, n, g);
    load_group(y, i, n, a);
    const uint8_t bits = mask[i / kGroup];
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      if (beta == A(0)) {
        a[j] = g[j] * A(0.5);
        continue;
      }
      const bool left = (bits >> j) & 1;
      A u = beta * a[j];
      if (u > slope_clamp<A>()) u = slope_clamp<A>();  // overflowed: t = u = L
      A slope;
      if constexpr (std::is_same_v<A, float>) {
        slope = sc::inplace_slope(u, left);  // polynomials in sqrt(u - g*), no iteration
      } else {
        const A t = inverse_g(u, left);
        const A s = sigmoid(t);
        slope = (left && u == A(0)) ? A(0) : s * (A(1) + t * (A(1) - s));
      }
      a[j] = g[j] * slope;
    }
    store_group(grad_x, i, c, a);
  }
}

unsigned blocks_for(int64_t n) {
  const int64_t groups = (n + kGroup - 1) / kGroup;
  return static_cast<unsigned>(std::clamp<int64_t>((groups + kThreads - 1) / kThreads, 1, 65535));
}

template <typename F>
void dispatch(DType t, F&& f) {
  switch (t) {
    case DType::kFloat: f(float{}); break;
    case DType::kDouble: f(double{}); break;
    case DType::kHalf: f(__half{}); break;
    case DType::kBFloat16: f(__nv_bfloat16{}); break;
  }
}

}  // namespace

void forward(DType t, const void* x, void* y, int64_t n, double beta, cudaStream_t stream) {
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    forward_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<T*>(y), n, static_cast<acc_t<T>>(beta));
  });
}

void backward(DType t, const void* grad, const void* x, void* grad_x, int64_t n, double beta,
              cudaStream_t stream) {
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    backward_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(
        static_cast<const T*>(grad), static_cast<const T*>(x), static_cast<T*>(grad_x), n,
        static_cast<acc_t<T>>(beta));
  });
}

void inplace_forward(DType t, void* x, uint8_t* mask, int64_t n, double beta, cudaStream_t stream) {
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    inplace_forward_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(
        static_cast<T*>(x), mask, n, static_cast<acc_t<T>>(beta));
  });
}

void inplace_backward(DType t, const void* grad, const void* y, const uint8_t* mask, void* grad_x,
                      int64_t n, double beta, cudaStream_t stream) {
  if (n == 0) return;
  dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    inplace_backward_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(
        static_cast<const T*>(grad), static_cast<const T*>(y), mask, static_cast<T*>(grad_x), n,
        static_cast<acc_t<T>>(beta));
  });
}

}  // namespace memlean::swish_cuda
