// memlean::fit search: plan, measure, tighten (see search.h).
#include "ops/fit/search.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <vector>

namespace memlean::fit {

SearchResult search(const Problem& problem, int64_t budget_bytes, int64_t floor_bytes,
                    int64_t empty_peak_bytes, const MeasurePlan& measure,
                    const SearchOptions& options) {
  if (options.max_rounds < 0 || options.bisect_rounds < 0 || options.descent_rounds < 0) {
    throw std::invalid_argument("search: max_rounds, bisect_rounds and descent_rounds must be >= 0");
  }
  if (!measure) throw std::invalid_argument("search: measure must be callable");
  SearchResult result;
  result.least = least_peak_plan(problem, options.resolution);  // validates the problem
  result.least_measured_peak_bytes = empty_peak_bytes;

  std::map<std::vector<int>, int64_t> measured;  // chosen -> measured peak
  // Plans for `target` and measures the plan (once per plan): its measured peak, or nullopt
  // when nothing is predicted to fit the target.
  auto attempt = [&](int64_t target) -> std::optional<int64_t> {
    const Plan p = plan(problem, target, options.resolution);
    if (!p.feasible) return std::nullopt;
    auto it = measured.find(p.chosen);
    if (it == measured.end()) {
      int64_t peak = empty_peak_bytes;
      if (!p.chosen.empty()) {
        peak = measure(p);
        ++result.measured_plans;
      }
      it = measured.emplace(p.chosen, peak).first;
      result.least_measured_peak_bytes = std::min(result.least_measured_peak_bytes, peak);
      if (peak <= budget_bytes &&
          (!result.fastest || p.recompute_seconds < result.fastest->recompute_seconds)) {
        result.fastest = p;
        result.fastest_peak_bytes = peak;
      }
    }
    return it->second;
  };

  // 1. Down.
  std::optional<int64_t> low;       // a target whose plan fits
  int64_t high = budget_bytes + 1;  // a target whose plan does not
  int64_t target = budget_bytes;
  for (int round = 0; round < options.max_rounds && budget_bytes >= floor_bytes; ++round) {
    const auto peak = attempt(target);
    if (!peak) break;
    if (*peak <= budget_bytes) {
      low = target;
      break;
    }
    high = target;
    target -= *peak - budget_bytes;
  }
  // 2. The least-peak plan.
  if (!low && budget_bytes >= floor_bytes && result.least.feasible) {
    // (planned: the target at which plan() finds it; predicted may be lower, shared inputs
    // counted once)
    if (const auto peak = attempt(result.least.planned_peak_bytes);
        peak && *peak <= budget_bytes) {
      low = result.least.planned_peak_bytes;
    }
  }
  // 3. Up.
  if (low) {
    const int64_t gap = std::max<int64_t>(budget_bytes / 200, int64_t{1} << 16);
    for (int round = 0; round < options.bisect_rounds && high - *low > gap; ++round) {
      const int64_t middle = *low + (high - *low) / 2;
      const auto peak = attempt(middle);
      if (peak && *peak <= budget_bytes) {
        low = middle;
      } else {
        high = middle;
      }
    }
  }
  // 4. Below the least peak measured.
  if (!result.fastest) {
    if (result.least.feasible) attempt(result.least.planned_peak_bytes);
    for (int round = 0; round < options.descent_rounds; ++round) {
      const int64_t least = result.least_measured_peak_bytes;
      const auto peak = attempt(least - 1);
      if (!peak || *peak >= least || result.fastest) break;
    }
  }
  return result;
}

}  // namespace memlean::fit
