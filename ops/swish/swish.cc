// Swish-β: the operators' schema and Meta kernels, their typed handles
// (internal/op_handles.h) and the public C++ API (swish.h). The CPU kernels are registered
// in cpu/register.cc, the CUDA ones in cuda/register.cc, the Autograd and ADInplaceOrView
// kernels in autograd/swish_autograd.cc (the layout torchvision's ops use).
#include "ops/swish/swish.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>

#include "ops/swish/internal/checks.h"
#include "ops/swish/internal/constants.h"
#include "ops/swish/internal/op_handles.h"
#include "third_party/torch/grads.h"

namespace memlean {
namespace swish_detail {

// The tensor x views all of, element for element, where autograd records an in-place op on
// x (a torch::nn::Linear output for a 3-d input is a view of its 2-d matmul result); else
// undefined. Autograd records an in-place op on a view as one on its base (CopySlices), whose
// backward makes a zeroed gradient of the base and copies into it: two more tensors of x's
// size. swish(x, kInplace) overwrites the base instead and returns a view of it: the same
// memory and values, and a backward as for a tensor that is no view. (Python's
// memlean.swish does the same: swish.py's _whole_base.)
static at::Tensor whole_base(const at::Tensor& x) {
  if (!x.defined() || !x.is_view() || !at::GradMode::is_enabled() || !x.requires_grad()) {
    return {};
  }
  const at::Tensor base(x._base());
  if (is_wrapped(x) || is_wrapped(base) || base.is_leaf() || !views_all_of(x, base)) return {};
  return base;
}

const ForwardOp& forward_op() {
  static const ForwardOp op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("memlean::swish", "")
                             .typed<at::Tensor(const at::Tensor&, double)>();
  return op;
}

const BackwardOp& backward_op() {
  static const BackwardOp op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memlean::swish_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op;
}

const BackwardIntoOp& backward_into_op() {
  static const BackwardIntoOp op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memlean::_swish_backward_", "")
          .typed<void(at::Tensor&, const at::Tensor&, double)>();
  return op;
}

const InplaceOp& inplace_op() {
  static const InplaceOp op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("memlean::swish_", "")
                             .typed<void(at::Tensor&, double)>();
  return op;
}

const InplaceWithMaskOp& inplace_with_mask_op() {
  static const InplaceWithMaskOp op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("memlean::_swish_inplace_with_mask", "")
                             .typed<at::Tensor(at::Tensor&, double)>();
  return op;
}

const InplaceBackwardOp& inplace_backward_op() {
  static const InplaceBackwardOp op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memlean::_swish_inplace_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return op;
}

const InplaceBackwardIntoOp& inplace_backward_into_op() {
  static const InplaceBackwardIntoOp op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memlean::_swish_inplace_backward_", "")
          .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return op;
}

namespace {

// ---- Meta kernels: shapes and checks only (torch.compile, torch.export, FakeTensor) ----

void inplace_meta(at::Tensor& x, double beta) { check_inplace_input(x, beta); }

at::Tensor inplace_with_mask_meta(at::Tensor& x, double beta) {
  check_inplace_input(x, beta);
  return at::empty_symint({swish_constants::mask_bytes(x.sym_numel())}, x.options().dtype(at::kByte));
}

at::Tensor inplace_backward_meta(const at::Tensor& grad, const at::Tensor& y,
                                 const at::Tensor& mask, double beta) {
  check_inplace_backward_args(grad, y, mask, beta);
  return at::empty_like(y);
}

void inplace_backward_into_meta(at::Tensor& grad, const at::Tensor& y, const at::Tensor& mask,
                                double beta) {
  check_inplace_backward_into_args(grad, y, mask, beta);
}

void backward_into_meta(at::Tensor& grad, const at::Tensor& x, double beta) {
  check_backward_into_args(grad, x, beta);
}

at::Tensor forward_meta(const at::Tensor& x, double beta) {
  check_input(x, "x", "memlean::swish");
  check_beta(beta, x, "memlean::swish");
  return at::empty_like(x);
}

at::Tensor backward_meta(const at::Tensor& grad, const at::Tensor& x, double beta) {
  check_backward_args(grad, x, beta);
  return at::empty_like(x);
}

}  // namespace
}  // namespace swish_detail

SwishVariant parse_swish_variant(std::string_view name) {
  if (name == "naive") return SwishVariant::kNaive;
  if (name == "memory_efficient") return SwishVariant::kMemoryEfficient;
  if (name == "inplace") return SwishVariant::kInplace;
  TORCH_CHECK(false, "memlean::swish: unknown variant \"", std::string(name),
              "\"; expected \"naive\", \"memory_efficient\" or \"inplace\"");
}

std::string to_string(SwishVariant variant) {
  switch (variant) {
    case SwishVariant::kNaive: return "naive";
    case SwishVariant::kMemoryEfficient: return "memory_efficient";
    case SwishVariant::kInplace: return "inplace";
  }
  TORCH_INTERNAL_ASSERT(false, "unknown SwishVariant ", static_cast<int>(variant));
}

at::Tensor swish(const at::Tensor& x, double beta, SwishVariant variant) {
  switch (variant) {
    case SwishVariant::kNaive:
      swish_detail::check_input(x, "x", "memlean::swish");
      swish_detail::check_beta(beta, x, "memlean::swish");
      return x * at::sigmoid(beta == 1.0 ? x : x * beta);
    case SwishVariant::kMemoryEfficient: return swish_detail::forward_op().call(x, beta);
    case SwishVariant::kInplace: {
      const at::Tensor base = swish_detail::whole_base(x);
      if (base.defined()) {
        swish_(base, beta);
        return base.view(x.sizes());
      }
      return swish_(x, beta);
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unknown SwishVariant ", static_cast<int>(variant));
}

const at::Tensor& swish_(const at::Tensor& x, double beta) {
  swish_detail::inplace_op().call(const_cast<at::Tensor&>(x), beta);
  return x;
}

at::Tensor swish_forward(const at::Tensor& x, double beta) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return swish_detail::forward_op().call(x, beta);
}

at::Tensor swish_backward(const at::Tensor& grad, const at::Tensor& x, double beta) {
  at::AutoDispatchBelowADInplaceOrView guard;
  return swish_detail::backward_op().call(grad, x, beta);
}

int64_t swish_inplace_mask_bytes(int64_t numel) { return swish_constants::mask_bytes(numel); }

}  // namespace memlean

// A fragment, so that every memlean op library (swish, checkpoint, ...) adds its own
// operators to the one `memlean` namespace, loaded together or alone.
TORCH_LIBRARY_FRAGMENT(memlean, m) {
  m.def("swish(Tensor x, float beta=1.0) -> Tensor");
  m.def("swish_backward(Tensor grad, Tensor x, float beta) -> Tensor");
  // The same, writing the gradient over grad (the memory-efficient variant's backward does so
  // when nothing else holds grad: autograd/swish_autograd.cc).
  m.def("_swish_backward_(Tensor(a!) grad, Tensor x, float beta) -> ()");
  // No return value: functionalization (torch.compile, torch.export) supports mutating
  // custom ops only when their outputs do not alias inputs. memlean::swish_ returns x.
  m.def("swish_(Tensor(a!) x, float beta=1.0) -> ()");
  m.def("_swish_inplace_with_mask(Tensor(a!) x, float beta) -> Tensor");
  m.def("_swish_inplace_backward(Tensor grad, Tensor y, Tensor mask, float beta) -> Tensor");
  // The same, writing the gradient over grad (the in-place variant's backward does so when
  // nothing else holds grad: autograd/swish_autograd.cc).
  m.def("_swish_inplace_backward_(Tensor(a!) grad, Tensor y, Tensor mask, float beta) -> ()");
}

TORCH_LIBRARY_IMPL(memlean, Meta, m) {
  m.impl("swish", &memlean::swish_detail::forward_meta);
  m.impl("swish_backward", &memlean::swish_detail::backward_meta);
  m.impl("_swish_backward_", &memlean::swish_detail::backward_into_meta);
  m.impl("swish_", &memlean::swish_detail::inplace_meta);
  m.impl("_swish_inplace_with_mask", &memlean::swish_detail::inplace_with_mask_meta);
  m.impl("_swish_inplace_backward", &memlean::swish_detail::inplace_backward_meta);
  m.impl("_swish_inplace_backward_", &memlean::swish_detail::inplace_backward_into_meta);
}

