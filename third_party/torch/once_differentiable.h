// memlean::mark_once_differentiable(): Python's @once_differentiable for a C++ backward.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>

#include <string>
#include <utility>
#include <vector>

#include "third_party/torch/compat.h"

namespace memlean {

// For a backward run with create_graph (grad mode on in it; call it there): makes each
// floating result of `grads` (computed without a graph) an alias whose own backward raises
// `message` (autograd's DelayedError): the first backward gives its gradients, a second one
// through them fails with a clear error instead of a silently wrong second derivative.
inline void mark_once_differentiable(torch::autograd::variable_list& grads,
                                     const std::string& message) {
  torch::autograd::variable_list inputs;
  std::vector<size_t> where;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].defined() && grads[i].is_floating_point()) {
      inputs.push_back(grads[i].detach().requires_grad_(true));
      where.push_back(i);
    }
  }
  if (inputs.empty()) return;
  auto error = torch_compat::make_node<torch::autograd::DelayedError>(
      message, static_cast<int64_t>(inputs.size()));
  torch::autograd::variable_list wrapped = error->apply(std::move(inputs));
  for (size_t j = 0; j < where.size(); ++j) grads[where[j]] = std::move(wrapped[j]);
}

}  // namespace memlean
