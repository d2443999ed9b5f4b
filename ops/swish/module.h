// memlean::Swish, a torch::nn module around memlean::swish (see swish.h).
#pragma once

#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <ostream>

#include "ops/swish/swish.h"

namespace memlean {

struct SwishOptions {
  SwishOptions(double beta = 1.0) : beta_(beta) {}  // NOLINT(runtime/explicit)
  TORCH_ARG(double, beta);
  TORCH_ARG(SwishVariant, variant) = SwishVariant::kMemoryEfficient;
};

// y = x * sigmoid(beta * x), with the chosen variant's backward. Has no parameters.
// With SwishVariant::kInplace, forward overwrites its input.
class SwishImpl : public torch::nn::Cloneable<SwishImpl> {
 public:
  explicit SwishImpl(const SwishOptions& options = {}) : options(options) { reset(); }

  void reset() override {
    TORCH_CHECK(std::isfinite(options.beta()), "memlean::Swish: beta must be finite, got ",
                options.beta());
  }

  at::Tensor forward(const at::Tensor& x) { return swish(x, options.beta(), options.variant()); }

  void pretty_print(std::ostream& stream) const override {
    stream << "memlean::Swish(beta=" << options.beta();
    if (options.variant() != SwishVariant::kMemoryEfficient) {
      stream << ", variant=" << to_string(options.variant());
    }
    stream << ")";
  }

  SwishOptions options;
};

TORCH_MODULE(Swish);

}  // namespace memlean
