// model_dump: builds one of the C++ models from a seed, runs one training forward and
// backward on a seeded input, and saves everything a Python twin needs to be compared with
// it (torch.load-able dict of tensors): the initial parameters and buffers, the input, the
// output, the gradients of sum(output * loss_weight), and the buffers after the forward.
//
//   model_dump <out.pt> model=mlp|densenet_bc|efficientnet_b0 [key=value ...]
//   keys: activation, checkpoint, seed, batch, size (image side), in, hidden, out (mlp),
//         depth, growth (densenet_bc), width, depth_multiplier, dropout, drop_connect
//         (efficientnet_b0), classes
#include <ATen/ATen.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>

#include "experiments/models/densenet.h"
#include "experiments/models/efficientnet.h"
#include "experiments/models/mlp.h"

namespace {

using namespace memlean::models;  // NOLINT(build/namespaces)

int run(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: model_dump <out.pt> model=NAME [key=value ...]\n";
    return 2;
  }
  std::map<std::string, std::string> kv;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    const auto eq = a.find('=');
    if (eq == std::string::npos) {
      std::cerr << "model_dump: expected key=value, got " << a << "\n";
      return 2;
    }
    kv[a.substr(0, eq)] = a.substr(eq + 1);
  }
  auto get = [&](const std::string& k, const std::string& d) { return kv.count(k) ? kv[k] : d; };
  auto geti = [&](const std::string& k, int64_t d) { return kv.count(k) ? std::stoll(kv[k]) : d; };
  auto getd = [&](const std::string& k, double d) { return kv.count(k) ? std::stod(kv[k]) : d; };

  const std::string name = get("model", "");
  const Activation act = parse_activation(get("activation", "memory_efficient"));
  const Checkpointing ckpt = parse_checkpointing(get("checkpoint", "none"));
  const int64_t batch = geti("batch", 4), size = geti("size", 16), classes = geti("classes", 10);
  at::manual_seed(static_cast<uint64_t>(geti("seed", 0)));

  std::shared_ptr<Model> model;
  at::Tensor x;
  if (name == "mlp") {
    const int64_t in = geti("in", 8);
    model = std::make_shared<MlpImpl>(MlpOptions()
                                          .in_features(in)
                                          .hidden_features(geti("hidden", 32))
                                          .out_features(geti("out", 3))
                                          .activation(act)
                                          .checkpoint(ckpt));
    x = at::randn({batch, in});
  } else if (name == "densenet_bc") {
    model = std::make_shared<DenseNetBCImpl>(DenseNetBCOptions()
                                                 .depth(geti("depth", 10))
                                                 .growth_rate(geti("growth", 4))
                                                 .num_classes(classes)
                                                 .checkpoint(ckpt));
    x = at::randn({batch, 3, size, size});
  } else if (name == "efficientnet_b0") {
    model = std::make_shared<EfficientNetB0Impl>(EfficientNetOptions()
                                                     .num_classes(classes)
                                                     .width_multiplier(getd("width", 0.25))
                                                     .depth_multiplier(getd("depth_multiplier", 0.25))
                                                     .dropout(getd("dropout", 0.0))
                                                     .drop_connect(getd("drop_connect", 0.0))
                                                     .activation(act)
                                                     .checkpoint(ckpt));
    x = at::randn({batch, 3, size, size});
  } else {
    std::cerr << "model_dump: unknown model '" << name << "'\n";
    return 2;
  }
  model->train();

  c10::Dict<std::string, at::Tensor> out;
  for (const auto& p : model->named_parameters()) out.insert("param/" + p.key(), p.value().detach().clone());
  for (const auto& b : model->named_buffers()) out.insert("buffer/" + b.key(), b.value().clone());
  out.insert("num_parameters", at::scalar_tensor(model->num_parameters(), at::kLong));
  out.insert("input", x.clone());
  const at::Tensor y = model->forward(x);
  const at::Tensor w = at::randn(y.sizes());
  (y * w).sum().backward();
  out.insert("output", y.detach().clone());
  out.insert("loss_weight", w);
  for (const auto& p : model->named_parameters()) out.insert("grad/" + p.key(), p.value().grad().clone());
  for (const auto& b : model->named_buffers()) out.insert("buffer_after/" + b.key(), b.value().clone());

  const std::vector<char> bytes = torch::jit::pickle_save(c10::IValue(out));
  std::ofstream file(argv[1], std::ios::binary);
  file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!file) {
    std::cerr << "model_dump: cannot write " << argv[1] << "\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "model_dump: " << e.what() << "\n";
    return 2;
  }
}
