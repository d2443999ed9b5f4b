// Tests of memlean::fit::search (the measured loop of memlean.fit and memlean::fit) with
// synthetic measurements: exact ones, ones above the prediction, and random errors.
#include "ops/fit/search.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <stdexcept>
#include <vector>

#include "ops/fit/planner_examples.h"

namespace memlean::fit {
namespace {

using testing::example;

// A measurement: the prediction plus `error(chosen)`, and a log of the calls.
struct Measurer {
  const Problem& problem;
  std::function<int64_t(const std::vector<int>&)> error = [](const std::vector<int>&) { return 0; };
  std::vector<std::vector<int>> calls;
  std::map<std::vector<int>, int64_t> peaks;

  MeasurePlan fn() {
    return [this](const Plan& plan) {
      EXPECT_FALSE(plan.chosen.empty());  // the empty plan's peak is given, never measured
      calls.push_back(plan.chosen);
      const int64_t peak = predicted_peak(problem, plan.chosen) + error(plan.chosen);
      peaks[plan.chosen] = peak;
      return peak;
    };
  }
};

// What every result must satisfy: the plan returned was measured to fit, with that peak; the
// least measured peak is the least of the measurements and the empty plan's.
void expect_sound(const Problem& p, const SearchResult& r, const Measurer& m, int64_t budget,
                  int64_t empty_peak) {
  int64_t least = empty_peak;
  for (const auto& [chosen, peak] : m.peaks) least = std::min(least, peak);
  EXPECT_EQ(r.least_measured_peak_bytes, least);
  EXPECT_EQ(r.measured_plans, static_cast<int>(m.calls.size()));
  // Each plan measured once.
  EXPECT_EQ(m.peaks.size(), m.calls.size());
  if (r.fastest) {
    EXPECT_LE(r.fastest_peak_bytes, budget);
    if (r.fastest->chosen.empty()) {
      EXPECT_EQ(r.fastest_peak_bytes, empty_peak);
    } else {
      EXPECT_EQ(r.fastest_peak_bytes, m.peaks.at(r.fastest->chosen));
    }
    // The fastest among those measured to fit.
    for (const auto& [chosen, peak] : m.peaks) {
      if (peak > budget) continue;
      double seconds = 0;
      for (int c : chosen) seconds += p.candidates[c].seconds;
      EXPECT_GE(seconds, r.fastest->recompute_seconds);
    }
  } else {
    EXPECT_GT(least, budget);
  }
}

TEST(Search, ExactMeasurementsTakeThePlannersPlan) {
  const Problem p = example();
  for (int64_t budget : {200, 190, 180, 175}) {
    SCOPED_TRACE(budget);
    Measurer m{p};
    const SearchResult r = search(p, budget, 0, predicted_peak(p, {}), m.fn());
    expect_sound(p, r, m, budget, predicted_peak(p, {}));
    const Plan expected = plan(p, budget);
    ASSERT_TRUE(r.fastest.has_value());
    EXPECT_EQ(r.fastest->chosen, expected.chosen);
    EXPECT_LE(m.calls.size(), 1u + 4u);  // the plan, then at most the bisection
  }
}

TEST(Search, TightensWhenAPlanMeasuresOverItsPrediction) {
  // {3} (0.5 s, predicted 180) measures 15 bytes over: at budget 185 the search must not
  // return it, and finds {0} (1.0 s, 175) instead.
  const Problem p = example();
  Measurer m{p};
  m.error = [](const std::vector<int>& chosen) {
    return chosen == std::vector<int>{3} ? int64_t{15} : int64_t{0};
  };
  const SearchResult r = search(p, 185, 0, 200, m.fn());
  expect_sound(p, r, m, 185, 200);
  ASSERT_TRUE(r.fastest.has_value());
  EXPECT_EQ(r.fastest->chosen, std::vector<int>{0});
  EXPECT_EQ(r.fastest_peak_bytes, 175);
}

TEST(Search, BelowTheLeastPeakNamesTheLeastMeasured) {
  const Problem p = example();
  Measurer m{p};
  const SearchResult r = search(p, 150, 0, 200, m.fn());
  expect_sound(p, r, m, 150, 200);
  EXPECT_FALSE(r.fastest.has_value());
  EXPECT_EQ(r.least.predicted_peak_bytes, 175);
  EXPECT_EQ(r.least_measured_peak_bytes, 175);
}

TEST(Search, DescendsBelowALeastPlanThatMeasuresHigh) {
  // The least-peak plan {0} (predicted 175) measures 195; {3} (predicted 180) measures
  // exactly. At 178 nothing fits, and the search names 180 (planning for just under 195
  // finds {3}), not the least plan's 195; at 180 it returns {3}.
  const Problem p = example();
  auto error = [](const std::vector<int>& chosen) {
    return chosen == std::vector<int>{0} ? int64_t{20} : int64_t{0};
  };
  Measurer below{p, error};
  const SearchResult none = search(p, 178, 0, 200, below.fn());
  expect_sound(p, none, below, 178, 200);
  EXPECT_FALSE(none.fastest.has_value());
  EXPECT_EQ(none.least_measured_peak_bytes, 180);
  Measurer at{p, error};
  const SearchResult r = search(p, 180, 0, 200, at.fn());
  expect_sound(p, r, at, 180, 200);
  ASSERT_TRUE(r.fastest.has_value());
  EXPECT_EQ(r.fastest->chosen, std::vector<int>{3});
}

TEST(Search, FindsALeastPlanWhoseSharedInputsTheProgramsCountTwice) {
  // Six atoms of 40 bytes; [0,2), [2,4) and [4,6) each keep 10 bytes: the same 10-byte input
  // (as a DenseNet layer keeps its block's earlier maps). The programs count it per reader:
  // their least is {0, 1} at 100 (forward end 10 + 10 + 80), which lives at 90. Under a
  // budget of 95 the search must measure that plan (planning for its planned peak, not its
  // predicted one, at which the programs find nothing) and return it.
  Problem p;
  p.atom_saved_bytes = {40, 40, 40, 40, 40, 40};
  p.candidates = {{0, 2, 70, 1.0, 0, 10}, {2, 4, 70, 1.0, 0, 10}, {4, 6, 70, 1.0, 0, 10}};
  p.shared_inputs = {{10, {0, 1, 2}}};
  EXPECT_EQ(predicted_peak(p, {0, 1}), 90);
  EXPECT_EQ(predicted_peak(p, {0, 1, 2}), 90);
  Measurer m{p};
  const SearchResult r = search(p, 95, 0, 240, m.fn());
  expect_sound(p, r, m, 95, 240);
  EXPECT_EQ(r.least.planned_peak_bytes, 100);
  EXPECT_EQ(r.least.predicted_peak_bytes, 90);
  ASSERT_TRUE(r.fastest.has_value());
  EXPECT_EQ(r.fastest->chosen, (std::vector<int>{0, 1}));
  EXPECT_EQ(r.fastest_peak_bytes, 90);
  // Found at once: the least plan was the first measured (a descent from the step without
  // checkpoints finds it too here, after measuring {0}; in DenseNet-121 its 3 rounds did not).
  EXPECT_EQ(m.calls, (std::vector<std::vector<int>>{{0, 1}}));
}

TEST(Search, BudgetBelowTheFloorFitsNothing) {
  // Every step peaks at 195 or more (the optimizer's step, say): at 190 nothing fits, and the
  // least measured is named.
  const Problem p = example();
  Measurer m{p};
  m.error = [&p](const std::vector<int>& chosen) {
    return std::max<int64_t>(0, 195 - predicted_peak(p, chosen));
  };
  const SearchResult r = search(p, 190, /*floor_bytes=*/195, 200, m.fn());
  expect_sound(p, r, m, 190, 200);
  EXPECT_FALSE(r.fastest.has_value());
  EXPECT_EQ(r.least_measured_peak_bytes, 195);
}

TEST(Search, RandomErrorsNeverReturnAPlanOverBudget) {
  std::mt19937_64 rng(29);
  for (int instance = 0; instance < 200; ++instance) {
    SCOPED_TRACE(instance);
    Problem p;
    p.base_bytes = std::uniform_int_distribution<int64_t>(0, 1000)(rng);
    const int n = std::uniform_int_distribution<int>(1, 7)(rng);
    for (int k = 0; k < n; ++k) {
      p.atom_saved_bytes.push_back(std::uniform_int_distribution<int64_t>(0, 500)(rng));
      p.atom_backward_extra_bytes.push_back(std::uniform_int_distribution<int64_t>(0, 300)(rng));
    }
    for (int b = 0; b < n; ++b) {
      for (int e = b + 1; e <= n; ++e) {
        if (std::uniform_int_distribution<int>(0, 2)(rng) == 0) continue;
        p.candidates.push_back({b, e, std::uniform_int_distribution<int64_t>(0, 800)(rng),
                                double(std::uniform_int_distribution<int>(0, 5)(rng)),
                                std::uniform_int_distribution<int64_t>(0, 100)(rng)});
      }
    }
    // Errors from -5 % to +20 % of the prediction, fixed per plan.
    std::map<std::vector<int>, int64_t> errors;
    Measurer m{p};
    m.error = [&](const std::vector<int>& chosen) {
      auto it = errors.find(chosen);
      if (it == errors.end()) {
        const int64_t predicted = predicted_peak(p, chosen);
        it = errors.emplace(chosen, std::uniform_int_distribution<int64_t>(
                                        -predicted / 20, predicted / 5)(rng)).first;
      }
      return it->second;
    };
    const int64_t empty_peak = predicted_peak(p, {});
    const int64_t budget = std::uniform_int_distribution<int64_t>(p.base_bytes, empty_peak)(rng);
    const SearchResult r = search(p, budget, 0, empty_peak, m.fn());
    expect_sound(p, r, m, budget, empty_peak);
  }
}

TEST(Search, MeasureErrorsPropagateAndBadOptionsAreNamed) {
  const Problem p = example();
  EXPECT_THROW(search(p, 180, 0, 200, [](const Plan&) -> int64_t { throw std::runtime_error("x"); }),
               std::runtime_error);
  SearchOptions bad;
  bad.bisect_rounds = -1;
  try {
    search(p, 180, 0, 200, [](const Plan&) { return int64_t{0}; }, bad);
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("bisect_rounds"), std::string::npos);
  }
  EXPECT_THROW(search(p, 180, 0, 200, MeasurePlan{}), std::invalid_argument);
}

}  // namespace
}  // namespace memlean::fit
