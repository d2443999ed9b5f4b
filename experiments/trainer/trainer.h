// The trainer: builds the model of a Config, trains it on its data with a progress display,
// and accounts its memory with memstats (the Swish blog post's phase table, docs/sources.md:
// data/forw/loss/back/step per step; the category split); writes the text summary and the
// JSON report.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "experiments/trainer/config.h"
#include "runtime/memstats/memstats.h"

namespace memlean::trainer {

struct Result {
  std::string model_description, data_description;
  int64_t num_parameters = 0;
  int threads = 0;
  std::vector<double> losses;  // one per step
  double seconds = 0;          // the training steps, wall clock
  double steps_per_second = 0;
  double steps_per_second_after_first = 0;  // without the first step (0 for one step)
  int64_t peak_bytes = 0;      // the most device bytes alive during training (memstats)
  std::vector<memstats::Mark> marks;  // 5 per step: data, forw, loss, back, step
  std::string memstats_json;          // memstats::Tracker::json()
  // After the last step's forward and loss, where the memory peaks (activations alive), and
  // after the last optimizer step.
  memstats::Categories categories, categories_end;
  // --memory_budget: memlean::fit's plan (FitPlan::str() and to_json()); empty when off.
  std::string fit_table, fit_json;
  int64_t fit_budget_bytes = 0;  // the plan's budget (--memory_budget's, or --fit_plan's)
  int64_t fit_checkpoints = 0, fit_sliced = 0, fit_peak_bytes = 0;  // (runs, MLPs sliced)
};

enum class ProgressMode { kBar, kLines, kNone };

// Trains as `config` says; progress on `progress` (stderr). Errors in the data (CIFAR-10)
// and sizes the model refuses are UsageErrors; anything failing later is a c10::Error or
// std::exception. With --memory_budget, memlean::fit first fits a step of the model (its
// chain of stages, then a "head" stage doing the rest of its forward) on the first batch,
// with the trainer's optimizer and loss, prints the plan on `plan_out` (when given) and
// trains with the plan; a budget that no plan fits is a UsageError naming --memory_budget.
// With --fit_plan, memlean::fit::apply_plan applies the plan in that file instead (a plan that
// does not match the model or peaks above its budget is a UsageError naming --fit_plan), and
// with --save_fit_plan the plan's JSON is written there.
Result train(const Config& config, std::ostream& progress, ProgressMode mode,
             std::ostream* plan_out = nullptr);

// The phase table (steps 1 to 3 and the last two when there are more than 6), the category
// splits and the throughput, as text.
std::string summary(const Config& config, const Result& result);

// {"flags": {...as given}, "config": {...resolved}, "model": ..., "loss": [...],
//  "steps_per_second": ..., "peak_bytes": ..., "fit": {...FitPlan::to_json()} or null,
//  "phases": {...}, "categories": {...}, ...}
std::string report_json(const Config& config, const Result& result);

// The whole program: parses args (without the program name), trains, prints the summary
// on `out`, progress and errors on `err`, writes the report. Returns the exit code: 0 done,
// 1 training failed, 2 bad flags or input data. stderr_is_tty picks the progress bar for
// --progress=auto.
int trainer_main(const std::vector<std::string>& args, std::ostream& out, std::ostream& err,
                 bool stderr_is_tty);

}  // namespace memlean::trainer
