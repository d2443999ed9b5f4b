// google-benchmark of the Swish variants against ATen's silu, the naive composition and a
// plain copy (x.clone(), the bandwidth reference), float32 at 1M, 16M and 64M elements, as
// [N, 64, 32, 32] tensors of N(0, 9) values (so the in-place backward's costlier branches all
// run; a second, smaller table repeats in-place vs silu on N(0, 1) values), in the
// contiguous and the channels_last layout, on the CPU and on
// CUDA (the CUDA cases are skipped without a GPU; each iteration there ends with a device
// synchronize, so real time is the kernels' time). Phases: fwd (kernels, no autograd), bwd
// (kernels; the naive one through autograd, as it runs in training), both (forward +
// backward through autograd). After the runs, a table of time ratios against at::silu and
// the naive composition, and bytes/s against clone (medians when run with
// --benchmark_repetitions=N).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <benchmark/benchmark.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "ops/swish/swish.h"
#include "third_party/torch/devices.h"

namespace {

constexpr int64_t kSizes[] = {1 << 20, 16 << 20, 64 << 20};
constexpr int64_t kImage = 64 * 32 * 32;  // C x H x W of every input; N = elements / kImage
constexpr const char* kLayouts[] = {"contiguous", "channels_last"};
constexpr const char* kDevices[] = {"cpu", "cuda"};

// The benchmark's case: state.range(0) elements, range(1) the layout, range(2) the device.
bool on_cuda(const benchmark::State& state) { return state.range(2) == 1; }

// Waits for the device's queued kernels (nothing to wait for on the CPU).
void sync(const benchmark::State& state) {
  if (on_cuda(state)) c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->synchronizeDevice(0);
}

// False (and the case marked skipped) when it is a CUDA case and there is no GPU.
bool runnable(benchmark::State& state) {
  if (on_cuda(state) && !memlean::have_cuda_device()) {
    state.SkipWithError("no GPU: CUDA case skipped");
    return false;
  }
  return true;
}

at::Tensor with_mask(at::Tensor& x) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("memlean::_swish_inplace_with_mask", "")
                             .typed<at::Tensor(at::Tensor&, double)>();
  return op.call(x, 1.0);
}

at::Tensor inplace_backward(const at::Tensor& g, const at::Tensor& y, const at::Tensor& mask) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("memlean::_swish_inplace_backward", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return op.call(g, y, mask, 1.0);
}

// N(0, scale^2) inputs. The default, 3, puts many elements in the in-place backward's tails
// (its costliest branches); 1 is closer to activations after a normalization.
at::Tensor input(const benchmark::State& state, double scale = 3) {
  at::manual_seed(0);
  at::Tensor x = at::randn({state.range(0) / kImage, 64, 32, 32}) * scale;
  if (state.range(1) == 1) x = x.contiguous(at::MemoryFormat::ChannelsLast);
  return on_cuda(state) ? x.to(at::kCUDA) : x;
}

void set_bytes(benchmark::State& state, int64_t bytes_per_element) {
  state.SetBytesProcessed(state.iterations() * state.range(0) * bytes_per_element);
}

// ---- forward kernels: read x, write y (8 bytes per element) ----
void BM_fwd_silu(benchmark::State& state) {
  if (!runnable(state)) return;
  const at::Tensor x = input(state);
  for (auto _ : state) {
    benchmark::DoNotOptimize(at::silu(x));
    sync(state);
  }
  set_bytes(state, 8);
}
void BM_fwd_naive(benchmark::State& state) {
  if (!runnable(state)) return;
  const at::Tensor x = input(state);
  for (auto _ : state) {
    benchmark::DoNotOptimize(x * at::sigmoid(x));
    sync(state);
  }
  set_bytes(state, 8);
}
void BM_fwd_memory_efficient(benchmark::State& state) {
  if (!runnable(state)) return;
  const at::Tensor x = input(state);
  for (auto _ : state) {
    benchmark::DoNotOptimize(memlean::swish_forward(x));
    sync(state);
  }
  set_bytes(state, 8);
}
void BM_fwd_inplace(benchmark::State& state) {
  if (!runnable(state)) return;
  const at::Tensor src = input(state);
  at::Tensor x = src.clone();
  for (auto _ : state) {
    state.PauseTiming();
    x.copy_(src);  // repeated in-place application would drift towards denormals
    sync(state);
    state.ResumeTiming();
    benchmark::DoNotOptimize(with_mask(x));
    sync(state);
  }
  set_bytes(state, 8);
}
void BM_clone(benchmark::State& state) {
  if (!runnable(state)) return;
  const at::Tensor x = input(state);
  for (auto _ : state) {
    benchmark::DoNotOptimize(x.clone());
    sync(state);
  }
  set_bytes(state, 8);
}

// ---- backward: read grad and x (or y), write grad_x (12 bytes per element) ----
void BM_bwd_silu_at(benchmark::State& state, double scale) {
  if (!runnable(state)) return;
  const at::Tensor x = input(state, scale), g = at::randn_like(x);
  for (auto _ : state) {
    benchmark::DoNotOptimize(at::silu_backward(g, x));
    sync(state);
  }
  set_bytes(state, 12);
}
void BM_bwd_naive(benchmark::State& state) {
  if (!runnable(state)) return;
  const at::Tensor x0 = input(state), g = at::randn_like(x0);
  const at::Tensor x = x0.clone().set_requires_grad(true);
  for (auto _ : state) {
    state.PauseTiming();
    x.mutable_grad() = at::Tensor();
    at::Tensor y = x * at::sigmoid(x);
    sync(state);
    state.ResumeTiming();
    y.backward(g);
    sync(state);
  }
  set_bytes(state, 12);
}
void BM_bwd_memory_efficient(benchmark::State& state) {
  if (!runnable(state)) return;
  const at::Tensor x = input(state), g = at::randn_like(x);
  for (auto _ : state) {
    benchmark::DoNotOptimize(memlean::swish_backward(g, x));
    sync(state);
  }
  set_bytes(state, 12);
}
void BM_bwd_inplace_at(benchmark::State& state, double scale) {
  if (!runnable(state)) return;
  at::Tensor y = input(state, scale);
  const at::Tensor g = at::randn_like(y);
  const at::Tensor mask = with_mask(y);
  for (auto _ : state) {
    benchmark::DoNotOptimize(inplace_backward(g, y, mask));
    sync(state);
  }
  set_bytes(state, 12);
}

// ---- forward + backward through autograd (20 bytes per element) ----
template <typename F>
void both(benchmark::State& state, F f, bool needs_non_leaf, double scale = 3) {
  if (!runnable(state)) return;
  const at::Tensor x0 = input(state, scale), g = at::randn_like(x0);
  const at::Tensor leaf = x0.clone().set_requires_grad(true);
  for (auto _ : state) {
    state.PauseTiming();
    leaf.mutable_grad() = at::Tensor();
    at::Tensor x = needs_non_leaf ? leaf.clone() : leaf;
    sync(state);
    state.ResumeTiming();
    f(x).backward(g);
    sync(state);
  }
  set_bytes(state, 20);
}
void BM_both_silu_at(benchmark::State& s, double scale) {
  both(s, [](const at::Tensor& x) { return at::silu(x); }, false, scale);
}
void BM_both_naive(benchmark::State& s) {
  both(s, [](const at::Tensor& x) { return x * at::sigmoid(x); }, false);
}
void BM_both_memory_efficient(benchmark::State& s) {
  both(s, [](const at::Tensor& x) { return memlean::swish(x); }, false);
}
void BM_both_inplace_at(benchmark::State& s, double scale) {
  both(s, [](const at::Tensor& x) { return memlean::swish(x, 1.0, memlean::SwishVariant::kInplace); }, true, scale);
}
void BM_bwd_silu(benchmark::State& s) { BM_bwd_silu_at(s, 3); }
void BM_bwd_inplace(benchmark::State& s) { BM_bwd_inplace_at(s, 3); }
void BM_both_silu(benchmark::State& s) { BM_both_silu_at(s, 3); }
void BM_both_inplace(benchmark::State& s) { BM_both_inplace_at(s, 3); }

void sizes(benchmark::internal::Benchmark* b) {
  for (int64_t device : {0, 1}) {
    for (int64_t layout : {0, 1}) {
      for (int64_t n : kSizes) b->Args({n, layout, device});
    }
  }
  b->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(0.3);
}

BENCHMARK(BM_clone)->Apply(sizes);
BENCHMARK(BM_fwd_silu)->Apply(sizes);
BENCHMARK(BM_fwd_naive)->Apply(sizes);
BENCHMARK(BM_fwd_memory_efficient)->Apply(sizes);
BENCHMARK(BM_fwd_inplace)->Apply(sizes);
BENCHMARK(BM_bwd_silu)->Apply(sizes);
BENCHMARK(BM_bwd_naive)->Apply(sizes);
BENCHMARK(BM_bwd_memory_efficient)->Apply(sizes);
BENCHMARK(BM_bwd_inplace)->Apply(sizes);
BENCHMARK(BM_both_silu)->Apply(sizes);
BENCHMARK(BM_both_naive)->Apply(sizes);
BENCHMARK(BM_both_memory_efficient)->Apply(sizes);
BENCHMARK(BM_both_inplace)->Apply(sizes);

// The in-place variant against silu on N(0, 1) inputs: contiguous, 16M and 64M elements.
void unit_sizes(benchmark::internal::Benchmark* b) {
  for (int64_t device : {0, 1}) {
    for (int64_t n : {kSizes[1], kSizes[2]}) b->Args({n, 0, device});
  }
  b->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(0.3);
}
BENCHMARK_CAPTURE(BM_bwd_silu_at, unit, 1.0)->Apply(unit_sizes);
BENCHMARK_CAPTURE(BM_bwd_inplace_at, unit, 1.0)->Apply(unit_sizes);
BENCHMARK_CAPTURE(BM_both_silu_at, unit, 1.0)->Apply(unit_sizes);
BENCHMARK_CAPTURE(BM_both_inplace_at, unit, 1.0)->Apply(unit_sizes);

// Keeps the median (over --benchmark_repetitions) time per iteration and bytes/s of each
// benchmark, keyed by its name.
class Collector : public benchmark::ConsoleReporter {
 public:
  struct Result {
    double seconds;
    double bytes_per_second;
  };
  std::map<std::string, std::vector<Result>> runs_by_name;

  void ReportRuns(const std::vector<Run>& runs) override {
    for (const Run& r : runs) {
      if (r.run_type != Run::RT_Iteration || r.error_occurred) continue;
      const auto bps = r.counters.find("bytes_per_second");
      runs_by_name[r.benchmark_name()].push_back(
          {r.GetAdjustedRealTime(), bps == r.counters.end() ? 0.0 : double(bps->second)});
    }
    ConsoleReporter::ReportRuns(runs);
  }

  const Result* median(const std::string& name) {
    auto it = runs_by_name.find(name);
    if (it == runs_by_name.end() || it->second.empty()) return nullptr;
    auto& v = it->second;
    std::sort(v.begin(), v.end(), [](const Result& a, const Result& b) { return a.seconds < b.seconds; });
    return &v[v.size() / 2];
  }
};

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  Collector collector;
  benchmark::RunSpecifiedBenchmarks(&collector);

  const auto get = [&](const std::string& name) { return collector.median(name); };
  std::printf("\nSpeed-up of each variant (time of the reference / time of the variant), at::"
              "get_num_threads()=%d\n",
              at::get_num_threads());
  std::printf("%-5s %-14s %-6s %-10s %-18s %10s %10s %14s\n", "dev", "layout", "phase",
              "elements", "variant", "vs silu", "vs naive", "GB/s (clone)");
  for (int device : {0, 1}) {
    for (int layout : {0, 1}) {
      for (const char* phase : {"fwd", "bwd", "both"}) {
        for (int64_t n : kSizes) {
          const std::string suffix = "/" + std::to_string(n) + "/" + std::to_string(layout) + "/" +
                                     std::to_string(device) + "/min_time:0.300/real_time";
          const auto* silu = get(std::string("BM_") + phase + "_silu" + suffix);
          const auto* naive = get(std::string("BM_") + phase + "_naive" + suffix);
          const auto* clone = get("BM_clone" + suffix);
          for (const char* v : {"memory_efficient", "inplace"}) {
            const auto* r = get(std::string("BM_") + phase + "_" + v + suffix);
            if (!r || !silu || !naive || !clone) continue;
            std::printf("%-5s %-14s %-6s %-10lld %-18s %9.2fx %9.2fx %7.1f (%.1f)\n",
                        kDevices[device], kLayouts[layout], phase, static_cast<long long>(n), v,
                        silu->seconds / r->seconds, naive->seconds / r->seconds,
                        r->bytes_per_second / 1e9, clone->bytes_per_second / 1e9);
          }
        }
      }
    }
  }
  std::printf("\nN(0, 1) inputs (the table above: N(0, 9)), contiguous: in-place vs silu\n");
  std::printf("%-5s %-6s %-10s %10s\n", "dev", "phase", "elements", "vs silu");
  for (int device : {0, 1}) {
    for (const char* phase : {"bwd", "both"}) {
      for (int64_t n : {kSizes[1], kSizes[2]}) {
        const std::string suffix = "/unit/" + std::to_string(n) + "/0/" + std::to_string(device) +
                                   "/min_time:0.300/real_time";
        const auto* silu = get(std::string("BM_") + phase + "_silu_at" + suffix);
        const auto* r = get(std::string("BM_") + phase + "_inplace_at" + suffix);
        if (!r || !silu) continue;
        std::printf("%-5s %-6s %-10lld %9.2fx\n", kDevices[device], phase,
                    static_cast<long long>(n), silu->seconds / r->seconds);
      }
    }
  }
  benchmark::Shutdown();
  return 0;
}
