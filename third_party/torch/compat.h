// The differences between the torch versions memlean builds against (2.11 to 2.14), in one
// place: code elsewhere calls these and never tests a torch version itself.
#pragma once

#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <type_traits>
#include <utility>

namespace memlean::torch_compat {

// An autograd node, owned the way this torch owns nodes: c10::intrusive_ptr since nodes
// derive from c10::intrusive_ptr_target (torch 2.13 and later), std::shared_ptr before
// (torch 2.11: make_intrusive fails there, "no member named combined_refcount_").
template <typename NodeT, typename... Args>
auto make_node(Args&&... args) {
  static_assert(std::is_base_of_v<torch::autograd::Node, NodeT>, "NodeT: an autograd Node");
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, torch::autograd::Node>) {
    return c10::make_intrusive<NodeT>(std::forward<Args>(args)...);
  } else {
    return std::make_shared<NodeT>(std::forward<Args>(args)...);
  }
}

}  // namespace memlean::torch_compat
