// CUDA kernels of the memlean swish operators: tensors and the current stream in, raw
// kernels (swish_kernel.cu) out. Registered for the CUDA dispatch key.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops/swish/cuda/swish_kernel.h"
#include "ops/swish/internal/checks.h"
#include "ops/swish/internal/constants.h"
#include "ops/swish/internal/layout.h"

namespace memlean {
namespace {

using swish_cuda::DType;

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat;
    case at::kDouble: return DType::kDouble;
    case at::kHalf: return DType::kHalf;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_INTERNAL_ASSERT(false, "dtype checked before: ", t.scalar_type());
  }
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Every wrapper walks memory order (layout.h): a dense input of any layout (channels_last
// included) is read and written in place, with outputs in its layout.
at::Tensor forward_cuda(const at::Tensor& x, double beta) {
  swish_detail::check_input(x, "x", "memlean::swish");
  swish_detail::check_beta(beta, x, "memlean::swish");
  const c10::cuda::CUDAGuard guard(x.device());
  return swish_detail::forward_in_memory_order(x, [&](const at::Tensor& xf, const at::Tensor& y) {
    swish_cuda::forward(dtype_of(xf), xf.const_data_ptr(), y.data_ptr(), xf.numel(), beta,
                        stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor backward_cuda(const at::Tensor& grad, const at::Tensor& x, double beta) {
  swish_detail::check_backward_args(grad, x, beta);
  const c10::cuda::CUDAGuard guard(x.device());
  return swish_detail::backward_in_memory_order(
      grad, x, [&](const at::Tensor& g, const at::Tensor& xf, const at::Tensor& grad_x) {
        swish_cuda::backward(dtype_of(xf), g.const_data_ptr(), xf.const_data_ptr(),
                             grad_x.data_ptr(), xf.numel(), beta, stream());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

// The same, grad_x written over grad (same strides as x, checked): each thread reads its
// elements of grad before it writes them, and no other.
void backward_into_cuda(at::Tensor& grad, const at::Tensor& x, double beta) {
  swish_detail::check_backward_into_args(grad, x, beta);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xf = swish_detail::memory_order(x);
  swish_cuda::backward(dtype_of(xf), grad.const_data_ptr(), xf.const_data_ptr(), grad.data_ptr(),
                       xf.numel(), beta, stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void run_inplace_cuda(at::Tensor& x, const at::Tensor& mask, double beta) {
  const c10::cuda::CUDAGuard guard(x.device());
  swish_detail::inplace_in_memory_order(x, [&](const at::Tensor& xf) {
    swish_cuda::inplace_forward(dtype_of(xf), xf.data_ptr(),
                                mask.defined() ? mask.data_ptr<uint8_t>() : nullptr, xf.numel(),
                                beta, stream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void inplace_cuda(at::Tensor& x, double beta) {
  swish_detail::check_inplace_input(x, beta);
  run_inplace_cuda(x, at::Tensor(), beta);
}

at::Tensor inplace_with_mask_cuda(at::Tensor& x, double beta) {
  swish_detail::check_inplace_input(x, beta);
  at::Tensor mask =
      at::empty({swish_constants::mask_bytes(x.numel())}, x.options().dtype(at::kByte));
  run_inplace_cuda(x, mask, beta);
  return mask;
}

at::Tensor inplace_backward_cuda(const at::Tensor& grad, const at::Tensor& y,
                                 const at::Tensor& mask, double beta) {
  swish_detail::check_inplace_backward_args(grad, y, mask, beta);
  const c10::cuda::CUDAGuard guard(y.device());
  const at::Tensor m = mask.contiguous();
  return swish_detail::backward_in_memory_order(
      grad, y, [&](const at::Tensor& g, const at::Tensor& yf, const at::Tensor& grad_x) {
        swish_cuda::inplace_backward(dtype_of(yf), g.const_data_ptr(), yf.const_data_ptr(),
                                     m.const_data_ptr<uint8_t>(), grad_x.data_ptr(), yf.numel(),
                                     beta, stream());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
}

// The same, grad_x written over grad (same strides as y, checked): each thread reads its
// elements of grad before it writes them, and no other.
void inplace_backward_into_cuda(at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                                double beta) {
  swish_detail::check_inplace_backward_into_args(grad, y, mask, beta);
  const c10::cuda::CUDAGuard guard(y.device());
  const at::Tensor m = mask.contiguous();
  const at::Tensor yf = swish_detail::memory_order(y);
  swish_cuda::inplace_backward(dtype_of(yf), grad.const_data_ptr(), yf.const_data_ptr(),
                               m.const_data_ptr<uint8_t>(), grad.data_ptr(), yf.numel(), beta,
                               stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace memlean

TORCH_LIBRARY_IMPL(memlean, CUDA, m) {
  m.impl("swish", &memlean::forward_cuda);
  m.impl("swish_backward", &memlean::backward_cuda);
  m.impl("_swish_backward_", &memlean::backward_into_cuda);
  m.impl("swish_", &memlean::inplace_cuda);
  m.impl("_swish_inplace_with_mask", &memlean::inplace_with_mask_cuda);
  m.impl("_swish_inplace_backward", &memlean::inplace_backward_cuda);
  m.impl("_swish_inplace_backward_", &memlean::inplace_backward_into_cuda);
}
