// The trainer's loop, progress display, summary and JSON report.
#include "experiments/trainer/trainer.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/functional.h>
#include <torch/optim/adam.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "experiments/models/densenet.h"
#include "experiments/models/efficientnet.h"
#include "experiments/models/mlp.h"
#include "experiments/trainer/data.h"
#include "ops/fit/budget.h"
#include "ops/fit/fit.h"
#include "ops/swish/module.h"
#include "runtime/memstats/nn.h"
#include "runtime/memstats/report.h"
#include "third_party/torch/devices.h"

namespace memlean::trainer {
namespace {

using memstats::json_string;
using memstats::json_number;

using Clock = std::chrono::steady_clock;

const char* const kPhases[] = {"data", "forw", "loss", "back", "step"};

std::shared_ptr<models::Model> build_model(const Config& c) {
  using namespace models;  // NOLINT(build/namespaces)
  try {
    if (c.model == "mlp") {
      return std::make_shared<MlpImpl>(MlpOptions()
                                           .in_features(c.mlp_in)
                                           .hidden_features(c.mlp_hidden)
                                           .out_features(c.mlp_out)
                                           .activation(c.swish)
                                           .checkpoint(c.checkpoint));
    }
    if (c.model == "densenet_bc") {
      return std::make_shared<DenseNetBCImpl>(DenseNetBCOptions()
                                                  .depth(c.densenet_depth)
                                                  .growth_rate(c.densenet_growth)
                                                  .num_classes(c.num_classes)
                                                  .checkpoint(c.checkpoint));
    }
    return std::make_shared<EfficientNetB0Impl>(EfficientNetOptions()
                                                    .num_classes(c.num_classes)
                                                    .width_multiplier(c.efficientnet_width)
                                                    .depth_multiplier(c.efficientnet_depth)
                                                    .activation(c.swish)
                                                    .checkpoint(c.checkpoint));
  } catch (const c10::Error& e) {
    throw UsageError(std::string("the model refuses these options: ") + e.what_without_backtrace());
  }
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Config& c,
                                                        const std::vector<at::Tensor>& params) {
  if (c.optimizer == "adam") {
    return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(c.lr));
  }
  return std::make_unique<torch::optim::SGD>(params,
                                             torch::optim::SGDOptions(c.lr).momentum(c.momentum));
}

// The model as one torch::nn::Sequential for memlean::fit: its chain of stages (the same
// modules, under their names), then a "head" stage doing what its forward does after the
// chain; `prepare` is what its forward does before it.
struct FitChain {
  torch::nn::Sequential chain;
  std::function<at::Tensor(const at::Tensor&)> prepare = [](const at::Tensor& x) { return x; };
};

// models::activate(x, activation) as a layer: memlean::Swish of that variant, torch::nn::SiLU,
// or (silu_inplace) a function layer overwriting its input.
torch::nn::AnyModule activation_layer(models::Activation activation) {
  using models::Activation;
  switch (activation) {
    case Activation::kNaive:
    case Activation::kMemoryEfficient:
    case Activation::kInplace:
      return torch::nn::AnyModule(memlean::Swish(SwishOptions(1.0).variant(
          activation == Activation::kNaive             ? SwishVariant::kNaive
          : activation == Activation::kMemoryEfficient ? SwishVariant::kMemoryEfficient
                                                       : SwishVariant::kInplace)));
    case Activation::kSilu:
      return torch::nn::AnyModule(torch::nn::SiLU());
    case Activation::kSiluInplace:
      break;
  }
  return torch::nn::AnyModule(torch::nn::Functional(
      [activation](const at::Tensor& x) { return models::activate(x, activation); }));
}

FitChain fit_chain(const std::shared_ptr<models::Model>& model) {
  using namespace models;  // NOLINT(build/namespaces)
  FitChain f;
  using Modules = std::vector<std::shared_ptr<torch::nn::Module>>;
  if (const auto mlp = std::dynamic_pointer_cast<MlpImpl>(model)) {
    // Its layers, not its stages (fc1 and the activation are one stage): fit may then swap
    // the activation and slice the MLP (its hidden tensor is the step's largest).
    f.chain->push_back("fc1", mlp->fc1);
    f.chain->push_back("activation", activation_layer(mlp->options.activation()));
    f.chain->push_back("fc2", mlp->fc2);
    f.prepare = [](const at::Tensor& x) { return x.dim() == 2 ? x : x.flatten(1); };
    return f;
  }
  const torch::nn::Sequential stages = model->stages();
  std::vector<std::string> names;
  for (const auto& item : stages->named_children()) names.push_back(item.key());
  for (size_t i = 0; i < stages->size(); ++i) f.chain->push_back(names.at(i), stages->begin()[i]);
  if (auto d = std::dynamic_pointer_cast<DenseNetBCImpl>(model)) {
    f.chain->push_back("head", Stage("relu+pool+classifier", Modules{d->classifier.ptr()},
                                     [c = d->classifier](const at::Tensor& x) mutable {
                                       return c(at::adaptive_avg_pool2d(x.relu_(), {1, 1}).flatten(1));
                                     }));
  } else if (auto e = std::dynamic_pointer_cast<EfficientNetB0Impl>(model)) {
    const double p = e->options.dropout();
    f.chain->push_back("head", Stage("pool+dropout+classifier", Modules{e->classifier.ptr()},
                                     [c = e->classifier, p](const at::Tensor& x) mutable {
                                       at::Tensor h = at::adaptive_avg_pool2d(x, {1, 1}).flatten(1);
                                       if (p > 0) h = at::dropout(h, p, c->is_training());
                                       return c(h);
                                     }));
  } else {
    throw UsageError("--memory_budget: memlean::fit does not know how to run this model as a "
                     "chain of layers");
  }
  return f;
}

std::string mib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f", static_cast<double>(bytes) / (1 << 20));
  return buf;
}

std::string human_count(int64_t n) {
  char buf[32];
  if (n >= 1000000) {
    std::snprintf(buf, sizeof(buf), "%.2fM", n / 1e6);
  } else if (n >= 1000) {
    std::snprintf(buf, sizeof(buf), "%.1fk", n / 1e3);
  } else {
    std::snprintf(buf, sizeof(buf), "%lld", static_cast<long long>(n));
  }
  return buf;
}

class Progress {
 public:
  Progress(std::ostream& out, ProgressMode mode, int64_t steps)
      : out_(out), mode_(mode), steps_(steps), every_(std::max<int64_t>(1, steps / 20)) {}

  void update(int64_t step, double loss, double rate, int64_t current, int64_t peak) {
    if (mode_ == ProgressMode::kNone) return;
    char stats[160];
    std::snprintf(stats, sizeof(stats), "loss %.6g  %.2f steps/s  mem %s MiB  peak %s MiB", loss,
                  rate, mib(current).c_str(), mib(peak).c_str());
    if (mode_ == ProgressMode::kBar) {
      constexpr int kWidth = 24;
      const auto filled = static_cast<int>(kWidth * step / steps_);
      std::string bar(kWidth, '.');
      std::fill(bar.begin(), bar.begin() + filled, '#');
      out_ << "\r[" << bar << "] " << step << "/" << steps_ << "  " << stats << "\x1b[K"
           << std::flush;
      if (step == steps_) out_ << "\n" << std::flush;
    } else if (step == 1 || step == steps_ || step % every_ == 0) {
      out_ << "step " << step << "/" << steps_ << "  " << stats << "\n" << std::flush;
    }
  }

 private:
  std::ostream& out_;
  ProgressMode mode_;
  int64_t steps_, every_;
};

// The steps shown in the text table: all when 6 or fewer, else 1, 2, 3, n-1, n.
std::vector<int64_t> shown_steps(int64_t steps) {
  std::vector<int64_t> s;
  for (int64_t i = 1; i <= steps; ++i) {
    if (steps <= 6 || i <= 3 || i >= steps - 1) s.push_back(i);
  }
  return s;
}

}  // namespace

Result train(const Config& c, std::ostream& progress_out, ProgressMode mode,
             std::ostream* plan_out) {
  Result r;
  const c10::Device device = memstats::parse_device(c.device);
  std::unique_ptr<DataSource> data = make_data(c);  // reads CIFAR-10 before the model exists
  r.data_description = data->describe();
  if (c.threads > 0) at::set_num_threads(c.threads);
  r.threads = at::get_num_threads();

  memstats::enable();  // before the model, so that its parameters are counted
  at::manual_seed(c.seed);
  std::shared_ptr<models::Model> model = build_model(c);
  model->to(device);
  model->train();
  {
    std::ostringstream s;
    model->pretty_print(s);
    r.model_description = s.str();
  }
  r.num_parameters = model->num_parameters();
  auto optimizer = make_optimizer(c, model->parameters());
  const bool regression = c.loss_name() == "mse";

  auto tensors = [&] { return memstats::tensors_of(*model, optimizer.get()); };

  // --memory_budget: fit a step of the first batch, and train with the plan.
  std::function<at::Tensor(const at::Tensor&)> forward = [&model](const at::Tensor& x) {
    return model->forward(x);
  };
  std::optional<fit::FitPlan> plan;
  std::optional<Batch> first;
  if (c.memory_budget > 0 || !c.fit_plan.empty()) {
    FitChain f = fit_chain(model);
    first = data->next();
    {
      const at::Tensor x = f.prepare(first->input.to(device)), y = first->target.to(device);
      fit::FitOptions options;
      options.loss_fn = [y, regression](const at::Tensor& out) {
        return regression ? at::mse_loss(out, y) : at::cross_entropy_loss(out, y);
      };
      options.optimizer = optimizer.get();
      if (c.fit_plan.empty()) {
        try {
          plan = fit::fit(f.chain, x, c.memory_budget, options);
        } catch (const fit::FitError& e) {
          throw UsageError(std::string("--memory_budget: ") + e.what());
        }
      } else {
        // --fit_plan: the plan read back and applied (a FitError: the step under it peaks
        // above its budget here; an invalid_argument: it is not this model's plan).
        std::ifstream file(c.fit_plan);
        std::stringstream text;
        text << file.rdbuf();
        if (!file) throw UsageError("--fit_plan: cannot read " + c.fit_plan);
        try {
          plan = fit::apply_plan(f.chain, x, fit::FitPlan::from_json(text.str()), options);
        } catch (const std::invalid_argument& e) {
          throw UsageError(std::string("--fit_plan: ") + e.what());
        }
      }
    }
    r.fit_table = plan->str();
    r.fit_json = plan->to_json();
    r.fit_budget_bytes = plan->budget_bytes;
    if (!c.save_fit_plan.empty()) {
      std::ofstream file(c.save_fit_plan);
      file << r.fit_json << "\n";
      file.close();
      if (!file) throw UsageError("--save_fit_plan: cannot write " + c.save_fit_plan);
    }
    r.fit_checkpoints = static_cast<int64_t>(plan->checkpointed.size());
    r.fit_sliced = static_cast<int64_t>(plan->sliced.size());
    r.fit_peak_bytes = plan->peak_bytes;
    if (plan_out != nullptr) *plan_out << r.fit_table << "\n" << std::flush;
    forward = [p = &*plan, prepare = f.prepare](const at::Tensor& x) {
      return p->forward(prepare(x));
    };
  }

  Progress progress(progress_out, mode, c.steps);
  memstats::Tracker tracker(device);
  const auto start = Clock::now();
  auto after_first = start;
  for (int64_t step = 1; step <= c.steps; ++step) {
    optimizer->zero_grad();
    Batch batch = first ? std::move(*first) : data->next();
    first.reset();
    const at::Tensor x = batch.input.to(device), y = batch.target.to(device);
    batch = {};
    synchronize(device);
    tracker.mark("data");

    at::Tensor out = forward(x);
    synchronize(device);
    tracker.mark("forw");

    at::Tensor loss = regression ? at::mse_loss(out, y) : at::cross_entropy_loss(out, y);
    const double loss_value = loss.item<double>();
    tracker.mark("loss");
    if (step == c.steps) r.categories = tracker.categories(tensors());

    loss.backward();
    out = at::Tensor();
    loss = at::Tensor();
    synchronize(device);
    tracker.mark("back");

    optimizer->step();
    synchronize(device);
    tracker.mark("step");

    r.losses.push_back(loss_value);
    const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    if (step == 1) after_first = Clock::now();
    progress.update(step, loss_value, static_cast<double>(step) / elapsed, tracker.current(),
                    tracker.peak());
  }
  const auto end = Clock::now();
  r.seconds = std::chrono::duration<double>(end - start).count();
  r.steps_per_second = static_cast<double>(c.steps) / r.seconds;
  const double rest = std::chrono::duration<double>(end - after_first).count();
  r.steps_per_second_after_first = c.steps > 1 && rest > 0 ? static_cast<double>(c.steps - 1) / rest : 0;
  r.categories_end = tracker.categories(tensors());
  tracker.stop();
  r.peak_bytes = tracker.peak();
  r.marks = tracker.marks();
  r.memstats_json = tracker.json();
  return r;
}

std::string summary(const Config& c, const Result& r) {
  std::ostringstream out;
  out << "memlean trainer: " << c.model << " (" << human_count(r.num_parameters)
      << " parameters), activation " << c.activation_name() << ", checkpoint "
      << models::to_string(c.checkpoint) << ", batch " << c.batch << ", " << c.steps << " steps, "
      << c.optimizer << " lr " << json_number(c.lr) << ", " << c.device << " (" << r.threads
      << " threads), " << r.data_description << "\n";
  char line[200];
  std::snprintf(line, sizeof(line),
                "loss %.6g -> %.6g; %.3f steps/s (%.3f after the first step); peak %s MiB\n\n",
                r.losses.front(), r.losses.back(), r.steps_per_second,
                r.steps_per_second_after_first, mib(r.peak_bytes).c_str());
  out << line;
  if (!r.fit_json.empty()) {
    out << "memory budget " << fit::describe_bytes(r.fit_budget_bytes)
        << (c.fit_plan.empty() ? "" : " (--fit_plan)") << ": memlean::fit checkpoints "
        << r.fit_checkpoints << (r.fit_checkpoints == 1 ? " run" : " runs") << " of layers";
    if (r.fit_sliced > 0) {
      out << " and slices " << r.fit_sliced << (r.fit_sliced == 1 ? " MLP" : " MLPs");
    }
    out << "; its measured step peaks at " << fit::describe_bytes(r.fit_peak_bytes) << "\n\n";
  }

  // Phase table: rows = phases, columns = steps (the value at each phase's end), and the
  // peak within each step.
  const auto steps = shown_steps(c.steps);
  std::map<std::pair<int64_t, std::string>, const memstats::Mark*> at;
  std::map<int64_t, int64_t> step_peak;
  for (const auto& m : r.marks) {
    at[{m.step, m.name}] = &m;
    step_peak[m.step] = std::max({step_peak[m.step], m.peak, m.current});
  }
  out << "memstats " << c.device << ": bytes alive at the end of each phase (MiB)\n";
  const int w = 11;
  char cell[64];
  std::snprintf(cell, sizeof(cell), "%-7s", "");
  out << cell;
  int64_t previous = 0;
  for (const int64_t s : steps) {
    if (previous && s != previous + 1) out << std::string(w - 3, ' ') << "...";
    std::snprintf(cell, sizeof(cell), "%*s", w, ("step " + std::to_string(s)).c_str());
    out << cell;
    previous = s;
  }
  out << "\n";
  std::vector<std::string> rows(std::begin(kPhases), std::end(kPhases));
  rows.push_back("(peak)");
  for (const auto& row : rows) {
    std::snprintf(cell, sizeof(cell), "%-7s", row.c_str());
    out << cell;
    previous = 0;
    for (const int64_t s : steps) {
      if (previous && s != previous + 1) out << std::string(w, ' ');
      std::string v = "-";
      if (row == "(peak)") {
        v = mib(step_peak[s]);
      } else if (auto it = at.find({s, row}); it != at.end()) {
        v = mib(it->second->current);
      }
      std::snprintf(cell, sizeof(cell), "%*s", w, v.c_str());
      out << cell;
      previous = s;
    }
    out << "\n";
  }
  // Not the peak (it used to say so): the (peak) row above is usually reached later, in
  // backward, when gradients are allocated while activations are still alive.
  out << "\nmemory by category after the last forward and loss (alive at that moment; the "
         "step's peak is the (peak) row above):\n"
      << r.categories.str() << "\nmemory by category at the end:\n"
      << r.categories_end.str();
  return out.str();
}

std::string report_json(const Config& c, const Result& r) {
  std::ostringstream out;
  out << "{\n  \"flags\": " << flags_json() << ",\n";
  out << "  \"config\": {\"model\": " << json_string(c.model) << ", \"activation\": "
      << json_string(c.activation_name()) << ", \"checkpoint\": " << json_string(models::to_string(c.checkpoint))
      << ", \"batch\": " << c.batch << ", \"steps\": " << c.steps << ", \"optimizer\": "
      << json_string(c.optimizer) << ", \"lr\": " << json_number(c.lr) << ", \"momentum\": "
      << json_number(c.momentum) << ", \"threads\": " << r.threads << ", \"device\": " << json_string(c.device)
      << ", \"data\": " << json_string(c.data) << ", \"seed\": " << c.seed << ", \"loss\": "
      << json_string(c.loss_name()) << ", \"num_classes\": " << c.num_classes << ", \"image_size\": "
      << c.image_size << ", \"memory_budget\": "
      << (c.memory_budget > 0 ? std::to_string(c.memory_budget) : std::string("null")) << "},\n";
  out << "  \"model\": {\"description\": " << json_string(r.model_description)
      << ", \"parameters\": " << r.num_parameters << "},\n";
  out << "  \"data\": " << json_string(r.data_description) << ",\n";
  out << "  \"loss\": [";
  for (size_t i = 0; i < r.losses.size(); ++i) out << (i ? ", " : "") << json_number(r.losses[i]);
  out << "],\n";
  out << "  \"seconds\": " << json_number(r.seconds) << ",\n";
  out << "  \"steps_per_second\": " << json_number(r.steps_per_second) << ",\n";
  out << "  \"steps_per_second_after_first\": " << json_number(r.steps_per_second_after_first) << ",\n";
  out << "  \"peak_bytes\": " << r.peak_bytes << ",\n";
  out << "  \"fit\": " << (r.fit_json.empty() ? "null" : r.fit_json) << ",\n";
  // The phase table: for each phase, one value per step.
  out << "  \"phases\": {";
  bool first_phase = true;
  for (const char* phase : kPhases) {
    std::vector<const memstats::Mark*> ms;
    double previous = 0;
    std::vector<double> seconds;
    for (const auto& m : r.marks) {
      if (m.name == phase) {
        ms.push_back(&m);
        seconds.push_back(m.seconds - previous);
      }
      previous = m.seconds;
    }
    auto series = [&](auto get) {
      std::string s = "[";
      for (size_t i = 0; i < ms.size(); ++i) s += (i ? ", " : "") + get(*ms[i]);
      return s + "]";
    };
    out << (first_phase ? "\n" : ",\n") << "    " << json_string(phase) << ": {\"current\": "
        << series([](const memstats::Mark& m) { return std::to_string(m.current); })
        << ", \"peak\": " << series([](const memstats::Mark& m) { return std::to_string(m.peak); })
        << ", \"kept\": "
        << series([](const memstats::Mark& m) { return m.kept < 0 ? std::string("null") : std::to_string(m.kept); })
        << ", \"seconds\": [";
    for (size_t i = 0; i < seconds.size(); ++i) out << (i ? ", " : "") << json_number(seconds[i]);
    out << "]}";
    first_phase = false;
  }
  out << "\n  },\n";
  out << "  \"categories\": " << r.categories.json() << ",\n";
  out << "  \"categories_end\": " << r.categories_end.json() << ",\n";
  out << "  \"memstats\": " << r.memstats_json << "\n}\n";
  return out.str();
}

int trainer_main(const std::vector<std::string>& args, std::ostream& out, std::ostream& err,
                 bool stderr_is_tty) {
  Config config;
  try {
    if (!parse_flags(args)) {
      out << usage();
      return 0;
    }
    config = config_from_flags();
  } catch (const UsageError& e) {
    err << "trainer: " << e.what() << "\n";
    return 2;
  }
  const ProgressMode mode = config.progress == "none"    ? ProgressMode::kNone
                            : config.progress == "bar"   ? ProgressMode::kBar
                            : config.progress == "lines" ? ProgressMode::kLines
                            : stderr_is_tty              ? ProgressMode::kBar
                                                         : ProgressMode::kLines;
  Result result;
  try {
    result = train(config, err, mode, &out);
  } catch (const UsageError& e) {
    err << "trainer: " << e.what() << "\n";
    return 2;
  } catch (const c10::Error& e) {
    err << "trainer: training failed: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    err << "trainer: training failed: " << e.what() << "\n";
    return 1;
  }
  out << summary(config, result) << std::flush;
  if (!config.report.empty()) {
    std::ofstream file(config.report);
    file << report_json(config, result);
    file.close();
    if (!file) {
      err << "trainer: cannot write the report " << config.report << "\n";
      return 1;
    }
    out << "\nreport: " << config.report << "\n";
  }
  return 0;
}

}  // namespace memlean::trainer
