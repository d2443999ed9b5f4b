// CUDA kernels of the memlean swish operators: tensors and the current stream in, raw
// kernels (swish_kernels.cu) out. Registered for the CUDA dispatch key.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops/swish/cuda/swish_kernels.h"
#include "ops/swish/swish_checks.h"

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

at::Tensor forward_cuda(const at::Tensor& x, double beta) {
  swish_detail::check_input(x, "x", "memlean::swish");
  swish_detail::check_beta(beta, x, "memlean::swish");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty_like(xc);
  swish_cuda::forward(dtype_of(xc), xc.const_data_ptr(), y.data_ptr(), xc.numel(), beta, stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

at::Tensor backward_cuda(const at::Tensor& grad, const at::Tensor& x, double beta) {
  swish_detail::check_backward_args(grad, x, beta);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor gc = grad.contiguous(), xc = x.contiguous();
  at::Tensor grad_x = at::empty_like(xc);
  swish_cuda::backward(dtype_of(xc), gc.const_data_ptr(), xc.const_data_ptr(), grad_x.data_ptr(),
                       xc.numel(), beta, stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad_x;
}

void run_inplace_cuda(at::Tensor& x, const at::Tensor& mask, double beta) {
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor xc = x.is_contiguous() ? x : x.contiguous();
  swish_cuda::inplace_forward(dtype_of(xc), xc.data_ptr(),
                              mask.defined() ? mask.data_ptr<uint8_t>() : nullptr, xc.numel(), beta,
                              stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (!xc.is_same(x)) x.copy_(xc);
}

void inplace_cuda(at::Tensor& x, double beta) {
  swish_detail::check_inplace_input(x, beta);
  run_inplace_cuda(x, at::Tensor(), beta);
}

at::Tensor inplace_with_mask_cuda(at::Tensor& x, double beta) {
  swish_detail::check_inplace_input(x, beta);
  at::Tensor mask = at::empty({(x.numel() + 7) / 8}, x.options().dtype(at::kByte));
  run_inplace_cuda(x, mask, beta);
  return mask;
}

at::Tensor inplace_backward_cuda(const at::Tensor& grad, const at::Tensor& y,
                                 const at::Tensor& mask, double beta) {
  swish_detail::check_inplace_backward_args(grad, y, mask, beta);
  const c10::cuda::CUDAGuard guard(y.device());
  const at::Tensor gc = grad.contiguous(), yc = y.contiguous(), mc = mask.contiguous();
  at::Tensor grad_x = at::empty(y.sizes(), y.options());
  swish_cuda::inplace_backward(dtype_of(yc), gc.const_data_ptr(), yc.const_data_ptr(),
                               mc.const_data_ptr<uint8_t>(), grad_x.data_ptr(), yc.numel(), beta,
                               stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return grad_x;
}

}  // namespace
}  // namespace memlean

TORCH_LIBRARY_IMPL(memlean, CUDA, m) {
  m.impl("swish", &memlean::forward_cuda);
  m.impl("swish_backward", &memlean::backward_cuda);
  m.impl("swish_", &memlean::inplace_cuda);
  m.impl("_swish_inplace_with_mask", &memlean::inplace_with_mask_cuda);
  m.impl("_swish_inplace_backward", &memlean::inplace_backward_cuda);
}
