// The choices a model of //experiments/models takes besides its sizes: the activation
// (memlean's Swish variants or torch's SiLU) and what to checkpoint. Light to include (no
// torch::nn headers), for flag parsing.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <string_view>

namespace memlean::models {

// Swish with beta = 1 (= SiLU), computed five ways with the same forward:
//   kNaive            memlean kNaive: x * sigmoid(x) by autograd (saves x and sigmoid(x))
//   kMemoryEfficient  memlean kMemoryEfficient: saves only x
//   kInplace          memlean kInplace: overwrites x, saves one bit per element
//   kSilu             torch's at::silu (torch.nn.SiLU())
//   kSiluInplace      torch's at::silu_ (torch.nn.SiLU(inplace=True): autograd keeps a copy of x)
enum class Activation { kNaive, kMemoryEfficient, kInplace, kSilu, kSiluInplace };

// "naive", "memory_efficient", "inplace", "silu", "silu_inplace"; anything else is an error
// (c10::Error) listing the names.
Activation parse_activation(std::string_view name);
std::string to_string(Activation activation);
// The names above, comma separated.
std::string activation_names();
// activation(x). The in-place kinds overwrite x and return it.
at::Tensor activate(const at::Tensor& x, Activation activation);

// What a model checkpoints (memlean's checkpoint; the activations inside a checkpointed part
// are recomputed in backward instead of kept):
//   none         nothing
//   memlean      the model's own memlean mode: DenseNet-BC's "efficient" bottlenecks
//                (cat -> BatchNorm -> ReLU -> 1x1 conv of every dense layer, as in
//                pytorch-checkpoint, docs/sources.md); for the MLP its hidden layer; for
//                EfficientNet-B0 round(sqrt(n)) segments of its n stages (Chen et al. 2016)
//   segments:K   the model's chain of stages cut into K (nearly) equal segments, each but
//                the last checkpointed (memlean::checkpoint_sequential); 1 <= K <= stages
struct Checkpointing {
  enum class Kind { kNone, kMemlean, kSegments };
  Kind kind = Kind::kNone;
  int64_t segments = 0;  // for kSegments

  static Checkpointing none() { return {}; }
  static Checkpointing memlean() { return {Kind::kMemlean, 0}; }
  static Checkpointing segments_of(int64_t k) { return {Kind::kSegments, k}; }
  bool operator==(const Checkpointing&) const = default;
};

// "none", "memlean", "segments:K" (K a positive integer); anything else is an error.
Checkpointing parse_checkpointing(std::string_view text);
std::string to_string(const Checkpointing& checkpointing);

}  // namespace memlean::models
