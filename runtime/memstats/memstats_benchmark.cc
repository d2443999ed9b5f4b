// google-benchmark of memstats' cost, plain vs counted, in one process:
//   BM_Allocate*: one allocate + free through c10's default CPU allocator vs the counting
//                 allocator (the added ns per allocation; target <= 50 ns).
//   BM_Empty*:    at::empty + free with either allocator installed as the CPU allocator.
//   BM_AllocationOverhead: both interleaved in batches; counter added_ns.
//   BM_MlpStep*:  one training step of an MLP as in the Swish blog post (docs/sources.md)
//                 (data, forward, loss, backward, SGD step) without accounting vs with the
//                 counting allocator, a Tracker and five marks (target <= 3% added);
//                 BM_MlpStepOverhead interleaves them, counter added_pct. (Interleaved
//                 figures resist a busy machine.)
// Run: bazel run -c opt //runtime/memstats:memstats_benchmark -- --benchmark_repetitions=5
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <benchmark/benchmark.h>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "runtime/memstats/internal/cpu_accounting.h"
#include "runtime/memstats/memstats.h"

namespace memlean::memstats {
namespace {

c10::Allocator* plain() { return c10::GetDefaultCPUAllocator(); }
c10::Allocator* counting() {
  static c10::Allocator* a = detail::install();
  return a;
}

// Makes `a` the CPU allocator that at::empty uses.
void use(c10::Allocator* a) {
  counting();
  c10::SetCPUAllocator(a, /*priority=*/255);
}

// The minimum over repetitions is the figure least disturbed by other processes.
double min_of(const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); }

void allocate_free(benchmark::State& state, c10::Allocator* a) {
  const size_t n = static_cast<size_t>(state.range(0));
  for (auto _ : state) {
    c10::DataPtr p = a->allocate(n);
    benchmark::DoNotOptimize(p.get());
  }
  state.SetItemsProcessed(state.iterations());
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(n));
}

void BM_AllocatePlain(benchmark::State& state) { allocate_free(state, plain()); }
void BM_AllocateCounting(benchmark::State& state) { allocate_free(state, counting()); }
BENCHMARK(BM_AllocatePlain)->Arg(64)->Arg(4096)->Arg(256 << 10)->ThreadRange(1, 2)
    ->ComputeStatistics("min", min_of);
BENCHMARK(BM_AllocateCounting)->Arg(64)->Arg(4096)->Arg(256 << 10)->ThreadRange(1, 2)
    ->ComputeStatistics("min", min_of);

// Plain and counting allocations interleaved in batches, so that both see the same machine
// load: counters plain_ns and counting_ns (the fastest batch of each) and added_ns (the
// median over batches of counting - plain).
void BM_AllocationOverhead(benchmark::State& state) {
  const size_t n = static_cast<size_t>(state.range(0));
  constexpr int kBatch = 512;
  auto batch_ns = [&](c10::Allocator* a) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kBatch; ++i) {
      c10::DataPtr p = a->allocate(n);
      benchmark::DoNotOptimize(p.get());
    }
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0)
               .count() / kBatch;
  };
  std::vector<double> plain_ns, counting_ns, added_ns;
  for (auto _ : state) {
    const double p = batch_ns(plain());
    const double c = batch_ns(counting());
    plain_ns.push_back(p);
    counting_ns.push_back(c);
    added_ns.push_back(c - p);
  }
  std::sort(added_ns.begin(), added_ns.end());
  state.counters["plain_ns"] = min_of(plain_ns);
  state.counters["counting_ns"] = min_of(counting_ns);
  state.counters["added_ns"] = added_ns[added_ns.size() / 2];
  state.SetItemsProcessed(state.iterations() * 2 * kBatch);
}
BENCHMARK(BM_AllocationOverhead)->Arg(64)->Arg(4096)->Arg(256 << 10)->MinTime(1.0);

void empty_free(benchmark::State& state, c10::Allocator* a) {
  use(a);
  const int64_t n = state.range(0);
  for (auto _ : state) {
    at::Tensor t = at::empty({n});
    benchmark::DoNotOptimize(t.data_ptr());
  }
  state.SetItemsProcessed(state.iterations());
  state.SetBytesProcessed(state.iterations() * n * 4);
  use(counting());
}

void BM_EmptyPlain(benchmark::State& state) { empty_free(state, plain()); }
void BM_EmptyCounting(benchmark::State& state) { empty_free(state, counting()); }
BENCHMARK(BM_EmptyPlain)->Arg(16)->Arg(1024)->ComputeStatistics("min", min_of);
BENCHMARK(BM_EmptyCounting)->Arg(16)->Arg(1024)->ComputeStatistics("min", min_of);

// The Swish blog post's MLP: D -> H -> H -> C with ReLU, cross entropy, plain SGD; gradients
// persist.
struct Mlp {
  static constexpr int64_t kBatch = 64, kIn = 784, kHidden = 1024, kClasses = 10;
  std::vector<at::Tensor> params;

  Mlp() {
    at::manual_seed(0);
    const int64_t shapes[3][2] = {{kHidden, kIn}, {kHidden, kHidden}, {kClasses, kHidden}};
    for (const auto& s : shapes) {
      params.push_back((at::randn({s[0], s[1]}) * 0.01).set_requires_grad(true));
      params.push_back(at::zeros({s[0]}).set_requires_grad(true));
    }
  }

  void step(Tracker* t) {
    at::Tensor x = at::randn({kBatch, kIn});
    at::Tensor y = at::randint(kClasses, {kBatch}, at::kLong);
    if (t) t->mark("data");
    at::Tensor h = x;
    for (size_t i = 0; i < params.size(); i += 2) {
      h = at::linear(h, params[i], params[i + 1]);
      if (i + 2 < params.size()) h = at::relu(h);
    }
    if (t) t->mark("forw");
    at::Tensor loss = at::cross_entropy_loss(h, y);
    if (t) t->mark("loss");
    loss.backward();
    if (t) t->mark("back");
    {
      at::NoGradGuard no_grad;
      for (auto& p : params) p.sub_(p.grad(), 0.01);
    }
    if (t) t->mark("step");
  }
};

void BM_MlpStepPlain(benchmark::State& state) {
  at::set_num_threads(1);
  use(plain());
  Mlp mlp;
  for (auto _ : state) mlp.step(nullptr);
  use(counting());
}

void BM_MlpStepTracked(benchmark::State& state) {
  at::set_num_threads(1);
  use(counting());
  Mlp mlp;
  Tracker t;
  for (auto _ : state) mlp.step(&t);
  state.counters["peak_MiB"] = static_cast<double>(t.peak()) / (1 << 20);
}

// Plain and tracked steps interleaved (each with its own model, created under its
// allocator): counters plain_us, tracked_us (fastest step of each) and added_pct (median over
// rounds of tracked / plain - 1, in %).
void BM_MlpStepOverhead(benchmark::State& state) {
  at::set_num_threads(1);
  use(plain());
  Mlp plain_mlp;
  use(counting());
  Mlp tracked_mlp;
  Tracker t;
  auto step_us = [](Mlp& mlp, Tracker* tracker) {
    const auto t0 = std::chrono::steady_clock::now();
    mlp.step(tracker);
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
        .count();
  };
  std::vector<double> plain_us, tracked_us, added_pct;
  for (auto _ : state) {
    use(plain());
    const double p = step_us(plain_mlp, nullptr);
    use(counting());
    const double c = step_us(tracked_mlp, &t);
    plain_us.push_back(p);
    tracked_us.push_back(c);
    added_pct.push_back(100.0 * (c / p - 1.0));
  }
  std::sort(added_pct.begin(), added_pct.end());
  state.counters["plain_us"] = min_of(plain_us);
  state.counters["tracked_us"] = min_of(tracked_us);
  state.counters["added_pct"] = added_pct[added_pct.size() / 2];
}

BENCHMARK(BM_MlpStepOverhead)->Unit(benchmark::kMillisecond)->MinTime(3.0);
BENCHMARK(BM_MlpStepPlain)->Unit(benchmark::kMicrosecond)->MinTime(1.0)->ComputeStatistics("min", min_of);
BENCHMARK(BM_MlpStepTracked)->Unit(benchmark::kMicrosecond)->MinTime(1.0)->ComputeStatistics("min", min_of);

}  // namespace
}  // namespace memlean::memstats
