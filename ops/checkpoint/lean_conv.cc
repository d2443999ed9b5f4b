// memlean::lean_conv2d (lean_conv.h): torch's convolution forward, and for a depthwise
// convolution a backward that allocates the input gradient and nothing else of the input's
// size.
#include "ops/checkpoint/lean_conv.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "ops/checkpoint/internal/reduced_bits.h"
#include "third_party/torch/grads.h"

namespace memlean {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Stride, padding and dilation as (height, width); nullopt where the argument is not one or
// two values of the range a convolution takes (torch's conv2d then reports it).
std::optional<std::array<int64_t, 2>> pair_of(at::IntArrayRef v, int64_t least) {
  if (v.size() != 1 && v.size() != 2) return std::nullopt;
  const std::array<int64_t, 2> p{v[0], v[v.size() - 1]};
  if (p[0] < least || p[1] < least) return std::nullopt;
  return p;
}

// The layouts the kernels walk: contiguous NCHW first (a tensor that is both, e.g. one
// channel, walks as NCHW), then channels_last.
bool channels_last(const at::Tensor& t) {
  return !t.is_contiguous() && t.is_contiguous(at::MemoryFormat::ChannelsLast);
}

// The shape of one depthwise convolution, for the kernels.
struct Shape {
  int64_t n, c, h, w, oh, ow, kh, kw;
  std::array<int64_t, 2> stride, padding, dilation;
  bool channels_last = false;  // the input's layout (else contiguous NCHW)
};

// For kernel column kw: the offset off of its input columns (ow * stride + off), and the
// output columns [lo, hi) whose input column lies in [0, w).
struct Columns {
  int64_t off, lo, hi;
};
Columns columns(const Shape& s, int64_t kw) {
  const int64_t sw = s.stride[1];
  const int64_t off = kw * s.dilation[1] - s.padding[1];
  const int64_t lo = off >= 0 ? 0 : (-off + sw - 1) / sw;
  const int64_t hi = s.w - 1 - off < 0 ? 0 : std::min(s.ow, (s.w - 1 - off) / sw + 1);
  return {off, lo, hi};
}

// The kernels walk the input gradient row by row: each input row ih gathers the output rows
// oh with oh * stride - padding + kh * dilation == ih, so every (output row, kernel row)
// pair is visited once, as in a walk over the output rows. T: the element as the kernels read
// it (bfloat16 by its bits: internal/reduced_bits.h); A (at::opmath_type of the tensor's
// type): float for float, bfloat16 and half, double for double; products and sums run in A.
// For T == A the input gradient is accumulated in place (it starts zeroed); for bfloat16 and
// half each input row is accumulated in a float row and rounded once into gi, as torch's
// convolution rounds its float accumulator once.

using reduced_bits::narrow;
using reduced_bits::widen;

// The output row that input row ih meets through kernel row kh, or -1.
inline int64_t output_row(const Shape& s, int64_t ih, int64_t kh) {
  const int64_t t = ih + s.padding[0] - kh * s.dilation[0];
  if (t < 0 || t % s.stride[0] != 0 || t / s.stride[0] >= s.oh) return -1;
  return t / s.stride[0];
}

// One channel's gradients, channels [c0, c1): gi (the input gradient, zeroed; nullptr when
// not wanted) gets each output gradient times the weight scattered back to the input
// positions it came from; gw (double, C*KH*KW) the sums of output gradient times input;
// gb (double, C; nullptr when not wanted) the sums of output gradient. Partial sums in A run
// over one row at most, then add into double.
template <typename T, typename A>
void depthwise_backward(const Shape& s, const T* go, const T* x, const T* weight, T* gi,
                        double* gw, double* gb) {
  constexpr bool kWide = !std::is_same_v<T, A>;
  const int64_t k_size = s.kh * s.kw;
  const int64_t sw = s.stride[1];
  at::parallel_for(0, s.c, 1, [&](int64_t c0, int64_t c1) {
    std::vector<double> acc(static_cast<size_t>(k_size));
    std::vector<A> wa(static_cast<size_t>(k_size));
    std::vector<A> wide(kWide && gi != nullptr ? static_cast<size_t>(s.w) : 0);
    for (int64_t c = c0; c < c1; ++c) {
      std::fill(acc.begin(), acc.end(), 0.0);
      double bias_sum = 0;
      for (int64_t k = 0; k < k_size; ++k) wa[k] = widen<A>(weight[c * k_size + k]);
      for (int64_t n = 0; n < s.n; ++n) {
        const T* g = go + (n * s.c + c) * s.oh * s.ow;
        const T* xp = x + (n * s.c + c) * s.h * s.w;
        T* gp = gi == nullptr ? nullptr : gi + (n * s.c + c) * s.h * s.w;
        if (gb != nullptr) {
          for (int64_t oh = 0; oh < s.oh; ++oh) {
            const T* grow = g + oh * s.ow;
            A b = 0;
#pragma omp simd reduction(+ : b)
            for (int64_t ow = 0; ow < s.ow; ++ow) b += widen<A>(grow[ow]);
            bias_sum += b;
          }
        }
        for (int64_t ih = 0; ih < s.h; ++ih) {
          const T* xrow = xp + ih * s.w;
          A* girow = nullptr;
          if (gp != nullptr) {
            if constexpr (kWide) {
              std::fill(wide.begin(), wide.end(), A(0));
              girow = wide.data();
            } else {
              girow = gp + ih * s.w;
            }
          }
          for (int64_t kh = 0; kh < s.kh; ++kh) {
            const int64_t oh = output_row(s, ih, kh);
            if (oh < 0) continue;
            const T* grow = g + oh * s.ow;
            for (int64_t kw = 0; kw < s.kw; ++kw) {
              const auto [off, lo, hi] = columns(s, kw);
              if (lo >= hi) continue;
              const A wv = wa[kh * s.kw + kw];
              A a = 0;
              if (sw == 1) {
                const T* xo = xrow + off;
                if (girow != nullptr) {
                  A* go_ = girow + off;
#pragma omp simd reduction(+ : a)
                  for (int64_t ow = lo; ow < hi; ++ow) {
                    const A gv = widen<A>(grow[ow]);
                    a += gv * widen<A>(xo[ow]);
                    go_[ow] += gv * wv;
                  }
                } else {
#pragma omp simd reduction(+ : a)
                  for (int64_t ow = lo; ow < hi; ++ow) {
                    a += widen<A>(grow[ow]) * widen<A>(xo[ow]);
                  }
                }
              } else {
                for (int64_t ow = lo; ow < hi; ++ow) {
                  const int64_t iw = ow * sw + off;
                  const A gv = widen<A>(grow[ow]);
                  a += gv * widen<A>(xrow[iw]);
                  if (girow != nullptr) girow[iw] += gv * wv;
                }
              }
              acc[static_cast<size_t>(kh * s.kw + kw)] += a;
            }
          }
          if constexpr (kWide) {
            if (gp != nullptr) {
              T* out = gp + ih * s.w;
              for (int64_t iw = 0; iw < s.w; ++iw) out[iw] = narrow<T>(wide[iw]);
            }
          }
        }
      }
      std::copy(acc.begin(), acc.end(), gw + c * k_size);
      if (gb != nullptr) gb[c] = bias_sum;
    }
  });
}

// The same for a channels_last input (N, H, W, C in memory; the output gradient laid out so
// too): the innermost loop runs over the channels of one pixel. Samples [n0, n1) split among
// the threads, each with its own double sums (gw: KH*KW*C here, k-major; gb: C), added after.
template <typename T, typename A>
void depthwise_backward_channels_last(const Shape& s, const T* go, const T* x, const T* weight,
                                      T* gi, double* gw, double* gb) {
  constexpr bool kWide = !std::is_same_v<T, A>;
  const int64_t c_size = s.c, k_size = s.kh * s.kw;
  std::vector<A> wt(static_cast<size_t>(k_size * c_size));  // weight, k-major
  for (int64_t c = 0; c < c_size; ++c) {
    for (int64_t k = 0; k < k_size; ++k) {
      wt[k * c_size + c] = widen<A>(weight[c * k_size + k]);
    }
  }
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), s.n));
  std::vector<double> acc(static_cast<size_t>(chunks * (k_size + 1) * c_size), 0.0);
  at::parallel_for(0, chunks, 1, [&](int64_t k0, int64_t k1) {
    std::vector<A> row(static_cast<size_t>(c_size));
    std::vector<A> wide(kWide && gi != nullptr ? static_cast<size_t>(s.w * c_size) : 0);
    for (int64_t chunk = k0; chunk < k1; ++chunk) {
      double* aw = acc.data() + chunk * (k_size + 1) * c_size;
      double* ab = aw + k_size * c_size;
      A* r = row.data();
      for (int64_t n = s.n * chunk / chunks; n < s.n * (chunk + 1) / chunks; ++n) {
        if (gb != nullptr) {
          for (int64_t oh = 0; oh < s.oh; ++oh) {
            const T* grow = go + (n * s.oh + oh) * s.ow * c_size;
            std::fill(row.begin(), row.end(), A(0));
            for (int64_t ow = 0; ow < s.ow; ++ow) {
              const T* g = grow + ow * c_size;
#pragma omp simd
              for (int64_t c = 0; c < c_size; ++c) r[c] += widen<A>(g[c]);
            }
            for (int64_t c = 0; c < c_size; ++c) ab[c] += r[c];
          }
        }
        for (int64_t ih = 0; ih < s.h; ++ih) {
          const int64_t in_row = (n * s.h + ih) * s.w * c_size;
          A* girow = nullptr;
          if (gi != nullptr) {
            if constexpr (kWide) {
              std::fill(wide.begin(), wide.end(), A(0));
              girow = wide.data();
            } else {
              girow = gi + in_row;
            }
          }
          for (int64_t kh = 0; kh < s.kh; ++kh) {
            const int64_t oh = output_row(s, ih, kh);
            if (oh < 0) continue;
            const T* grow = go + (n * s.oh + oh) * s.ow * c_size;
            for (int64_t kw = 0; kw < s.kw; ++kw) {
              const auto [off, lo, hi] = columns(s, kw);
              if (lo >= hi) continue;
              const int64_t k = kh * s.kw + kw;
              const A* wk = wt.data() + k * c_size;
              std::fill(row.begin(), row.end(), A(0));
              for (int64_t ow = lo; ow < hi; ++ow) {
                const int64_t iw = ow * s.stride[1] + off;
                const T* g = grow + ow * c_size;
                const T* xp = x + in_row + iw * c_size;
                if (girow != nullptr) {
                  A* gp = girow + iw * c_size;
#pragma omp simd
                  for (int64_t c = 0; c < c_size; ++c) {
                    const A gv = widen<A>(g[c]);
                    r[c] += gv * widen<A>(xp[c]);
                    gp[c] += gv * wk[c];
                  }
                } else {
#pragma omp simd
                  for (int64_t c = 0; c < c_size; ++c) {
                    r[c] += widen<A>(g[c]) * widen<A>(xp[c]);
                  }
                }
              }
              double* a = aw + k * c_size;
              for (int64_t c = 0; c < c_size; ++c) a[c] += r[c];
            }
          }
          if constexpr (kWide) {
            if (gi != nullptr) {
              T* out = gi + in_row;
              for (int64_t e = 0; e < s.w * c_size; ++e) out[e] = narrow<T>(wide[e]);
            }
          }
        }
      }
    }
  });
  for (int64_t c = 0; c < c_size; ++c) {
    for (int64_t k = 0; k < k_size; ++k) {
      double v = 0;
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        v += acc[(chunk * (k_size + 1) + k) * c_size + c];
      }
      gw[c * k_size + k] = v;
    }
    if (gb != nullptr) {
      double v = 0;
      for (int64_t chunk = 0; chunk < chunks; ++chunk) {
        v += acc[(chunk * (k_size + 1) + k_size) * c_size + c];
      }
      gb[c] = v;
    }
  }
}

// The three gradients from the kernels above: the input gradient is the one tensor of the
// input's size allocated (plus a contiguous copy of grad where autograd hands over another
// layout, e.g. the expanded gradient of out.sum()).
std::tuple<at::Tensor, at::Tensor, at::Tensor> lean_backward(const at::Tensor& grad_in,
                                                             const at::Tensor& input,
                                                             const at::Tensor& weight_in,
                                                             const Shape& shape, bool need_input,
                                                             bool need_weight, bool need_bias) {
  const auto layout =
      shape.channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  const at::Tensor grad = grad_in.contiguous(layout);
  const at::Tensor weight = weight_in.contiguous();
  at::Tensor gi = need_input ? at::zeros_like(input, layout) : at::Tensor();
  std::vector<double> gw(static_cast<size_t>(shape.c * shape.kh * shape.kw));
  std::vector<double> gb(need_bias ? static_cast<size_t>(shape.c) : 0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, input.scalar_type(),
                                  "memlean::lean_conv2d backward", [&] {
    using T = reduced_bits::Element<scalar_t>;
    using A = at::opmath_type<scalar_t>;
    auto* kernel = shape.channels_last ? &depthwise_backward_channels_last<T, A>
                                       : &depthwise_backward<T, A>;
    kernel(shape, reduced_bits::elements(grad.const_data_ptr<scalar_t>()),
           reduced_bits::elements(input.const_data_ptr<scalar_t>()),
           reduced_bits::elements(weight.const_data_ptr<scalar_t>()),
           need_input ? reduced_bits::elements(gi.mutable_data_ptr<scalar_t>()) : nullptr,
           gw.data(), need_bias ? gb.data() : nullptr);
  });
  const auto options = at::TensorOptions().dtype(at::kDouble);
  at::Tensor dw, db;
  if (need_weight) dw = at::tensor(gw, options).to(weight_in.options()).view(weight_in.sizes());
  if (need_bias) db = at::tensor(gb, options).to(weight_in.options());
  return {gi, dw, db};
}

class LeanConvFunction : public torch::autograd::Function<LeanConvFunction> {
 public:
  // bias: zeros that need no gradient where the call has none (has_bias false); Function::apply
  // takes no absent tensor. The forward then runs without it, as the caller's would.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input,
                            const at::Tensor& weight, const at::Tensor& bias, bool has_bias,
                            const Shape& shape) {
    const std::vector<int64_t> stride(shape.stride.begin(), shape.stride.end());
    const std::vector<int64_t> padding(shape.padding.begin(), shape.padding.end());
    const std::vector<int64_t> dilation(shape.dilation.begin(), shape.dilation.end());
    at::Tensor out = at::convolution(input, weight, has_bias ? std::optional<at::Tensor>(bias)
                                                             : std::nullopt,
                                     stride, padding, dilation, /*transposed=*/false, {0, 0},
                                     shape.c);
    ctx->save_for_backward({input, weight});
    ctx->saved_data["has_bias"] = has_bias;
    ctx->saved_data["geometry"] = std::vector<int64_t>{
        shape.stride[0], shape.stride[1], shape.padding[0], shape.padding[1],
        shape.dilation[0], shape.dilation[1], out.size(2), out.size(3)};
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& input = saved[0];
    const at::Tensor& weight = saved[1];
    const std::vector<int64_t> g = ctx->saved_data["geometry"].toIntVector();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    variable_list out(5);
    if (!grads[0].defined()) return out;
    const bool need_input = ctx->needs_input_grad(0);
    const bool need_weight = ctx->needs_input_grad(1);
    const bool need_bias = has_bias && ctx->needs_input_grad(2);
    if (at::GradMode::is_enabled()) {
      // create_graph=True: torch's convolution backward, which autograd differentiates.
      const int64_t c = input.size(1);
      std::tie(out[0], out[1], out[2]) = at::convolution_backward(
          grads[0], input, weight,
          has_bias ? at::OptionalIntArrayRef(at::IntArrayRef(&c, 1)) : std::nullopt,
          {g[0], g[1]}, {g[2], g[3]}, {g[4], g[5]}, /*transposed=*/false, {0, 0}, c,
          {need_input, need_weight, need_bias});
    } else {
      const Shape shape{input.size(0), input.size(1), input.size(2), input.size(3),
                        g[6],          g[7],          weight.size(2), weight.size(3),
                        {g[0], g[1]},  {g[2], g[3]},  {g[4], g[5]},  channels_last(input)};
      std::tie(out[0], out[1], out[2]) =
          lean_backward(grads[0], input, weight, shape, need_input, need_weight, need_bias);
    }
    if (!need_input) out[0] = at::Tensor();
    if (!need_weight) out[1] = at::Tensor();
    if (!need_bias) out[2] = at::Tensor();
    return out;
  }
};

bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// A tensor CPU autocast casts to its dtype (a floating one other than float64).
bool castable(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
         t.scalar_type() == at::kHalf;
}

}  // namespace


bool lean_conv2d_applies(const at::Tensor& input, const at::Tensor& weight, int64_t groups) {
  const auto plain = [](const at::Tensor& t) {
    return t.defined() && t.device().is_cpu() && t.layout() == at::kStrided && !is_wrapped(t);
  };
  if (!plain(input) || !plain(weight)) return false;
  const auto type = input.scalar_type();
  bool types = false;
  if (at::autocast::is_autocast_enabled(at::kCPU)) {
    // torch's conv2d there computes in autocast's dtype (float32, bfloat16 and float16 input
    // and weight cast to it); lean_conv2d casts them as it does.
    const auto dtype = at::autocast::get_autocast_dtype(at::kCPU);
    types = (dtype == at::kBFloat16 || dtype == at::kHalf) && castable(input) &&
            castable(weight);
  } else {
    types = (type == at::kFloat || type == at::kDouble || type == at::kBFloat16 ||
             type == at::kHalf) &&
            weight.scalar_type() == type;
  }
  return types && input.dim() == 4 && weight.dim() == 4 && input.numel() > 0 &&
         (input.is_contiguous() || input.is_contiguous(at::MemoryFormat::ChannelsLast)) &&
         groups > 1 && input.size(1) == groups && weight.size(0) == groups &&
         weight.size(1) == 1;
}

at::Tensor lean_conv2d(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, at::IntArrayRef stride,
                       at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  const auto s = pair_of(stride, 1);
  const auto p = pair_of(padding, 0);
  const auto d = pair_of(dilation, 1);
  const bool grads = at::GradMode::is_enabled() &&
                     (input.requires_grad() || weight.requires_grad() ||
                      (present(bias) && bias->requires_grad()));
  const bool autocast = at::autocast::is_autocast_enabled(at::kCPU);
  const bool bias_fits = !present(bias) ||
                         (bias->dim() == 1 && bias->size(0) == groups &&
                          (autocast ? castable(*bias)
                                    : bias->scalar_type() == input.scalar_type()) &&
                          bias->device().is_cpu() && !is_wrapped(*bias));
  if (!grads || !s || !p || !d || !bias_fits || !lean_conv2d_applies(input, weight, groups)) {
    // torch's own (its checks and errors included).
    return at::conv2d(input, weight, bias, stride, padding, dilation, groups);
  }
  Shape shape{input.size(0), input.size(1), input.size(2), input.size(3), 0, 0,
              weight.size(2), weight.size(3), *s, *p, *d, channels_last(input)};
  const int64_t eh = (shape.kh - 1) * (*d)[0] + 1, ew = (shape.kw - 1) * (*d)[1] + 1;
  if (shape.h + 2 * (*p)[0] < eh || shape.w + 2 * (*p)[1] < ew) {
    return at::conv2d(input, weight, bias, stride, padding, dilation, groups);  // its error
  }
  // Under CPU autocast, as its conv2d does: input, weight and bias in autocast's dtype, the
  // weight's copy from its cache (made once in a region; its backward gives the float32
  // weight a float32 gradient).
  at::Tensor args[] = {input, weight, present(bias) ? *bias : at::Tensor()};
  if (autocast) {
    const auto dtype = at::autocast::get_autocast_dtype(at::kCPU);
    for (at::Tensor& t : args) {
      if (t.defined()) t = at::autocast::cached_cast(dtype, t, c10::DeviceType::CPU);
    }
  }
  const at::Tensor b = present(bias) ? args[2] : at::zeros({groups}, args[0].options());
  return LeanConvFunction::apply(args[0], args[1], b, present(bias), shape);
}

}  // namespace memlean
