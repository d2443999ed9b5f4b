// Internal to //ops/checkpoint (and its Python binding, ops/checkpoint/python/): the
// checkpoint that the public forms and checkpoint_sequential share.
#pragma once

#include <ATen/core/MT19937RNGEngine.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ops/checkpoint/checkpoint.h"
#include "ops/checkpoint/sequential.h"

namespace memlean::detail {

// The states of the default generators of some devices (the CPU, CUDA devices).
// The CPU's is its engine and cached normal samples, copied as they are (no state tensor to
// make and parse: this runs three times per checkpoint call); a CUDA device's is its state
// tensor.
struct RngState {
  std::vector<at::Device> devices;
  std::vector<at::Tensor> states;  // per device; undefined for the CPU
  at::mt19937 cpu_engine;
  std::optional<float> cpu_next_float_normal;
  std::optional<double> cpu_next_double_normal;

  static RngState capture(const std::vector<at::Device>& devices);
  void restore() const;
};

// The CPU, and every CUDA device that holds one of the tensors.
std::vector<at::Device> rng_devices(at::TensorList tensors);

// Copies the buffers on construction and puts the copies back on destruction, so that a
// module that updates a buffer in forward (torch's BatchNorm2d) is not updated by a recompute
// or a measurement. The copies go back without bumping the buffers' version counters (like
// the in-kernel updates of batch norm's running statistics, which do not bump them either),
// so that graphs that saved a buffer stay valid.
class BufferRestore {
 public:
  explicit BufferRestore(const std::vector<at::Tensor>& buffers) : buffers_(buffers) {
    at::NoGradGuard no_grad;
    copies_.reserve(buffers_.size());
    for (const auto& b : buffers_) copies_.push_back(b.clone());
  }
  ~BufferRestore() {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i].variable_data().copy_(copies_[i]);
  }
  BufferRestore(const BufferRestore&) = delete;
  BufferRestore& operator=(const BufferRestore&) = delete;

 private:
  const std::vector<at::Tensor>& buffers_;
  std::vector<at::Tensor> copies_;
};

// One layer of a chain: layer(i, h) runs layer i on h and returns its output.
using ChainLayer = std::function<at::Tensor(int64_t, const at::Tensor&)>;

// measure_layer_costs for any chain of n_layers layers: the public form runs a
// torch::nn::Sequential, the Python one (memlean.measure_layer_costs) Python callables. One
// specification: per layer, its input's storage bytes, and the bytes allocated while it ran
// that are still alive after the whole chain ran (LiveBytes: exact; its output's storage
// bytes alone where LiveBytes cannot run, e.g. under the profiler). `buffers` and the RNG
// states of the CPU and the sample's device are left as they were. Errors name `op`.
std::vector<LayerCost> measure_chain_costs(int64_t n_layers, const ChainLayer& layer,
                                           const std::vector<at::Tensor>& buffers,
                                           const at::Tensor& sample, const char* op);

inline constexpr const char* kCheckpointName = "memlean::checkpoint";

// A chain of layers as checkpoint_sequential runs it: the public form over a
// torch::nn::Sequential, the Python one (memlean.checkpoint_sequential) over Python layers.
// One loop (checkpoint_chain) for both, so they cannot drift.
struct Chain {
  // layer(i, h): layer i's output on h.
  ChainLayer layer;
  // Per layer, the parameters its forward uses and the buffers to put back after a
  // recompute (one entry per layer; a tensor shared by layers is listed once per segment).
  std::vector<std::vector<at::Tensor>> parameters;
  std::vector<std::vector<at::Tensor>> buffers;
  // Per layer (or empty: none), those of its buffers a recompute rewinds (Segment::rewound).
  std::vector<std::vector<at::Tensor>> rewound;
  // How errors name the call, and the remedy for a tensor requiring grad that a layer uses
  // but is not among the parameters.
  std::string name = "memlean::checkpoint_sequential";
  std::string how_to_list =
      "Make it a parameter of a module of the chain (torch::nn::Module::register_parameter).";
  // Optional; asked after the forward of the segment [begin, end): true when its layers
  // gathered leaves of their own (FSDP2), see Segment::backward_in_full.
  std::function<bool(int64_t begin, int64_t end)> backward_in_full;

  int64_t size() const { return static_cast<int64_t>(parameters.size()); }
};

// checkpoint_sequential's loop: the chain run on x in the segments starting at `starts`
// (checked: check_segment_starts), each but the last a checkpoint_impl segment whose
// parameters and buffers are those of its layers, each tensor once. The segments' nodes
// share the chain until their backward.
at::Tensor checkpoint_chain(const std::shared_ptr<const Chain>& chain,
                            const std::vector<int64_t>& starts, const at::Tensor& x,
                            const CheckpointOptions& options);

// A segment as checkpoint_impl runs it. The C++ forms set the function (and a module's
// buffers); the Python checkpoint (memlean._C.checkpoint) also names itself in errors and
// may ask for a full backward.
struct Segment {
  IValueFunction function;
  // Copied before the recompute and put back after it (a module's buffers).
  std::vector<at::Tensor> buffers;
  // Those of `buffers` whose values at the forward's start the recompute begins from where the
  // forward changed them (a spectral norm's power-iteration vectors, a QAT observer's
  // statistics: the forward reads what it updates, so a recompute from the updated values
  // would compute another function, and gradients for it). Not BatchNorm statistics: a
  // training forward updates them without reading them (nothing to keep).
  std::vector<at::Tensor> rewound;
  // How errors name the checkpoint, and the remedy they give for a tensor requiring grad
  // that the function uses but the checkpoint was not given.
  std::string name = kCheckpointName;
  std::string how_to_list =
      "Pass it among the parameters, after the n_inputs inputs (a module's parameters: "
      "module->parameters()).";
  // Asked once, after the forward. True when the function gathered leaves of its own that
  // its recompute's backward must accumulate into (FSDP2's unsharded parameters): the
  // backward then runs the recomputed graph's backward in full, and returns the inputs'
  // gradients only.
  std::function<bool()> backward_in_full;
};

// Whether `now` holds what `then` held: the same sizes, dtype, layout and device, every element
// equal, a NaN equal to a NaN (sparse tensors compared densely). On the CPU it allocates
// nothing where they are equal without NaNs; on CUDA it waits for the device (one
// synchronisation). How a checkpoint sees a buffer changed through `.data`, and
// unversioned_changes.
bool same_values(const at::Tensor& now, const at::Tensor& then);

// Of `buffers` (module's), those a checkpoint of `module` rewinds for the recompute
// (Segment::rewound): all but the statistics of its torch::nn BatchNorm{1,2,3}d and
// InstanceNorm{1,2,3}d and memlean::BatchNorm2d layers and of NormStatisticsHolder modules,
// which their training forward updates without reading.
std::vector<at::Tensor> rewound_buffers(const torch::nn::Module& module,
                                        const std::vector<at::Tensor>& buffers);

// The checkpoint every form runs: segment.function(inputs_and_params[0, n_inputs)),
// recomputed in backward (see checkpoint.h).
std::vector<c10::IValue> checkpoint_impl(Segment segment, int64_t n_inputs,
                                         const std::vector<c10::IValue>& inputs_and_params,
                                         const CheckpointOptions& options);

}  // namespace memlean::detail
