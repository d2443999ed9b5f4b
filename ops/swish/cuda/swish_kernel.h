// CUDA kernels of //ops/swish, on raw contiguous memory (no torch headers: nvcc compiles
// this quickly; ops/swish/cuda/register.cc adapts tensors and streams).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace memlean::swish_cuda {

enum class DType { kFloat, kDouble, kHalf, kBFloat16 };

// y = x * sigmoid(beta * x).
void forward(DType t, const void* x, void* y, int64_t n, double beta, cudaStream_t stream);
// grad_x = grad * dy/dx, from x.
void backward(DType t, const void* grad, const void* x, void* grad_x, int64_t n, double beta,
              cudaStream_t stream);
// x <- y; if mask is not null, bit i%8 of mask[i/8] = (beta * x_i < t*).
void inplace_forward(DType t, void* x, uint8_t* mask, int64_t n, double beta, cudaStream_t stream);
// grad_x = grad * dy/dx, from y and the mask.
void inplace_backward(DType t, const void* grad, const void* y, const uint8_t* mask, void* grad_x,
                      int64_t n, double beta, cudaStream_t stream);

}  // namespace memlean::swish_cuda
