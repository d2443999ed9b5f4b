// Small tensor-list helpers memlean's libraries share. Internal to memlean.
#pragma once

#include <ATen/core/Tensor.h>

#include <unordered_set>
#include <vector>

namespace memlean {

// Each defined tensor once, in first-seen order: a tensor two modules hold (tied weights, a
// buffer two layers share) is one tensor, restored, checkpointed or counted once.
inline std::vector<at::Tensor> unique_tensors(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<const c10::TensorImpl*> seen;
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) {
    if (t.defined() && seen.insert(t.unsafeGetTensorImpl()).second) out.push_back(t);
  }
  return out;
}

}  // namespace memlean
