// One training step of a small MLP with memlean's in-place Swish, a checkpointed block and
// memstats' phase table: what a LibTorch project gets from `@memlean//...` deps.
#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <cstdio>

#include "ops/checkpoint/checkpoint.h"
#include "ops/swish/module.h"
#include "ops/swish/swish.h"
#include "runtime/memstats/memstats.h"

int main() {
  memlean::memstats::enable();  // count every CPU allocation from here on
  memlean::memstats::Tracker tracker;
  torch::manual_seed(0);
  torch::nn::Sequential block(
      torch::nn::Linear(64, 256),
      memlean::Swish(memlean::SwishOptions(1.0).variant(memlean::SwishVariant::kInplace)),
      torch::nn::Linear(256, 64));
  torch::nn::Linear head(64, 10);
  torch::optim::SGD sgd(block->parameters(), torch::optim::SGDOptions(0.1));
  at::Tensor x = at::randn({32, 64});
  tracker.mark("data");
  at::Tensor h = memlean::checkpoint(block, x);  // block's activations recomputed in backward
  at::Tensor loss = memlean::swish(head(h), 1.5).square().mean();
  tracker.mark("forward");
  loss.backward();
  tracker.mark("backward");
  sgd.step();
  tracker.mark("step");
  std::printf("loss %.6f\n%s", loss.item<double>(), tracker.table().c_str());
  const bool ok = block->parameters()[0].grad().defined() && tracker.peak() > 0;
  std::printf("%s\n", ok ? "ok" : "FAILED: no gradient or no memory counted");
  return ok ? 0 : 1;
}
