// memstats categories of a torch::nn model and torch::optim optimizers (nn.h).
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include "runtime/memstats/nn.h"

namespace memlean::memstats {
namespace {

int64_t nbytes(const std::vector<at::Tensor>& ts) {
  int64_t n = 0;
  for (const auto& t : ts) n += static_cast<int64_t>(t.nbytes());
  return n;
}

void check_sum(const Categories& c) {
  EXPECT_EQ(c.parameters + c.buffers + c.gradients + c.optimizer_state + c.activations + c.other,
            c.total);
}

TEST(MemstatsNn, SequentialWithAdamAndSgd) {
  enable();
  Tracker t;
  torch::nn::Sequential model(torch::nn::Linear(32, 64), torch::nn::BatchNorm1d(64),
                              torch::nn::ReLU(), torch::nn::Linear(64, 5));
  const int64_t params = nbytes(model->parameters());
  const int64_t buffers = nbytes(model->buffers());
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-3));
  at::Tensor x = at::randn({16, 32});
  at::Tensor y = at::randint(5, {16}, at::kLong);
  t.mark("data");
  at::Tensor out = model->forward(x);
  t.mark("forward");
  Categories c = categories(t, *model, &adam);
  EXPECT_EQ(c.parameters, params);
  EXPECT_EQ(c.buffers, buffers);
  EXPECT_EQ(c.gradients, 0);
  EXPECT_EQ(c.optimizer_state, 0);
  EXPECT_EQ(c.activations, t.marks().back().kept);
  EXPECT_GT(c.activations, static_cast<int64_t>(out.nbytes()));
  EXPECT_EQ(c.total, t.current());
  check_sum(c);

  at::cross_entropy_loss(out, y).backward();
  adam.step();
  c = categories(t, *model, &adam);
  EXPECT_EQ(c.gradients, params);
  EXPECT_EQ(c.optimizer_state, 2 * params);  // exp_avg, exp_avg_sq; the step is an int
  check_sum(c);

  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  sgd.step();
  c = categories(t, *model, &sgd);
  EXPECT_EQ(c.optimizer_state, params);  // one momentum buffer per parameter
  EXPECT_EQ(c.gradients, params);
  check_sum(c);
  EXPECT_EQ(tensors_of(*model).optimizer_state.size(), 0u);
}

}  // namespace
}  // namespace memlean::memstats
