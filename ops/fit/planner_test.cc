// Tests of the memlean::fit planner: a hand-checked example, a brute-force reference on random
// small instances, monotonicity, the chain candidates, validation, JSON, and a speed run.
#include "ops/fit/planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <cstdio>
#include <limits>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "ops/fit/planner_examples.h"

namespace memlean::fit {
namespace {

// ---- Reference: an independent exact peak and an enumeration of every disjoint choice. ----

// The model's formula, written per atom: kept[k] is what atom k (or a chosen candidate ending at
// k) keeps. A shared input belongs to its first chosen reader (by begin): every later chosen
// reader's kept bytes and recompute count it no more (`again`).
int64_t reference_peak(const Problem& p, const std::vector<int>& chosen) {
  const int n = static_cast<int>(p.atom_saved_bytes.size());
  std::vector<int64_t> kept = p.atom_saved_bytes;
  auto range = [&](const Candidate& c) {
    int64_t sum = 0;
    for (int k = c.begin; k < c.end; ++k) sum += p.atom_saved_bytes[k];
    return sum;
  };
  std::vector<int64_t> again(p.candidates.size(), 0);
  for (const SharedInput& s : p.shared_inputs) {
    std::vector<int> readers;
    for (int i : chosen) {
      if (std::find(s.candidates.begin(), s.candidates.end(), i) != s.candidates.end()) {
        readers.push_back(i);
      }
    }
    std::sort(readers.begin(), readers.end(), [&](int a, int b) {
      return p.candidates[a].begin < p.candidates[b].begin;
    });
    for (size_t r = 1; r < readers.size(); ++r) again[readers[r]] += s.bytes;
  }
  for (int i : chosen) {
    const Candidate& c = p.candidates[i];
    for (int k = c.begin; k < c.end; ++k) kept[k] = 0;
    const int64_t own = range(c) - std::min(c.freed_bytes, range(c));
    kept[c.end - 1] = own - std::min(again[i], own);
  }
  int64_t total = 0;
  for (int k = 0; k < n; ++k) total += kept[k];
  int64_t peak = p.base_bytes + total;
  auto extra = [&](int k) {
    return p.atom_backward_extra_bytes.empty() ? int64_t{0} : p.atom_backward_extra_bytes[k];
  };
  std::vector<bool> covered(n, false);
  for (int i : chosen) {
    const Candidate& c = p.candidates[i];
    int64_t before = 0;
    for (int k = 0; k < c.begin; ++k) before += kept[k];
    // Backward through atom k of c: its atoms up to k are alive again, with k's extra.
    int64_t backward = 0;
    const int until = c.backward_extra_end == 0 ? c.end : c.backward_extra_end;
    for (int k = c.begin; k < c.end; ++k) {
      int64_t after = 0;
      for (int j = k + 1; j < c.end; ++j) {
        after += p.atom_saved_bytes[j] +
                 (p.atom_deferred_bytes.empty() ? int64_t{0} : p.atom_deferred_bytes[j]);
      }
      backward = std::max(backward,
                          extra(k) - after + (k < until ? c.backward_extra_bytes : 0));
      covered[k] = true;
    }
    // Its recompute, then backward through it: the larger of the two (given, for a compound).
    const int64_t held = c.nested_peak_bytes >= 0
                             ? c.nested_peak_bytes
                             : range(c) + std::max(c.recompute_extra_bytes, backward);
    peak = std::max(peak, p.base_bytes + before + c.input_bytes - again[i] + held);
  }
  // Backward through an atom no candidate covers: the kept bytes up to it and its extra.
  int64_t through = 0;
  for (int k = 0; k < n; ++k) {
    through += kept[k];
    if (!covered[k]) peak = std::max(peak, p.base_bytes + through + extra(k));
  }
  return peak;
}

struct Outcome {
  double seconds = 0;
  int64_t peak = 0;
  size_t count = 0;
};

// Calls f with every set of pairwise-disjoint candidates (n <= 31 atoms), the empty one first.
void for_each_disjoint(const Problem& p, const std::function<void(const std::vector<int>&)>& f) {
  std::vector<int> chosen;
  std::function<void(size_t, uint32_t)> visit = [&](size_t i, uint32_t used) {
    if (i == p.candidates.size()) {
      f(chosen);
      return;
    }
    visit(i + 1, used);
    const Candidate& c = p.candidates[i];
    const uint32_t mask = ((1u << (c.end - c.begin)) - 1) << c.begin;
    if ((used & mask) == 0) {
      chosen.push_back(static_cast<int>(i));
      visit(i + 1, used | mask);
      chosen.pop_back();
    }
  };
  visit(0, 0);
}

// Every set of pairwise-disjoint candidates, with its seconds and reference peak.
std::vector<Outcome> enumerate_all(const Problem& p) {
  std::vector<Outcome> out;
  for_each_disjoint(p, [&](const std::vector<int>& chosen) {
    double seconds = 0;
    for (int c : chosen) seconds += p.candidates[c].seconds;
    out.push_back({seconds, reference_peak(p, chosen), chosen.size()});
  });
  return out;
}

// The lexicographically least (seconds, peak, count) among the outcomes within `budget`.
std::optional<Outcome> best_within(const std::vector<Outcome>& all, int64_t budget) {
  std::optional<Outcome> best;
  for (const Outcome& o : all) {
    if (o.peak > budget) continue;
    if (!best || o.seconds < best->seconds ||
        (o.seconds == best->seconds &&
         (o.peak < best->peak || (o.peak == best->peak && o.count < best->count)))) {
      best = o;
    }
  }
  return best;
}

int64_t bucket_bytes(const Problem& p, int64_t budget, int resolution) {
  const int64_t room = budget - p.base_bytes;
  return std::max<int64_t>(1, (room + resolution - 1) / resolution);
}

// ---- Random instances. Seconds are small integers: sums are exact and ties are common. ----

// A random binary nesting of [b, e): each interval kept with probability 0.6, sometimes twice
// (a wrapper module over the same atoms).
void nested_intervals(std::mt19937_64& rng, int b, int e, std::vector<std::pair<int, int>>* out) {
  std::uniform_real_distribution<double> u(0, 1);
  if (u(rng) < 0.6) out->push_back({b, e});
  if (u(rng) < 0.1) out->push_back({b, e});
  if (e - b < 2) return;
  const int cut = std::uniform_int_distribution<int>(b + 1, e - 1)(rng);
  nested_intervals(rng, b, cut, out);
  nested_intervals(rng, cut, e, out);
}

std::vector<int64_t> random_bytes(std::mt19937_64& rng, int n, int64_t max_bytes) {
  std::vector<int64_t> bytes(n);
  for (int64_t& b : bytes) b = std::uniform_int_distribution<int64_t>(0, max_bytes)(rng);
  return bytes;
}

// Half of the problems get per-atom backward extras (up to twice an atom's most bytes).
void random_backward_extras(std::mt19937_64& rng, Problem* p, int64_t max_bytes) {
  if (std::uniform_int_distribution<int>(0, 1)(rng) == 0) return;
  p->atom_backward_extra_bytes = random_bytes(rng, static_cast<int>(p->atom_saved_bytes.size()),
                                              2 * max_bytes);
  // A third of those get deferred gradients too (up to an atom's most bytes).
  if (std::uniform_int_distribution<int>(0, 2)(rng) != 0) return;
  p->atom_deferred_bytes = random_bytes(rng, static_cast<int>(p->atom_saved_bytes.size()),
                                        max_bytes);
}

Problem random_laminar(std::mt19937_64& rng, int n, int64_t max_bytes) {
  Problem p;
  p.base_bytes = std::uniform_int_distribution<int64_t>(0, 3 * max_bytes)(rng);
  p.atom_saved_bytes = random_bytes(rng, n, max_bytes);
  std::vector<std::pair<int, int>> intervals;
  nested_intervals(rng, 0, n, &intervals);
  for (auto [b, e] : intervals) {
    int64_t range = 0;
    for (int k = b; k < e; ++k) range += p.atom_saved_bytes[k];
    // Up to 1.3x the range, to exercise the clamp.
    const int64_t freed = std::uniform_int_distribution<int64_t>(0, range + range / 3)(rng);
    // Half of them with bytes alive besides their atoms while recomputed.
    const int64_t extra = std::uniform_int_distribution<int64_t>(-max_bytes, max_bytes)(rng);
    // A third of them keep inputs that none of their atoms saved.
    const int64_t input = std::uniform_int_distribution<int64_t>(-2 * max_bytes, max_bytes)(rng);
    // A third of them hold gradients apart through their backward.
    const int64_t apart = std::uniform_int_distribution<int64_t>(-2 * max_bytes, max_bytes)(rng);
    // ... until a random atom's backward (0: through all of it).
    const int until = std::uniform_int_distribution<int>(b, e)(rng);
    // A fifth of them compounds, their recompute's peak given (up to 1.5x the range).
    const int64_t nested =
        std::uniform_int_distribution<int64_t>(-6 * range, range + range / 2)(rng);
    p.candidates.push_back({b, e, freed, double(std::uniform_int_distribution<int>(0, 6)(rng)),
                            std::max<int64_t>(0, extra), std::max<int64_t>(0, input),
                            std::max<int64_t>(0, apart), until == b ? 0 : until,
                            nested < 0 ? -1 : nested});
  }
  random_backward_extras(rng, &p, max_bytes);
  return p;
}

Problem random_chain(std::mt19937_64& rng, int n, int64_t max_bytes) {
  Problem p;
  p.base_bytes = std::uniform_int_distribution<int64_t>(0, 3 * max_bytes)(rng);
  p.atom_saved_bytes = random_bytes(rng, n, max_bytes);
  std::vector<double> seconds(n);
  for (double& s : seconds) s = std::uniform_int_distribution<int>(0, 4)(rng);
  p.candidates = chain_candidates(p.atom_saved_bytes, random_bytes(rng, n, max_bytes), seconds);
  random_backward_extras(rng, &p, max_bytes);
  return p;
}

// Budgets from below the base to above the eager peak, with every reachable peak and its
// neighbours (the tight cases).
std::vector<int64_t> budgets_for(std::mt19937_64& rng, const Problem& p,
                                 const std::vector<Outcome>& all) {
  const int64_t eager = reference_peak(p, {});
  std::vector<int64_t> budgets = {p.base_bytes - 1, p.base_bytes, eager + 7};
  for (const Outcome& o : all) {
    budgets.insert(budgets.end(), {o.peak - 1, o.peak, o.peak + 1});
  }
  for (int i = 0; i < 5; ++i) {
    budgets.push_back(std::uniform_int_distribution<int64_t>(p.base_bytes, eager)(rng));
  }
  std::sort(budgets.begin(), budgets.end());
  budgets.erase(std::unique(budgets.begin(), budgets.end()), budgets.end());
  return budgets;
}

// What every plan must satisfy, whatever the budget: its fields are those of its chosen set.
void expect_consistent(const Problem& p, const Plan& plan, int64_t budget) {
  if (!plan.feasible) {
    EXPECT_TRUE(plan.chosen.empty());
    return;
  }
  double seconds = 0;
  for (size_t i = 0; i < plan.chosen.size(); ++i) {
    ASSERT_GE(plan.chosen[i], 0);
    ASSERT_LT(plan.chosen[i], static_cast<int>(p.candidates.size()));
    seconds += p.candidates[plan.chosen[i]].seconds;
    if (i > 0) {  // forward order and disjoint
      EXPECT_LE(p.candidates[plan.chosen[i - 1]].end, p.candidates[plan.chosen[i]].begin);
    }
  }
  EXPECT_EQ(plan.recompute_seconds, seconds);
  EXPECT_EQ(plan.predicted_peak_bytes, reference_peak(p, plan.chosen));
  EXPECT_EQ(plan.predicted_peak_bytes, predicted_peak(p, plan.chosen));
  Problem per_reader = p;  // as the programs count: shared inputs once per chosen reader
  per_reader.shared_inputs.clear();
  EXPECT_EQ(plan.planned_peak_bytes, reference_peak(per_reader, plan.chosen));
  EXPECT_LE(plan.predicted_peak_bytes, plan.planned_peak_bytes);
  EXPECT_LE(plan.planned_peak_bytes, budget);
}

// ---- A hand-checked example. ----

// base 100, atoms 10 20 30 40 (eager peak 200). Candidates:
//   0: [0,2) frees 25, 1 s     {0}: kept 5+30+40 -> 175; recompute 100+0+30 = 130    -> 175
//   1: [2,4) frees 60, 2 s     {1}: recompute 100+30+70 = 200                          -> 200
//   2: [0,4) frees 90, 2.5 s   {2}: recompute 100+0+100 = 200                          -> 200
//   3: [1,2) frees 20, 0.5 s   {3}: kept 10+0+30+40 -> 180; recompute 100+10+20        -> 180
//   {0,1}: kept 5+10 -> 115; recompute 1: 100+5+70 = 175 -> 175, 3 s
//   {3,1}: kept 10+0+10 -> 120; recompute 1: 100+10+70 = 180 -> 180, 2.5 s
using testing::example;

TEST(Planner, HandCheckedExample) {
  const Problem p = example();
  EXPECT_EQ(predicted_peak(p, {}), 200);
  EXPECT_EQ(predicted_peak(p, {0}), 175);
  EXPECT_EQ(predicted_peak(p, {1}), 200);
  EXPECT_EQ(predicted_peak(p, {3}), 180);
  EXPECT_EQ(predicted_peak(p, {1, 0}), 175);
  EXPECT_EQ(predicted_peak(p, {3, 1}), 180);

  struct Case {
    int64_t budget;
    bool feasible;
    std::vector<int> chosen;
    int64_t peak;
    double seconds;
  };
  for (const Case& c : std::vector<Case>{{250, true, {}, 200, 0},
                                         {200, true, {}, 200, 0},
                                         {199, true, {3}, 180, 0.5},
                                         {180, true, {3}, 180, 0.5},
                                         {179, true, {0}, 175, 1},
                                         {175, true, {0}, 175, 1},
                                         {174, false, {}, 0, 0},
                                         {50, false, {}, 0, 0}}) {
    SCOPED_TRACE("budget " + std::to_string(c.budget));
    const Plan plan_ = plan(p, c.budget);
    EXPECT_EQ(plan_.feasible, c.feasible);
    EXPECT_EQ(plan_.chosen, c.chosen);
    EXPECT_EQ(plan_.predicted_peak_bytes, c.peak);
    EXPECT_EQ(plan_.recompute_seconds, c.seconds);
  }
  const Plan least = least_peak_plan(p);
  EXPECT_TRUE(least.feasible);
  EXPECT_EQ(least.chosen, std::vector<int>{0});
  EXPECT_EQ(least.predicted_peak_bytes, 175);
}

// A compound candidate: four atoms of 10 bytes, base 0, each atom a candidate keeping 2 bytes
// (1 s), the first two as one plain candidate (keeps 2, 2 s) and as a compound of the two
// (keeps 2; 4 s: its forward and theirs; while it is recomputed and backward runs through it,
// what the sub-problem [0, 2) with both chosen holds: kept 2 + 2, then atom 1 recomputed,
// 2 + 10 = 12). Plain checkpoints of the first three peak at 16 (their 6 kept bytes and the
// last atom's 10); the compound keeps 2 where the first two kept 4: 14, at 5 s (the last
// atom's own checkpoint lowers nothing: its recompute is the same 4 + 10).
TEST(Planner, HandCheckedCompound) {
  Problem p;
  p.atom_saved_bytes = {10, 10, 10, 10};
  for (int k = 0; k < 4; ++k) p.candidates.push_back({k, k + 1, 8, 1.0});
  p.candidates.push_back({0, 2, 18, 2.0});
  Candidate compound{0, 2, 18, 4.0};
  compound.nested_peak_bytes = 12;
  p.candidates.push_back(compound);
  EXPECT_EQ(predicted_peak(p, {0, 1, 2, 3}), 16);
  EXPECT_EQ(predicted_peak(p, {4, 2, 3}), 20);  // (the plain one recomputes both atoms: 20)
  EXPECT_EQ(predicted_peak(p, {5, 2, 3}), 14);
  EXPECT_EQ(predicted_peak(p, {5}), 2 + 20);    // (its forward end: 2 + the last two atoms)
  EXPECT_EQ(predicted_peak(p, {5, 2}), 14);
  const Plan least = least_peak_plan(p);
  EXPECT_EQ(least.chosen, (std::vector<int>{5, 2}));
  EXPECT_EQ(least.predicted_peak_bytes, 14);
  EXPECT_EQ(least.recompute_seconds, 5.0);
  const Plan at16 = plan(p, 16);  // the plain ones are faster where they fit
  EXPECT_EQ(at16.chosen, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(at16.recompute_seconds, 3.0);
  EXPECT_EQ(plan(p, 15).chosen, (std::vector<int>{5, 2}));
}

// with_compounds on that problem without its compound: it makes it, with the least-peak inner
// plan of [0, 2) (atom 0's checkpoint alone: 2 + 10 = 12 at 1 s; both: 12 at 2 s), keeping
// what the plain [0, 2) keeps; the singles have nothing inside them. With candidate 4
// excluded from nothing and candidate 0 excluded from it, the inner plan is atom 1's alone
// (10 + 10 = 20: not below the plain 20): none.
TEST(Planner, WithCompoundsMakesTheCompound) {
  Problem p;
  p.atom_saved_bytes = {10, 10, 10, 10};
  for (int k = 0; k < 4; ++k) p.candidates.push_back({k, k + 1, 8, 1.0});
  p.candidates.push_back({0, 2, 18, 2.0});
  std::vector<Compound> made;
  const Problem out = with_compounds(p, {}, 64, &made);
  ASSERT_EQ(made.size(), 1u);
  EXPECT_EQ(made[0].outer, 4);
  EXPECT_EQ(made[0].inner, std::vector<int>{0});
  ASSERT_EQ(out.candidates.size(), 6u);
  const Candidate& c = out.candidates[5];
  EXPECT_EQ(c.begin, 0);
  EXPECT_EQ(c.end, 2);
  EXPECT_EQ(c.freed_bytes, 18);
  EXPECT_EQ(c.seconds, 3.0);
  EXPECT_EQ(c.nested_peak_bytes, 12);
  EXPECT_EQ(least_peak_plan(out).predicted_peak_bytes, 14);
  EXPECT_EQ(least_peak_plan(p).predicted_peak_bytes, 16);
  made.clear();
  EXPECT_EQ(with_compounds(p, {{}, {}, {}, {}, {0}}, 64, &made).candidates.size(), 5u);
  EXPECT_TRUE(made.empty());
  EXPECT_THROW(with_compounds(p, {{}}), std::invalid_argument);
}

// The same compound with 3 recompute_extra_bytes (the outer's recomputed output, alive at the
// end of its recompute with what the inner plan keeps): the inner plan {0} keeps 2 + 10, so
// its term would be max(12, 12 + 3) = 15; the inner plan {0, 1} keeps 2 + 2 and reaches
// max(12, 4 + 3) = 12, and with_compounds takes it (it weighs the end of the recompute as one
// more moment of the inner problem; before, it took the least inner peak alone, {0}: 15).
TEST(Planner, WithCompoundsWeighTheEndOfTheRecompute) {
  Problem p;
  p.atom_saved_bytes = {10, 10, 10, 10};
  for (int k = 0; k < 4; ++k) p.candidates.push_back({k, k + 1, 8, 1.0});
  p.candidates.push_back({0, 2, 18, 2.0, 3});
  std::vector<Compound> made;
  const Problem out = with_compounds(p, {}, 64, &made);
  ASSERT_EQ(made.size(), 1u);
  EXPECT_EQ(made[0].inner, (std::vector<int>{0, 1}));
  EXPECT_EQ(out.candidates.back().nested_peak_bytes, 12);
  EXPECT_EQ(out.candidates.back().seconds, 4.0);
}

// That compound where its inner checkpoint 0's forward, run inside its recompute without
// grad, holds 15 bytes above its input (forward_bytes) while the outer's recompute holds 2 of
// its 3 recompute_extra_bytes from its start (recompute_held_bytes: the gradient backward
// brought): nested peak max(inner peak 12, kept 4 + 3, 0 + 15 + 2) = 17. At 11 forward bytes
// 13; at 25 (27 >= 20 + 3, the plain term) no compound.
TEST(Planner, WithCompoundsCountsANestedForward) {
  Problem p;
  p.atom_saved_bytes = {10, 10, 10, 10};
  for (int k = 0; k < 4; ++k) p.candidates.push_back({k, k + 1, 8, 1.0});
  p.candidates.push_back({0, 2, 18, 2.0, 3});
  p.candidates[4].recompute_held_bytes = 2;
  p.candidates[0].forward_bytes = 15;
  std::vector<Compound> made;
  Problem out = with_compounds(p, {}, 64, &made);
  ASSERT_EQ(made.size(), 1u);
  EXPECT_EQ(made[0].inner, (std::vector<int>{0, 1}));
  EXPECT_EQ(out.candidates.back().nested_peak_bytes, 17);
  EXPECT_EQ(out.candidates.back().forward_bytes, 0);  // (its outer's: [0, 2) no forward given)
  p.candidates[0].forward_bytes = 11;
  EXPECT_EQ(with_compounds(p).candidates.back().nested_peak_bytes, 13);
  p.candidates[0].forward_bytes = 25;
  out = with_compounds(p, {}, 64, &made);
  EXPECT_TRUE(made.empty());
  EXPECT_EQ(out.candidates.size(), 5u);
}

// A compound whose inner checkpoints keep one input between them (3 bytes no atom saves, a
// dense block's map): the inner plan keeps it once, so the compound's nested peak counts it
// once: kept 5 + (5 - 3) + 10 = 17 (counted per reader, 20).
TEST(Planner, WithCompoundsCountsASharedInputOnce) {
  Problem p;
  p.atom_saved_bytes = {10, 10, 10};
  p.candidates.push_back({0, 1, 5, 1.0, 0, 3});
  p.candidates.push_back({1, 2, 5, 1.0, 0, 3});
  p.candidates.push_back({0, 3, 20, 3.0});
  p.shared_inputs.push_back({3, {0, 1}});
  std::vector<Compound> made;
  const Problem out = with_compounds(p, {}, 64, &made);
  ASSERT_EQ(made.size(), 1u);
  EXPECT_EQ(made[0].outer, 2);
  EXPECT_EQ(made[0].inner, (std::vector<int>{0, 1}));
  EXPECT_EQ(out.candidates.back().nested_peak_bytes, 17);
}

// The example with backward extras {0, 0, 80, 0}: atom 2's backward needs 80 bytes above what
// is kept through it.
TEST(Planner, HandCheckedBackwardExtras) {
  Problem p = example();
  p.atom_backward_extra_bytes = {0, 0, 80, 0};
  EXPECT_EQ(predicted_peak(p, {}), 240);  // atom 2: 100 + 60 + 80, above 200
  // [0,2) keeps 5: atom 2 then needs 100 + 5 + 30 + 80.
  EXPECT_EQ(predicted_peak(p, {0}), 215);
  // [2,4) recomputes 70 bytes with 80 - 40 (atom 3's bytes are gone by atom 2's backward).
  EXPECT_EQ(predicted_peak(p, {1}), 240);
  EXPECT_EQ(predicted_peak(p, {0, 1}), 215);
  EXPECT_EQ(predicted_peak(p, {2}), 240);
  EXPECT_EQ(predicted_peak(p, {3}), 220);
  EXPECT_EQ(predicted_peak(p, {3, 1}), 220);
  EXPECT_EQ(plan(p, 240).chosen, std::vector<int>{});
  EXPECT_EQ(plan(p, 239).chosen, std::vector<int>{3});  // 0.5 s at 220
  EXPECT_EQ(plan(p, 220).chosen, std::vector<int>{3});
  EXPECT_EQ(plan(p, 219).chosen, std::vector<int>{0});  // 1.0 s at 215
  EXPECT_FALSE(plan(p, 214).feasible);
  const Plan least = least_peak_plan(p);
  EXPECT_EQ(least.predicted_peak_bytes, 215);
  EXPECT_EQ(least.chosen, std::vector<int>{0});
  // The recompute and the backward through a candidate are two moments: its
  // recompute_extra_bytes and its backward extra do not add up. [2,4) recomputing 30 more
  // stays at 240 (its backward needs 40); recomputing 50 more reaches 100 + 30 + 70 + 50.
  p.candidates[1].recompute_extra_bytes = 30;
  EXPECT_EQ(predicted_peak(p, {1}), 240);
  p.candidates[1].recompute_extra_bytes = 50;
  EXPECT_EQ(predicted_peak(p, {1}), 250);
  EXPECT_EQ(predicted_peak(p, {0, 1}), 225);  // 100 + 5 + 70 + 50
  // An input it keeps that none of its atoms saved is alive in both moments.
  p.candidates[1].recompute_extra_bytes = 0;
  p.candidates[1].input_bytes = 15;
  EXPECT_EQ(predicted_peak(p, {1}), 255);  // 100 + 30 + 70 + 15 + 40
  // Gradients it holds apart through its backward add to that moment, not its recompute:
  // 10 more reach 100 + 30 + 70 + 15 + 50.
  p.candidates[1].backward_extra_bytes = 10;
  EXPECT_EQ(predicted_peak(p, {1}), 265);
  // Through atom 2's backward alone (end 3): there the 40 above are held (80 less atom 3's
  // 40 bytes), so 265 again. Where atom 3's backward holds the most, they show only through
  // all of it (end 0 or 4): 100 + 30 + 70 + 15 + 80 (atom 2: 30 - 40 + 10), then + 10.
  p.candidates[1].backward_extra_end = 3;
  EXPECT_EQ(predicted_peak(p, {1}), 265);
  p.atom_backward_extra_bytes = {0, 0, 30, 80};
  EXPECT_EQ(predicted_peak(p, {1}), 295);
  p.candidates[1].backward_extra_end = 4;
  EXPECT_EQ(predicted_peak(p, {1}), 305);
  p.candidates[1].backward_extra_end = 0;
  EXPECT_EQ(predicted_peak(p, {1}), 305);
  // A recompute of 100 more sets it.
  p.candidates[1].recompute_extra_bytes = 100;
  EXPECT_EQ(predicted_peak(p, {1}), 315);
}

// Deferred gradients (atom_deferred_bytes: what the backward through a checkpoint holds less
// than the step without it, from an atom's backward on): the backward through a chosen
// candidate holds them less at the atoms before them inside it; nowhere else.
TEST(Planner, HandCheckedDeferredGradients) {
  Problem p = example();
  p.atom_backward_extra_bytes = {0, 0, 30, 80};
  EXPECT_EQ(predicted_peak(p, {1}), 280);  // [2,4): 100 + 30 + 70 + max(30 - 40, 80)
  p.atom_deferred_bytes = {0, 0, 0, 50};
  // Atom 3's deferred bytes count at the atoms before it only: atom 3's term stays.
  EXPECT_EQ(predicted_peak(p, {1}), 280);
  p.atom_backward_extra_bytes = {0, 0, 120, 0};
  p.atom_deferred_bytes = {0, 0, 0, 0};
  EXPECT_EQ(predicted_peak(p, {1}), 280);  // 100 + 30 + 70 + (120 - 40)
  p.atom_deferred_bytes = {0, 0, 0, 25};
  EXPECT_EQ(predicted_peak(p, {1}), 255);  // 100 + 30 + 70 + (120 - 40 - 25)
  p.atom_deferred_bytes = {0, 0, 0, 100};
  EXPECT_EQ(predicted_peak(p, {1}), 200);  // its backward term 0 (atom 3's): its recompute
  EXPECT_EQ(predicted_peak(p, {0, 1}), 175);  // 100 + 5 + 70
  // Uncovered, atom 2's backward holds what it held: 100 + 60 + 120.
  EXPECT_EQ(predicted_peak(p, {}), 280);
  for (const std::vector<int>& chosen : std::vector<std::vector<int>>{{}, {0}, {1}, {2}, {3}, {0, 1}, {3, 1}}) {
    EXPECT_EQ(predicted_peak(p, chosen), reference_peak(p, chosen));
  }
  EXPECT_EQ(least_peak_plan(p).predicted_peak_bytes, 175);
  Problem without = p;
  without.atom_deferred_bytes.clear();
  EXPECT_EQ(least_peak_plan(without).predicted_peak_bytes, 255);  // {0, 1}: 100 + 5 + 70 + 80
}

// A tensor both [0,2) and [2,4) keep (5 bytes, in the input_bytes of each: 5 and 8) lives once.
//   {0,1}: kept 5 + 10 - 5 -> 110; recompute 0: 100 + 30 + 5 = 135; recompute 1: 100 + 5 + 70
//          + 8 - 5 = 178 (183 counting it twice)
//   {1}:   recompute 100 + 30 + 70 + 8 = 208 (one reader: nothing shared)
TEST(Planner, HandCheckedSharedInput) {
  Problem p = example();
  p.candidates[0].input_bytes = 5;
  p.candidates[1].input_bytes = 8;
  EXPECT_EQ(predicted_peak(p, {0, 1}), 183);
  EXPECT_EQ(predicted_peak(p, {1}), 208);
  p.shared_inputs = {{5, {0, 1}}};
  EXPECT_EQ(predicted_peak(p, {0, 1}), 178);
  EXPECT_EQ(predicted_peak(p, {1, 0}), 178);
  EXPECT_EQ(predicted_peak(p, {1}), 208);
  EXPECT_EQ(predicted_peak(p, {0}), 175);
  // Listed by a candidate not chosen, or by one alone: no change.
  p.candidates[2].input_bytes = 5;
  p.shared_inputs = {{5, {0, 2}}, {8, {1}}};
  EXPECT_EQ(predicted_peak(p, {0, 1}), 183);
  // What the later reader keeps counts it at most as far as it keeps anything: [2,4) keeping
  // 1 byte (freeing 69) and reading 6 shared bytes keeps 0 of its own at the forward's end.
  p.candidates[1].freed_bytes = 69;
  p.candidates[1].input_bytes = 6;
  p.shared_inputs = {{5, {0, 1}}, {1, {0, 1}}};
  p.candidates[0].input_bytes = 6;
  // kept 5 + 1 - 1 -> 105; recompute 0: 100 + 30 + 6 = 136; recompute 1: 100 + 5 + 70 + 0
  EXPECT_EQ(predicted_peak(p, {0, 1}), 175);
  // The programs count it per reader: a plan's predicted peak is exact and within its budget.
  const Plan got = plan(p, 176);
  EXPECT_TRUE(got.feasible);
  EXPECT_LE(got.predicted_peak_bytes, 176);
  EXPECT_EQ(got.predicted_peak_bytes, predicted_peak(p, got.chosen));
}

// Random problems with shared inputs: predicted_peak equals the reference (which gives each
// shared input to its first chosen reader) for every disjoint choice and never exceeds the
// count without sharing; plan() finds a plan whenever one fits counting per reader, and every
// plan it returns is consistent and within its budget.
TEST(Planner, SharedInputsMatchTheReference) {
  std::mt19937_64 rng(31);
  int shared_lower = 0;
  for (int instance = 0; instance < 300; ++instance) {
    SCOPED_TRACE("instance " + std::to_string(instance));
    const int64_t max_bytes = instance % 2 == 0 ? 40 : 1'000'000'000;
    const int n = std::uniform_int_distribution<int>(2, 8)(rng);
    Problem p = random_laminar(rng, n, max_bytes);
    if (p.candidates.size() < 2) continue;
    const int inputs = std::uniform_int_distribution<int>(1, 3)(rng);
    for (int s = 0; s < inputs; ++s) {
      SharedInput shared;
      shared.bytes = std::uniform_int_distribution<int64_t>(0, max_bytes)(rng);
      for (size_t c = 0; c < p.candidates.size(); ++c) {
        if (std::uniform_int_distribution<int>(0, 1)(rng) == 0) continue;
        shared.candidates.push_back(static_cast<int>(c));
        // As fit counts it: among the reader's inputs, and among what it keeps.
        p.candidates[c].input_bytes += shared.bytes;
        p.candidates[c].freed_bytes = std::max<int64_t>(0, p.candidates[c].freed_bytes -
                                                               shared.bytes);
      }
      p.shared_inputs.push_back(std::move(shared));
    }
    Problem counted_per_reader = p;
    counted_per_reader.shared_inputs.clear();
    const std::vector<Outcome> all = enumerate_all(counted_per_reader);
    for_each_disjoint(p, [&](const std::vector<int>& chosen) {
      const int64_t got = predicted_peak(p, chosen);
      EXPECT_EQ(got, reference_peak(p, chosen));
      const int64_t per_reader = predicted_peak(counted_per_reader, chosen);
      EXPECT_LE(got, per_reader);
      shared_lower += got < per_reader;
    });
    for (int64_t budget : budgets_for(rng, counted_per_reader, all)) {
      SCOPED_TRACE("budget " + std::to_string(budget));
      const Plan got = plan(p, budget);
      expect_consistent(p, got, budget);
      EXPECT_EQ(got.feasible, best_within(all, budget).has_value());
    }
    const Plan least = least_peak_plan(p);
    int64_t least_per_reader = all.front().peak;
    for (const Outcome& o : all) least_per_reader = std::min(least_per_reader, o.peak);
    expect_consistent(p, least, least_per_reader);
    EXPECT_EQ(least.planned_peak_bytes, least_per_reader);
    // plan() finds a plan at the least's planned peak, not always at its predicted one.
    EXPECT_TRUE(plan(p, least.planned_peak_bytes).feasible);
  }
  EXPECT_GT(shared_lower, 100);  // sharing lowered many predictions
}

// ---- Against brute force. ----

// For every random instance, budget and resolution (q = the bucket size, n the atoms):
//  - plan() is feasible exactly when some disjoint choice has peak <= budget;
//  - a feasible plan is consistent (expect_consistent) and never faster than the optimum;
//  - it is at least as fast as every choice with peak <= budget - n * (q - 1);
//  - with q == 1 it is the exact lexicographic optimum (seconds, then peak).
// least_peak_plan() reaches exactly the least peak of any choice (and with q == 1 at that
// budget, the least time among the choices that reach it).
TEST(Planner, MatchesBruteForce) {
  std::mt19937_64 rng(20240611);
  int checked = 0, coarse = 0, coarse_slower = 0;
  for (int instance = 0; instance < 400; ++instance) {
    const bool chain = instance % 2 == 1;
    // Small bytes: q == 1 at resolution 4096. Large bytes: q > 1 everywhere.
    const int64_t max_bytes = instance % 4 < 2 ? 40 : 1'000'000'000;
    const int n = std::uniform_int_distribution<int>(1, chain ? 6 : 8)(rng);
    const Problem p = chain ? random_chain(rng, n, max_bytes) : random_laminar(rng, n, max_bytes);
    SCOPED_TRACE("instance " + std::to_string(instance));
    const std::vector<Outcome> all = enumerate_all(p);
    int64_t least = all.front().peak;  // the empty choice comes first
    for (const Outcome& o : all) least = std::min(least, o.peak);

    for (int resolution : {4096, 5}) {
      SCOPED_TRACE("resolution " + std::to_string(resolution));
      for (int64_t budget : budgets_for(rng, p, all)) {
        SCOPED_TRACE("budget " + std::to_string(budget));
        const Plan got = plan(p, budget, resolution);
        expect_consistent(p, got, budget);
        const std::optional<Outcome> opt = best_within(all, budget);
        ASSERT_EQ(got.feasible, opt.has_value());
        ++checked;
        if (!opt) continue;
        EXPECT_GE(got.recompute_seconds, opt->seconds);
        const int64_t q = bucket_bytes(p, budget, resolution);
        if (const std::optional<Outcome> slack = best_within(all, budget - n * (q - 1))) {
          EXPECT_LE(got.recompute_seconds, slack->seconds);
        }
        if (q == 1) {
          EXPECT_EQ(got.recompute_seconds, opt->seconds);
          EXPECT_EQ(got.predicted_peak_bytes, opt->peak);
          // (Fewer candidates is only a preference: see planner.h.)
        } else {
          ++coarse;
          coarse_slower += got.recompute_seconds > opt->seconds;
        }
      }

      const Plan least_plan = least_peak_plan(p, resolution);
      expect_consistent(p, least_plan, least);
      ASSERT_TRUE(least_plan.feasible);
      EXPECT_EQ(least_plan.predicted_peak_bytes, least);
      const std::optional<Outcome> at_least = best_within(all, least);
      EXPECT_GE(least_plan.recompute_seconds, at_least->seconds);
      if (bucket_bytes(p, least, resolution) == 1) {
        EXPECT_EQ(least_plan.recompute_seconds, at_least->seconds);
      }
    }
  }
  // Both regimes were exercised (the counts are deterministic for the seed).
  EXPECT_GT(coarse, 1000);
  EXPECT_GT(checked - coarse, 1000);
  std::printf("checked %d plans, %d with q > 1, %d of those slower than the optimum\n", checked,
              coarse, coarse_slower);
}

// ---- Monotonicity. ----

// Sweeps the budget down from the eager peak by `step`. With q == 1 (small bytes) plan() is
// exact, so its time never falls as the budget falls, at any step. With q > 1 the caveat gives
// it for steps of at least n * (q - 1), q taken at the eager peak (the largest).
void expect_monotonic(const Problem& p, int64_t step, int resolution) {
  const int64_t eager = predicted_peak(p, {});
  double last_seconds = 0;
  bool last_feasible = true;
  int feasible_count = 0;
  for (int64_t budget = eager; budget >= p.base_bytes - step; budget -= step) {
    SCOPED_TRACE("budget " + std::to_string(budget));
    const Plan got = plan(p, budget, resolution);
    expect_consistent(p, got, budget);
    if (got.feasible) {
      ++feasible_count;
      ASSERT_TRUE(last_feasible);
      EXPECT_GE(got.recompute_seconds, last_seconds);
      last_seconds = got.recompute_seconds;
    }
    last_feasible = got.feasible;
  }
  EXPECT_FALSE(last_feasible);
  EXPECT_GT(feasible_count, 0);  // the eager peak fits
}

TEST(Planner, TimeNeverFallsAsBudgetFalls) {
  std::mt19937_64 rng(7);
  for (int instance = 0; instance < 60; ++instance) {
    SCOPED_TRACE("small instance " + std::to_string(instance));
    const int n = std::uniform_int_distribution<int>(2, 8)(rng);
    expect_monotonic(instance % 2 ? random_chain(rng, n, 40) : random_laminar(rng, n, 40), 1,
                     4096);
  }
  for (int instance = 0; instance < 4; ++instance) {
    SCOPED_TRACE("large instance " + std::to_string(instance));
    const int n = 40;
    const Problem p = random_laminar(rng, n, 1'000'000'000);
    expect_monotonic(p, n * bucket_bytes(p, predicted_peak(p, {}), 4096), 4096);
  }
}

// ---- Boundaries. ----

TEST(Planner, GenerousBudgetChoosesNothing) {
  std::mt19937_64 rng(11);
  for (int instance = 0; instance < 50; ++instance) {
    Problem p = random_laminar(rng, 8, 1'000'000);
    for (Candidate& c : p.candidates) c.seconds += 0.25;  // positive: any choice costs time
    const int64_t eager = predicted_peak(p, {});
    for (int64_t budget : {eager, eager + 1, 2 * eager}) {
      const Plan got = plan(p, budget);
      EXPECT_TRUE(got.feasible);
      EXPECT_TRUE(got.chosen.empty());
      EXPECT_EQ(got.recompute_seconds, 0);
      EXPECT_EQ(got.predicted_peak_bytes, eager);
    }
  }
}

TEST(Planner, BudgetBelowLeastPeakIsInfeasible) {
  std::mt19937_64 rng(13);
  for (int instance = 0; instance < 50; ++instance) {
    const Problem p = instance % 2 ? random_chain(rng, 8, 1'000'000)
                                   : random_laminar(rng, 8, 1'000'000);
    const Plan least = least_peak_plan(p);
    ASSERT_TRUE(least.feasible);
    EXPECT_TRUE(plan(p, least.predicted_peak_bytes).feasible);
    for (int64_t budget : {least.predicted_peak_bytes - 1, p.base_bytes - 1, int64_t{-5}}) {
      const Plan got = plan(p, budget);
      EXPECT_FALSE(got.feasible);
      EXPECT_TRUE(got.chosen.empty());
    }
  }
}

TEST(Planner, NoAtoms) {
  Problem p;
  p.base_bytes = 5;
  EXPECT_TRUE(plan(p, 5).feasible);
  EXPECT_FALSE(plan(p, 4).feasible);
  EXPECT_EQ(least_peak_plan(p).predicted_peak_bytes, 5);
}

// ---- chain_candidates. ----

TEST(ChainCandidates, ThreeLayers) {
  // Layer saved bytes 10, 2, 30; outputs 4, 5, 6; seconds 1, 2, 3.
  const std::vector<Candidate> got = chain_candidates({10, 2, 30}, {4, 5, 6}, {1, 2, 3});
  const std::vector<Candidate> want = {
      {0, 1, 6, 1},   // 10 - 4
      {0, 2, 7, 3},   // 12 - 5
      {0, 3, 36, 6},  // 42 - 6
      {1, 2, 0, 2},   // 2 - 5, clamped
      {1, 3, 26, 5},  // 32 - 6
      {2, 3, 24, 3},  // 30 - 6
  };
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("candidate " + std::to_string(i));
    EXPECT_EQ(got[i].begin, want[i].begin);
    EXPECT_EQ(got[i].end, want[i].end);
    EXPECT_EQ(got[i].freed_bytes, want[i].freed_bytes);
    EXPECT_EQ(got[i].seconds, want[i].seconds);
  }
  EXPECT_THROW(chain_candidates({1, 2}, {1}, {1, 2}), std::invalid_argument);
  EXPECT_THROW(chain_candidates({1, 2}, {1, 2}, {1}), std::invalid_argument);
  EXPECT_THROW(chain_candidates({-1}, {1}, {1}), std::invalid_argument);
}

// ---- Validation. ----

void expect_invalid(const std::function<void()>& f, const std::string& field) {
  try {
    f();
    ADD_FAILURE() << "no std::invalid_argument naming " << field;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos)
        << "'" << e.what() << "' does not name " << field;
  }
}

TEST(Validate, NamesTheBadField) {
  EXPECT_NO_THROW(validate(example()));
  struct Case {
    std::function<void(Problem&)> corrupt;
    std::string field;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const int64_t max = std::numeric_limits<int64_t>::max();
  for (const Case& c : std::vector<Case>{
           {[](Problem& p) { p.base_bytes = -1; }, "base_bytes"},
           {[](Problem& p) { p.atom_deferred_bytes = {1, 2}; }, "atom_deferred_bytes"},
           {[](Problem& p) { p.atom_deferred_bytes = {0, -1, 0, 0}; }, "atom_deferred_bytes[1]"},
           {[&](Problem& p) { p.atom_deferred_bytes = {0, 0, max - 150, 0}; },
            "atom_deferred_bytes[2]"},
           {[](Problem& p) { p.atom_saved_bytes[1] = -5; }, "atom_saved_bytes[1]"},
           {[&](Problem& p) { p.atom_saved_bytes = {max, 1, 0, 0}; }, "atom_saved_bytes"},
           {[&](Problem& p) { p.base_bytes = max - 99; }, "base_bytes"},
           {[](Problem& p) { p.candidates[1].begin = p.candidates[1].end; },
            "candidates[1].begin/end"},
           {[](Problem& p) { p.candidates[2].begin = 3, p.candidates[2].end = 2; },
            "candidates[2].begin/end"},
           {[](Problem& p) { p.candidates[0].begin = -1; }, "candidates[0].begin/end"},
           {[](Problem& p) { p.candidates[3].end = 5; }, "candidates[3].begin/end"},
           {[](Problem& p) { p.candidates[2].freed_bytes = -1; }, "candidates[2].freed_bytes"},
           {[](Problem& p) { p.candidates[1].recompute_extra_bytes = -1; },
            "candidates[1].recompute_extra_bytes"},
           {[](Problem& p) { p.candidates[1].input_bytes = -1; }, "candidates[1].input_bytes"},
           {[](Problem& p) { p.candidates[3].nested_peak_bytes = -2; },
            "candidates[3].nested_peak_bytes"},
           {[&](Problem& p) { p.candidates[3].nested_peak_bytes = max - 50; },
            "candidates[3].nested_peak_bytes"},
           {[](Problem& p) { p.candidates[2].forward_bytes = -1; }, "candidates[2].forward_bytes"},
           {[&](Problem& p) { p.candidates[2].forward_bytes = max; }, "candidates[2].forward_bytes"},
           {[](Problem& p) { p.candidates[1].recompute_held_bytes = -p.base_bytes - 1; },
            "candidates[1].recompute_held_bytes"},
           {[](Problem& p) {
              p.candidates[1].recompute_extra_bytes = 4;
              p.candidates[1].recompute_held_bytes = 5;
            },
            "candidates[1].recompute_held_bytes"},
           {[](Problem& p) { p.candidates[2].backward_extra_bytes = -1; },
            "candidates[2].backward_extra_bytes"},
           {[&](Problem& p) { p.candidates[2].backward_extra_bytes = max; },
            "candidates[2].backward_extra_bytes"},
           {[](Problem& p) { p.candidates[1].backward_extra_end = 2; },
            "candidates[1].backward_extra_end"},
           {[](Problem& p) { p.candidates[1].backward_extra_end = 5; },
            "candidates[1].backward_extra_end"},
           {[](Problem& p) {
              p.candidates[1].input_bytes = std::numeric_limits<int64_t>::max() - 100;
            },
            "candidates[1].input_bytes"},
           {[](Problem& p) { p.candidates[0].recompute_extra_bytes = std::numeric_limits<int64_t>::max(); },
            "candidates[0].recompute_extra_bytes"},
           {[](Problem& p) { p.candidates[1].seconds = -0.5; }, "candidates[1].seconds"},
           {[&](Problem& p) { p.candidates[0].seconds = nan; }, "candidates[0].seconds"},
           {[&](Problem& p) { p.candidates[3].seconds = inf; }, "candidates[3].seconds"},
           {[](Problem& p) { p.atom_backward_extra_bytes = {1, 2}; },
            "atom_backward_extra_bytes"},
           {[](Problem& p) { p.atom_backward_extra_bytes = {0, 0, -1, 0}; },
            "atom_backward_extra_bytes[2]"},
           {[&](Problem& p) { p.atom_backward_extra_bytes = {0, max, 0, 0}; },
            "atom_backward_extra_bytes[1]"},
           {[](Problem& p) {
              p.candidates[1].input_bytes = 9;
              p.shared_inputs = {{-1, {1}}};
            },
            "shared_inputs[0].bytes"},
           {[](Problem& p) {
              p.candidates[1].input_bytes = 9;
              p.shared_inputs = {{1, {1}}, {1, {1, 4}}};
            },
            "shared_inputs[1].candidates: index 4"},
           {[](Problem& p) {
              p.candidates[1].input_bytes = 9;
              p.shared_inputs = {{1, {1, -1}}};
            },
            "shared_inputs[0].candidates: index -1"},
           {[](Problem& p) {
              p.candidates[1].input_bytes = 9;
              p.shared_inputs = {{1, {1, 1}}};
            },
            "shared_inputs[0].candidates: index 1 repeated"},
           {[](Problem& p) {
              p.candidates[1].input_bytes = 9;
              p.shared_inputs = {{5, {1}}, {5, {1}}};
            },
            "candidates[1].input_bytes"},
           {[&](Problem& p) {
              p.candidates[1].input_bytes = 9;
              p.shared_inputs = {{9, {1}}, {max, {1}}};
            },
            "candidates[1].input_bytes"},
       }) {
    Problem p = example();
    c.corrupt(p);
    SCOPED_TRACE(c.field);
    expect_invalid([&] { validate(p); }, c.field);
    expect_invalid([&] { plan(p, 1000); }, c.field);
    expect_invalid([&] { least_peak_plan(p); }, c.field);
    expect_invalid([&] { predicted_peak(p, {}); }, c.field);
  }
  const Problem p = example();
  expect_invalid([&] { plan(p, 1000, 0); }, "resolution");
  expect_invalid([&] { least_peak_plan(p, -3); }, "resolution");
  expect_invalid([&] { predicted_peak(p, {0, 3}); }, "chosen");  // [0,2) and [1,2)
  expect_invalid([&] { predicted_peak(p, {1, 1}); }, "chosen");
  expect_invalid([&] { predicted_peak(p, {4}); }, "chosen");
  expect_invalid([&] { predicted_peak(p, {-1}); }, "chosen");
}

TEST(Validate, AcceptsCrossingCandidatesAndClampsFreed) {
  Problem p = example();
  p.candidates.push_back({1, 3, 1000, 0.1});  // crosses [0,2) and [2,4); frees at most 50
  EXPECT_NO_THROW(validate(p));
  // {4}: kept 10 + 0 + 0 + 40 -> 150; recompute 100 + 10 + 50 = 160.
  EXPECT_EQ(predicted_peak(p, {4}), 160);
  const Plan got = plan(p, 160);
  EXPECT_EQ(got.chosen, std::vector<int>{4});
  EXPECT_EQ(got.predicted_peak_bytes, 160);
}

// ---- JSON. ----

TEST(ToJson, Renders) {
  Plan plan_;
  EXPECT_EQ(to_json(plan_), R"({"feasible": false, "chosen": [], )"
                            R"("predicted_peak_bytes": 0, "recompute_seconds": 0})");
  plan_ = {true, {0, 3}, 123, 0.5};
  EXPECT_EQ(to_json(plan_), R"({"feasible": true, "chosen": [0, 3], )"
                            R"("predicted_peak_bytes": 123, "recompute_seconds": 0.5})");
}

// ---- Speed: n = 500 atoms, 2000 nested candidates, resolution 4096 (reported, not asserted).

TEST(Planner, SpeedSanity) {
  std::mt19937_64 rng(17);
  const int n = 500;
  Problem p;
  p.base_bytes = 4'000'000'000;
  p.atom_saved_bytes = random_bytes(rng, n, 50'000'000);
  std::vector<std::pair<int, int>> laminar;  // one tree's nodes, repeated: still laminar
  nested_intervals(rng, 0, n, &laminar);
  for (int i = 0; i < 2000; ++i) {
    const auto [b, e] = laminar[i % laminar.size()];
    int64_t range = 0;
    for (int k = b; k < e; ++k) range += p.atom_saved_bytes[k];
    p.candidates.push_back({b, e, std::uniform_int_distribution<int64_t>(0, range)(rng),
                            std::uniform_real_distribution<double>(0, 1e-3)(rng) * (e - b)});
  }
  ASSERT_EQ(p.candidates.size(), 2000u);

  using Clock = std::chrono::steady_clock;
  auto t0 = Clock::now();
  const Plan least = least_peak_plan(p);
  auto t1 = Clock::now();
  const int64_t eager = predicted_peak(p, {});
  const int64_t budget = least.predicted_peak_bytes + (eager - least.predicted_peak_bytes) / 2;
  const Plan mid = plan(p, budget);
  auto t2 = Clock::now();
  ASSERT_TRUE(least.feasible);
  ASSERT_TRUE(mid.feasible);
  EXPECT_LE(mid.predicted_peak_bytes, budget);
  EXPECT_EQ(mid.predicted_peak_bytes, predicted_peak(p, mid.chosen));
  auto ms = [](auto d) { return std::chrono::duration<double, std::milli>(d).count(); };
  std::printf("n=%d, %zu candidates: least_peak_plan %.1f ms, plan %.1f ms (%zu chosen)\n", n,
              p.candidates.size(), ms(t1 - t0), ms(t2 - t1), mid.chosen.size());
}

}  // namespace
}  // namespace memlean::fit
