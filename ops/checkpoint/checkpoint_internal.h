// Internal to //ops/checkpoint: the checkpoint that the public forms and
// checkpoint_sequential share.
#pragma once

#include <ATen/core/MT19937RNGEngine.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ops/checkpoint/checkpoint.h"

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

inline constexpr const char* kCheckpointName = "memlean::checkpoint";

// A segment as checkpoint_impl runs it. The C++ forms set the function (and a module's
// buffers); the Python checkpoint (memlean._C.checkpoint) also names itself in errors and
// may ask for a full backward.
struct Segment {
  IValueFunction function;
  // Copied before the recompute and put back after it (a module's buffers).
  std::vector<at::Tensor> buffers;
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

// The checkpoint every form runs: segment.function(inputs_and_params[0, n_inputs)),
// recomputed in backward (see checkpoint.h).
std::vector<c10::IValue> checkpoint_impl(Segment segment, int64_t n_inputs,
                                         const std::vector<c10::IValue>& inputs_and_params,
                                         const CheckpointOptions& options);

}  // namespace memlean::detail
