// The trainer's absl flags, a parser that reports mistakes instead of exiting, and Config.
#include <absl/flags/commandlineflag.h>
#include <absl/flags/flag.h>
#include <absl/flags/reflection.h>
#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <sstream>
#include <string>
#include <vector>

#include "experiments/trainer/config.h"
#include "ops/fit/budget.h"
#include "runtime/memstats/memstats.h"
#include "runtime/memstats/report.h"
#include "third_party/torch/devices.h"

ABSL_FLAG(std::string, model, "mlp", "mlp | densenet_bc | efficientnet_b0");
ABSL_FLAG(std::string, swish, "memory_efficient",
          "activation of mlp and efficientnet_b0: naive | memory_efficient | inplace (memlean's "
          "Swish variants) | silu | silu_inplace (torch's); densenet_bc uses ReLU");
ABSL_FLAG(std::string, checkpoint, "none",
          "none | memlean (densenet_bc: efficient bottlenecks; mlp: the hidden layer; "
          "efficientnet_b0: sqrt(n) segments) | segments:K (the model's chain of stages in K "
          "segments)");
ABSL_FLAG(std::string, memory_budget, "",
          "fit one training step into this many bytes, e.g. 6GiB, 512MiB, 2.5GB (\"\" = off): "
          "memlean::fit measures a step on the first batch and checkpoints the runs of the "
          "model's stages that make it fit at the least recompute time (with --checkpoint=none)");
ABSL_FLAG(std::string, save_fit_plan, "",
          "with --memory_budget: write the plan memlean::fit made (its JSON) to this path, for "
          "--fit_plan of a later run (another rank, the job restarted)");
ABSL_FLAG(std::string, fit_plan, "",
          "apply the plan in this file (the JSON --save_fit_plan wrote) with "
          "memlean::fit::apply_plan instead of fitting: the same changes, checked and measured "
          "on the first batch without fit's search; the budget is the plan's (not with "
          "--memory_budget)");
ABSL_FLAG(int64_t, batch, 64, "batch size");
ABSL_FLAG(int64_t, steps, 20, "training steps");
ABSL_FLAG(std::string, optimizer, "sgd", "sgd (with --momentum) | adam");
ABSL_FLAG(double, lr, 0,
          "learning rate; 0 = the model's default (sgd: mlp 1e-4 * 2^20 / mlp_hidden, at most 0.05, "
          "densenet_bc 0.1, efficientnet_b0 0.01; adam: 1e-3)");
ABSL_FLAG(double, momentum, 0.9, "SGD momentum");
ABSL_FLAG(int32_t, threads, 0, "CPU threads (at::set_num_threads); 0 = torch's default");
ABSL_FLAG(std::string, device, "auto",
          "auto (cuda when torch sees a GPU, else cpu) | cpu | cuda | cuda:N");
ABSL_FLAG(std::string, data, "synthetic",
          "synthetic (generated from --seed) | cifar10:<dir> (the CIFAR-10 binary version: "
          "<dir>/data_batch_*.bin)");
ABSL_FLAG(uint64_t, seed, 0, "seed of the model's initialisation, the data and dropout");
ABSL_FLAG(std::string, report, "", "write the JSON report to this path");
ABSL_FLAG(std::string, progress, "auto",
          "auto (a bar when stderr is a terminal, else plain lines) | bar | lines | none");
ABSL_FLAG(int64_t, num_classes, 0,
          "classes; 0 = 10 (densenet_bc, cifar10) or 1000 (efficientnet_b0 on synthetic data)");
ABSL_FLAG(int64_t, image_size, 0,
          "side of the synthetic images; 0 = 32 (densenet_bc) or 224 (efficientnet_b0); "
          "cifar10: 32");
ABSL_FLAG(int64_t, mlp_in, 0, "mlp inputs; 0 = 128 (the Swish blog post), 3072 on cifar10");
ABSL_FLAG(int64_t, mlp_hidden, int64_t{1} << 20, "mlp hidden units (the Swish blog post: 2^20)");
ABSL_FLAG(int64_t, mlp_out, 0, "mlp outputs; 0 = 1 (the Swish blog post), 10 on cifar10");
ABSL_FLAG(int64_t, densenet_depth, 100, "DenseNet-BC depth, 6n + 4");
ABSL_FLAG(int64_t, densenet_growth, 12, "DenseNet-BC growth rate");
ABSL_FLAG(double, efficientnet_width, 1.0, "EfficientNet width multiplier (B0: 1)");
ABSL_FLAG(double, efficientnet_depth, 1.0, "EfficientNet depth multiplier (B0: 1)");

namespace memlean::trainer {
namespace {

using memstats::json_string;

bool is_trainer_flag(const absl::CommandLineFlag& flag) {
  return flag.Filename().find("experiments/trainer/") != std::string::npos;
}

std::map<std::string, absl::CommandLineFlag*> trainer_flags() {
  std::map<std::string, absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (is_trainer_flag(*flag)) flags.emplace(std::string(name), flag);
  }
  return flags;
}

[[noreturn]] void fail(const std::string& flag, const std::string& message) {
  throw UsageError("--" + flag + ": " + message);
}

void check(bool ok, const std::string& flag, const std::string& message) {
  if (!ok) fail(flag, message);
}

std::string type_name(const absl::CommandLineFlag& flag) {
  if (flag.IsOfType<int64_t>() || flag.IsOfType<int32_t>()) return "integer";
  if (flag.IsOfType<uint64_t>()) return "non-negative integer";
  if (flag.IsOfType<double>()) return "number";
  return "value";
}

// `bazel run` starts the binary in its runfiles: relative paths are the user's, from the
// folder bazel was run in (BUILD_WORKING_DIRECTORY).
std::string user_path(const std::string& path) {
  if (path.empty() || std::filesystem::path(path).is_absolute()) return path;
  const char* wd = std::getenv("BUILD_WORKING_DIRECTORY");
  return wd && *wd ? (std::filesystem::path(wd) / path).string() : path;
}

std::string without_backtrace(const c10::Error& e) { return e.what_without_backtrace(); }

}  // namespace

std::string Config::activation_name() const {
  return model == "densenet_bc" ? "relu" : models::to_string(swish);
}

std::string Config::loss_name() const {
  return model == "mlp" && !cifar10() ? "mse" : "cross_entropy";
}

bool parse_flags(const std::vector<std::string>& args) {
  const auto flags = trainer_flags();
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.size() < 2 || arg[0] != '-' || arg == "--") {
      throw UsageError("unexpected argument '" + arg + "': the trainer takes only flags, --name=value");
    }
    const std::string body = arg.substr(arg[1] == '-' ? 2 : 1);
    const auto eq = body.find('=');
    const std::string name = body.substr(0, eq);
    if (name == "help" || name == "helpfull" || name == "h") return false;
    const auto it = flags.find(name);
    if (it == flags.end()) {
      std::string known;
      for (const auto& [n, f] : flags) known += (known.empty() ? "--" : ", --") + n;
      throw UsageError("unknown flag --" + name + " (the flags are " + known + "; see --help)");
    }
    std::string value;
    if (eq != std::string::npos) {
      value = body.substr(eq + 1);
    } else {
      if (i + 1 >= args.size()) fail(name, "missing value (use --" + name + "=VALUE)");
      value = args[++i];
    }
    std::string error;
    if (!it->second->ParseFrom(value, &error)) {
      fail(name, "'" + value + "' is not a valid " + type_name(*it->second) + " (" + error + ")");
    }
  }
  return true;
}

Config config_from_flags() {
  Config c;
  c.model = absl::GetFlag(FLAGS_model);
  check(c.model == "mlp" || c.model == "densenet_bc" || c.model == "efficientnet_b0", "model",
        "unknown model '" + c.model + "'; expected mlp, densenet_bc or efficientnet_b0");
  try {
    c.swish = models::parse_activation(absl::GetFlag(FLAGS_swish));
  } catch (const c10::Error& e) {
    fail("swish", without_backtrace(e));
  }
  try {
    c.checkpoint = models::parse_checkpointing(absl::GetFlag(FLAGS_checkpoint));
  } catch (const c10::Error& e) {
    fail("checkpoint", without_backtrace(e));
  }
  c.memory_budget_text = absl::GetFlag(FLAGS_memory_budget);
  if (!c.memory_budget_text.empty()) {
    try {
      c.memory_budget = fit::parse_budget(c.memory_budget_text, "--memory_budget");
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());
    }
    check(c.checkpoint.kind == models::Checkpointing::Kind::kNone, "memory_budget",
          "memlean::fit chooses what to checkpoint itself; use it with --checkpoint=none (got "
          "--checkpoint=" + models::to_string(c.checkpoint) + ")");
  }
  c.save_fit_plan = user_path(absl::GetFlag(FLAGS_save_fit_plan));
  if (!c.save_fit_plan.empty()) {
    check(c.memory_budget > 0, "save_fit_plan",
          "needs --memory_budget (the plan it writes is the one memlean::fit makes for it)");
    const auto parent = std::filesystem::absolute(c.save_fit_plan).parent_path();
    check(std::filesystem::is_directory(parent), "save_fit_plan",
          "the folder " + parent.string() + " does not exist");
  }
  c.fit_plan = user_path(absl::GetFlag(FLAGS_fit_plan));
  if (!c.fit_plan.empty()) {
    check(c.memory_budget == 0, "fit_plan",
          "applies a plan made for its own budget; use it without --memory_budget");
    check(c.checkpoint.kind == models::Checkpointing::Kind::kNone, "fit_plan",
          "the plan says what to checkpoint; use it with --checkpoint=none (got --checkpoint=" +
              models::to_string(c.checkpoint) + ")");
    check(std::filesystem::is_regular_file(c.fit_plan), "fit_plan",
          "no file " + c.fit_plan);
  }
  c.batch = absl::GetFlag(FLAGS_batch);
  check(c.batch >= 1, "batch", "must be >= 1, got " + std::to_string(c.batch));
  c.steps = absl::GetFlag(FLAGS_steps);
  check(c.steps >= 1, "steps", "must be >= 1, got " + std::to_string(c.steps));
  c.optimizer = absl::GetFlag(FLAGS_optimizer);
  check(c.optimizer == "sgd" || c.optimizer == "adam", "optimizer",
        "unknown optimizer '" + c.optimizer + "'; expected sgd or adam");
  c.momentum = absl::GetFlag(FLAGS_momentum);
  check(c.momentum >= 0 && c.momentum < 1, "momentum", "must be in [0, 1)");
  c.threads = absl::GetFlag(FLAGS_threads);
  check(c.threads >= 0, "threads", "must be >= 0 (0 = torch's default)");
  c.device = absl::GetFlag(FLAGS_device);
  if (c.device == "auto") c.device = have_cuda_device() ? "cuda" : "cpu";
  try {
    memstats::parse_device(c.device);
  } catch (const c10::Error& e) {
    fail("device", without_backtrace(e));
  }
  c.data = absl::GetFlag(FLAGS_data);
  if (c.data.rfind("cifar10:", 0) == 0) {
    c.cifar_dir = user_path(c.data.substr(8));
    check(!c.cifar_dir.empty(), "data", "cifar10:<dir> needs a folder");
  } else {
    check(c.data == "synthetic", "data",
          "unknown data '" + c.data + "'; expected synthetic or cifar10:<dir>");
  }
  c.seed = absl::GetFlag(FLAGS_seed);
  c.report = user_path(absl::GetFlag(FLAGS_report));
  if (!c.report.empty()) {
    const auto parent = std::filesystem::absolute(c.report).parent_path();
    check(std::filesystem::is_directory(parent), "report",
          "the folder " + parent.string() + " does not exist");
    check(!std::filesystem::is_directory(c.report), "report", c.report + " is a folder");
  }
  c.progress = absl::GetFlag(FLAGS_progress);
  check(c.progress == "auto" || c.progress == "bar" || c.progress == "lines" || c.progress == "none",
        "progress", "unknown mode '" + c.progress + "'; expected auto, bar, lines or none");

  // Sizes.
  const int64_t classes = absl::GetFlag(FLAGS_num_classes);
  const int64_t size = absl::GetFlag(FLAGS_image_size);
  check(classes >= 0, "num_classes", "must be >= 1 (0 = the default)");
  check(size >= 0, "image_size", "must be >= 1 (0 = the default)");
  if (c.cifar10()) {
    check(classes == 0 || classes == 10, "num_classes", "CIFAR-10 has 10 classes");
    check(size == 0 || size == 32, "image_size", "CIFAR-10 images are 32 x 32");
    c.num_classes = 10;
    c.image_size = 32;
  } else {
    c.num_classes = classes ? classes : (c.model == "efficientnet_b0" ? 1000 : 10);
    c.image_size = size ? size : (c.model == "efficientnet_b0" ? 224 : 32);
  }
  const int64_t mlp_in = absl::GetFlag(FLAGS_mlp_in), mlp_out = absl::GetFlag(FLAGS_mlp_out);
  c.mlp_hidden = absl::GetFlag(FLAGS_mlp_hidden);
  check(mlp_in >= 0, "mlp_in", "must be >= 1 (0 = the default)");
  check(mlp_out >= 0, "mlp_out", "must be >= 1 (0 = the default)");
  check(c.mlp_hidden >= 1, "mlp_hidden", "must be >= 1");
  if (c.cifar10()) {
    check(mlp_in == 0 || mlp_in == 3072, "mlp_in", "CIFAR-10 images have 3 * 32 * 32 = 3072 values");
    check(mlp_out == 0 || mlp_out == 10, "mlp_out", "CIFAR-10 has 10 classes");
    c.mlp_in = 3072;
    c.mlp_out = 10;
  } else {
    c.mlp_in = mlp_in ? mlp_in : 128;
    c.mlp_out = mlp_out ? mlp_out : 1;
  }
  c.densenet_depth = absl::GetFlag(FLAGS_densenet_depth);
  check(c.densenet_depth >= 10 && (c.densenet_depth - 4) % 6 == 0, "densenet_depth",
        "must be 6 * n + 4 with n >= 1 (e.g. 10, 40, 100, 190), got " + std::to_string(c.densenet_depth));
  c.densenet_growth = absl::GetFlag(FLAGS_densenet_growth);
  check(c.densenet_growth >= 1, "densenet_growth", "must be >= 1");
  c.efficientnet_width = absl::GetFlag(FLAGS_efficientnet_width);
  c.efficientnet_depth = absl::GetFlag(FLAGS_efficientnet_depth);
  check(c.efficientnet_width > 0 && std::isfinite(c.efficientnet_width), "efficientnet_width", "must be > 0");
  check(c.efficientnet_depth > 0 && std::isfinite(c.efficientnet_depth), "efficientnet_depth", "must be > 0");

  // Training-mode batch norm needs two values per channel in its smallest feature map.
  if (c.model != "mlp") {
    const int64_t side = c.model == "densenet_bc" ? c.image_size / 4 : (c.image_size + 31) / 32;
    check(c.image_size >= (c.model == "densenet_bc" ? 4 : 1), "image_size",
          "densenet_bc needs images of at least 4 x 4");
    check(c.batch * side * side >= 2, "batch",
          "batch norm in training needs at least 2 values per channel: with " +
              std::to_string(c.image_size) + " x " + std::to_string(c.image_size) +
              " images use --batch >= 2");
  }

  c.lr = absl::GetFlag(FLAGS_lr);
  check(c.lr >= 0 && std::isfinite(c.lr), "lr", "must be >= 0 (0 = the model's default)");
  if (c.lr == 0) {
    if (c.optimizer == "adam") {
      c.lr = 1e-3;
    } else if (c.model == "mlp") {
      c.lr = 1e-4 * static_cast<double>(int64_t{1} << 20) / static_cast<double>(c.mlp_hidden);
      c.lr = std::min(c.lr, 0.05);
    } else {
      c.lr = c.model == "densenet_bc" ? 0.1 : 0.01;
    }
  }
  return c;
}

std::string usage() {
  std::ostringstream out;
  out << "memlean trainer: trains a LibTorch model and reports where its memory goes.\n\n"
         "  trainer --model=efficientnet_b0 --swish=inplace --batch=64 --report=run.json\n\n"
         "Flags (--name=value or --name value):\n";
  for (const auto& [name, flag] : trainer_flags()) {
    out << "  --" << name << " (default: " << (flag->DefaultValue().empty() ? "\"\"" : flag->DefaultValue())
        << ")\n      " << flag->Help() << "\n";
  }
  out << "\nExit codes: 0 done, 1 training failed, 2 bad flags or input data.\n";
  return out.str();
}

std::string flags_json() {
  std::ostringstream out;
  out << "{";
  bool first = true;
  for (const auto& [name, flag] : trainer_flags()) {
    const std::string v = flag->CurrentValue();
    const bool number = flag->IsOfType<int64_t>() || flag->IsOfType<int32_t>() ||
                        flag->IsOfType<uint64_t>() || flag->IsOfType<double>();
    out << (first ? "" : ", ") << json_string(name) << ": " << (number ? v : json_string(v));
    first = false;
  }
  out << "}";
  return out.str();
}

}  // namespace memlean::trainer
