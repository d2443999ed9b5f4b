// Model, Stage, and running a chain of stages (model.h).
#include "experiments/models/model.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <charconv>
#include <ostream>
#include <utility>

#include "ops/checkpoint/sequential.h"
#include "ops/swish/swish.h"

namespace memlean::models {

int64_t Model::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

StageImpl::StageImpl(std::string name, std::vector<std::shared_ptr<torch::nn::Module>> modules,
                     Function function)
    : torch::nn::Module("Stage"), name_(std::move(name)), function_(std::move(function)) {
  for (size_t i = 0; i < modules.size(); ++i) register_module(std::to_string(i), modules[i]);
}

void StageImpl::pretty_print(std::ostream& stream) const { stream << "Stage(" << name_ << ")"; }

void check_checkpointing(const Checkpointing& checkpointing, int64_t n_stages,
                         const std::string& model) {
  if (checkpointing.kind != Checkpointing::Kind::kSegments) return;
  TORCH_CHECK_VALUE(checkpointing.segments >= 1 && checkpointing.segments <= n_stages, model,
                    ": checkpoint segments:", checkpointing.segments,
                    " asks for more segments than the model has stages (", n_stages,
                    "); use 1 to ", n_stages);
}

at::Tensor run_stages(const torch::nn::Sequential& stages, const Checkpointing& checkpointing,
                      const at::Tensor& x) {
  switch (checkpointing.kind) {
    case Checkpointing::Kind::kNone:
      return torch::nn::Sequential(stages)->forward(x);
    case Checkpointing::Kind::kSegments:
      return memlean::checkpoint_sequential(stages, checkpointing.segments, x);
    case Checkpointing::Kind::kMemlean:
      return memlean::checkpoint_sequential(
          stages, memlean::sqrt_segment_starts(static_cast<int64_t>(stages->size())), x);
  }
  TORCH_INTERNAL_ASSERT(false, "unknown Checkpointing kind");
}

}  // namespace memlean::models
