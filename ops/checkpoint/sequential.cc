// checkpoint_sequential, the segment planner and the layer-cost measurement.
#include "ops/checkpoint/sequential.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>

#include "ops/checkpoint/internal/checkpoint.h"
#include "runtime/memstats/live_bytes.h"
#include "third_party/torch/tensors.h"

namespace memlean {
namespace {

constexpr int64_t kInf = std::numeric_limits<int64_t>::max();

void check_layers(const std::vector<LayerCost>& layers) {
  // Every sum the planner forms (bytes kept + a segment's input and activations) is at most
  // the sum of all costs: if that fits in int64, nothing overflows.
  int64_t total = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    TORCH_CHECK(layers[i].input_bytes >= 0 && layers[i].activation_bytes >= 0,
                "memlean::plan_segments: layer ", i, " has a negative cost (input_bytes=",
                layers[i].input_bytes, ", activation_bytes=", layers[i].activation_bytes, ")");
    TORCH_CHECK(!__builtin_add_overflow(total, layers[i].input_bytes, &total) &&
                    !__builtin_add_overflow(total, layers[i].activation_bytes, &total),
                "memlean::plan_segments: the layer costs add up to more than 2^63 - 1 bytes "
                "(at layer ", i, ": input_bytes=", layers[i].input_bytes, ", activation_bytes=",
                layers[i].activation_bytes, "); the estimates would overflow");
  }
}

// Prefix sums of activation bytes: act[i] = sum of activation_bytes of layers [0, i).
std::vector<int64_t> prefix_activations(const std::vector<LayerCost>& layers) {
  std::vector<int64_t> act(layers.size() + 1, 0);
  for (size_t i = 0; i < layers.size(); ++i) act[i + 1] = act[i] + layers[i].activation_bytes;
  return act;
}

// The best plan whose estimated peak is <= budget: the last segment starts at the lowest
// layer possible, and the earlier segments keep the fewest bytes. Empty if none fits.
std::vector<int64_t> plan_within(const std::vector<LayerCost>& layers,
                                 const std::vector<int64_t>& act, int64_t budget) {
  const auto n = static_cast<int64_t>(layers.size());
  auto segment = [&](int64_t s, int64_t e) { return layers[s].input_bytes + act[e] - act[s]; };
  // kept[i]: the fewest bytes that checkpoints covering layers [0, i) keep, each segment
  // fitting the budget on top of the bytes kept before it.
  std::vector<int64_t> kept(n + 1, kInf), parent(n + 1, -1);
  kept[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (kept[i] == kInf) continue;
    if (kept[i] + segment(i, n) <= budget) {
      std::vector<int64_t> starts = {i};
      for (int64_t b = i; b > 0; b = parent[b]) starts.push_back(parent[b]);
      std::reverse(starts.begin(), starts.end());
      return starts;
    }
    const int64_t after = kept[i] + layers[i].input_bytes;
    for (int64_t m = i + 1; m < n && kept[i] + segment(i, m) <= budget; ++m) {
      if (after < kept[m]) {
        kept[m] = after;
        parent[m] = i;
      }
    }
  }
  return {};
}

}  // namespace

int64_t estimate_peak_bytes(const std::vector<LayerCost>& layers,
                            const std::vector<int64_t>& starts) {
  check_layers(layers);
  const auto n = static_cast<int64_t>(layers.size());
  check_segment_starts(starts, n, "memlean::estimate_peak_bytes");
  const auto act = prefix_activations(layers);
  int64_t kept = 0, peak = 0;
  for (size_t j = 0; j < starts.size(); ++j) {
    const int64_t s = starts[j];
    const int64_t e = j + 1 < starts.size() ? starts[j + 1] : n;
    peak = std::max(peak, kept + layers[s].input_bytes + act[e] - act[s]);
    kept += layers[s].input_bytes;
  }
  return peak;
}

void check_segment_starts(const std::vector<int64_t>& starts, int64_t n, const char* op) {
  if (n == 0) {
    TORCH_CHECK_VALUE(starts.empty(), op, ": there are no layers, so there can be no segments");
    return;
  }
  TORCH_CHECK_VALUE(!starts.empty() && starts[0] == 0, op,
                    ": the first segment must start at layer 0 (starts=", starts, ")");
  for (size_t j = 1; j < starts.size(); ++j) {
    TORCH_CHECK_VALUE(starts[j] > starts[j - 1] && starts[j] < n, op,
                      ": segment starts must increase and be < the number of layers (", n,
                      "), got ", starts);
  }
}

std::vector<int64_t> equal_segment_starts(int64_t n_layers, int64_t segments, const char* op) {
  TORCH_CHECK_VALUE(n_layers >= 0, op, ": the number of layers must be >= 0, got ", n_layers);
  if (n_layers == 0) return {};
  TORCH_CHECK_VALUE(segments >= 1 && segments <= n_layers, op, ": segments must be between 1 ",
                    "and the number of layers (", n_layers, "), got ", segments);
  std::vector<int64_t> starts;
  for (int64_t j = 0; j < segments; ++j) starts.push_back(j * n_layers / segments);
  return starts;
}

std::vector<int64_t> sqrt_segment_starts(int64_t n_layers) {
  if (n_layers <= 0) return {};
  const auto k = std::max<int64_t>(1, std::llround(std::sqrt(static_cast<double>(n_layers))));
  return equal_segment_starts(n_layers, std::min(k, n_layers));
}

SegmentPlan plan_segments(const std::vector<LayerCost>& layers, std::optional<int64_t> budget_bytes) {
  check_layers(layers);
  SegmentPlan plan;
  const auto n = static_cast<int64_t>(layers.size());
  if (!budget_bytes.has_value()) {
    plan.starts = sqrt_segment_starts(n);
    plan.estimated_peak_bytes = estimate_peak_bytes(layers, plan.starts);
    return plan;
  }
  TORCH_CHECK(*budget_bytes >= 0, "memlean::plan_segments: budget_bytes must be >= 0, got ",
              *budget_bytes);
  if (n == 0) return plan;
  const auto act = prefix_activations(layers);
  plan.starts = plan_within(layers, act, *budget_bytes);
  if (plan.starts.empty()) {
    // Nothing fits: the lowest budget that something fits in. One segment always fits in
    // its own peak, and fitting is monotone in the budget.
    int64_t lo = 0, hi = layers[0].input_bytes + act[n];
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (plan_within(layers, act, mid).empty()) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    plan.starts = plan_within(layers, act, lo);
    plan.fits_budget = false;
  }
  plan.estimated_peak_bytes = estimate_peak_bytes(layers, plan.starts);
  return plan;
}

namespace {

int64_t storage_bytes(const at::Tensor& t) {
  if (!t.defined()) return 0;
  if (t.has_storage()) return static_cast<int64_t>(t.storage().nbytes());
  return static_cast<int64_t>(t.nbytes());
}

}  // namespace

namespace detail {

std::vector<LayerCost> measure_chain_costs(int64_t n_layers, const ChainLayer& layer,
                                           const std::vector<at::Tensor>& buffers,
                                           const at::Tensor& sample, const char* op) {
  TORCH_CHECK(sample.defined(), op, ": sample is an undefined tensor");
  TORCH_CHECK(n_layers >= 0, op, ": n_layers must be >= 0, got ", n_layers);
  // Leave the chain and the RNG as they were: measuring is not a training step.
  BufferRestore kept(buffers);
  const auto rng = RngState::capture(rng_devices({sample}));

  std::vector<LayerCost> costs;
  {
    at::AutoGradMode grad_mode(true);
    std::unique_ptr<LiveBytes> live;
    if (LiveBytes::available()) live = std::make_unique<LiveBytes>();
    std::vector<at::Tensor> outputs;  // keeps every layer's graph alive until the end
    at::Tensor h = sample;
    for (int64_t i = 0; i < n_layers; ++i) {
      LayerCost cost;
      cost.input_bytes = storage_bytes(h);
      const int64_t before = live ? live->live() : 0;
      at::Tensor out = layer(i, h);
      TORCH_CHECK(out.defined(), op, ": layer ", i, " returned an undefined tensor");
      cost.activation_bytes = live ? live->live() - before : storage_bytes(out);
      costs.push_back(cost);
      outputs.push_back(out);
      h = std::move(out);
    }
  }
  rng.restore();
  return costs;
}

}  // namespace detail

std::vector<LayerCost> measure_layer_costs(torch::nn::Sequential sequential,
                                           const at::Tensor& sample) {
  std::vector<at::Tensor> buffers;
  for (const auto& b : sequential->buffers()) {
    if (b.defined()) buffers.push_back(b);
  }
  return detail::measure_chain_costs(
      static_cast<int64_t>(sequential->size()),
      [&](int64_t i, const at::Tensor& h) { return sequential->begin()[i].forward(h); },
      buffers, sample, "memlean::measure_layer_costs");
}

namespace detail {

at::Tensor checkpoint_chain(const std::shared_ptr<const Chain>& chain,
                            const std::vector<int64_t>& starts, const at::Tensor& x,
                            const CheckpointOptions& options) {
  const int64_t n = chain->size();
  TORCH_INTERNAL_ASSERT(static_cast<int64_t>(chain->buffers.size()) == n,
                        "memlean: a chain with ", n, " parameter lists but ",
                        chain->buffers.size(), " buffer lists");
  check_segment_starts(starts, n, chain->name.c_str());
  auto run = [](const Chain& c, int64_t begin, int64_t end, at::Tensor h) {
    for (int64_t i = begin; i < end; ++i) h = c.layer(i, h);
    return h;
  };
  at::Tensor h = x;
  for (size_t j = 0; j < starts.size(); ++j) {
    const int64_t s = starts[j];
    const int64_t e = j + 1 < starts.size() ? starts[j + 1] : n;
    if (j + 1 == starts.size()) return run(*chain, s, e, h);

    Segment segment;
    // The segment's parameters and buffers, each once (layers may share them).
    std::vector<at::Tensor> params;
    for (int64_t i = s; i < e; ++i) {
      params.insert(params.end(), chain->parameters[i].begin(), chain->parameters[i].end());
      segment.buffers.insert(segment.buffers.end(), chain->buffers[i].begin(),
                             chain->buffers[i].end());
      if (!chain->rewound.empty()) {
        segment.rewound.insert(segment.rewound.end(), chain->rewound[i].begin(),
                               chain->rewound[i].end());
      }
    }
    std::vector<c10::IValue> args = {h};
    for (const auto& p : unique_tensors(params)) args.emplace_back(p);
    segment.buffers = unique_tensors(segment.buffers);
    segment.rewound = unique_tensors(segment.rewound);
    segment.function = [chain, s, e, run](const std::vector<c10::IValue>& in) {
      return std::vector<c10::IValue>{run(*chain, s, e, in[0].toTensor())};
    };
    segment.name = chain->name;
    segment.how_to_list = chain->how_to_list;
    if (chain->backward_in_full) {
      segment.backward_in_full = [chain, s, e] { return chain->backward_in_full(s, e); };
    }
    h = checkpoint_impl(std::move(segment), 1, args, options)[0].toTensor();
  }
  return h;  // no layers
}

}  // namespace detail

at::Tensor checkpoint_sequential(torch::nn::Sequential sequential,
                                 const std::vector<int64_t>& starts, const at::Tensor& x,
                                 const CheckpointOptions& options) {
  auto chain = std::make_shared<detail::Chain>();
  const auto n = static_cast<int64_t>(sequential->size());
  chain->parameters.reserve(n);
  chain->buffers.reserve(n);
  chain->rewound.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    const auto module = sequential->ptr(i);
    chain->parameters.push_back(module->parameters());
    chain->buffers.push_back(module->buffers());
    chain->rewound.push_back(detail::rewound_buffers(*module, chain->buffers.back()));
  }
  chain->layer = [sequential](int64_t i, const at::Tensor& h) mutable {
    return sequential->begin()[i].forward(h);
  };
  return detail::checkpoint_chain(chain, starts, x, options);
}

at::Tensor checkpoint_sequential(torch::nn::Sequential sequential, int64_t segments,
                                 const at::Tensor& x, const CheckpointOptions& options) {
  const auto n = static_cast<int64_t>(sequential->size());
  return checkpoint_sequential(sequential, equal_segment_starts(n, segments), x, options);
}

at::Tensor checkpoint_sequential(torch::nn::Sequential sequential, const SegmentPlan& plan,
                                 const at::Tensor& x, const CheckpointOptions& options) {
  return checkpoint_sequential(sequential, plan.starts, x, options);
}

}  // namespace memlean
