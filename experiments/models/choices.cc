// Activation and checkpointing choices (choices.h): parsing, names, applying an activation.
#include "experiments/models/choices.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <charconv>
#include <ostream>
#include <utility>

#include "ops/checkpoint/sequential.h"
#include "ops/swish/swish.h"

namespace memlean::models {
namespace {

struct ActivationName {
  Activation activation;
  const char* name;
};

constexpr ActivationName kActivations[] = {
    {Activation::kNaive, "naive"},
    {Activation::kMemoryEfficient, "memory_efficient"},
    {Activation::kInplace, "inplace"},
    {Activation::kSilu, "silu"},
    {Activation::kSiluInplace, "silu_inplace"},
};

}  // namespace

Activation parse_activation(std::string_view name) {
  for (const auto& a : kActivations) {
    if (name == a.name) return a.activation;
  }
  TORCH_CHECK_VALUE(false, "unknown activation '", name, "'; expected one of ", activation_names());
}

std::string to_string(Activation activation) {
  for (const auto& a : kActivations) {
    if (a.activation == activation) return a.name;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown Activation ", static_cast<int>(activation));
}

std::string activation_names() {
  std::string s;
  for (const auto& a : kActivations) s += (s.empty() ? "" : ", ") + std::string(a.name);
  return s;
}

at::Tensor activate(const at::Tensor& x, Activation activation) {
  switch (activation) {
    case Activation::kNaive:
      return memlean::swish(x, 1.0, SwishVariant::kNaive);
    case Activation::kMemoryEfficient:
      return memlean::swish(x, 1.0, SwishVariant::kMemoryEfficient);
    case Activation::kInplace:
      return memlean::swish(x, 1.0, SwishVariant::kInplace);
    case Activation::kSilu:
      return at::silu(x);
    case Activation::kSiluInplace: {
      at::Tensor y = x;  // shares x's storage: at::silu_ overwrites x
      return at::silu_(y);
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unknown Activation ", static_cast<int>(activation));
}

Checkpointing parse_checkpointing(std::string_view text) {
  if (text == "none") return Checkpointing::none();
  if (text == "memlean") return Checkpointing::memlean();
  constexpr std::string_view kPrefix = "segments:";
  if (text.substr(0, kPrefix.size()) == kPrefix) {
    const std::string_view k = text.substr(kPrefix.size());
    int64_t value = 0;
    const auto [end, ec] = std::from_chars(k.data(), k.data() + k.size(), value);
    TORCH_CHECK_VALUE(!k.empty() && ec == std::errc() && end == k.data() + k.size() && value >= 1,
                      "checkpoint '", text, "': K in segments:K must be a positive integer");
    return Checkpointing::segments_of(value);
  }
  TORCH_CHECK_VALUE(false, "unknown checkpoint mode '", text,
                    "'; expected none, memlean or segments:K (K a positive integer)");
}

std::string to_string(const Checkpointing& checkpointing) {
  switch (checkpointing.kind) {
    case Checkpointing::Kind::kNone:
      return "none";
    case Checkpointing::Kind::kMemlean:
      return "memlean";
    case Checkpointing::Kind::kSegments:
      return "segments:" + std::to_string(checkpointing.segments);
  }
  TORCH_INTERNAL_ASSERT(false, "unknown Checkpointing kind");
}

}  // namespace memlean::models
