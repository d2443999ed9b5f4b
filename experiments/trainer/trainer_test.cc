// Tests of the trainer: flag parsing and checking, the CIFAR-10 reader (tiny files written
// here, garbled and missing ones too), synthetic data, a 2-step run of every model at tiny
// sizes, repeatability, the progress display, the summary and the JSON report.
#include <ATen/ATen.h>
#include <absl/flags/reflection.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "experiments/trainer/config.h"
#include "experiments/trainer/data.h"
#include "experiments/trainer/trainer.h"
#include "third_party/torch/devices.h"

namespace memlean::trainer {
namespace {

namespace fs = std::filesystem;
using Args = std::vector<std::string>;

// Parses args into the flags (restored after each test) and returns the Config.
class TrainerTest : public ::testing::Test {
 protected:
  // Each call starts from the defaults: the flags it sets are restored on return.
  Config parse(const Args& args) {
    absl::FlagSaver saver;
    EXPECT_TRUE(parse_flags(args));
    return config_from_flags();
  }
  int main(const Args& args, std::ostream& out, std::ostream& err) {
    absl::FlagSaver saver;
    return trainer_main(args, out, err, false);
  }
  // The UsageError message of parsing args and making the Config.
  std::string error(const Args& args) {
    absl::FlagSaver saver;
    try {
      if (parse_flags(args)) config_from_flags();
    } catch (const UsageError& e) {
      return e.what();
    }
    ADD_FAILURE() << "no UsageError for " << ::testing::PrintToString(args);
    return "";
  }
  fs::path temp(const std::string& name) {
    const char* t = std::getenv("TEST_TMPDIR");
    fs::path p = fs::path(t ? t : "/tmp") / name;
    fs::remove_all(p);
    fs::create_directories(p);
    return p;
  }

 private:
  absl::FlagSaver saver_;
};

const Args kTinyMlp = {"--model=mlp", "--mlp_in=8", "--mlp_hidden=32", "--batch=16", "--steps=2",
                       "--progress=none"};
const Args kTinyDenseNet = {"--model=densenet_bc", "--densenet_depth=10", "--densenet_growth=4",
                            "--image_size=8", "--batch=4", "--steps=2", "--progress=none"};
const Args kTinyEfficientNet = {"--model=efficientnet_b0", "--efficientnet_width=0.25",
                                "--efficientnet_depth=0.25", "--image_size=32", "--num_classes=10",
                                "--batch=4", "--steps=2", "--progress=none"};

Args with(Args a, const Args& more) {
  a.insert(a.end(), more.begin(), more.end());
  return a;
}

// ---- flags -------------------------------------------------------------------------------

TEST_F(TrainerTest, Defaults) {
  const Config c = parse({});
  EXPECT_EQ(c.model, "mlp");
  EXPECT_EQ(c.swish, models::Activation::kMemoryEfficient);
  EXPECT_EQ(c.checkpoint, models::Checkpointing::none());
  EXPECT_EQ(c.batch, 64);
  EXPECT_EQ(c.steps, 20);
  EXPECT_EQ(c.optimizer, "sgd");
  EXPECT_DOUBLE_EQ(c.lr, 1e-4);
  // --device=auto: CUDA when torch sees a GPU.
  EXPECT_EQ(c.device, memlean::have_cuda_device() ? "cuda" : "cpu");
  EXPECT_FALSE(c.cifar10());
  EXPECT_EQ(c.mlp_in, 128);
  EXPECT_EQ(c.mlp_hidden, 1 << 20);
  EXPECT_EQ(c.mlp_out, 1);
  EXPECT_EQ(c.loss_name(), "mse");
  EXPECT_EQ(c.activation_name(), "memory_efficient");
}

TEST_F(TrainerTest, ParsesEveryForm) {
  const Config c = parse({"--model=efficientnet_b0", "--swish", "inplace", "-checkpoint=segments:3",
                          "--batch", "8", "--steps=2", "--optimizer=adam", "--threads=1",
                          "--seed=7", "--data=synthetic", "--progress=lines"});
  EXPECT_EQ(c.model, "efficientnet_b0");
  EXPECT_EQ(c.swish, models::Activation::kInplace);
  EXPECT_EQ(c.checkpoint, models::Checkpointing::segments_of(3));
  EXPECT_EQ(c.batch, 8);
  EXPECT_EQ(c.steps, 2);
  EXPECT_EQ(c.optimizer, "adam");
  EXPECT_DOUBLE_EQ(c.lr, 1e-3);
  EXPECT_EQ(c.threads, 1);
  EXPECT_EQ(c.seed, 7u);
  EXPECT_EQ(c.num_classes, 1000);
  EXPECT_EQ(c.image_size, 224);
  EXPECT_EQ(c.loss_name(), "cross_entropy");
  EXPECT_EQ(parse({"--model=densenet_bc", "--swish=silu"}).activation_name(), "relu");
  EXPECT_DOUBLE_EQ(parse({"--model=densenet_bc"}).lr, 0.1);
  EXPECT_DOUBLE_EQ(parse({"--lr=0.5"}).lr, 0.5);
  EXPECT_DOUBLE_EQ(parse({"--mlp_hidden=1024"}).lr, 0.05);  // capped
}

TEST_F(TrainerTest, RelativePathsAreFromWhereBazelRunWasTyped) {
  const fs::path dir = temp("bazel_run");
  ASSERT_EQ(setenv("BUILD_WORKING_DIRECTORY", dir.c_str(), 1), 0);
  const Config c = parse({"--report=r.json", "--data=cifar10:cifar"});
  unsetenv("BUILD_WORKING_DIRECTORY");
  EXPECT_EQ(c.report, (dir / "r.json").string());
  EXPECT_EQ(c.cifar_dir, (dir / "cifar").string());
  EXPECT_EQ(parse({"--report=/tmp/x.json"}).report, "/tmp/x.json");
}

TEST_F(TrainerTest, HelpListsTheFlags) {
  EXPECT_FALSE(parse_flags({"--help"}));
  EXPECT_FALSE(parse_flags({"-h"}));
  const std::string u = usage();
  for (const char* f : {"--model", "--swish", "--checkpoint", "--batch", "--steps", "--optimizer",
                        "--lr", "--threads", "--device", "--data", "--seed", "--report"}) {
    EXPECT_NE(u.find(std::string(f) + " (default"), std::string::npos) << f;
  }
  EXPECT_EQ(u.find("--flagfile"), std::string::npos);  // only the trainer's own flags
}

TEST_F(TrainerTest, BadFlagsNameTheFlag) {
  const std::vector<std::pair<Args, std::string>> cases = {
      {{"--nope=1"}, "unknown flag --nope (the flags are --batch, "},
      {{"extra"}, "unexpected argument 'extra'"},
      {{"--batch"}, "--batch: missing value"},
      {{"--batch=abc"}, "--batch: 'abc' is not a valid integer"},
      {{"--lr=fast"}, "--lr: 'fast' is not a valid number"},
      {{"--seed=-1"}, "--seed: '-1' is not a valid non-negative integer"},
      {{"--model=resnet"}, "--model: unknown model 'resnet'; expected mlp, densenet_bc or efficientnet_b0"},
      {{"--swish=relu"}, "--swish: unknown activation 'relu'; expected one of naive, memory_efficient"},
      {{"--checkpoint=segments:0"}, "--checkpoint: checkpoint 'segments:0': K in segments:K must be a positive integer"},
      {{"--checkpoint=all"}, "--checkpoint: unknown checkpoint mode 'all'"},
      {{"--batch=0"}, "--batch: must be >= 1, got 0"},
      {{"--steps=-2"}, "--steps: must be >= 1"},
      {{"--optimizer=lbfgs"}, "--optimizer: unknown optimizer 'lbfgs'"},
      {{"--lr=-1"}, "--lr: must be >= 0"},
      {{"--momentum=1"}, "--momentum: must be in [0, 1)"},
      {{"--threads=-1"}, "--threads: must be >= 0"},
      {{"--device=tpu"}, "--device: "},
      {{"--data=imagenet"}, "--data: unknown data 'imagenet'; expected synthetic or cifar10:<dir>"},
      {{"--data=cifar10:"}, "--data: cifar10:<dir> needs a folder"},
      {{"--data=cifar10:/x", "--num_classes=100"}, "--num_classes: CIFAR-10 has 10 classes"},
      {{"--data=cifar10:/x", "--image_size=64"}, "--image_size: CIFAR-10 images are 32 x 32"},
      {{"--report=/no/such/folder/r.json"}, "--report: the folder /no/such/folder does not exist"},
      {{"--progress=fancy"}, "--progress: unknown mode 'fancy'"},
      {{"--densenet_depth=12"}, "--densenet_depth: must be 6 * n + 4"},
      {{"--efficientnet_width=0"}, "--efficientnet_width: must be > 0"},
      {{"--model=efficientnet_b0", "--batch=1", "--image_size=32"},
       "--batch: batch norm in training needs at least 2 values per channel"},
      {{"--memory_budget=lots"}, "--memory_budget: no number, got 'lots'"},
      {{"--memory_budget=5 parsecs"}, "--memory_budget: unknown unit 'parsecs'"},
      {{"--memory_budget=0"}, "--memory_budget: a budget must be at least one byte"},
      {{"--memory_budget=1GiB", "--checkpoint=segments:2"},
       "--memory_budget: memlean::fit chooses what to checkpoint itself; use it with "
       "--checkpoint=none (got --checkpoint=segments:2)"},
      {{"--save_fit_plan=plan.json"}, "--save_fit_plan: needs --memory_budget"},
      {{"--memory_budget=1GiB", "--save_fit_plan=/no/such/folder/plan.json"},
       "--save_fit_plan: the folder /no/such/folder does not exist"},
      {{"--fit_plan=/no/such/plan.json"}, "--fit_plan: no file /no/such/plan.json"},
      {{"--fit_plan=/no/such/plan.json", "--memory_budget=1GiB"},
       "--fit_plan: applies a plan made for its own budget; use it without --memory_budget"},
      {{"--fit_plan=/no/such/plan.json", "--checkpoint=memlean"},
       "--fit_plan: the plan says what to checkpoint; use it with --checkpoint=none"},
  };
  for (const auto& [args, want] : cases) {
    const std::string got = error(args);
    EXPECT_NE(got.find(want), std::string::npos) << "args " << ::testing::PrintToString(args)
                                                  << "\n got: " << got << "\nwant: " << want;
  }
}

TEST_F(TrainerTest, CudaWithoutAGpuIsAUsageError) {
  if (at::hasCUDA()) GTEST_SKIP() << "this machine has a GPU";
  EXPECT_NE(error({"--device=cuda"}).find("--device: memstats: device 'cuda' was asked for, but CUDA is not available"),
            std::string::npos);
}

// ---- CIFAR-10 ------------------------------------------------------------------------------

// A CIFAR-10 binary file of the given labels; image i's pixels are (i + 1) * (p % 7).
void write_cifar(const fs::path& file, const std::vector<int>& labels) {
  std::ofstream out(file, std::ios::binary);
  for (size_t i = 0; i < labels.size(); ++i) {
    out.put(static_cast<char>(labels[i]));
    for (int64_t p = 0; p < kCifarPixels; ++p) out.put(static_cast<char>((i + 1) * (p % 7)));
  }
}

TEST_F(TrainerTest, ReadsCifar10) {
  const fs::path dir = temp("cifar");
  write_cifar(dir / "data_batch_2.bin", {3, 4});
  write_cifar(dir / "data_batch_1.bin", {0, 9, 5});
  write_cifar(dir / "test_batch.bin", {1});
  std::ofstream(dir / "batches.meta.txt") << "airplane\n";
  const Cifar10 data = read_cifar10(dir.string());
  ASSERT_EQ(data.files.size(), 2u);
  EXPECT_EQ(fs::path(data.files[0]).filename(), "data_batch_1.bin");
  EXPECT_EQ(data.size(), 5);
  EXPECT_EQ(data.labels, (std::vector<uint8_t>{0, 9, 5, 3, 4}));
  ASSERT_EQ(data.pixels.size(), 5u * kCifarPixels);
  EXPECT_EQ(data.pixels[kCifarPixels + 3], 2 * 3);  // image 1 of file 1, pixel 3

  auto source = cifar10_batches(data, 4, 0);
  EXPECT_EQ(source->describe(), "CIFAR-10, 5 images from 2 file(s)");
  std::vector<int64_t> seen;
  for (int i = 0; i < 3; ++i) {
    const Batch b = source->next();
    EXPECT_EQ(b.input.sizes(), (std::vector<int64_t>{4, 3, 32, 32}));
    EXPECT_EQ(b.input.scalar_type(), at::kFloat);
    EXPECT_EQ(b.target.scalar_type(), at::kLong);
    for (int64_t j = 0; j < 4; ++j) seen.push_back(b.target[j].item<int64_t>());
    // The first red pixel is 0 in every image: (0 - mean) / std.
    EXPECT_NEAR(b.input[0][0][0][0].item<double>(), -0.4914 / 0.2470, 1e-5);
    EXPECT_NEAR(b.input[3][0][0][0].item<double>(), -0.4914 / 0.2470, 1e-5);
  }
  // The first 5 draws are one epoch: every image once.
  std::vector<int64_t> epoch(seen.begin(), seen.begin() + 5);
  std::sort(epoch.begin(), epoch.end());
  EXPECT_EQ(epoch, (std::vector<int64_t>{0, 3, 4, 5, 9}));
}

TEST_F(TrainerTest, MissingOrGarbledCifar10IsAUsageError) {
  auto message = [](const std::string& dir) {
    try {
      read_cifar10(dir);
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const fs::path root = temp("bad_cifar");
  EXPECT_NE(message((root / "missing").string()).find("--data: CIFAR-10 folder " + (root / "missing").string() + " does not exist"),
            std::string::npos);
  std::ofstream(root / "file.bin") << "x";
  EXPECT_NE(message((root / "file.bin").string()).find("is not a folder"), std::string::npos);
  fs::create_directories(root / "empty");
  std::ofstream(root / "empty" / "test_batch.bin") << "x";
  EXPECT_NE(message((root / "empty").string()).find("no data_batch_*.bin in"), std::string::npos);
  fs::create_directories(root / "zero");
  std::ofstream(root / "zero" / "data_batch_1.bin");
  EXPECT_NE(message((root / "zero").string()).find("garbled CIFAR-10 file"), std::string::npos);
  EXPECT_NE(message((root / "zero").string()).find("it is empty"), std::string::npos);
  fs::create_directories(root / "short");
  write_cifar(root / "short" / "data_batch_1.bin", {1, 2});
  fs::resize_file(root / "short" / "data_batch_1.bin", 2 * kCifarRecord - 10);
  EXPECT_NE(message((root / "short").string()).find("6136 bytes is not a whole number of records of 3073 bytes"),
            std::string::npos);
  fs::create_directories(root / "label");
  write_cifar(root / "label" / "data_batch_1.bin", {1, 10});
  EXPECT_NE(message((root / "label").string()).find("record 1 has label 10 (labels are 0 to 9)"),
            std::string::npos);
}

TEST_F(TrainerTest, SyntheticDataIsRepeatable) {
  auto a = synthetic_images(4, 10, 8, 1), b = synthetic_images(4, 10, 8, 1), c = synthetic_images(4, 10, 8, 2);
  for (int i = 0; i < 3; ++i) {
    const Batch x = a->next(), y = b->next(), z = c->next();
    EXPECT_TRUE(at::equal(x.input, y.input));
    EXPECT_TRUE(at::equal(x.target, y.target));
    EXPECT_FALSE(at::equal(x.input, z.input));
    EXPECT_EQ(x.input.sizes(), (std::vector<int64_t>{4, 3, 8, 8}));
    EXPECT_EQ(x.target.max().item<int64_t>() < 10, true);
  }
  auto r = synthetic_regression(5, 3, 2, 0);
  const Batch batch = r->next();
  EXPECT_EQ(batch.input.sizes(), (std::vector<int64_t>{5, 3}));
  EXPECT_EQ(batch.target.sizes(), (std::vector<int64_t>{5, 2}));
  EXPECT_LE(batch.target.abs().max().item<double>(), 1.0);
}

// ---- training ------------------------------------------------------------------------------

class TrainerRun : public TrainerTest {
 public:
  Result train_with(const Args& args, ProgressMode mode = ProgressMode::kNone,
                    std::string* progress = nullptr) {
    const Config c = parse(args);
    std::ostringstream out;
    Result r = train(c, out, mode);
    if (progress) *progress = out.str();
    return r;
  }
};

TEST_F(TrainerRun, TwoStepsOfEveryModel) {
  for (const Args& args : {kTinyMlp, kTinyDenseNet, kTinyEfficientNet}) {
    const Result r = train_with(args);
    ASSERT_EQ(r.losses.size(), 2u);
    for (double l : r.losses) EXPECT_TRUE(std::isfinite(l));
    EXPECT_EQ(r.marks.size(), 10u);
    EXPECT_EQ(r.marks[0].name, "data");
    EXPECT_EQ(r.marks[4].name, "step");
    EXPECT_EQ(r.marks[9].step, 2);
    EXPECT_GT(r.peak_bytes, 0);
    EXPECT_GT(r.num_parameters, 0);
    EXPECT_GT(r.steps_per_second, 0);
    // Categories add up, and the last forward's activations are alive at the peak.
    const auto& k = r.categories;
    EXPECT_EQ(k.parameters + k.buffers + k.gradients + k.optimizer_state + k.activations + k.other +
                  k.allocator_rounding,
              k.total);
    EXPECT_GT(k.activations, 0);
    EXPECT_GE(k.parameters, r.num_parameters * 4);
    EXPECT_GT(r.categories_end.gradients, 0);
    EXPECT_EQ(r.categories_end.activations, 0);
  }
}

TEST_F(TrainerRun, SameFlagsSameLossCurve) {
  for (const Args& args : {kTinyMlp, kTinyEfficientNet}) {
    EXPECT_EQ(train_with(args).losses, train_with(args).losses);
    EXPECT_NE(train_with(args).losses, train_with(with(args, {"--seed=3"})).losses);
  }
}

TEST_F(TrainerRun, LossFallsOnTinyConfigurations) {
  for (const Args& args : {with(kTinyMlp, {"--steps=15", "--mlp_hidden=256"}),
                           with(kTinyDenseNet, {"--steps=15", "--batch=16", "--image_size=16"}),
                           with(kTinyEfficientNet, {"--steps=15", "--batch=16"})}) {
    const Result r = train_with(args);
    double first = 0, last = 0;
    for (int i = 0; i < 3; ++i) {
      first += r.losses[i];
      last += r.losses[r.losses.size() - 1 - i];
    }
    EXPECT_LT(last, first) << ::testing::PrintToString(args);
  }
}

TEST_F(TrainerRun, SwishVariantsGiveTheSameLossCurve) {
  // (64 x 64 images and batch 8: batch norm over a few values per channel would amplify the
  // last-bit differences between the variants' float32 results.)
  for (const Args& base : {kTinyMlp, with(kTinyEfficientNet, {"--image_size=64", "--batch=8"})}) {
    const auto ref = train_with(with(base, {"--swish=naive", "--steps=3"})).losses;
    for (const char* v : {"memory_efficient", "inplace", "silu", "silu_inplace"}) {
      const auto got = train_with(with(base, {std::string("--swish=") + v, "--steps=3"})).losses;
      ASSERT_EQ(got.size(), ref.size());
      for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], 1e-4 * ref[i]) << v;
    }
  }
}

TEST_F(TrainerRun, CheckpointingGivesTheSameLossCurveInLessMemory) {
  const Args base = with(kTinyDenseNet, {"--densenet_growth=8", "--image_size=16", "--steps=2"});
  const Result plain = train_with(base);
  const Result efficient = train_with(with(base, {"--checkpoint=memlean"}));
  const Result segments = train_with(with(base, {"--checkpoint=segments:3"}));
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_NEAR(efficient.losses[i], plain.losses[i], 1e-5 * plain.losses[i]);
    EXPECT_NEAR(segments.losses[i], plain.losses[i], 1e-5 * plain.losses[i]);
  }
  EXPECT_LT(efficient.categories.activations, plain.categories.activations);
  EXPECT_LT(segments.categories.activations, plain.categories.activations);
}

// The Mlp's layers are fit's chain (fc1, its activation, fc2): below what checkpoints reach
// (their recompute makes the 16 MiB hidden tensor again, and the activation's output), fit
// slices the MLP (here a least of 10.8 MB against an eager 54.8 MB); the same losses, within
// the budget.
TEST_F(TrainerRun, MemoryBudgetSlicesTheMlp) {
  const Args base = with(kTinyMlp, {"--mlp_in=64", "--mlp_hidden=8192", "--batch=512",
                                    "--steps=3", "--threads=1", "--swish=silu"});
  const Result plain = train_with(base);
  const Result eager = train_with(with(base, {"--memory_budget=1TiB"}));
  const int64_t budget = eager.fit_peak_bytes / 4;
  const Result fitted = train_with(with(base, {"--memory_budget=" + std::to_string(budget)}));
  EXPECT_NE(fitted.fit_json.find("\"sliced\": [[0, 3]]"), std::string::npos) << fitted.fit_table;
  EXPECT_NE(fitted.fit_table.find("sliced mlp"), std::string::npos) << fitted.fit_table;
  EXPECT_EQ(fitted.fit_sliced, 1);
  EXPECT_LE(fitted.fit_peak_bytes, budget) << fitted.fit_table;
  ASSERT_EQ(fitted.losses.size(), plain.losses.size());
  for (size_t i = 0; i < plain.losses.size(); ++i) {
    EXPECT_NEAR(fitted.losses[i], plain.losses[i], 1e-5 * plain.losses[i]);
  }
}

// A plan's JSON without its recompute times (apply_plan measures them where it runs).
std::string without_times(const std::string& json) {
  static const std::regex kSeconds("\"recompute_seconds\": [-+.0-9eE]+");
  return std::regex_replace(json, kSeconds, "\"recompute_seconds\": _");
}

// --save_fit_plan writes the plan memlean::fit made; --fit_plan applies it in a later run
// (another rank, the job restarted) with memlean::fit::apply_plan, without fit's search: the
// same plan (its JSON: the sliced MLP, the peak to the byte; its recompute times this run's)
// and the same losses. A plan for another model is a usage error naming --fit_plan.
TEST_F(TrainerRun, AFitPlanSavedIsAppliedByALaterRun) {
  const Args base = with(kTinyMlp, {"--mlp_in=64", "--mlp_hidden=8192", "--batch=512",
                                    "--steps=3", "--threads=1", "--swish=silu"});
  const Result eager = train_with(with(base, {"--memory_budget=1TiB"}));
  const std::string path = (temp("fit_plan") / "plan.json").string();
  const Result fitted = train_with(with(base, {"--memory_budget=" +
                                                   std::to_string(eager.fit_peak_bytes / 4),
                                               "--save_fit_plan=" + path}));
  EXPECT_EQ(fitted.fit_sliced, 1) << fitted.fit_table;
  const Result applied = train_with(with(base, {"--fit_plan=" + path}));
  EXPECT_EQ(without_times(applied.fit_json), without_times(fitted.fit_json));
  EXPECT_NE(without_times(fitted.fit_json), fitted.fit_json);  // (times were there)
  EXPECT_EQ(applied.fit_budget_bytes, eager.fit_peak_bytes / 4);
  EXPECT_EQ(applied.losses, fitted.losses);
  try {
    train_with(with(kTinyEfficientNet, {"--threads=1", "--fit_plan=" + path}));
    ADD_FAILURE() << "another model's plan was applied";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "--fit_plan: memlean::fit::apply_plan: plan does not match this model's "
                  "training step"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(TrainerTest, MemoryBudgetParses) {
  EXPECT_EQ(parse({}).memory_budget, 0);
  EXPECT_EQ(parse({"--memory_budget=2.5MB"}).memory_budget, 2500000);
  EXPECT_EQ(parse({"--memory_budget", "3 GiB"}).memory_budget, int64_t{3} << 30);
}

TEST_F(TrainerRun, MemoryBudgetTrainsTheSameLossCurveWithinTheBudget) {
  const Args base = with(kTinyEfficientNet, {"--steps=3", "--threads=1"});
  const Result plain = train_with(base);
  EXPECT_TRUE(plain.fit_json.empty());
  // A budget that the eager step fits: no checkpoint, fit's peak is the eager peak.
  const Result eager = train_with(with(base, {"--memory_budget=1TiB"}));
  EXPECT_EQ(eager.fit_checkpoints, 0);
  EXPECT_NE(eager.fit_json.find("\"checkpointed\": []"), std::string::npos) << eager.fit_json;
  // 5% below the eager peak: checkpoints, within the budget, the same losses.
  const int64_t budget = eager.fit_peak_bytes - eager.fit_peak_bytes / 20;
  const Result fitted = train_with(with(base, {"--memory_budget=" + std::to_string(budget)}));
  EXPECT_GT(fitted.fit_checkpoints, 0) << fitted.fit_table;
  EXPECT_LE(fitted.fit_peak_bytes, budget) << fitted.fit_table;
  EXPECT_LT(fitted.peak_bytes, plain.peak_bytes);
  ASSERT_EQ(fitted.losses.size(), plain.losses.size());
  for (size_t i = 0; i < plain.losses.size(); ++i) {
    EXPECT_NEAR(fitted.losses[i], plain.losses[i], 1e-5 * plain.losses[i]);
    EXPECT_NEAR(eager.losses[i], plain.losses[i], 1e-5 * plain.losses[i]);
  }
  // DenseNet-BC (its features, then the head stage): the same losses too.
  const Args dense = with(kTinyDenseNet, {"--densenet_depth=16", "--densenet_growth=8",
                                          "--image_size=16", "--batch=8", "--threads=1"});
  const Result dense_plain = train_with(dense);
  const Result dense_eager = train_with(with(dense, {"--memory_budget=1TiB"}));
  const int64_t dense_budget = dense_eager.fit_peak_bytes - dense_eager.fit_peak_bytes / 50;
  const Result dense_fitted = train_with(with(dense, {"--memory_budget=" + std::to_string(dense_budget)}));
  EXPECT_GT(dense_fitted.fit_checkpoints, 0) << dense_fitted.fit_table;
  EXPECT_LE(dense_fitted.fit_peak_bytes, dense_budget);
  for (size_t i = 0; i < dense_plain.losses.size(); ++i) {
    EXPECT_NEAR(dense_fitted.losses[i], dense_plain.losses[i], 1e-5 * dense_plain.losses[i]);
  }
}

TEST_F(TrainerRun, ProgressLinesAndBar) {
  std::string lines, bar, none;
  train_with(kTinyMlp, ProgressMode::kLines, &lines);
  EXPECT_NE(lines.find("step 1/2  loss "), std::string::npos) << lines;
  EXPECT_NE(lines.find("step 2/2  loss "), std::string::npos) << lines;
  EXPECT_NE(lines.find(" steps/s  mem "), std::string::npos) << lines;
  EXPECT_NE(lines.find(" MiB  peak "), std::string::npos) << lines;
  EXPECT_EQ(lines.find('\r'), std::string::npos);
  train_with(kTinyMlp, ProgressMode::kBar, &bar);
  EXPECT_NE(bar.find("\r[############............] 1/2  loss "), std::string::npos) << bar;
  EXPECT_NE(bar.find("\r[########################] 2/2  loss "), std::string::npos) << bar;
  EXPECT_EQ(bar.back(), '\n');
  train_with(kTinyMlp, ProgressMode::kNone, &none);
  EXPECT_EQ(none, "");
}

TEST_F(TrainerTest, MainWritesTheSummaryAndTheReport) {
  const fs::path dir = temp("main");
  const std::string report = (dir / "run.json").string();
  std::ostringstream out, err;
  ASSERT_EQ(main(with(kTinyDenseNet, {"--report=" + report, "--progress=lines"}), out, err), 0)
      << err.str();
  const std::string s = out.str();
  for (const char* want : {"memlean trainer: densenet_bc (", "activation relu, checkpoint none, batch 4, 2 steps",
                           "memstats cpu: bytes alive at the end of each phase (MiB)", "step 1", "step 2",
                           "\ndata ", "\nforw ", "\nloss ", "\nback ", "\nstep ", "\n(peak) ",
                           "memory by category after the last forward and loss", "activations",
                           "optimizer state", "report: "}) {
    EXPECT_NE(s.find(want), std::string::npos) << want << "\n" << s;
  }
  // The categories after forward are not the peak, and the report must not call them so.
  EXPECT_EQ(s.find("(the peak)"), std::string::npos) << s;
  EXPECT_NE(err.str().find("step 2/2"), std::string::npos);
  std::ifstream in(report);
  std::stringstream json;
  json << in.rdbuf();
  const std::string j = json.str();
  for (const char* want : {"\"flags\": {", "\"model\": \"densenet_bc\"", "\"config\": {", "\"loss\": [",
                           "\"steps_per_second\": ", "\"peak_bytes\": ", "\"phases\": {", "\"data\": {\"current\": [",
                           "\"categories\": {\"parameters\": ", "\"categories_end\": ", "\"memstats\": {\"device\": \"cpu\""}) {
    EXPECT_NE(j.find(want), std::string::npos) << want << "\n" << j;
  }
}

TEST_F(TrainerTest, MainExitCodes) {
  std::ostringstream out, err;
  EXPECT_EQ(main({"--help"}, out, err), 0);
  EXPECT_NE(out.str().find("--model (default: mlp)"), std::string::npos);
  EXPECT_EQ(main({"--batch=x"}, out, err), 2);
  EXPECT_NE(err.str().find("trainer: --batch: 'x' is not a valid integer"), std::string::npos);
  const fs::path dir = temp("main_cifar");
  std::ofstream(dir / "data_batch_1.bin") << "garbage";
  std::ostringstream err2;
  EXPECT_EQ(main({"--model=mlp", "--mlp_hidden=8", "--data=cifar10:" + dir.string()}, out, err2), 2);
  EXPECT_NE(err2.str().find("trainer: --data: garbled CIFAR-10 file"), std::string::npos) << err2.str();
  std::ostringstream err3;
  EXPECT_EQ(main(with(kTinyDenseNet, {"--checkpoint=segments:9"}), out, err3), 2);
  EXPECT_NE(err3.str().find("the model refuses these options: DenseNetBC: checkpoint segments:9 asks for more segments than the model has stages (7)"),
            std::string::npos)
      << err3.str();
  std::ostringstream out4, err4;
  EXPECT_EQ(main(with(kTinyMlp, {"--memory_budget=1B"}), out4, err4), 2);
  EXPECT_NE(err4.str().find("trainer: --memory_budget: memlean::fit: no choice of checkpoints fits "
                            "budget_bytes = 1 bytes (0.00 GiB): the least peak reached is "),
            std::string::npos)
      << err4.str();
  EXPECT_EQ(out4.str(), "");
}

}  // namespace
}  // namespace memlean::trainer
