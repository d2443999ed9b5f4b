// For memlean::fit's own tests: a look inside fit()'s checkpoint search, which the measured plans
// alone do not show (which candidates a search tries depends on the machine's module times).
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "ops/fit/planner.h"

namespace memlean::fit::testing {

// A checkpoint problem fit() built: its candidate runs [begin, end) of layers, the planner's
// problem (one candidate per run), the runs nested in each (a compound, planner.h: the runs
// its recompute checkpoints; empty for a plain run), and `predict_and_measure(chosen)`
// (chosen: disjoint indices into runs), which returns the planner's predicted peak of the
// step with those runs checkpointed and the peak measured when one such step runs.
struct CheckpointProblem {
  std::vector<std::pair<int64_t, int64_t>> runs;
  Problem problem;
  std::vector<std::vector<int>> nested;
  std::function<std::pair<int64_t, int64_t>(const std::vector<int>& chosen)> predict_and_measure;
};

// While set (not empty), fit() calls `observer` once for each checkpoint problem it builds,
// before its search. Not thread-safe: set it and call fit() from one thread.
using ProblemObserver = std::function<void(const CheckpointProblem&)>;
void set_problem_observer(ProblemObserver observer);

}  // namespace memlean::fit::testing
