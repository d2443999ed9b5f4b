// memstats categories of a C++-frontend model and optimizer (torch::nn::Module,
// torch::optim::*). Header-only and in its own target (//runtime/memstats:nn), so the core
// library never pulls in the C++ frontend's headers.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <optional>
#include <string>
#include <typeinfo>
#include <vector>

#include "runtime/memstats/memstats.h"

namespace memlean::memstats {

// The fields of one optimizer state of a type with fixed fields (Adam, AdamW, SGD, RMSprop,
// Adagrad): its tensors (some may be undefined, e.g. Adam's max_exp_avg_sq without amsgrad)
// and its step counts, as pointers into the state, so a caller may read, copy and put them
// back (memlean::fit saves their values and restores them in the same tensors). nullopt for
// other types (LBFGS's queues of tensors, a state of the caller's own).
struct OptimizerStateFields {
  std::vector<at::Tensor*> tensors;
  std::vector<int64_t*> counts;
};

inline std::optional<OptimizerStateFields> optimizer_state_fields(
    torch::optim::OptimizerParamState& state) {
  torch::optim::OptimizerParamState* s = &state;
  if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(s)) {
    return OptimizerStateFields{{&a->exp_avg(), &a->exp_avg_sq(), &a->max_exp_avg_sq()},
                                {&a->step()}};
  }
  if (auto* w = dynamic_cast<torch::optim::AdamWParamState*>(s)) {
    return OptimizerStateFields{{&w->exp_avg(), &w->exp_avg_sq(), &w->max_exp_avg_sq()},
                                {&w->step()}};
  }
  if (auto* g = dynamic_cast<torch::optim::SGDParamState*>(s)) {
    return OptimizerStateFields{{&g->momentum_buffer()}, {}};
  }
  if (auto* r = dynamic_cast<torch::optim::RMSpropParamState*>(s)) {
    return OptimizerStateFields{{&r->square_avg(), &r->momentum_buffer(), &r->grad_avg()},
                                {&r->step()}};
  }
  if (auto* d = dynamic_cast<torch::optim::AdagradParamState*>(s)) {
    return OptimizerStateFields{{&d->sum()}, {&d->step()}};
  }
  return std::nullopt;
}

// The tensors of one optimizer's state: Adam, AdamW, SGD, RMSprop, Adagrad and LBFGS;
// an error naming the type for other states.
inline std::vector<at::Tensor> optimizer_state_tensors(const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> out;
  for (const auto& [key, state] : optimizer.state()) {
    torch::optim::OptimizerParamState* s = state.get();
    if (s == nullptr) continue;
    if (const auto fields = optimizer_state_fields(*s)) {
      for (const at::Tensor* t : fields->tensors) out.push_back(*t);
    } else if (const auto* l = dynamic_cast<const torch::optim::LBFGSParamState*>(s)) {
      out.insert(out.end(), {l->d(), l->H_diag(), l->prev_flat_grad()});
      for (const auto* q : {&l->old_dirs(), &l->old_stps(), &l->ro()}) {
        out.insert(out.end(), q->begin(), q->end());
      }
      if (l->al()) out.insert(out.end(), l->al()->begin(), l->al()->end());
    } else {
      TORCH_CHECK_TYPE(false, "memstats: optimizer state of type ", typeid(*s).name(),
                       " is not known; pass its tensors in Tracker::Tensors::optimizer_state");
    }
  }
  return out;
}

// Parameters, buffers and gradients of `model`, gradients of the optimizer's parameters and
// its state (optimizer may be null).
inline Tracker::Tensors tensors_of(const torch::nn::Module& model,
                                   const torch::optim::Optimizer* optimizer = nullptr) {
  Tracker::Tensors t;
  t.parameters = model.parameters();
  t.buffers = model.buffers();
  for (const auto& p : t.parameters) {
    if (p.grad().defined()) t.gradients.push_back(p.grad());
  }
  if (optimizer != nullptr) {
    for (const auto& group : optimizer->param_groups()) {
      for (const auto& p : group.params()) {
        if (p.grad().defined()) t.gradients.push_back(p.grad());
      }
    }
    t.optimizer_state = optimizer_state_tensors(*optimizer);
  }
  return t;
}

// tracker.categories(tensors_of(model, optimizer), forward_mark).
inline Categories categories(const Tracker& tracker, const torch::nn::Module& model,
                             const torch::optim::Optimizer* optimizer = nullptr,
                             const std::string& forward_mark = "") {
  return tracker.categories(tensors_of(model, optimizer), forward_mark);
}

}  // namespace memlean::memstats
