// Checkpointed vs plain training steps in one process: step time and peak bytes of the
// activations (LiveBytes, exact on CPU), and at the end each variant's ratios to the plain
// step of its model.
//
//   ./bazelw run //ops/checkpoint:checkpoint_benchmark -- --benchmark_repetitions=3
//
// Models (float32, CPU, one intra-op thread so that runs on a shared machine compare):
//   chain: 16 blocks BN -> ReLU -> Conv3x3 (32 channels, 8 x 32 x 16 x 16 input).
//     plain | each (every block checkpointed in pytorch-checkpoint's form; docs/sources.md)
//     | sqrt (checkpoint_sequential, √16 = 4 segments) | plan (the planner's plan for half
//     the plain peak's activations)
//   dense: a DenseNet-BC dense block (12 layers, growth 12, 24 input channels, batch 16,
//     16 x 16), BN-ReLU-Conv1x1(4k)-BN-ReLU-Conv3x3(k) on the concatenation of all earlier
//     features. plain | efficient (concat-BN-ReLU-Conv1x1 checkpointed,
//     pytorch-checkpoint's DenseNet example, with memlean::BatchNorm2d).
//   tiny: a segment with almost no work, for the fixed cost of one checkpoint.
//   BatchNorm, BatchNormChannelsLast, BatchNormBfloat16: one training forward and backward
//     of a (16, 96, 56, 56) batch norm (float32; the last bfloat16 with float32 weights, as
//     in an autocast region), dL/dy from y * 2 (autograd's own gradient): plain
//     (at::batch_norm, torch's backward) | lean (memlean::lean_batch_norm, lean_batchnorm.h).
//   DepthwiseConv, DepthwiseConvStride2, DepthwiseConvBfloat16: one training forward and
//     backward of a 3x3 depthwise convolution of a (16, 96, 56, 56) input (padding 1; stride
//     1 or 2; the last bfloat16, stride 1): plain (at::conv2d, torch's backward) | lean
//     (memlean::lean_conv2d, lean_conv.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/conv.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "ops/checkpoint/batchnorm.h"
#include "ops/checkpoint/checkpoint.h"
#include "ops/checkpoint/lean_batchnorm.h"
#include "ops/checkpoint/lean_conv.h"
#include "runtime/memstats/live_bytes.h"
#include "ops/checkpoint/sequential.h"

namespace memlean {
namespace {

using torch::nn::Conv2d;
using torch::nn::Conv2dOptions;

// ---- chain ---------------------------------------------------------------------------

constexpr int kBlocks = 16;
constexpr int kChannels = 32;

// BN -> ReLU -> Conv3x3.
class BlockImpl : public torch::nn::Module {
 public:
  BlockImpl()
      : norm(register_module("norm", BatchNorm2d(kChannels))),
        conv(register_module("conv", Conv2d(Conv2dOptions(kChannels, kChannels, 3).padding(1).bias(false)))) {}
  at::Tensor forward(const at::Tensor& x) { return conv(at::relu(norm(x))); }

  BatchNorm2d norm;
  Conv2d conv;
};
TORCH_MODULE(Block);

torch::nn::Sequential make_chain() {
  at::manual_seed(0);
  torch::nn::Sequential chain;
  for (int i = 0; i < kBlocks; ++i) chain->push_back(Block());
  return chain;
}

at::Tensor chain_input() { return at::randn({8, kChannels, 16, 16}); }

enum class ChainMode { kPlain, kEach, kSqrt, kPlan };

at::Tensor run_chain(torch::nn::Sequential& chain, const at::Tensor& x, ChainMode mode,
                     const SegmentPlan& plan) {
  switch (mode) {
    case ChainMode::kPlain: return chain->forward(x);
    case ChainMode::kEach: {
      at::Tensor h = x;
      for (size_t i = 0; i < chain->size(); ++i) {
        auto block = chain->ptr(i);
        std::vector<at::Tensor> args = {h};
        for (const auto& p : block->parameters()) args.push_back(p);
        h = checkpoint(
            [&chain, i](const std::vector<at::Tensor>& in) {
              return std::vector<at::Tensor>{chain->begin()[i].forward(in[0])};
            },
            1, args)[0];
      }
      return h;
    }
    case ChainMode::kSqrt: return checkpoint_sequential(chain, sqrt_segment_starts(kBlocks), x);
    case ChainMode::kPlan: return checkpoint_sequential(chain, plan, x);
  }
  return {};
}

void clear_grads(torch::nn::Module& m) {
  for (auto& p : m.parameters()) p.mutable_grad().reset();
}

void BM_Chain(benchmark::State& state, ChainMode mode) {
  at::set_num_threads(1);
  auto chain = make_chain();
  const at::Tensor x = chain_input();
  SegmentPlan plan;
  if (mode == ChainMode::kPlan) {
    const auto costs = measure_layer_costs(chain, x);
    const int64_t plain_peak = estimate_peak_bytes(costs, {0});
    plan = plan_segments(costs, plain_peak / 2);
    state.counters["segments"] = static_cast<double>(plan.num_segments());
  }
  int64_t peak = 0;
  for (auto _ : state) {
    clear_grads(*chain);
    LiveBytes live;
    run_chain(chain, x, mode, plan).sum().backward();
    peak = live.peak();
  }
  state.counters["peak_bytes"] = static_cast<double>(peak);
  state.SetItemsProcessed(state.iterations() * x.size(0));
}

// ---- dense block ---------------------------------------------------------------------

constexpr int kLayers = 12;
constexpr int kGrowth = 12;
constexpr int kInChannels = 24;

struct DenseLayer {
  BatchNorm2d norm1, norm2;
  Conv2d conv1, conv2;
  explicit DenseLayer(int in)
      : norm1(in),
        norm2(4 * kGrowth),
        conv1(Conv2dOptions(in, 4 * kGrowth, 1).bias(false)),
        conv2(Conv2dOptions(4 * kGrowth, kGrowth, 3).padding(1).bias(false)) {}

  // bn_function of pytorch-checkpoint's DenseNet example.
  at::Tensor bottleneck(const std::vector<at::Tensor>& features) {
    return conv1(at::relu(norm1(at::cat(features, 1))));
  }

  at::Tensor forward(const std::vector<at::Tensor>& features, bool efficient) {
    at::Tensor b;
    if (efficient) {
      std::vector<at::Tensor> args = features;
      for (const auto& p : norm1->parameters()) args.push_back(p);
      for (const auto& p : conv1->parameters()) args.push_back(p);
      b = checkpoint([this](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{bottleneck(in)}; },
                     static_cast<int64_t>(features.size()), args)[0];
    } else {
      b = bottleneck(features);
    }
    return conv2(at::relu(norm2(b)));
  }

  std::vector<at::Tensor> parameters() const {
    std::vector<at::Tensor> ps;
    for (const auto* m : {static_cast<const torch::nn::Module*>(norm1.get()),
                          static_cast<const torch::nn::Module*>(norm2.get()),
                          static_cast<const torch::nn::Module*>(conv1.get()),
                          static_cast<const torch::nn::Module*>(conv2.get())}) {
      for (const auto& p : m->parameters()) ps.push_back(p);
    }
    return ps;
  }
};

void BM_Dense(benchmark::State& state, bool efficient) {
  at::set_num_threads(1);
  at::manual_seed(0);
  std::vector<DenseLayer> layers;
  for (int i = 0; i < kLayers; ++i) layers.emplace_back(kInChannels + i * kGrowth);
  const at::Tensor x = at::randn({16, kInChannels, 16, 16});
  int64_t peak = 0;
  for (auto _ : state) {
    for (auto& l : layers) {
      for (auto& p : l.parameters()) p.mutable_grad().reset();
    }
    LiveBytes live;
    std::vector<at::Tensor> features = {x};
    for (auto& l : layers) features.push_back(l.forward(features, efficient));
    at::cat(features, 1).sum().backward();
    peak = live.peak();
  }
  state.counters["peak_bytes"] = static_cast<double>(peak);
  state.SetItemsProcessed(state.iterations() * x.size(0));
}

// ---- fixed cost of one checkpoint -------------------------------------------------------

// A segment with almost no work (tanh of a 4 x 8 linear): the time of a checkpointed step
// over the plain one is the bookkeeping (RNG state, nested autograd call, graph check).
void BM_Tiny(benchmark::State& state, bool checkpointed, bool rng) {
  at::set_num_threads(1);
  const at::Tensor w = at::randn({8, 8}).requires_grad_(true);
  const at::Tensor x = at::randn({4, 8}).requires_grad_(true);
  auto f = [&](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{at::tanh(at::linear(in[0], w))}; };
  for (auto _ : state) {
    const at::Tensor y = checkpointed
                             ? checkpoint(f, 1, {x, w}, CheckpointOptions().preserve_rng_state(rng))[0]
                             : f({x})[0];
    y.sum().backward();
  }
}

BENCHMARK_CAPTURE(BM_Tiny, plain, false, false)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Tiny, checkpoint, true, true)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Tiny, checkpoint_no_rng, true, false)->Unit(benchmark::kMicrosecond);

BENCHMARK_CAPTURE(BM_Chain, plain, ChainMode::kPlain)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Chain, each, ChainMode::kEach)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Chain, sqrt, ChainMode::kSqrt)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Chain, plan, ChainMode::kPlan)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Dense, plain, false)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_Dense, efficient, true)->Unit(benchmark::kMillisecond)->UseRealTime();

// ---- batch norm backward -------------------------------------------------------------

void batch_norm_step(benchmark::State& state, bool lean, bool channels_last,
                     at::ScalarType dtype = at::kFloat) {
  at::set_num_threads(1);
  at::manual_seed(0);
  at::Tensor x0 = at::randn({16, 96, 56, 56}).to(dtype);
  if (channels_last) x0 = x0.contiguous(at::MemoryFormat::ChannelsLast);
  const at::Tensor w = (at::rand({96}) + 0.5).requires_grad_();
  const at::Tensor b = at::zeros({96}).requires_grad_();
  const at::Tensor dy = at::ones_like(x0);
  int64_t peak = 0;
  for (auto _ : state) {
    const at::Tensor x = x0.detach().requires_grad_();
    LiveBytes live;
    const at::Tensor y =
        lean ? lean_batch_norm(x, w, b, std::nullopt, std::nullopt, 0.1, 1e-5)
             : at::batch_norm(x, w, b, {}, {}, /*training=*/true, 0.1, 1e-5, false);
    torch::autograd::backward({y * 2}, {dy});
    peak = live.peak();
    benchmark::DoNotOptimize(x.grad().data_ptr());
  }
  state.counters["peak_bytes"] = static_cast<double>(peak);
}

void BM_BatchNorm(benchmark::State& state, bool lean) { batch_norm_step(state, lean, false); }
void BM_BatchNormChannelsLast(benchmark::State& state, bool lean) {
  batch_norm_step(state, lean, true);
}
void BM_BatchNormBfloat16(benchmark::State& state, bool lean) {
  batch_norm_step(state, lean, false, at::kBFloat16);
}

BENCHMARK_CAPTURE(BM_BatchNorm, plain, false)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_BatchNorm, lean, true)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_BatchNormChannelsLast, plain, false)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_BatchNormChannelsLast, lean, true)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_BatchNormBfloat16, plain, false)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_BatchNormBfloat16, lean, true)->Unit(benchmark::kMillisecond)->UseRealTime();

// ---- depthwise convolution backward --------------------------------------------------

void depthwise_step(benchmark::State& state, bool lean, int64_t stride,
                    at::ScalarType dtype = at::kFloat) {
  at::set_num_threads(1);
  at::manual_seed(0);
  const at::Tensor x0 = at::randn({16, 96, 56, 56}).to(dtype);
  const at::Tensor w = at::randn({96, 1, 3, 3}).to(dtype).requires_grad_();
  int64_t peak = 0;
  for (auto _ : state) {
    const at::Tensor x = x0.detach().requires_grad_();
    LiveBytes live;
    const at::Tensor y = lean ? lean_conv2d(x, w, std::nullopt, {stride}, {1}, {1}, 96)
                              : at::conv2d(x, w, {}, {stride}, {1}, {1}, 96);
    torch::autograd::backward({y}, {at::ones_like(y)});
    peak = live.peak();
    benchmark::DoNotOptimize(x.grad().data_ptr());
  }
  state.counters["peak_bytes"] = static_cast<double>(peak);
}

void BM_DepthwiseConv(benchmark::State& state, bool lean) { depthwise_step(state, lean, 1); }
void BM_DepthwiseConvStride2(benchmark::State& state, bool lean) {
  depthwise_step(state, lean, 2);
}
void BM_DepthwiseConvBfloat16(benchmark::State& state, bool lean) {
  depthwise_step(state, lean, 1, at::kBFloat16);
}

BENCHMARK_CAPTURE(BM_DepthwiseConv, plain, false)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_DepthwiseConv, lean, true)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_DepthwiseConvStride2, plain, false)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_DepthwiseConvStride2, lean, true)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_DepthwiseConvBfloat16, plain, false)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_DepthwiseConvBfloat16, lean, true)->Unit(benchmark::kMillisecond)->UseRealTime();

// Prints the usual table, then each variant's step time and peak bytes over those of the
// plain variant of the same model.
class RatioReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const auto& run : runs) {
      // One figure per variant: the run, or with --benchmark_repetitions the median.
      if (run.error_occurred) continue;
      const bool median = run.run_type == Run::RT_Aggregate && run.aggregate_name == "median";
      if (run.run_type != Run::RT_Iteration && !median) continue;
      std::string name = run.run_name.str();
      const std::string suffix = "/real_time";
      if (name.size() > suffix.size() && name.ends_with(suffix)) name.resize(name.size() - suffix.size());
      if (results_.count(name) && !median) continue;
      const auto peak = run.counters.find("peak_bytes");
      const double to_ms = 1e3 / benchmark::GetTimeUnitMultiplier(run.time_unit);
      results_[name] = {run.GetAdjustedRealTime() * to_ms, run.GetAdjustedCPUTime() * to_ms,
                        peak == run.counters.end() ? 0.0 : peak->second.value};
      if (std::find(order_.begin(), order_.end(), name) == order_.end()) order_.push_back(name);
    }
  }

  void PrintRatios() const {
    std::printf("\n%-26s %10s %10s %10s %11s %11s %11s\n", "variant", "real (ms)", "cpu (ms)",
                "peak (MB)", "real ratio", "cpu ratio", "peak ratio");
    for (const auto& name : order_) {
      const auto plain = results_.find(name.substr(0, name.find('/')) + "/plain");
      if (plain == results_.end()) continue;
      const Result& r = results_.at(name);
      const Result& p = plain->second;
      std::printf("%-26s %10.3f %10.3f %10.2f %11.3f %11.3f", name.c_str(), r.real, r.cpu,
                  r.peak / 1e6, r.real / p.real, r.cpu / p.cpu);
      if (p.peak > 0) {
        std::printf(" %11.3f\n", r.peak / p.peak);
      } else {
        std::printf(" %11s\n", "-");
      }
    }
  }

 private:
  struct Result {
    double real, cpu, peak;
  };
  std::map<std::string, Result> results_;
  std::vector<std::string> order_;
};

}  // namespace
}  // namespace memlean

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  memlean::RatioReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.PrintRatios();
  benchmark::Shutdown();
  return 0;
}
