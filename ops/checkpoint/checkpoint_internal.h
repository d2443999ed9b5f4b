// Internal to //ops/checkpoint: the checkpoint that the public forms and
// checkpoint_sequential share.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <vector>

#include "ops/checkpoint/checkpoint.h"

namespace memlean::detail {

// The states of the default generators of some devices (the CPU, CUDA devices).
struct RngState {
  std::vector<at::Device> devices;
  std::vector<at::Tensor> states;

  static RngState capture(const std::vector<at::Device>& devices);
  void restore() const;
};

// The CPU, and every CUDA device that holds one of the tensors.
std::vector<at::Device> rng_devices(at::TensorList tensors);

// checkpoint(function, n_inputs, inputs_and_params, options), where `buffers` are copied
// before the recompute and put back after it.
std::vector<c10::IValue> checkpoint_impl(const IValueFunction& function, int64_t n_inputs,
                                         const std::vector<c10::IValue>& inputs_and_params,
                                         const CheckpointOptions& options,
                                         const std::vector<at::Tensor>& buffers);

}  // namespace memlean::detail
