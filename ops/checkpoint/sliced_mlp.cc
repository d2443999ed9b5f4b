// memlean::sliced_mlp, memlean::sliced_gated_mlp: see sliced_mlp.h.
#include "ops/checkpoint/sliced_mlp.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "third_party/torch/grads.h"
#include "third_party/torch/once_differentiable.h"

namespace memlean {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kMostSlices = 16;

// What forward and backward share: the activation, the slices' bounds over the hidden
// features, and where gate's and up's rows begin (gated: in wu, or packed: both in wg).
struct Spec : torch::CustomClassHolder {
  SliceActivation act;
  bool act_writes_input = false;
  std::vector<std::pair<int64_t, int64_t>> bounds;
  bool gated = false;
  bool packed = false;
  int64_t gate_row = 0, up_row = 0;
  // Which of bg, wu, bu, bd the caller gave: Function::apply takes no undefined tensor, so the
  // absent ones travel as empty placeholders (present() turns them back into undefined).
  bool has[4] = {false, false, false, false};
};

enum Optional { kBg = 0, kWu = 1, kBu = 2, kBd = 3 };

at::Tensor present(const Spec& spec, Optional which, const at::Tensor& t) {
  return spec.has[which] ? t : at::Tensor();
}

at::Tensor rows_of(const at::Tensor& t, int64_t begin, int64_t count) {
  return t.defined() ? t.narrow(0, begin, count) : at::Tensor();
}

at::Tensor activate(const Spec& spec, const at::Tensor& h) {
  return spec.act ? spec.act(h) : h;
}

// bfloat16 and float16 slices: their partial sums (the output's, the input gradient's) add up
// in float32 and are rounded once, as one matrix product over all hidden features rounds its
// float32 accumulator once.
bool reduced(const at::Tensor& x) {
  return x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf;
}

class SlicedMlpFunction : public torch::autograd::Function<SlicedMlpFunction> {
 public:
  // wu, bu: up (gated, not packed), else undefined; bg, bu, bd undefined where absent.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& wg,
                            const at::Tensor& bg_or_empty, const at::Tensor& wu_or_empty,
                            const at::Tensor& bu_or_empty, const at::Tensor& wd,
                            const at::Tensor& bd_or_empty, const c10::intrusive_ptr<Spec>& spec) {
    const at::Tensor bg = present(*spec, kBg, bg_or_empty), wu = present(*spec, kWu, wu_or_empty);
    const at::Tensor bu = present(*spec, kBu, bu_or_empty), bd = present(*spec, kBd, bd_or_empty);
    const at::Tensor rows = x.reshape({-1, x.size(-1)});
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
    shape.push_back(wd.size(0));
    // The output is the Function's own tensor (a caller's `y += x` may write it in place).
    const bool low = reduced(x);
    at::Tensor out = at::empty(shape, low ? x.options().dtype(at::kFloat) : x.options());
    at::Tensor flat = out.view({rows.size(0), wd.size(0)});
    if (bd.defined()) {
      flat.copy_(bd.expand_as(flat));
    } else {
      flat.zero_();
    }
    const at::Tensor& up_w = spec->packed ? wg : wu;
    const at::Tensor& up_b = spec->packed ? bg : bu;
    for (const auto& [j0, j1] : spec->bounds) {
      const int64_t w = j1 - j0;
      at::Tensor m = activate(*spec, at::linear(rows, wg.narrow(0, spec->gate_row + j0, w),
                                                rows_of(bg, spec->gate_row + j0, w)));
      if (spec->gated) {
        m.mul_(at::linear(rows, up_w.narrow(0, spec->up_row + j0, w),
                          rows_of(up_b, spec->up_row + j0, w)));
      }
      if (low) {
        flat.add_(at::mm(m, wd.narrow(1, j0, w).t()));
      } else {
        flat.addmm_(m, wd.narrow(1, j0, w).t());
      }
    }
    if (low) out = out.to(x.scalar_type());
    ctx->save_for_backward({x, wg, bg_or_empty, wu_or_empty, bu_or_empty, wd, bd_or_empty});
    ctx->saved_data["spec"] = c10::IValue::make_capsule(spec);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto spec = c10::static_intrusive_pointer_cast<Spec>(ctx->saved_data["spec"].toCapsule());
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &wg = saved[1], &wd = saved[5];
    const at::Tensor bg = present(*spec, kBg, saved[2]), bd = present(*spec, kBd, saved[6]);
    const at::Tensor up_w = spec->packed ? wg : present(*spec, kWu, saved[3]);
    const at::Tensor up_b = spec->packed ? bg : present(*spec, kBu, saved[4]);
    variable_list out(8);
    if (!grads[0].defined()) return out;
    const bool create_graph = at::GradMode::is_enabled();
    at::NoGradGuard no_grad;
    const at::Tensor rows = x.reshape({-1, x.size(-1)});
    const at::Tensor g = grads[0].reshape({-1, grads[0].size(-1)});
    const auto need = [&](size_t i, const at::Tensor& like) {
      return ctx->needs_input_grad(i) && like.defined() ? at::zeros_like(like) : at::Tensor();
    };
    const bool low = reduced(x);
    at::Tensor grad_x;  // (float32 for reduced() slices)
    if (ctx->needs_input_grad(0)) {
      grad_x = at::zeros(rows.sizes(), rows.options().dtype(low ? at::kFloat : x.scalar_type()));
    }
    at::Tensor grad_wg = need(1, wg), grad_bg = need(2, bg);
    at::Tensor grad_wu = spec->packed ? grad_wg : need(3, up_w);
    at::Tensor grad_bu = spec->packed ? grad_bg : need(4, up_b);
    at::Tensor grad_wd = need(5, wd);
    at::Tensor grad_bd = ctx->needs_input_grad(6) && bd.defined() ? g.sum(0) : at::Tensor();
    const bool through = grad_x.defined() || grad_wg.defined() || grad_bg.defined() ||
                         grad_wu.defined() || grad_bu.defined();
    for (const auto& [j0, j1] : spec->bounds) {
      const int64_t w = j1 - j0;
      at::Tensor h = at::linear(rows, wg.narrow(0, spec->gate_row + j0, w),
                                rows_of(bg, spec->gate_row + j0, w));
      at::Tensor a;
      {
        // h is the leaf whose gradient is taken; an activation that writes its input gets a copy.
        const at::AutoGradMode grad_mode(true);
        h.requires_grad_(true);
        a = activate(*spec, spec->act_writes_input ? h.clone() : h);
      }
      const at::Tensor a_value = a.detach();
      at::Tensor u;
      if (spec->gated) {
        u = at::linear(rows, up_w.narrow(0, spec->up_row + j0, w),
                       rows_of(up_b, spec->up_row + j0, w));
      }
      if (grad_wd.defined()) {
        grad_wd.narrow(1, j0, w).copy_(at::mm(g.t(), spec->gated ? a_value * u : a_value));
      }
      if (!through) continue;
      at::Tensor grad_a = at::mm(g, wd.narrow(1, j0, w));
      at::Tensor grad_u;
      if (spec->gated) {
        grad_u = grad_a * a_value;
        grad_a.mul_(u);
        u = at::Tensor();
      }
      at::Tensor grad_h;
      if (a.is_same(h)) {  // no activation
        grad_h = std::move(grad_a);
      } else {
        const at::AutoGradMode grad_mode(true);
        grad_h = torch::autograd::grad({a}, {h}, {grad_a})[0];
      }
      a = h = grad_a = at::Tensor();
      const std::pair<const at::Tensor*, int64_t> parts[] = {{&wg, spec->gate_row},
                                                              {&up_w, spec->up_row}};
      const at::Tensor* gradients[] = {&grad_h, &grad_u};
      at::Tensor* grad_ws[] = {&grad_wg, &grad_wu};
      at::Tensor* grad_bs[] = {&grad_bg, &grad_bu};
      for (int k = 0; k < (spec->gated ? 2 : 1); ++k) {
        const at::Tensor& gradient = *gradients[k];
        const int64_t o = parts[k].second + j0;
        if (grad_ws[k]->defined()) {
          at::Tensor rows_of_grad = grad_ws[k]->narrow(0, o, w);
          at::mm_out(rows_of_grad, gradient.t(), rows);
        }
        if (grad_bs[k]->defined()) {
          at::Tensor rows_of_grad = grad_bs[k]->narrow(0, o, w);
          at::sum_out(rows_of_grad, gradient, {0});
        }
        if (grad_x.defined() && low) {
          grad_x.add_(at::mm(gradient, parts[k].first->narrow(0, o, w)));
        } else if (grad_x.defined()) {
          grad_x.addmm_(gradient, parts[k].first->narrow(0, o, w));
        }
      }
    }
    if (grad_x.defined() && low) grad_x = grad_x.to(x.scalar_type());
    out[0] = grad_x.defined() ? grad_x.view(x.sizes()) : grad_x;
    out[1] = grad_wg;
    out[2] = grad_bg;
    if (!spec->packed) {  // (packed: up's gradients are in wg's and bg's)
      out[3] = grad_wu;
      out[4] = grad_bu;
    }
    out[5] = grad_wd;
    out[6] = grad_bd;
    if (create_graph) {
      mark_once_differentiable(out, "memlean::sliced_mlp: trying to differentiate twice (a "
                                    "backward through the gradients of a sliced MLP) is not "
                                    "supported");
    }
    return out;
  }
};

const at::Tensor& value_or_undefined(const std::optional<at::Tensor>& t) {
  static const at::Tensor undefined;
  return t.has_value() ? *t : undefined;
}

// Checks a Linear's weight (and bias) for `in` input features: its output features.
int64_t check_linear(const char* fn, const char* weight_name, const at::Tensor& weight,
                     const char* bias_name, const at::Tensor& bias, int64_t in) {
  TORCH_CHECK_VALUE(weight.defined() && weight.dim() == 2, fn, ": ", weight_name,
                    " must be a 2-d tensor [out_features, in_features], got ",
                    weight.defined() ? std::to_string(weight.dim()) + "-d" : "undefined");
  TORCH_CHECK_VALUE(weight.size(1) == in, fn, ": ", weight_name, " takes ", weight.size(1),
                    " features, its input has ", in);
  TORCH_CHECK_VALUE(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)), fn,
                    ": ", bias_name, " must be a 1-d tensor of ", weight.size(0),
                    " elements (", weight_name, "'s output features), got shape ", bias.sizes());
  return weight.size(0);
}

void check_same(const char* fn, const at::Tensor& x, const char* name, const at::Tensor& t) {
  if (!t.defined()) return;
  TORCH_CHECK_VALUE(t.scalar_type() == x.scalar_type() && t.device() == x.device() &&
                        t.layout() == at::kStrided && !is_wrapped(t),
                    fn, ": ", name, " must be a plain ", x.scalar_type(), " tensor on ",
                    x.device(), " as x is, got a ", t.scalar_type(), " tensor on ", t.device());
}

// The slices of the hidden features: options.slices, or where 0 sliced_mlp_slices' for the
// hidden tensor x makes (x in the dtype the MLP computes in).
std::vector<std::pair<int64_t, int64_t>> bounds_of(const char* fn, const at::Tensor& x,
                                                   int64_t hidden,
                                                   const SlicedMlpOptions& options) {
  int64_t slices = options.slices;
  if (slices == 0) {
    const int64_t rows = x.size(-1) > 0 ? x.numel() / x.size(-1) : 0;
    slices = sliced_mlp_slices(rows * hidden * static_cast<int64_t>(x.element_size()), hidden,
                               options.slice_bytes);
  }
  TORCH_CHECK_VALUE(slices >= 1 && slices <= hidden, fn, ": options.slices must be in 1..",
                    hidden, " (the hidden features) or 0 (the default), got ", slices);
  std::vector<std::pair<int64_t, int64_t>> bounds;
  for (int64_t i = 0; i < slices; ++i) {
    bounds.emplace_back(hidden * i / slices, hidden * (i + 1) / slices);
  }
  return bounds;
}

at::Tensor run(const char* fn, const at::Tensor& x, const at::Tensor& wg, const at::Tensor& bg,
               const SliceActivation& act, const at::Tensor& wu, const at::Tensor& bu,
               const at::Tensor& wd, const at::Tensor& bd, bool gated, bool gate_first,
               const SlicedMlpOptions& options) {
  TORCH_CHECK_VALUE(x.defined() && x.dim() >= 1, fn, ": x must be a tensor of 1 or more ",
                    "dimensions, got ", x.defined() ? "a 0-d tensor" : "an undefined tensor");
  const int64_t in = x.size(-1);
  const bool packed = gated && !wu.defined();
  const int64_t made = check_linear(fn, gated ? "wg" : "w1", wg, gated ? "bg" : "b1", bg, in);
  TORCH_CHECK_VALUE(!packed || made % 2 == 0, fn, ": wu is undefined (gate and up packed in wg)",
                    " but wg has an odd number of rows, ", made);
  TORCH_CHECK_VALUE(!packed || !bu.defined(), fn, ": bu is given but wu is undefined (gate and ",
                    "up packed in wg: their biases are bg's two halves)");
  const int64_t hidden = packed ? made / 2 : made;
  if (gated && !packed) {
    const int64_t up = check_linear(fn, "wu", wu, "bu", bu, in);
    TORCH_CHECK_VALUE(up == hidden, fn, ": wu makes ", up, " features, wg ", hidden);
  }
  check_linear(fn, gated ? "wd" : "w2", wd, gated ? "bd" : "b2", bd, hidden);
  const bool sliced = sliced_mlp_applies(x);
  // Under CPU autocast, as its linear does: x, the weights and the biases in autocast's dtype
  // (float64 ones as they are), the weights' copies from its cache (made once in a region, as
  // the layers in turn make them; their backward gives the float32 weights float32 gradients).
  at::Tensor args[] = {x, wg, bg, wu, bu, wd, bd};
  if (sliced && at::autocast::is_autocast_enabled(at::kCPU)) {
    const at::ScalarType dtype = at::autocast::get_autocast_dtype(at::kCPU);
    for (at::Tensor& t : args) {
      if (t.defined()) t = at::autocast::cached_cast(dtype, t, c10::DeviceType::CPU);
    }
  }
  auto spec = c10::make_intrusive<Spec>();
  spec->act = act;
  spec->act_writes_input = options.act_writes_input;
  spec->bounds = bounds_of(fn, args[0], hidden, options);
  spec->gated = gated;
  spec->packed = packed;
  spec->gate_row = packed && !gate_first ? hidden : 0;
  spec->up_row = packed && gate_first ? hidden : 0;
  if (!sliced) {  // torch's ops in turn
    at::Tensor g, u;
    if (packed) {
      const auto halves = at::linear(x, wg, bg).chunk(2, -1);
      g = halves[gate_first ? 0 : 1];
      u = halves[gate_first ? 1 : 0];
      if (options.act_writes_input) g = g.clone();  // (autograd refuses writing a chunk)
    } else {
      g = at::linear(x, wg, bg);
      if (gated) u = at::linear(x, wu, bu);
    }
    at::Tensor m = activate(*spec, g);
    return at::linear(gated ? m * u : m, wd, bd);
  }
  const char* names[] = {"x", "weight wg/w1", "bias bg/b1", "weight wu", "bias bu",
                         "weight wd/w2", "bias bd/b2"};
  for (int i = 1; i < 7; ++i) check_same(fn, args[0], names[i], args[i]);
  const int optional[] = {2, 3, 4, 6};  // bg, wu, bu, bd: kBg, kWu, kBu, kBd
  at::Tensor given[4];
  for (int i = 0; i < 4; ++i) {
    spec->has[i] = args[optional[i]].defined();
    given[i] = spec->has[i] ? args[optional[i]] : at::empty({0}, args[0].options());
  }
  return SlicedMlpFunction::apply(args[0], args[1], given[kBg], given[kWu], given[kBu], args[5],
                                  given[kBd], spec);
}

}  // namespace

bool sliced_mlp_applies(const at::Tensor& x) {
  return x.defined() && x.device().is_cpu() && x.layout() == at::kStrided && !is_wrapped(x) &&
         (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble || reduced(x)) &&
         x.dim() >= 1 && x.numel() > 0;
}

int64_t sliced_mlp_slices(int64_t hidden_bytes, int64_t features, int64_t slice_bytes) {
  TORCH_CHECK_VALUE(slice_bytes >= 1, "sliced_mlp_slices: slice_bytes must be at least 1, got ",
                    slice_bytes);
  TORCH_CHECK_VALUE(hidden_bytes >= 0, "sliced_mlp_slices: hidden_bytes must not be negative, got ",
                    hidden_bytes);
  TORCH_CHECK_VALUE(features >= 0, "sliced_mlp_slices: features must not be negative, got ",
                    features);
  return std::max<int64_t>(1, std::min({features, kMostSlices, hidden_bytes / slice_bytes}));
}

at::Tensor sliced_mlp(const at::Tensor& x, const at::Tensor& w1,
                      const std::optional<at::Tensor>& b1, const SliceActivation& act,
                      const at::Tensor& w2, const std::optional<at::Tensor>& b2,
                      SlicedMlpOptions options) {
  return run("memlean::sliced_mlp", x, w1, value_or_undefined(b1), act, at::Tensor(),
             at::Tensor(), w2, value_or_undefined(b2), /*gated=*/false, true, options);
}

at::Tensor sliced_gated_mlp(const at::Tensor& x, const at::Tensor& wg,
                            const std::optional<at::Tensor>& bg, const SliceActivation& act,
                            const at::Tensor& wu, const std::optional<at::Tensor>& bu,
                            const at::Tensor& wd, const std::optional<at::Tensor>& bd,
                            bool gate_first, SlicedMlpOptions options) {
  return run("memlean::sliced_gated_mlp", x, wg, value_or_undefined(bg), act, wu,
             value_or_undefined(bu), wd, value_or_undefined(bd), /*gated=*/true, gate_first,
             options);
}

}  // namespace memlean
