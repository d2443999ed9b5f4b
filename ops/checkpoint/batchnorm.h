// memlean::BatchNorm2d: torch::nn::BatchNorm2d whose running statistics are updated
// exactly once per training forward, also when a checkpoint recomputes that forward.
//
// A drop-in: the same options (torch::nn::BatchNorm2dOptions), parameters (weight, bias),
// buffers (running_mean, running_var, num_batches_tracked) and so the same state-dict
// keys. It differs from torch's in one case: while a memlean checkpoint recomputes a
// forward in backward (memlean::is_recomputing()), it normalizes with the batch
// statistics as before but leaves running_mean, running_var and num_batches_tracked alone:
// they were updated by the forward that is being recomputed. Everywhere else it behaves as
// torch's does, including a train-mode forward under no_grad (which updates the stats).
#pragma once

#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <ostream>

#include "ops/checkpoint/checkpoint.h"

namespace memlean {

// (Its running statistics are updated by a training forward that does not read them: a
// checkpoint does not copy them for the recompute, NormStatisticsHolder.)
class BatchNorm2dImpl : public torch::nn::BatchNormImplBase<2, BatchNorm2dImpl>,
                        public NormStatisticsHolder {
 public:
  using torch::nn::BatchNormImplBase<2, BatchNorm2dImpl>::BatchNormImplBase;

  at::Tensor forward(const at::Tensor& input);

  void pretty_print(std::ostream& stream) const override;

 protected:
  void _check_input_dim(const at::Tensor& input) override;
};

TORCH_MODULE(BatchNorm2d);

}  // namespace memlean
