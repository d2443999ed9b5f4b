// memlean::BatchNorm2d: torch's BatchNorm2d forward, minus the second update of the
// running statistics when a checkpoint recomputes it.
#include "ops/checkpoint/batchnorm.h"

#include <ATen/ATen.h>
#include <torch/nn/functional/batchnorm.h>

#include "ops/checkpoint/checkpoint.h"

namespace memlean {

void BatchNorm2dImpl::_check_input_dim(const at::Tensor& input) {
  TORCH_CHECK(input.dim() == 4, "memlean::BatchNorm2d: expected 4D input (got ", input.dim(),
              "D input)");
}

at::Tensor BatchNorm2dImpl::forward(const at::Tensor& input) {
  _check_input_dim(input);
  const bool use_batch_stats = is_training() || !options.track_running_stats();
  // In a recompute, the forward being recomputed has updated the statistics already. In
  // training mode the output depends only on the batch statistics, so leaving the running
  // ones out gives the same output and no second update.
  const bool update = is_training() && options.track_running_stats() && !is_recomputing();

  double factor = options.momentum().value_or(0.0);
  if (update && num_batches_tracked.defined()) {
    num_batches_tracked += 1;
    if (!options.momentum().has_value()) {  // cumulative moving average
      factor = 1.0 / num_batches_tracked.item<double>();
    }
  }
  const bool skip_stats = use_batch_stats && is_training() && !update;
  return torch::nn::functional::detail::batch_norm(
      input, skip_stats ? at::Tensor() : running_mean, skip_stats ? at::Tensor() : running_var,
      weight, bias, use_batch_stats, factor, options.eps());
}

void BatchNorm2dImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "memlean::BatchNorm2d(" << options.num_features()
         << ", eps=" << options.eps() << ", momentum=";
  if (options.momentum().has_value()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << ", affine=" << options.affine()
         << ", track_running_stats=" << options.track_running_stats() << ')';
}

}  // namespace memlean
