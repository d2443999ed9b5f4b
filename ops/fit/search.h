// memlean::fit search: the measured loop around the planner that both memlean.fit (Python) and
// memlean::fit (C++) run. The planner's peak is a prediction; the search applies plans, has the
// caller measure each one, and keeps the fastest plan *measured* to fit, so a plan it returns
// never exceeds the budget.
//
// The loop (each distinct plan measured once):
//  1. Down: plan for the budget; while the measured peak exceeds the budget, lower the target
//     by the excess and plan again (at most max_rounds plans; none when the budget is below
//     floor_bytes, a part of the step no plan changes, e.g. the optimizer's step).
//  2. If none fitted: the least-peak plan (least_peak_plan).
//  3. Up: once a target's plan fits, bisect between it and the lowest target whose plan did
//     not fit, for a faster plan that fits (at most bisect_rounds, down to a gap of
//     max(budget / 200, 64 KiB)).
//  4. If still none fits: plan for just under the least peak measured so far, while that
//     measures lower (at most descent_rounds): plans measured above their predictions may hide
//     lower ones, and the least peak measured is what a FitError names.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>

#include "ops/fit/planner.h"

namespace memlean::fit {

struct SearchOptions {
  int resolution = 4096;  // the planner's
  int max_rounds = 8;
  int bisect_rounds = 4;
  int descent_rounds = 3;
};

struct SearchResult {
  std::optional<Plan> fastest;    // the fastest plan measured to fit; nullopt: none fits
  int64_t fastest_peak_bytes = 0;  // its measured peak
  // The least measured peak of every plan tried and of the step without checkpoints.
  int64_t least_measured_peak_bytes = 0;
  Plan least;  // least_peak_plan(problem): the planner's least prediction
  int measured_plans = 0;  // plans the caller measured
};

// Measures one training step under `plan` (never called with an empty plan: that one's peak
// is empty_peak_bytes) and returns its peak in bytes. Exceptions propagate out of search().
using MeasurePlan = std::function<int64_t(const Plan& plan)>;

// Throws std::invalid_argument for a bad problem (see validate()), resolution < 1 or negative
// round counts.
SearchResult search(const Problem& problem, int64_t budget_bytes, int64_t floor_bytes,
                    int64_t empty_peak_bytes, const MeasurePlan& measure,
                    const SearchOptions& options = {});

}  // namespace memlean::fit
