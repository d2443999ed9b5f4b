// A small planner problem that the planner and search tests check by hand.
#pragma once

#include "ops/fit/planner.h"

namespace memlean::fit::testing {

// Four atoms of 10..40 bytes over base 100; candidates [0,2) (frees 25, 1.0 s), [2,4) (60,
// 2.0 s), [0,4) (90, 2.5 s) and [1,2) (20, 0.5 s). Predicted peaks: {} 200, {0} 175, {1} 200,
// {3} 180, {0,1} 175, {3,1} 180.
inline Problem example() {
  Problem p;
  p.base_bytes = 100;
  p.atom_saved_bytes = {10, 20, 30, 40};
  p.candidates = {{0, 2, 25, 1.0}, {2, 4, 60, 2.0}, {0, 4, 90, 2.5}, {1, 2, 20, 0.5}};
  return p;
}

}  // namespace memlean::fit::testing
