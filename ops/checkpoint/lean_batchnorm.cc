// memlean::lean_batch_norm (lean_batchnorm.h): torch's batch-norm forward, and a backward
// that allocates at most the input gradient, written over the incoming gradient when autograd
// alone holds it.
#include "ops/checkpoint/lean_batchnorm.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops/checkpoint/internal/reduced_bits.h"
#include "third_party/torch/grads.h"

namespace memlean {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Two shapes of memory the kernels walk: planes (N, C, S), a contiguous tensor of 3 or more
// dimensions (S: the product of the spatial sizes, > 1); rows (R, C), a 4-d channels_last
// tensor (R = N*H*W) or a contiguous one of one element per sample and channel ((N, C),
// (N, C, 1, 1)).
enum class Walk { kPlanes, kRows, kNone };

Walk walk_of(const at::Tensor& t) {
  if (t.is_contiguous()) {
    return t.numel() == t.size(0) * t.size(1) ? Walk::kRows : Walk::kPlanes;
  }
  if (t.dim() == 4 && t.is_contiguous(at::MemoryFormat::ChannelsLast)) return Walk::kRows;
  return Walk::kNone;
}

// Partial sums run in float (double for double tensors) over at most this many elements
// (planes) or rows (rows) per channel, then add into double: float error stays that of a
// short sum.
constexpr int64_t kPlaneBlock = 2048;
constexpr int64_t kRowBlock = 64;

// A: the type partial sums and the formula run in (at::opmath_type<T>: float for float,
// bfloat16 and half, double for double); T: the element as the kernels read it (bfloat16 by
// its bits: internal/reduced_bits.h).
using reduced_bits::narrow;
using reduced_bits::widen;

// sum_dy[c] = sum of dy over channel c, sum_dyx[c] = sum of dy * (x - mean[c]).
template <typename T, typename A>
void sums_planes(const T* dy, const T* x, const double* mean, int64_t n, int64_t c_size,
                 int64_t s_size, double* sum_dy, double* sum_dyx) {
  at::parallel_for(0, c_size, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const A m = static_cast<A>(mean[c]);
      double a = 0, b = 0;
      for (int64_t i = 0; i < n; ++i) {
        const T* g = dy + (i * c_size + c) * s_size;
        const T* v = x + (i * c_size + c) * s_size;
        for (int64_t s0 = 0; s0 < s_size; s0 += kPlaneBlock) {
          const int64_t s1 = std::min(s_size, s0 + kPlaneBlock);
          A pa = 0, pb = 0;
#pragma omp simd reduction(+ : pa, pb)
          for (int64_t s = s0; s < s1; ++s) {
            const A gs = widen<A>(g[s]);
            pa += gs;
            pb += gs * (widen<A>(v[s]) - m);
          }
          a += pa;
          b += pb;
        }
      }
      sum_dy[c] = a;
      sum_dyx[c] = b;
    }
  });
}

template <typename T, typename A>
void sums_rows(const T* dy, const T* x, const double* mean, int64_t rows, int64_t c_size,
               double* sum_dy, double* sum_dyx) {
  const int64_t chunks =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));
  std::vector<double> acc(static_cast<size_t>(2 * c_size * chunks), 0.0);
  std::vector<A> mean_a(mean, mean + c_size);
  at::parallel_for(0, chunks, 1, [&](int64_t k0, int64_t k1) {
    std::vector<A> pa(c_size), pb(c_size);
    const A* m = mean_a.data();
    for (int64_t k = k0; k < k1; ++k) {
      double* a = acc.data() + 2 * c_size * k;
      double* b = a + c_size;
      const int64_t r0 = rows * k / chunks, r1 = rows * (k + 1) / chunks;
      for (int64_t rb = r0; rb < r1; rb += kRowBlock) {
        std::fill(pa.begin(), pa.end(), A(0));
        std::fill(pb.begin(), pb.end(), A(0));
        A* pa_p = pa.data();
        A* pb_p = pb.data();
        for (int64_t r = rb, re = std::min(r1, rb + kRowBlock); r < re; ++r) {
          const T* g = dy + r * c_size;
          const T* v = x + r * c_size;
#pragma omp simd
          for (int64_t c = 0; c < c_size; ++c) {
            const A gc = widen<A>(g[c]);
            pa_p[c] += gc;
            pb_p[c] += gc * (widen<A>(v[c]) - m[c]);
          }
        }
        for (int64_t c = 0; c < c_size; ++c) {
          a[c] += pa_p[c];
          b[c] += pb_p[c];
        }
      }
    }
  });
  for (int64_t c = 0; c < c_size; ++c) {
    double a = 0, b = 0;
    for (int64_t k = 0; k < chunks; ++k) {
      a += acc[2 * c_size * k + c];
      b += acc[2 * c_size * k + c_size + c];
    }
    sum_dy[c] = a;
    sum_dyx[c] = b;
  }
}

// out = dy * scale[c] + x * slope[c] + shift[c], computed in A and rounded once to T; out
// may be dy itself (element by element).
template <typename T, typename A>
void apply_planes(const T* dy, const T* x, T* out, const A* scale, const A* slope,
                  const A* shift, int64_t n, int64_t c_size, int64_t s_size) {
  at::parallel_for(0, n * c_size, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t c = p % c_size;
      const A a = scale[c], b = slope[c], d = shift[c];
      const T* g = dy + p * s_size;
      const T* v = x + p * s_size;
      T* o = out + p * s_size;
#pragma omp simd
      for (int64_t s = 0; s < s_size; ++s) {
        o[s] = narrow<T>(widen<A>(g[s]) * a + widen<A>(v[s]) * b + d);
      }
    }
  });
}

template <typename T, typename A>
void apply_rows(const T* dy, const T* x, T* out, const A* scale, const A* slope,
                const A* shift, int64_t rows, int64_t c_size) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, c_size));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = dy + r * c_size;
      const T* v = x + r * c_size;
      T* o = out + r * c_size;
#pragma omp simd
      for (int64_t c = 0; c < c_size; ++c) {
        o[c] = narrow<T>(widen<A>(g[c]) * scale[c] + widen<A>(v[c]) * slope[c] + shift[c]);
      }
    }
  });
}

std::vector<double> to_doubles(const at::Tensor& t) {
  const at::Tensor d = t.to(at::kDouble).contiguous();
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

at::Tensor from_doubles(const std::vector<double>& v, const at::Tensor& like) {
  return at::tensor(v, at::TensorOptions().dtype(at::kDouble)).to(like.options());
}

// The three gradients from the kernels above: no tensor of the input's size is allocated
// beyond the input gradient, and none when dy is ours to overwrite.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lean_backward(
    at::Tensor grad, const at::Tensor& input, const at::Tensor& weight, const at::Tensor& mean,
    const at::Tensor& invstd, bool need_input, bool need_weight, bool need_bias) {
  if (grad.sizes() != input.sizes() || grad.strides() != input.strides() ||
      grad.scalar_type() != input.scalar_type()) {
    // Another layout (e.g. the expanded gradient of out.sum()): one copy laid out as x,
    // then ours to overwrite.
    at::Tensor laid = at::empty_like(input);
    laid.copy_(grad);
    grad = std::move(laid);
  }
  const int64_t c_size = input.size(1);
  const int64_t count = input.numel() / c_size;
  const Walk walk = walk_of(input);
  const std::vector<double> mu = to_doubles(mean);
  const std::vector<double> istd = to_doubles(invstd);
  const std::vector<double> w = to_doubles(weight);
  std::vector<double> sum_dy(c_size), sum_dyx(c_size);
  at::Tensor dx;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(),
                                  "memlean::lean_batch_norm backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    using T = reduced_bits::Element<scalar_t>;
    const T* g = reduced_bits::elements(grad.const_data_ptr<scalar_t>());
    const T* x = reduced_bits::elements(input.const_data_ptr<scalar_t>());
    const int64_t spatial = walk == Walk::kPlanes ? count / input.size(0) : 1;
    if (walk == Walk::kPlanes) {
      sums_planes<T, acc_t>(g, x, mu.data(), input.size(0), c_size, spatial, sum_dy.data(),
                            sum_dyx.data());
    } else {
      sums_rows<T, acc_t>(g, x, mu.data(), count, c_size, sum_dy.data(), sum_dyx.data());
    }
    if (!need_input) return;
    // dx = w*istd*(dy - mean(dy) - xhat*mean(dy*xhat)), xhat = (x - mu)*istd:
    // dx = dy*scale + x*slope + shift.
    std::vector<acc_t> scale(c_size), slope(c_size), shift(c_size);
    for (int64_t c = 0; c < c_size; ++c) {
      const double a = w[c] * istd[c];
      const double b = -a * istd[c] * istd[c] * sum_dyx[c] / static_cast<double>(count);
      scale[c] = static_cast<acc_t>(a);
      slope[c] = static_cast<acc_t>(b);
      shift[c] = static_cast<acc_t>(-a * sum_dy[c] / static_cast<double>(count) - b * mu[c]);
    }
    dx = grad_owned_alone(grad, input) ? grad : at::empty_like(input);
    T* o = reduced_bits::elements(dx.mutable_data_ptr<scalar_t>());
    if (walk == Walk::kPlanes) {
      apply_planes(g, x, o, scale.data(), slope.data(), shift.data(), input.size(0), c_size,
                   spatial);
    } else {
      apply_rows(g, x, o, scale.data(), slope.data(), shift.data(), count, c_size);
    }
  });
  grad.reset();
  at::Tensor dw, db;
  if (need_weight) {
    std::vector<double> v(c_size);
    for (int64_t c = 0; c < c_size; ++c) v[c] = sum_dyx[c] * istd[c];
    dw = from_doubles(v, weight);
  }
  if (need_bias) db = from_doubles(sum_dy, weight);
  return {dx, dw, db};
}

// The same gradients from differentiable ops, the batch statistics recomputed from x so that
// they are differentiated too (double backward: create_graph=True).
std::tuple<at::Tensor, at::Tensor, at::Tensor> differentiable_backward(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& weight, double eps) {
  std::vector<int64_t> dims;
  std::vector<int64_t> channel(input.dim(), 1);
  for (int64_t d = 0; d < input.dim(); ++d) {
    if (d != 1) dims.push_back(d);
  }
  channel[1] = input.size(1);
  const at::Tensor centred = input - input.mean(dims, /*keepdim=*/true);
  const at::Tensor istd = (centred.pow(2).mean(dims, /*keepdim=*/true) + eps).rsqrt();
  const at::Tensor xhat = centred * istd;
  const at::Tensor scale = weight.view(channel) * istd;
  const at::Tensor dx =
      scale * (grad - grad.mean(dims, true) - xhat * (grad * xhat).mean(dims, true));
  return {dx, (grad * xhat).sum(dims), grad.sum(dims)};
}

// The running statistics, handed to the autograd function as one non-tensor argument:
// torch::autograd::Function::apply takes no absent tensor, and they need no gradient.
struct RunningStats {
  std::optional<at::Tensor> mean, var;
};

class LeanBatchNormFunction : public torch::autograd::Function<LeanBatchNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const at::Tensor& bias,
                            const RunningStats& stats, double momentum, double eps) {
    auto [out, mean, invstd] = at::native_batch_norm(input, weight, bias, stats.mean, stats.var,
                                                     /*training=*/true, momentum, eps);
    ctx->save_for_backward({input, weight, mean, invstd});
    ctx->saved_data["eps"] = eps;
    return out;
  }

  // grads by reference: a gradient autograd alone holds is overwritten (grad_owned_alone).
  static variable_list backward(AutogradContext* ctx, variable_list& grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    variable_list out(6);
    if (!grads[0].defined()) return out;
    const bool need_weight = ctx->needs_input_grad(1);
    const bool need_bias = ctx->needs_input_grad(2);
    if (at::GradMode::is_enabled()) {
      std::tie(out[0], out[1], out[2]) = differentiable_backward(
          grads[0], input, weight, ctx->saved_data["eps"].toDouble());
    } else {
      std::tie(out[0], out[1], out[2]) =
          lean_backward(std::move(grads[0]), input, weight, saved[2], saved[3],
                        ctx->needs_input_grad(0), need_weight, need_bias);
    }
    if (!ctx->needs_input_grad(0)) out[0] = at::Tensor();
    if (!need_weight) out[1] = at::Tensor();
    if (!need_bias) out[2] = at::Tensor();
    return out;
  }
};

bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

}  // namespace

bool lean_batch_norm_applies(const at::Tensor& input) {
  return input.defined() && input.device().is_cpu() && input.layout() == at::kStrided &&
         (input.scalar_type() == at::kFloat || input.scalar_type() == at::kDouble ||
          input.scalar_type() == at::kBFloat16 || input.scalar_type() == at::kHalf) &&
         input.dim() >= 2 && input.numel() > 0 && !is_wrapped(input) &&
         walk_of(input) != Walk::kNone;
}

at::Tensor lean_batch_norm(const at::Tensor& input, const std::optional<at::Tensor>& weight,
                           const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& running_mean,
                           const std::optional<at::Tensor>& running_var, double momentum,
                           double eps) {
  TORCH_CHECK(input.defined() && input.dim() >= 2,
              "memlean::lean_batch_norm: input must be a tensor of shape (N, C, ...) with 2 or "
              "more dimensions, got ",
              input.defined() ? std::to_string(input.dim()) + " dimension(s)" : "none");
  const int64_t c_size = input.size(1);
  auto check_channel = [&](const std::optional<at::Tensor>& t, const char* name) {
    TORCH_CHECK(!t.has_value() || !t->defined() || (t->dim() == 1 && t->size(0) == c_size),
                "memlean::lean_batch_norm: ", name, " must have one element per channel (",
                c_size, " = input.size(1)), got shape ", t.has_value() && t->defined()
                    ? t->sizes() : at::IntArrayRef());
  };
  check_channel(weight, "weight");
  check_channel(bias, "bias");
  check_channel(running_mean, "running_mean");
  check_channel(running_var, "running_var");
  const bool grads = at::GradMode::is_enabled() &&
                     (input.requires_grad() || (present(weight) && weight->requires_grad()) ||
                      (present(bias) && bias->requires_grad()));
  if (!grads || !lean_batch_norm_applies(input)) {
    return at::batch_norm(input, weight, bias, running_mean, running_var, /*training=*/true,
                          momentum, eps, at::globalContext().userEnabledCuDNN());
  }
  // No weight or bias: ones and zeros that need no gradient (Function::apply takes no absent
  // tensor), computing what torch's does without them.
  const at::Tensor w = present(weight) ? *weight : at::ones({c_size}, input.options());
  const at::Tensor b = present(bias) ? *bias : at::zeros({c_size}, input.options());
  return LeanBatchNormFunction::apply(input, w, b, RunningStats{running_mean, running_var},
                                      momentum, eps);
}

}  // namespace memlean
