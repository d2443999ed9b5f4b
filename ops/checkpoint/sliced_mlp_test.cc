// memlean::sliced_mlp and memlean::sliced_gated_mlp against float64 autograd through the
// layers in turn; bfloat16, float16 and CPU autocast against the layers in turn; exact bytes
// kept; frozen parameters; where they do not apply; bad input; double backward.
#include "ops/checkpoint/sliced_mlp.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <optional>
#include <string>
#include <vector>

#include "runtime/memstats/live_bytes.h"
#include "testing/autocast_region.h"
#include "testing/expect_error.h"

namespace memlean {
namespace {

using ::memlean::testing::expect_error;

// An MLP's tensors: fc1 (or gate), up (gated, separate), fc2 (or down).
struct Mlp {
  at::Tensor w1, b1, wu, bu, w2, b2;

  std::vector<at::Tensor> all() const {
    std::vector<at::Tensor> out;
    for (const auto& t : {w1, b1, wu, bu, w2, b2}) {
      if (t.defined()) out.push_back(t);
    }
    return out;
  }

  Mlp to(at::ScalarType dtype) const {
    Mlp m;
    at::Tensor* to_[] = {&m.w1, &m.b1, &m.wu, &m.bu, &m.w2, &m.b2};
    const at::Tensor* from[] = {&w1, &b1, &wu, &bu, &w2, &b2};
    for (int i = 0; i < 6; ++i) {
      if (from[i]->defined()) *to_[i] = from[i]->detach().to(dtype).requires_grad_(true);
    }
    return m;
  }
};

std::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

enum class Kind { kPlain, kGated, kPacked };

Mlp make(Kind kind, int64_t in, int64_t hidden, int64_t out, bool bias) {
  at::manual_seed(0);
  Mlp m;
  const int64_t first = kind == Kind::kPacked ? 2 * hidden : hidden;
  m.w1 = at::randn({first, in}, at::kDouble) * 0.4;
  if (bias) m.b1 = at::randn({first}, at::kDouble) * 0.1;
  if (kind == Kind::kGated) {
    m.wu = at::randn({hidden, in}, at::kDouble) * 0.4;
    if (bias) m.bu = at::randn({hidden}, at::kDouble) * 0.1;
  }
  m.w2 = at::randn({out, hidden}, at::kDouble) * 0.3;
  if (bias) m.b2 = at::randn({out}, at::kDouble) * 0.1;
  return m;
}

// The layers in turn, autograd's: the reference.
at::Tensor in_turn(Kind kind, const at::Tensor& x, const Mlp& m, const SliceActivation& act,
                   bool gate_first) {
  const auto a = [&](const at::Tensor& h) { return act ? act(h) : h; };
  if (kind == Kind::kPlain) return at::linear(a(at::linear(x, m.w1, m.b1)), m.w2, m.b2);
  at::Tensor g, u;
  if (kind == Kind::kGated) {
    g = at::linear(x, m.w1, m.b1);
    u = at::linear(x, m.wu, m.bu);
  } else {
    const auto halves = at::linear(x, m.w1, m.b1).chunk(2, -1);
    g = halves[gate_first ? 0 : 1];
    u = halves[gate_first ? 1 : 0];
  }
  return at::linear(a(g) * u, m.w2, m.b2);
}

at::Tensor sliced(Kind kind, const at::Tensor& x, const Mlp& m, const SliceActivation& act,
                  bool gate_first, SlicedMlpOptions options) {
  if (kind == Kind::kPlain) return sliced_mlp(x, m.w1, opt(m.b1), act, m.w2, opt(m.b2), options);
  return sliced_gated_mlp(x, m.w1, opt(m.b1), act, m.wu, opt(m.bu), m.w2, opt(m.b2), gate_first,
                          options);
}

SliceActivation gelu() {
  return [](const at::Tensor& h) { return at::gelu(h); };
}
SliceActivation silu() {
  return [](const at::Tensor& h) { return at::silu(h); };
}
SliceActivation relu_() {  // writes its input
  return [](const at::Tensor& h) { return h.relu_(); };
}
SliceActivation relu() {
  return [](const at::Tensor& h) { return at::relu(h); };
}

struct Case {
  Kind kind;
  bool bias;
  bool gate_first;
  std::vector<int64_t> shape;
};

// Output (the caller writes it in place, as `y += x` does) and every gradient equal to
// float64 autograd through the layers in turn: float64 to 1e-12, float32 to 1e-5.
void expect_equal_to_in_turn(const Case& c, const SliceActivation& act, bool writes,
                             const SliceActivation& ref_act, int64_t slices) {
  const int64_t in = c.shape.back(), hidden = 10;
  const Mlp base = make(c.kind, in, hidden, 5, c.bias);
  at::manual_seed(1);
  const at::Tensor x0 = at::randn(c.shape, at::kDouble);
  for (const auto& [dtype, tol] : {std::pair<at::ScalarType, double>{at::kDouble, 1e-12},
                                   {at::kFloat, 1e-5}}) {
    const Mlp mine = base.to(dtype), ref = base.to(at::kDouble);
    const at::Tensor x = x0.to(dtype).clone().requires_grad_(true);
    const at::Tensor x64 = x0.clone().requires_grad_(true);
    SlicedMlpOptions options;
    options.slices = slices;
    options.act_writes_input = writes;
    at::Tensor y = sliced(c.kind, x, mine, act, c.gate_first, options).mul_(1.5);
    at::Tensor y64 = in_turn(c.kind, x64, ref, ref_act, c.gate_first) * 1.5;
    ASSERT_EQ(y.sizes(), y64.sizes());
    EXPECT_TRUE(at::allclose(y.to(at::kDouble), y64, tol, tol));
    const at::Tensor g = at::randn(y64.sizes(), at::kDouble);
    y.backward(g.to(dtype));
    y64.backward(g);
    EXPECT_TRUE(at::allclose(x.grad().to(at::kDouble), x64.grad(), tol, tol)) << "x";
    const auto a = mine.all(), b = ref.all();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_TRUE(a[i].grad().defined()) << "parameter " << i;
      EXPECT_TRUE(at::allclose(a[i].grad().to(at::kDouble), b[i].grad(), tol, tol))
          << "parameter " << i << ": " << (a[i].grad().to(at::kDouble) - b[i].grad()).abs().max();
    }
  }
}

TEST(SlicedMlp, EqualsTheLayersInTurn) {
  for (const int64_t slices : {1, 3, 10}) {
    for (const auto& shape : {std::vector<int64_t>{4, 6}, {2, 3, 6}, {2, 2, 3, 6}}) {
      for (const bool bias : {true, false}) {
        const Case c{Kind::kPlain, bias, true, shape};
        expect_equal_to_in_turn(c, gelu(), false, gelu(), slices);
        expect_equal_to_in_turn(c, nullptr, false, nullptr, slices);  // no activation
        // An activation writing its input, against the same one out of place.
        expect_equal_to_in_turn(c, relu_(), true, relu(), slices);
      }
    }
  }
}

TEST(SlicedMlp, GatedAndPackedEqualTheFormula) {
  for (const int64_t slices : {1, 4, 10}) {
    for (const bool bias : {true, false}) {
      expect_equal_to_in_turn({Kind::kGated, bias, true, {3, 5, 6}}, silu(), false, silu(),
                              slices);
      for (const bool first : {true, false}) {
        expect_equal_to_in_turn({Kind::kPacked, bias, first, {4, 6}}, silu(), false, silu(),
                                slices);
        expect_equal_to_in_turn({Kind::kPacked, bias, first, {2, 3, 6}}, relu_(), true, relu(),
                                slices);
      }
    }
  }
}

TEST(SlicedMlp, FrozenParametersGetNoGradient) {
  for (const Kind kind : {Kind::kPlain, Kind::kPacked}) {
    Mlp m = make(kind, 6, 8, 6, true).to(at::kDouble);
    Mlp ref = m.to(at::kDouble);
    for (Mlp* p : {&m, &ref}) {
      p->w1.requires_grad_(false);
      p->b2.requires_grad_(false);
    }
    const at::Tensor x = at::randn({5, 6}, at::kDouble).requires_grad_(true);
    const at::Tensor xr = x.detach().clone().requires_grad_(true);
    sliced(kind, x, m, gelu(), true, {3, false}).sum().backward();
    in_turn(kind, xr, ref, gelu(), true).sum().backward();
    EXPECT_FALSE(m.w1.grad().defined());
    EXPECT_FALSE(m.b2.grad().defined());
    EXPECT_TRUE(at::allclose(x.grad(), xr.grad(), 1e-12, 1e-12));
    EXPECT_TRUE(at::allclose(m.w2.grad(), ref.w2.grad(), 1e-12, 1e-12));
    EXPECT_TRUE(at::allclose(m.b1.grad(), ref.b1.grad(), 1e-12, 1e-12));
  }
}

using testing::AutocastRegion;

// What the sliced MLP ([0]) and the layers in turn ([1]) hold after the forward (kept) and
// at their highest through forward and backward (peak), exact CPU bytes, the forward in a CPU
// autocast region of `autocast` if given; `output`: the sliced one's output's bytes.
struct Footprints {
  int64_t kept[2] = {0, 0}, peak[2] = {0, 0}, output = 0;
};

Footprints footprints(const Mlp& m, const at::Tensor& x,
                      std::optional<at::ScalarType> autocast) {
  Footprints f;
  for (int s = 0; s < 2; ++s) {
    LiveBytes live;
    {
      at::Tensor y;
      {
        std::optional<AutocastRegion> region;
        if (autocast) region.emplace(*autocast);
        y = s == 0 ? sliced(Kind::kPlain, x, m, gelu(), true, {8, false})
                   : in_turn(Kind::kPlain, x, m, gelu(), true);
        f.kept[s] = live.live();
      }
      EXPECT_EQ(y.scalar_type(), autocast.value_or(x.scalar_type()));
      if (s == 0) f.output = static_cast<int64_t>(y.storage().nbytes());
      y.backward(at::ones_like(y));
    }
    f.peak[s] = live.peak();
    x.mutable_grad().reset();
    for (const auto& t : m.all()) t.mutable_grad().reset();
  }
  return f;
}

// Exact bytes: after its forward the sliced MLP holds its output alone (its input is the
// caller's); the layers in turn hold the hidden tensors too (fc1's output, which GELU saves,
// and GELU's, which fc2 saves: two of 8 x 128 x 256 floats). Forward and backward together
// peak under half of the layers in turn.
TEST(SlicedMlp, KeepsItsOutputAloneAndPeaksUnderHalf) {
  if (!LiveBytes::available()) GTEST_SKIP() << "another memory reporter is active";
  const Mlp m = make(Kind::kPlain, 64, 256, 64, true).to(at::kFloat);
  const at::Tensor x = at::randn({8, 128, 64}).requires_grad_(true);
  const Footprints f = footprints(m, x, std::nullopt);
  EXPECT_EQ(f.kept[0], f.output);
  const int64_t hidden = 8 * 128 * 256 * 4;
  EXPECT_GE(f.kept[1], f.kept[0] + 2 * hidden);
  EXPECT_LT(f.peak[0], f.peak[1] / 2) << f.peak[0] << " vs " << f.peak[1];
}

TEST(SlicedMlp, WhereItDoesNotApplyTheLayersInTurn) {
  const at::Tensor x = at::randn({3, 6});
  for (const at::ScalarType dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    EXPECT_TRUE(sliced_mlp_applies(x.to(dtype))) << dtype;
  }
  EXPECT_FALSE(sliced_mlp_applies(x.to(at::kComplexFloat)));
  EXPECT_FALSE(sliced_mlp_applies(x.to(at::kMeta)));
  EXPECT_FALSE(sliced_mlp_applies(x.narrow(0, 0, 0)));
  EXPECT_FALSE(sliced_mlp_applies(at::Tensor()));
  // Complex: torch's ops in turn, bitwise.
  const Mlp c = make(Kind::kPacked, 6, 8, 5, true).to(at::kComplexFloat);
  const at::Tensor xc = x.to(at::kComplexFloat);
  for (const bool first : {true, false}) {
    EXPECT_TRUE(at::equal(sliced(Kind::kPacked, xc, c, nullptr, first, {0, false}),
                          in_turn(Kind::kPacked, xc, c, nullptr, first)));
  }
}

double max_error(const at::Tensor& t, const at::Tensor& ref) {
  return (t.to(at::kDouble) - ref).abs().max().item<double>();
}

// bfloat16 and float16 models, and float32 models in a CPU autocast region of either: the
// sliced MLP gives its output and every gradient in the dtype autograd gives through the
// layers in turn, no further from float64 autograd (on the same rounded weights and input)
// than those are, twice their error at most (its partial sums add up in float32 and are
// rounded once; the layers in turn round once too).
TEST(SlicedMlp, ReducedPrecisionAndAutocastAsTheLayersInTurn) {
  struct Mode {
    at::ScalarType params;  // the model's dtype
    std::optional<at::ScalarType> autocast;
  };
  const Mode modes[] = {{at::kBFloat16, std::nullopt},
                        {at::kHalf, std::nullopt},
                        {at::kFloat, at::kBFloat16},
                        {at::kFloat, at::kHalf}};
  for (const Kind kind : {Kind::kPlain, Kind::kGated, Kind::kPacked}) {
    for (const Mode& mode : modes) {
      const at::ScalarType computed = mode.autocast.value_or(mode.params);
      const std::string what = std::to_string(static_cast<int>(kind)) + " " +
                               c10::toString(mode.params) + " autocast " +
                               (mode.autocast ? c10::toString(*mode.autocast) : "off");
      const Mlp base = make(kind, 32, 64, 24, true);
      const Mlp mine = base.to(mode.params), turn = base.to(mode.params);
      const Mlp ref = mine.to(at::kDouble);  // (the rounded weights, in float64)
      at::manual_seed(2);
      const at::Tensor x0 = at::randn({4, 8, 32}, at::kDouble).to(mode.params);
      const at::Tensor x = x0.clone().requires_grad_(true), xt = x0.clone().requires_grad_(true);
      const at::Tensor x64 = x0.to(at::kDouble).requires_grad_(true);
      at::Tensor y, yt;
      {
        std::optional<AutocastRegion> region;
        if (mode.autocast) region.emplace(*mode.autocast);
        y = sliced(kind, x, mine, silu(), true, {4, false});
        yt = in_turn(kind, xt, turn, silu(), true);
      }
      const at::Tensor y64 = in_turn(kind, x64, ref, silu(), true);
      ASSERT_TRUE(y.grad_fn()) << what;
      EXPECT_NE(y.grad_fn()->name().find("SlicedMlpFunction"), std::string::npos)
          << what << ": " << y.grad_fn()->name();  // (sliced, not the layers in turn)
      ASSERT_EQ(y.scalar_type(), computed) << what;
      ASSERT_EQ(y.scalar_type(), yt.scalar_type()) << what;
      ASSERT_EQ(y.sizes(), y64.sizes()) << what;
      const double scale = y64.abs().max().item<double>();
      EXPECT_LE(max_error(y, y64), 2 * max_error(yt, y64) + 1e-4 * scale) << what;
      const at::Tensor g = at::randn(y64.sizes(), at::kDouble);
      y.backward(g.to(y.scalar_type()));
      yt.backward(g.to(yt.scalar_type()));
      y64.backward(g);
      const auto a = mine.all(), b = turn.all(), r = ref.all();
      std::vector<std::pair<at::Tensor, at::Tensor>> grads = {{x.grad(), xt.grad()}};
      std::vector<at::Tensor> refs = {x64.grad()};
      for (size_t i = 0; i < a.size(); ++i) {
        grads.emplace_back(a[i].grad(), b[i].grad());
        refs.push_back(r[i].grad());
      }
      for (size_t i = 0; i < grads.size(); ++i) {
        const auto& [got, theirs] = grads[i];
        ASSERT_TRUE(got.defined()) << what << ": gradient " << i;
        EXPECT_EQ(got.scalar_type(), theirs.scalar_type()) << what << ": gradient " << i;
        EXPECT_EQ(got.scalar_type(), mode.params) << what << ": gradient " << i;
        const double s = refs[i].abs().max().item<double>();
        EXPECT_LE(max_error(got, refs[i]), 2 * max_error(theirs, refs[i]) + 1e-4 * s)
            << what << ": gradient " << i << " (0: x)";
      }
    }
  }
}

// Exact bytes in a bfloat16 autocast region: after its forward the sliced MLP holds its output,
// the bfloat16 copy of its input and autocast's bfloat16 copies of the weights (which the
// layers in turn hold too), not the two hidden tensors; the whole step peaks at least one
// hidden tensor lower than the layers in turn. (Not a ratio of their peaks: what torch's
// bfloat16 matrix products allocate differs by CPU, 0.56 of theirs on an Intel Xeon with
// avx512_bf16, 0.64 on an AMD EPYC with AVX2 only.)
TEST(SlicedMlp, InAutocastKeepsItsOutputAndTheCastsAlone) {
  if (!LiveBytes::available()) GTEST_SKIP() << "another memory reporter is active";
  const Mlp m = make(Kind::kPlain, 64, 256, 64, true).to(at::kFloat);
  const at::Tensor x = at::randn({8, 128, 64}).requires_grad_(true);
  int64_t params = 0;
  for (const auto& t : m.all()) params += t.numel();
  const Footprints f = footprints(m, x, at::kBFloat16);
  EXPECT_EQ(f.kept[0], f.output + 2 * x.numel() + 2 * params);
  const int64_t hidden = 8 * 128 * 256 * 2;
  EXPECT_GE(f.kept[1], f.kept[0] + 2 * hidden);
  EXPECT_LE(f.peak[0] + hidden, f.peak[1]) << f.peak[0] << " vs " << f.peak[1];
}

TEST(SlicedMlp, BadInputIsNamed) {
  const Mlp m = make(Kind::kPlain, 6, 8, 5, true).to(at::kFloat);
  const at::Tensor x = at::randn({3, 6});
  expect_error([&] { sliced_mlp(at::randn({3, 5}), m.w1, m.b1, gelu(), m.w2, m.b2); },
               "memlean::sliced_mlp: w1 takes 6 features, its input has 5");
  expect_error([&] { sliced_mlp(x, m.w1, m.b1, gelu(), m.w2.t(), m.b2); },
               "w2 takes 5 features, its input has 8");
  expect_error([&] { sliced_mlp(x, m.w1, at::randn({7}), gelu(), m.w2, m.b2); },
               "b1 must be a 1-d tensor of 8 elements");
  expect_error([&] { sliced_mlp(x, m.w1[0], m.b1, gelu(), m.w2, m.b2); },
               "w1 must be a 2-d tensor");
  expect_error([&] { sliced_mlp(at::Tensor(), m.w1, m.b1, gelu(), m.w2, m.b2); },
               "x must be a tensor of 1 or more dimensions, got an undefined tensor");
  expect_error([&] { sliced_mlp(x, m.w1, m.b1, gelu(), m.w2, m.b2, {9, false}); },
               "options.slices must be in 1..8 (the hidden features) or 0 (the default), got 9");
  expect_error([&] { sliced_mlp(x.to(at::kDouble), m.w1, m.b1, gelu(), m.w2, m.b2); },
               "weight wg/w1 must be a plain Double tensor");
  expect_error([&] {
    sliced_gated_mlp(x, at::randn({7, 6}), std::nullopt, silu(), at::Tensor(), std::nullopt,
                     at::randn({5, 3}), std::nullopt);
  }, "wg has an odd number of rows, 7");
  expect_error([&] {
    sliced_gated_mlp(x, at::randn({8, 6}), std::nullopt, silu(), at::Tensor(), at::randn({4}),
                     at::randn({5, 4}), std::nullopt);
  }, "bu is given but wu is undefined");
  expect_error([&] {
    sliced_gated_mlp(x, at::randn({8, 6}), std::nullopt, silu(), at::randn({7, 6}),
                     std::nullopt, at::randn({5, 8}), std::nullopt);
  }, "wu makes 7 features, wg 8");
}

// The default slice count: one per slice_bytes of the hidden tensor, capped at 16 and at the
// features, never 0.
TEST(SlicedMlp, SliceCountRule) {
  constexpr int64_t MiB = int64_t{1} << 20;
  EXPECT_EQ(sliced_mlp_slices(0, 1024), 1);
  EXPECT_EQ(sliced_mlp_slices(MiB - 1, 1024), 1);
  EXPECT_EQ(sliced_mlp_slices(5 * MiB + 7, 1024), 5);
  EXPECT_EQ(sliced_mlp_slices(100 * MiB, 1024), 16);
  EXPECT_EQ(sliced_mlp_slices(100 * MiB, 3), 3);
  EXPECT_EQ(sliced_mlp_slices(100 * MiB, 0), 1);
  EXPECT_EQ(sliced_mlp_slices(6 << 10, 1024, 1 << 10), 6);
  expect_error([] { sliced_mlp_slices(MiB, 8, 0); }, "slice_bytes must be at least 1, got 0");
  expect_error([] { sliced_mlp_slices(-1, 8); }, "hidden_bytes must not be negative, got -1");
  expect_error([] { sliced_mlp_slices(MiB, -2); }, "features must not be negative, got -2");
}

// A backward with create_graph gives the first gradients; differentiating them raises.
TEST(SlicedMlp, DoubleBackwardIsRefused) {
  const Mlp m = make(Kind::kPlain, 6, 8, 5, true).to(at::kDouble);
  const at::Tensor x = at::randn({3, 6}, at::kDouble).requires_grad_(true);
  const at::Tensor y = sliced(Kind::kPlain, x, m, gelu(), true, {2, false});
  const at::Tensor gx = torch::autograd::grad({y.square().sum()}, {x}, {}, true, true)[0];
  const at::Tensor xr = x.detach().clone().requires_grad_(true);
  const at::Tensor gr =
      torch::autograd::grad({in_turn(Kind::kPlain, xr, m, gelu(), true).square().sum()}, {xr})[0];
  EXPECT_TRUE(at::allclose(gx, gr, 1e-12, 1e-12));
  expect_error([&] { gx.sum().backward(); }, "differentiate twice");
}

}  // namespace
}  // namespace memlean
