// Mlp (the Swish blog post's reference network).
#include "experiments/models/mlp.h"

#include <c10/util/Exception.h>

#include <ostream>

namespace memlean::models {

using Modules = std::vector<std::shared_ptr<torch::nn::Module>>;

MlpImpl::MlpImpl(const MlpOptions& options) : Model("Mlp"), options(options) {
  TORCH_CHECK_VALUE(options.in_features() >= 1 && options.hidden_features() >= 1 &&
                        options.out_features() >= 1,
                    "Mlp: sizes must be >= 1, got in_features=", options.in_features(),
                    ", hidden_features=", options.hidden_features(),
                    ", out_features=", options.out_features());
  fc1 = register_module("fc1", torch::nn::Linear(options.in_features(), options.hidden_features()));
  fc2 = register_module("fc2", torch::nn::Linear(options.hidden_features(), options.out_features()));
  const Activation activation = options.activation();
  auto linear1 = fc1;
  stages_->push_back(Stage("fc1+activation", Modules{fc1.ptr()}, [linear1, activation](const at::Tensor& x) mutable {
    return activate(linear1->forward(x), activation);
  }));
  stages_->push_back(fc2);
  check_checkpointing(options.checkpoint(), static_cast<int64_t>(stages_->size()), "Mlp");
}

at::Tensor MlpImpl::forward(const at::Tensor& x) {
  const at::Tensor flat = x.dim() == 2 ? x : x.flatten(1);
  const Checkpointing& c = options.checkpoint();
  return run_stages(stages_,
                    c.kind == Checkpointing::Kind::kMemlean ? Checkpointing::segments_of(2) : c,
                    flat);
}

void MlpImpl::pretty_print(std::ostream& stream) const {
  stream << "memlean::models::Mlp(" << options.in_features() << " -> "
         << options.hidden_features() << " -> " << options.out_features()
         << ", activation=" << to_string(options.activation())
         << ", checkpoint=" << to_string(options.checkpoint()) << ")";
}

}  // namespace memlean::models
