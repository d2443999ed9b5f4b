// checkpoint_sequential and the segment planner: checkpoint a chain of modules in
// segments, with the segments chosen for a memory budget from measured activation sizes.
//
//   auto plan = memlean::plan_segments(memlean::measure_layer_costs(seq, sample));  // √n
//   auto plan = memlean::plan_segments(costs, /*budget_bytes=*/64 << 20);
//   at::Tensor y = memlean::checkpoint_sequential(seq, plan, x);
//
// Each segment but the last is checkpointed: only its input is kept in forward, and its
// activations are recomputed in backward. The last segment runs as usual (its backward
// comes first, so keeping its activations costs no more at the peak than recomputing
// them, and saves one recompute).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "ops/checkpoint/checkpoint.h"

namespace memlean {

// The memory one layer of a chain costs during training.
struct LayerCost {
  // Bytes of the layer's input: what a checkpoint starting at this layer keeps.
  int64_t input_bytes = 0;
  // Bytes that the layer's forward allocates and that stay alive after it (its saved
  // tensors, its output, anything else it keeps), measured with grad mode on.
  int64_t activation_bytes = 0;
};

// Segments of a chain of layers, and the activation memory they are expected to need.
struct SegmentPlan {
  // First layer of each segment: starts[0] == 0, increasing, each < the number of layers.
  std::vector<int64_t> starts;
  // The model below, for this plan: the peak, over the segments j, of
  //   sum_{i < j} input_bytes(segment i) + input_bytes(segment j)
  //     + sum of activation_bytes over the layers of segment j
  // i.e. the inputs kept by the earlier checkpoints plus segment j's activations while it
  // is recomputed (or, for the last, kept). Gradients and temporaries are not counted.
  int64_t estimated_peak_bytes = 0;
  // Whether estimated_peak_bytes <= the budget asked for (true without a budget).
  bool fits_budget = true;

  int64_t num_segments() const { return static_cast<int64_t>(starts.size()); }
};

// The modelled activation peak of the segments starting at `starts` (see SegmentPlan).
int64_t estimate_peak_bytes(const std::vector<LayerCost>& layers,
                            const std::vector<int64_t>& starts);

// Without a budget: round(√n) segments of (nearly) equal numbers of layers, after Chen et
// al. 2016 (the activation memory of n equal layers falls from O(n) to O(√n)).
// With a budget: of the plans whose estimated peak fits in it, the one that recomputes the
// fewest layers (the longest last segment, which is not recomputed), and among those the
// one that keeps the fewest bytes; if none fits, the plan with the lowest estimated peak,
// with fits_budget == false.
SegmentPlan plan_segments(const std::vector<LayerCost>& layers,
                          std::optional<int64_t> budget_bytes = std::nullopt);

// round(√n) equal segments over n layers.
std::vector<int64_t> sqrt_segment_starts(int64_t n_layers);

// `segments` (nearly) equal segments over n layers; segments outside [1, n] is a ValueError
// naming `op` (the C++ and the Python checkpoint_sequential share it).
std::vector<int64_t> equal_segment_starts(int64_t n_layers, int64_t segments,
                                          const char* op = "memlean::checkpoint_sequential");

// Segment starts over n layers: 0 first, then increasing and < n (none when n is 0); else a
// ValueError naming `op`.
void check_segment_starts(const std::vector<int64_t>& starts, int64_t n_layers,
                          const char* op = "memlean::checkpoint_sequential");

// Runs the chain once on `sample` with grad mode on and measures every layer's cost: the
// bytes allocated while the layer ran that are still alive after the chain ran (its saved
// tensors, its output, whatever else it keeps), counted exactly by LiveBytes where it can run
// (not under the profiler: there, from the output sizes alone). The buffers of the chain
// (e.g. running statistics) and the RNG state are left as they were. memlean.
// measure_layer_costs is the same measurement (one implementation) over Python layers.
std::vector<LayerCost> measure_layer_costs(torch::nn::Sequential sequential,
                                           const at::Tensor& sample);

// Runs `sequential` on x in `segments` equal segments, each but the last checkpointed.
// Each layer must take and return one tensor.
at::Tensor checkpoint_sequential(torch::nn::Sequential sequential, int64_t segments,
                                 const at::Tensor& x, const CheckpointOptions& options = {});

// The same with the segments of a plan (SegmentPlan::starts).
at::Tensor checkpoint_sequential(torch::nn::Sequential sequential,
                                 const std::vector<int64_t>& starts, const at::Tensor& x,
                                 const CheckpointOptions& options = {});

at::Tensor checkpoint_sequential(torch::nn::Sequential sequential, const SegmentPlan& plan,
                                 const at::Tensor& x, const CheckpointOptions& options = {});

}  // namespace memlean
