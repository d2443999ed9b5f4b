// Tests of memlean::checkpoint: gradients equal those of the plain function (float64,
// bitwise), RNG preservation, activation memory (exact, with LiveBytes), the module forms,
// and a clear error for every misuse.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include <atomic>
#include <chrono>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "ops/checkpoint/checkpoint.h"
#include "ops/checkpoint/sequential.h"
#include "runtime/memstats/live_bytes.h"
#include "testing/autocast_region.h"
#include "testing/expect_error.h"

namespace memlean {
namespace {

using ::memlean::testing::expect_error;
using Tensors = std::vector<at::Tensor>;

at::TensorOptions f64() { return at::TensorOptions(at::kDouble); }

at::Tensor leaf(at::IntArrayRef shape, bool requires_grad = true) {
  return at::randn(shape, f64()).requires_grad_(requires_grad);
}

// The gradients of `tensors` (undefined where there is none), then cleared.
Tensors take_grads(const Tensors& tensors) {
  Tensors grads;
  for (const auto& t : tensors) {
    grads.push_back(t.grad().defined() ? t.grad().clone() : at::Tensor());
    if (t.grad().defined()) t.mutable_grad().reset();
  }
  return grads;
}

void expect_same(const Tensors& a, const Tensors& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].defined(), b[i].defined()) << "tensor " << i;
    if (a[i].defined()) {
      EXPECT_TRUE(at::equal(a[i], b[i])) << "tensor " << i;
    }
  }
}

// A segment with two parameters: tanh(x w^T + b) * x.
struct Block {
  at::Tensor w = leaf({8, 8});
  at::Tensor b = leaf({8});
  Tensors params() const { return {w, b}; }
  at::Tensor operator()(const at::Tensor& x) const { return at::tanh(at::linear(x, w, b)) * x; }
};

TEST(Checkpoint, GradientsEqualThePlainFunctionInFloat64) {
  Block block;
  const at::Tensor x = leaf({5, 8});
  const Tensors all = {x, block.w, block.b};

  block(x).pow(2).sum().backward();
  const Tensors plain = take_grads(all);

  const Tensors out = checkpoint(
      [&](const Tensors& in) { return Tensors{block(in[0])}; }, 1, {x, block.w, block.b});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_TRUE(out[0].requires_grad());
  out[0].pow(2).sum().backward();
  expect_same(take_grads(all), plain);
}

TEST(Checkpoint, SeveralOutputsAndOutputsWithoutGradient) {
  Block block;
  const at::Tensor x = leaf({4, 8});
  const at::Tensor y = leaf({4, 8});
  const Tensors all = {x, y, block.w, block.b};
  auto f = [&](const Tensors& in) {
    const at::Tensor h = block(in[0]);
    return Tensors{h * in[1], h.sum(1), in[1].exp()};
  };
  {
    const Tensors o = f({x, y});
    (o[0].sum() + o[1].pow(2).sum()).backward();  // o[2] unused
  }
  const Tensors plain = take_grads(all);
  const Tensors o = checkpoint(f, 2, {x, y, block.w, block.b});
  ASSERT_EQ(o.size(), 3u);
  (o[0].sum() + o[1].pow(2).sum()).backward();
  expect_same(take_grads(all), plain);
}

TEST(Checkpoint, AnInputReturnedAsItIsKeepsItsOwnHistory) {
  const at::Tensor x = leaf({3, 4});
  const at::Tensor h = x * 2;  // not a leaf: its grad_fn must stay what it is
  const auto* const before = h.grad_fn().get();
  const at::Tensor y = checkpoint([](const Tensors& in) { return Tensors{in[0]}; }, 1, {h})[0];
  EXPECT_FALSE(y.is_same(h));
  EXPECT_EQ(y.data_ptr(), h.data_ptr());
  EXPECT_EQ(h.grad_fn().get(), before);
  EXPECT_EQ(y.grad_fn()->name(), "memlean::CheckpointBackward");
  (y * 3).sum().backward();  // the recompute returns the detached input itself
  EXPECT_TRUE(at::equal(x.grad(), at::full_like(x, 6.0)));
}

TEST(Checkpoint, InputsThatDoNotRequireGrad) {
  Block block;
  const at::Tensor x = leaf({3, 8}, /*requires_grad=*/false);
  block(x).sum().backward();
  const Tensors plain = take_grads(block.params());
  checkpoint([&](const Tensors& in) { return Tensors{block(in[0])}; }, 1, {x, block.w, block.b})[0]
      .sum()
      .backward();
  expect_same(take_grads(block.params()), plain);
  EXPECT_FALSE(x.grad().defined());
}

TEST(Checkpoint, UndefinedInputsPassThrough) {
  Block block;
  const at::Tensor x = leaf({3, 8});
  int calls = 0;
  auto f = [&](const Tensors& in) {
    ++calls;
    EXPECT_FALSE(in[1].defined());
    return Tensors{block(in[0])};
  };
  checkpoint(f, 2, {x, at::Tensor(), block.w, block.b})[0].sum().backward();
  EXPECT_EQ(calls, 2);  // forward and recompute
  EXPECT_TRUE(x.grad().defined());
}

TEST(Checkpoint, NonTensorInputsAndOutputsPassThrough) {
  Block block;
  const at::Tensor x = leaf({3, 8});
  auto f = [&](const std::vector<c10::IValue>& in) {
    EXPECT_EQ(in[2].toStringRef(), "scale");
    EXPECT_TRUE(in[3].isNone());
    const at::Tensor h = block(in[0].toTensor()) * in[1].toDouble();
    return std::vector<c10::IValue>{c10::IValue(int64_t{7}), h, c10::IValue("done")};
  };
  (f({x, 2.5, "scale", c10::IValue()})[1].toTensor()).sum().backward();
  const Tensors plain = take_grads({x, block.w, block.b});

  const std::vector<c10::IValue> out =
      checkpoint(f, 4, {x, 2.5, "scale", c10::IValue(), block.w, block.b});
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].toInt(), 7);
  EXPECT_EQ(out[2].toStringRef(), "done");
  out[1].toTensor().sum().backward();
  expect_same(take_grads({x, block.w, block.b}), plain);
}

TEST(Checkpoint, NonDifferentiableOutputs) {
  Block block;
  const at::Tensor x = leaf({3, 8});
  const Tensors out = checkpoint(
      [&](const Tensors& in) {
        const at::Tensor h = block(in[0]);
        return Tensors{h.argmax(1), h};
      },
      1, {x, block.w, block.b});
  EXPECT_EQ(out[0].scalar_type(), at::kLong);
  EXPECT_FALSE(out[0].requires_grad());
  out[1].sum().backward();
  EXPECT_TRUE(block.w.grad().defined());
}

TEST(Checkpoint, ParameterListedTwiceGetsItsGradientOnce) {
  Block block;
  const at::Tensor x = leaf({3, 8});
  block(x).sum().backward();
  const Tensors plain = take_grads({x, block.w, block.b});
  checkpoint([&](const Tensors& in) { return Tensors{block(in[0])}; }, 1,
             {x, block.w, block.b, block.w})[0]
      .sum()
      .backward();
  expect_same(take_grads({x, block.w, block.b}), plain);
}

TEST(Checkpoint, WithoutGradModeItIsAPlainCall) {
  Block block;
  const at::Tensor x = leaf({3, 8});
  int calls = 0;
  at::NoGradGuard no_grad;
  const Tensors out = checkpoint(
      [&](const Tensors& in) {
        ++calls;
        return Tensors{block(in[0])};
      },
      1, {x, block.w, block.b});
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(out[0].requires_grad());
  EXPECT_TRUE(at::equal(out[0], block(x)));
}

// ---- autocast --------------------------------------------------------------------------

// A segment whose input, a float32 layer output (no leaf), feeds two linear layers in a CPU
// bfloat16 autocast region (a gated MLP's gate and up projections): the forward casts it per
// use and sums the two gradients in float32. The recompute casts it per use too (a view of
// its detached input: autocast caches a float32 leaf that requires grad, as it caches weights;
// until 2026-11-28 it did, and summed the two gradients in bfloat16), so the gradients are
// bitwise those without checkpoint.
TEST(Checkpoint, AutocastRecomputeCastsALayerOutputPerUseAsTheForwardDid) {
  at::manual_seed(0);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor gate = at::randn({64, 32}, f32).requires_grad_();
  const at::Tensor up = at::randn({64, 32}, f32).requires_grad_();
  const at::Tensor scale = (at::rand({32}, f32) + 0.5).requires_grad_();
  const at::Tensor x0 = at::randn({16, 32}, f32);
  auto mlp = [&](const Tensors& in) {
    return Tensors{at::silu(at::linear(in[0], gate)) * at::linear(in[0], up)};
  };
  auto grads = [&](bool checkpointed) {
    const at::Tensor x = x0.clone().requires_grad_();
    at::Tensor loss;
    {
      testing::AutocastRegion region(at::kBFloat16);
      const at::Tensor h = x * at::rsqrt(x.pow(2).mean(-1, true)) * scale;  // float32
      const at::Tensor out = checkpointed ? checkpoint(mlp, 1, {h, gate, up})[0] : mlp({h})[0];
      EXPECT_EQ(out.scalar_type(), at::kBFloat16);
      loss = out.to(at::kFloat).pow(2).sum();
    }
    loss.backward();  // outside the region, as PyTorch's autocast docs advise
    return take_grads({x, gate, up, scale});
  };
  const Tensors plain = grads(false);
  const Tensors checkpointed = grads(true);
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_TRUE(at::equal(checkpointed[i], plain[i])) << "gradient " << i;
  }
}

// ---- RNG -----------------------------------------------------------------------------

TEST(Checkpoint, DropoutGradientsEqualWithRngPreservation) {
  Block block;
  const at::Tensor x = leaf({64, 8});
  auto f = [&](const Tensors& in) { return Tensors{at::dropout(block(in[0]), 0.5, true)}; };

  at::manual_seed(123);
  f({x})[0].pow(2).sum().backward();
  const at::Tensor after_plain = at::rand({4}, f64());
  const Tensors plain = take_grads({x, block.w, block.b});

  at::manual_seed(123);
  checkpoint(f, 1, {x, block.w, block.b})[0].pow(2).sum().backward();
  // The recompute did not move the RNG stream either.
  EXPECT_TRUE(at::equal(at::rand({4}, f64()), after_plain));
  expect_same(take_grads({x, block.w, block.b}), plain);
}

TEST(Checkpoint, DropoutDiffersWithoutRngPreservation) {
  Block block;
  const at::Tensor x = leaf({64, 8});
  auto f = [&](const Tensors& in) { return Tensors{at::dropout(block(in[0]), 0.5, true)}; };
  at::manual_seed(123);
  f({x})[0].pow(2).sum().backward();
  const Tensors plain = take_grads({x, block.w, block.b});
  at::manual_seed(123);
  checkpoint(f, 1, {x, block.w, block.b}, CheckpointOptions().preserve_rng_state(false))[0]
      .pow(2)
      .sum()
      .backward();
  EXPECT_FALSE(at::equal(take_grads({x, block.w, block.b})[1], plain[1]));
}

// ---- memory --------------------------------------------------------------------------

// A chain of n blocks tanh(h w^T + b) in segments of `per` blocks; each segment either
// checkpointed or plain.
struct Chain {
  std::vector<Block> blocks;
  explicit Chain(int n) : blocks(n) {}
  at::Tensor run(const at::Tensor& x, int per, bool checkpointed, bool rng = false) const {
    at::Tensor h = x;
    for (size_t s = 0; s < blocks.size(); s += per) {
      auto segment = [this, s, per](const Tensors& in) {
        at::Tensor t = in[0];
        for (size_t i = s; i < s + per; ++i) t = at::tanh(at::linear(t, blocks[i].w, blocks[i].b));
        return Tensors{t};
      };
      Tensors args = {h};
      for (size_t i = s; i < s + per; ++i) {
        args.push_back(blocks[i].w);
        args.push_back(blocks[i].b);
      }
      h = checkpointed ? checkpoint(segment, 1, args, CheckpointOptions().preserve_rng_state(rng))[0]
                       : segment({h})[0];
    }
    return h;
  }
};

TEST(CheckpointMemory, ForwardKeepsOnlyTheSegmentInputs) {
  ASSERT_TRUE(LiveBytes::available());
  constexpr int kBlocks = 12;
  const Chain chain(kBlocks);
  const at::Tensor x = leaf({32, 8});
  const int64_t act = 32 * 8 * 8;  // one activation, float64

  {
    LiveBytes live;
    const at::Tensor y = chain.run(x, 1, /*checkpointed=*/false);
    // Plain: every tanh keeps its output for backward.
    EXPECT_EQ(live.live(), kBlocks * act);
  }
  for (int per : {1, 2, 3, 4, 6, 12}) {
    LiveBytes live;
    const at::Tensor y = chain.run(x, per, /*checkpointed=*/true);
    // k segments: the k segment outputs (each the next one's saved input, the last one y).
    EXPECT_EQ(live.live(), (kBlocks / per) * act) << per << " blocks per segment";
    // Backward frees them; the recompute of one segment at a time needs `per` more.
    live.reset_peak();
    y.sum().backward();
  }
}

TEST(CheckpointMemory, RngStateCostsNoTensorMemory) {
  // The CPU generator's state is kept as a copy of its engine in the checkpoint's node (a
  // few KiB of host memory per checkpoint), not as a state tensor.
  const Chain chain(4);
  const at::Tensor x = leaf({32, 8});
  LiveBytes live;
  const at::Tensor y = chain.run(x, 1, /*checkpointed=*/true, /*rng=*/true);
  EXPECT_EQ(live.live(), 4 * 32 * 8 * 8);
}

TEST(CheckpointMemory, BackwardRecomputesOneSegmentAtATime) {
  constexpr int kBlocks = 12;
  const Chain chain(kBlocks);
  const at::Tensor x = leaf({512, 8});  // activations much larger than the parameters
  const int64_t act = 512 * 8 * 8;
  int64_t peak[2] = {0, 0};
  for (bool ckpt : {false, true}) {
    LiveBytes live;
    const at::Tensor y = chain.run(x, 4, ckpt);
    y.sum().backward();
    peak[ckpt] = live.peak();
    for (const auto& b : chain.blocks) take_grads({b.w, b.b});
  }
  x.mutable_grad().reset();
  // Plain: the 12 kept activations and the gradients' temporaries. Checkpointed: 3 kept
  // segment outputs, plus one segment of 4 recomputed, plus the same temporaries.
  EXPECT_GE(peak[0], kBlocks * act);
  // (Measured: 14.0 and 9.1 activations.)
  EXPECT_LT(peak[1], 10 * act) << peak[1] << " vs " << peak[0];
  EXPECT_LT(peak[1], peak[0] - 4 * act) << peak[1] << " vs " << peak[0];
}

TEST(CheckpointMemory, BackwardFreesTheRecomputedOutputAndItsGradientEarly) {
  // cos(sin(x)): cos keeps sin(x), and no node keeps the output. The checkpoint's backward
  // frees the recomputed output at once, and the incoming gradient once cos's backward has
  // used it, as the plain function's backward does (and torch's non-reentrant checkpoint):
  // its peak is the plain backward's to the byte. Holding both until the whole segment's
  // backward has run (torch::autograd::grad from the recomputed outputs) adds two
  // activations.
  constexpr int64_t n = 4096;
  const at::Tensor x = leaf({n});
  const at::Tensor c = at::randn({n}, f64());  // makes the incoming gradient a real tensor
  auto f = [](const Tensors& in) { return Tensors{at::cos(at::sin(in[0]))}; };
  int64_t peak[2] = {0, 0};
  Tensors grads[2];
  for (bool ckpt : {false, true}) {
    LiveBytes live;
    {
      const at::Tensor y = ckpt ? checkpoint(f, 1, {x})[0] : f({x})[0];
      const at::Tensor loss = (y * c).sum();
      live.reset_peak();
      loss.backward();
    }
    peak[ckpt] = live.peak();
    grads[ckpt] = take_grads({x});
  }
  expect_same(grads[0], grads[1]);
  EXPECT_GE(peak[0], 3 * n * 8);  // the incoming gradient, sin(x) and a gradient, at least
  EXPECT_EQ(peak[1], peak[0]);
}

// ---- module forms --------------------------------------------------------------------

TEST(CheckpointModule, SequentialGradientsEqualPlain) {
  torch::nn::Sequential seq(torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 4));
  seq->to(at::kDouble);
  const at::Tensor x = leaf({5, 8});
  Tensors all = seq->parameters();
  all.push_back(x);
  seq->forward(x).pow(2).sum().backward();
  const Tensors plain = take_grads(all);
  checkpoint(seq, x).pow(2).sum().backward();
  expect_same(take_grads(all), plain);
}

TEST(CheckpointModule, FunctionOverAModule) {
  torch::nn::Linear lin(8, 8);
  lin->to(at::kDouble);
  const at::Tensor x = leaf({5, 8});
  const at::Tensor y = leaf({5, 8});
  Tensors all = {x, y, lin->weight, lin->bias};
  (lin(x) * y).sum().backward();
  const Tensors plain = take_grads(all);
  checkpoint(*lin, [&](const Tensors& in) { return Tensors{lin(in[0]) * in[1]}; }, {x, y})[0]
      .sum()
      .backward();
  expect_same(take_grads(all), plain);
}

// The module form restores the buffers the forward changed, so even torch's BatchNorm2d
// inside it is updated once.
TEST(CheckpointModule, TorchBatchNormInsideIsUpdatedOnce) {
  auto make = [] {
    torch::nn::Sequential s(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).padding(1)),
                            torch::nn::BatchNorm2d(4), torch::nn::ReLU());
    s->to(at::kDouble);
    return s;
  };
  at::manual_seed(0);
  auto plain = make();
  at::manual_seed(0);
  auto ckpt = make();
  const at::Tensor x = at::randn({6, 3, 5, 5}, f64());
  plain->forward(x).sum().backward();
  checkpoint(ckpt, x).sum().backward();
  auto bp = std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(plain->ptr(1));
  auto bc = std::dynamic_pointer_cast<torch::nn::BatchNorm2dImpl>(ckpt->ptr(1));
  EXPECT_EQ(bc->num_batches_tracked.item<int64_t>(), 1);
  EXPECT_TRUE(at::equal(bc->running_mean, bp->running_mean));
  EXPECT_TRUE(at::equal(bc->running_var, bp->running_var));
  expect_same(take_grads(ckpt->parameters()), take_grads(plain->parameters()));
}

// A layer whose forward updates a buffer and reads it (as spectral norm's power iteration and
// a QAT observer do): y = x * scale after scale *= 2. Its gradient is the scale the forward
// used. through_data: the update through scale.data(), which leaves the buffer's version
// counter alone.
struct DoublingImpl : torch::nn::Module {
  explicit DoublingImpl(bool through_data = false) : through_data(through_data) {
    scale = register_buffer("scale", at::full({1}, 1.5, f64()));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (through_data) {
      scale.data().mul_(2);
    } else {
      at::NoGradGuard no_grad;
      scale.mul_(2);
    }
    return x * scale;
  }
  bool through_data;
  at::Tensor scale;
};
TORCH_MODULE(Doubling);

// The recompute begins from the buffers the forward began from where the forward changed
// them: the module form and checkpoint_sequential give the plain gradients (3, not the 6 a
// recompute from the updated scale gave), and the buffer is updated once. Also where the
// forward updates it through .data(), which no version counter sees (found by value since
// 2026-11-27).
TEST(CheckpointModule, TheRecomputeBeginsFromTheBuffersTheForwardBeganFrom) {
  for (const bool sequential : {false, true}) for (const bool through_data : {false, true}) {
    torch::nn::Sequential s(torch::nn::Linear(4, 4), Doubling(through_data), torch::nn::Tanh());
    s->to(at::kDouble);
    const at::Tensor x = at::randn({3, 4}, f64()).requires_grad_();
    const at::Tensor y = sequential ? checkpoint_sequential(s, {0, 2}, x) : checkpoint(s, x);
    y.sum().backward();
    const at::Tensor g = x.grad().clone();
    auto scale = std::dynamic_pointer_cast<DoublingImpl>(s->ptr(1))->scale;
    EXPECT_EQ(scale.item<double>(), 3.0) << "updated once";
    x.mutable_grad().reset();
    {
      at::NoGradGuard no_grad;
      scale.fill_(1.5);
    }
    s->forward(x).sum().backward();
    EXPECT_TRUE(at::allclose(g, x.grad(), 1e-14, 0))
        << (sequential ? "sequential" : "module") << (through_data ? ", through .data()" : "");
  }
}

// Which buffers a checkpoint copies until its backward, in exact bytes: a buffer the forward
// updates (Doubling's 8 bytes), not one it only reads (the table of 64 KiB: its copy is dropped
// after the forward), not a BatchNorm's statistics, nor those of a NormStatisticsHolder.
struct TableImpl : torch::nn::Module {
  TableImpl() { table = register_buffer("table", at::ones({8192}, f64())); }
  at::Tensor forward(const at::Tensor& x) { return x * table.slice(0, 0, 4); }
  at::Tensor table;
};
TORCH_MODULE(Table);
struct HeldStatisticsImpl : torch::nn::Module, NormStatisticsHolder {
  HeldStatisticsImpl() { count = register_buffer("count", at::zeros({1024}, f64())); }
  at::Tensor forward(const at::Tensor& x) {
    {
      at::NoGradGuard no_grad;
      count.add_(1);
    }
    return x.tanh();
  }
  at::Tensor count;
};
TORCH_MODULE(HeldStatistics);

TEST(CheckpointMemory, OnlyTheBuffersTheForwardChangedAreCopiedUntilBackward) {
  ASSERT_TRUE(LiveBytes::available());
  torch::nn::Sequential s(Table(), torch::nn::BatchNorm1d(4), HeldStatistics(), Doubling());
  s->to(at::kDouble);
  const at::Tensor x = leaf({3, 4});
  LiveBytes live;
  const at::Tensor y = checkpoint(s, x);
  EXPECT_EQ(live.live(), 3 * 4 * 8 + 8) << "the output and Doubling's scale at the start";
  y.sum().backward();
}

// ---- other properties ----------------------------------------------------------------

TEST(Checkpoint, IsRecomputingOnlyDuringTheRecompute) {
  Block block;
  const at::Tensor x = leaf({3, 8});
  std::vector<bool> seen;
  auto f = [&](const Tensors& in) {
    seen.push_back(is_recomputing());
    return Tensors{block(in[0])};
  };
  EXPECT_FALSE(is_recomputing());
  checkpoint(f, 1, {x, block.w, block.b})[0].sum().backward();
  EXPECT_EQ(seen, (std::vector<bool>{false, true}));
  EXPECT_FALSE(is_recomputing());
}

TEST(Checkpoint, NestedCheckpointsGiveTheSameGradients) {
  Block inner, outer;
  const at::Tensor x = leaf({4, 8});
  const Tensors all = {x, inner.w, inner.b, outer.w, outer.b};
  outer(inner(x)).sum().backward();
  const Tensors plain = take_grads(all);
  auto f = [&](const Tensors& in) {
    const at::Tensor h =
        checkpoint([&](const Tensors& i) { return Tensors{inner(i[0])}; }, 1, {in[0], inner.w, inner.b})[0];
    return Tensors{outer(h)};
  };
  checkpoint(f, 1, {x, inner.w, inner.b, outer.w, outer.b})[0].sum().backward();
  expect_same(take_grads(all), plain);
}

TEST(Checkpoint, BackwardTwiceWithRetainGraphRecomputesAgain) {
  Block block;
  const at::Tensor x = leaf({3, 8});
  block(x).sum().backward();
  const Tensors once = take_grads({x, block.w});
  const at::Tensor y =
      checkpoint([&](const Tensors& in) { return Tensors{block(in[0])}; }, 1, {x, block.w, block.b})[0];
  y.sum().backward({}, /*retain_graph=*/true);
  y.sum().backward();
  const Tensors twice = take_grads({x, block.w});
  EXPECT_TRUE(at::allclose(twice[0], 2 * once[0], 1e-14, 0));
  EXPECT_TRUE(at::allclose(twice[1], 2 * once[1], 1e-14, 0));
}

TEST(Checkpoint, BackwardOnTwoThreadsThroughOneGraphRecomputesOneAtATime) {
  // Two threads run backward through one retained graph at the same time (the second frees
  // it). The node serialises them: the recomputes never overlap, nothing is used after the
  // second backward freed it, and the gradients are twice one backward's.
  Block block;
  const at::Tensor x = leaf({3, 8});
  block(x).sum().backward();
  const Tensors once = take_grads({x, block.w});
  std::atomic<int> inside{0}, most_inside{0}, recomputes{0};
  const at::Tensor y = checkpoint(
      [&](const Tensors& in) {
        if (at::GradMode::is_enabled() && is_recomputing()) {
          const int now = ++inside;
          int seen = most_inside.load();
          while (now > seen && !most_inside.compare_exchange_weak(seen, now)) {
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
          ++recomputes;
          --inside;
        }
        return Tensors{block(in[0])};
      },
      1, {x, block.w, block.b})[0];
  const at::Tensor loss = y.sum();
  std::thread first([&] { loss.backward({}, /*retain_graph=*/true); });
  std::thread second([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    loss.backward({}, /*retain_graph=*/true);
  });
  first.join();
  second.join();
  EXPECT_EQ(recomputes.load(), 2);
  EXPECT_EQ(most_inside.load(), 1) << "two recomputes of one checkpoint ran at once";
  const Tensors twice = take_grads({x, block.w});
  EXPECT_TRUE(at::allclose(twice[0], 2 * once[0], 1e-14, 0));
  EXPECT_TRUE(at::allclose(twice[1], 2 * once[1], 1e-14, 0));
}

TEST(Checkpoint, DoubleBackwardEqualsThePlainFunction) {
  // A gradient penalty through a checkpoint of a non-leaf input: the first-order gradients
  // (kept differentiable) and the second-order ones of the leaf and the parameters equal
  // the plain function's, in float64.
  Block block;
  const at::Tensor x0 = leaf({3, 8});
  auto step = [&](bool checkpointed) {
    const at::Tensor x = x0 * 1.5;
    const at::Tensor y =
        checkpointed ? checkpoint([&](const Tensors& in) { return Tensors{block(in[0])}; }, 1,
                                  {x, block.w, block.b})[0]
                     : block(x);
    const Tensors g = torch::autograd::grad({y.pow(2).sum()}, {x, block.w}, {}, std::nullopt,
                                            /*create_graph=*/true);
    EXPECT_TRUE(g[0].requires_grad() && g[1].requires_grad());
    (y.sum() + g[0].pow(2).sum() + g[1].pow(2).sum()).backward();
    Tensors out = {g[0].detach(), g[1].detach()};
    for (const at::Tensor& t : take_grads({x0, block.w, block.b})) out.push_back(t);
    return out;
  };
  const Tensors plain = step(false), ckpt = step(true);
  ASSERT_EQ(plain.size(), ckpt.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    ASSERT_TRUE(ckpt[i].defined()) << i;
    EXPECT_TRUE(at::allclose(ckpt[i], plain[i], 1e-12, 1e-12)) << "tensor " << i;
  }
}

// ---- errors --------------------------------------------------------------------------

TEST(CheckpointErrors, NLargerThanTheArguments) {
  const at::Tensor x = leaf({2});
  expect_error([&] { checkpoint([](const Tensors& in) { return in; }, 3, {x, x}); },
               "memlean::checkpoint: n_inputs is 3 but only 2 arguments were given");
  expect_error([&] { checkpoint([](const Tensors& in) { return in; }, -1, {x}); },
               "n_inputs must be >= 0, got -1");
}

TEST(CheckpointErrors, AParameterThatIsNotATensor) {
  const at::Tensor x = leaf({2});
  auto f = [](const std::vector<c10::IValue>& in) { return in; };
  expect_error([&] { checkpoint(f, 1, {x, 0.5}); },
               "parameter 0 (inputs_and_params[1]) is a value of type Double, not a tensor");
  expect_error([&] { checkpoint(f, 1, {x, x, c10::IValue()}); },
               "parameter 1 (inputs_and_params[2]) is None, not a tensor");
  expect_error([&] { checkpoint([](const Tensors& in) { return in; }, 1, {x, at::Tensor()}); },
               "parameter 0 (inputs_and_params[1]) is an undefined tensor, not a tensor");
}

TEST(Checkpoint, AFunctionThatReturnsNoTensorReturnsItsValues) {
  // As torch's checkpoint: nothing to differentiate, the values come back as they are.
  const at::Tensor x = leaf({2});
  EXPECT_TRUE(checkpoint([](const Tensors&) { return Tensors{}; }, 1, {x}).empty());
  const Tensors undefined = checkpoint([](const Tensors&) { return Tensors{at::Tensor()}; }, 1, {x});
  ASSERT_EQ(undefined.size(), 1u);
  EXPECT_FALSE(undefined[0].defined());
  auto ints = [](const std::vector<c10::IValue>&) {
    return std::vector<c10::IValue>{c10::IValue(int64_t{1}), c10::IValue()};
  };
  const std::vector<c10::IValue> values = checkpoint(ints, 1, {x});
  ASSERT_EQ(values.size(), 2u);
  EXPECT_EQ(values[0].toInt(), 1);
  EXPECT_TRUE(values[1].isNone());
  // An integer tensor: returned, nothing to differentiate.
  const Tensors index = checkpoint([](const Tensors& in) { return Tensors{in[0].argmax()}; }, 1, {x});
  EXPECT_FALSE(index[0].requires_grad());
  EXPECT_EQ(index[0].item<int64_t>(), x.argmax().item<int64_t>());
}

TEST(CheckpointErrors, TensorsInsideAContainer) {
  const at::Tensor x = leaf({2});
  auto f = [](const std::vector<c10::IValue>& in) {
    return std::vector<c10::IValue>{in[0], c10::IValue(c10::List<at::Tensor>({in[0].toTensor()}))};
  };
  expect_error([&] { checkpoint(f, 1, {x}); }, "output 1 of the function is a container that holds tensors");
}

TEST(CheckpointErrors, BackwardThroughACheckpointTwice) {
  Block block;
  const at::Tensor x = leaf({3, 8});
  const at::Tensor y =
      checkpoint([&](const Tensors& in) { return Tensors{block(in[0])}; }, 1, {x, block.w, block.b})[0];
  y.sum().backward();
  expect_error([&] { y.sum().backward(); },
               "memlean::checkpoint: backward ran through this checkpoint a second time");
}

TEST(CheckpointErrors, AParameterThatWasNotListed) {
  Block block;
  const at::Tensor x = leaf({3, 8});
  const at::Tensor y =
      checkpoint([&](const Tensors& in) { return Tensors{block(in[0])}; }, 1, {x, block.w})[0];
  expect_error([&] { y.sum().backward(); },
               "uses a tensor that requires grad but is neither one of its inputs nor one of the "
               "parameters given to the checkpoint (it reaches a leaf of shape [8] through");
}

TEST(CheckpointErrors, AnOutsideActivationThatWasNotListed) {
  Block block;
  const at::Tensor x = leaf({3, 8});
  const at::Tensor outside = leaf({3, 8}) * 2;  // not a leaf
  const at::Tensor y = checkpoint(
      [&](const Tensors& in) { return Tensors{block(in[0]) + outside}; }, 1, {x, block.w, block.b})[0];
  expect_error([&] { y.sum().backward(); }, "its gradient would be lost");
}

TEST(CheckpointErrors, TheFunctionModifiesItsInputInPlace) {
  const at::Tensor x = leaf({3, 8});
  const at::Tensor h = x * 2;
  expect_error(
      [&] { checkpoint([](const Tensors& in) { return Tensors{in[0].relu_()}; }, 1, {h}); },
      "the function modified its input 0 in place");
}

TEST(CheckpointErrors, AnInputModifiedBeforeBackward) {
  Block block;
  const at::Tensor x = leaf({3, 8});
  const at::Tensor h = x * 2;
  const at::Tensor y =
      checkpoint([&](const Tensors& in) { return Tensors{block(in[0])}; }, 1, {h, block.w, block.b})[0];
  {
    at::NoGradGuard no_grad;
    h.add_(1);
  }
  expect_error([&] { y.sum().backward(); }, "modified by an inplace operation");
}

// A function whose recompute computes something else than its forward did (a forward that
// reads state it changed: a key-value cache its first call appended to) is refused, naming the
// output and both shapes or dtypes: before 2026-11-28 a shape surfaced as autograd's "invalid
// gradient" of memlean::CheckpointGradients, and a dtype passed in silence.
TEST(CheckpointErrors, ARecomputeWhoseOutputsDifferFromTheForwards) {
  for (const bool shape : {true, false}) {
    std::vector<at::Tensor> cache;  // grows by one entry per call
    const auto attend = [&cache, shape](const Tensors& in) {
      cache.push_back(in[0] * 2);
      const at::Tensor all = at::cat(cache, 0);
      if (shape) return Tensors{in[1], all};
      return Tensors{cache.size() > 1 ? all.narrow(0, 0, 3).to(at::kFloat) : all, in[1]};
    };
    const at::Tensor x = leaf({3, 4}), other = leaf({2});
    const Tensors out = checkpoint(attend, 2, {x, other});
    expect_error([&] { (out[0].sum() + out[1].sum()).backward(); },
                 shape ? "output 1 was a Double tensor of shape [3, 4] in forward but is a "
                         "Double tensor of shape [6, 4] when recomputed in backward"
                       : "output 0 was a Double tensor of shape [3, 4] in forward but is a Float "
                         "tensor of shape [3, 4] when recomputed in backward");
  }
}

TEST(CheckpointErrors, EmptyFunction) {
  expect_error([&] { checkpoint(TensorFunction(), 0, {leaf({2})}); }, "function is empty");
}

// unversioned_changes flags exactly the buffers changed through .data() (no version bump):
// not one changed in place in the open (a checkpoint sees that), nor one left alone, nor a NaN
// left a NaN; a sparse buffer changed through its values and a complex one are found too.
TEST(UnversionedChanges, FlagsTheChangesNoVersionCounterSaw) {
  at::Tensor seen = at::ones({4});
  at::Tensor unseen = at::ones({4});
  at::Tensor untouched = at::full({3}, std::numeric_limits<float>::quiet_NaN());
  at::Tensor sparse = at::eye(3).to_sparse();
  at::Tensor complex = at::ones({2}, at::kComplexFloat);
  at::Tensor integers = at::arange(5);
  at::Tensor undefined;
  const std::vector<at::Tensor> buffers{seen, unseen, untouched, sparse, complex, integers,
                                        undefined};
  int calls = 0;
  const std::vector<bool> changed = unversioned_changes(buffers, [&] {
    ++calls;
    seen.mul_(2);
    unseen.data().mul_(2);
    untouched.data().add_(1);  // NaN + 1 is NaN: the value is unchanged
    sparse.data()._values().mul_(3);
    complex.data().mul_(c10::complex<float>(0, 1));
  });
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(changed, (std::vector<bool>{false, true, false, true, true, false, false}));
  EXPECT_EQ(unversioned_changes({integers}, [&] { integers.data()[0] = 7; }),
            std::vector<bool>{true});
}

}  // namespace
}  // namespace memlean
