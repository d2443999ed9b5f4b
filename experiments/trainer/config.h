// The trainer's configuration: its absl flags, parsed without exiting, and checked into a
// Config. Every mistake in the flags is a UsageError naming the flag (exit code 2).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "experiments/models/choices.h"

namespace memlean::trainer {

// A mistake in the command line or the input data: the trainer prints it and exits with 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Config {
  std::string model = "mlp";  // mlp | densenet_bc | efficientnet_b0
  models::Activation swish = models::Activation::kMemoryEfficient;
  models::Checkpointing checkpoint;
  int64_t batch = 64;
  int64_t steps = 20;
  std::string optimizer = "sgd";  // sgd | adam
  double lr = 0;                  // resolved: never 0 after config_from_flags
  double momentum = 0.9;          // sgd
  int threads = 0;                // 0: torch's default
  std::string device = "cpu";
  std::string data = "synthetic";  // the flag as given
  std::string cifar_dir;           // set for --data=cifar10:<dir>
  // (Relative --report and cifar10 paths are taken from BUILD_WORKING_DIRECTORY when set,
  // i.e. from the folder where `bazel run` was typed.)
  uint64_t seed = 0;
  std::string report;            // JSON report path, "" for none
  std::string progress = "auto";  // auto | bar | lines | none
  // --memory_budget: "" = off; else the bytes (memlean::fit::parse_budget) that one training
  // step must fit in, by memlean::fit checkpointing runs of the model's stages.
  std::string memory_budget_text;
  int64_t memory_budget = 0;
  // --save_fit_plan: where to write the plan fit made ("" = nowhere); --fit_plan: a plan's
  // JSON to apply (memlean::fit::apply_plan) instead of fitting ("" = fit, or no plan).
  std::string save_fit_plan, fit_plan;
  // Resolved sizes (the flags' 0 = the model's and the data's defaults).
  int64_t num_classes = 10;
  int64_t image_size = 32;
  int64_t mlp_in = 128, mlp_hidden = int64_t{1} << 20, mlp_out = 1;
  int64_t densenet_depth = 100, densenet_growth = 12;
  double efficientnet_width = 1.0, efficientnet_depth = 1.0;

  bool cifar10() const { return !cifar_dir.empty(); }
  // What the model computes its activations with ("relu" for DenseNet-BC).
  std::string activation_name() const;
  // "mse" for the MLP on synthetic data (the Swish blog post's regression), else "cross_entropy".
  std::string loss_name() const;
};

// Parses command-line arguments (without the program name) into the trainer's absl flags:
// --name=value, --name value (also with one dash). Returns false when help was asked
// (--help, -h, --helpfull). Unknown flags, positional arguments, values that do not parse:
// UsageError.
bool parse_flags(const std::vector<std::string>& args);

// The Config of the current flag values, with defaults resolved and every value checked
// (UsageError naming the flag). --device=cuda without a GPU, and a --report folder that does
// not exist, are caught here, before any training.
Config config_from_flags();

// The help text: each trainer flag with its default and meaning.
std::string usage();

// The flags as given, {"name": value, ...} (JSON object), for the report.
std::string flags_json();

}  // namespace memlean::trainer
