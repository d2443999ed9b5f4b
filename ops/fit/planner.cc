// memlean::fit planner: the checkpoint-selection programs behind plan() and least_peak_plan().
#include "ops/fit/planner.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>

namespace memlean::fit {
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();
constexpr double kInf = std::numeric_limits<double>::infinity();

// A validated problem with the sums every program needs.
struct Prepared {
  const Problem& problem;
  int n = 0;
  std::vector<int64_t> prefix;              // prefix[k] = sum of atom_saved_bytes[0, k)
  std::vector<int64_t> freed;               // freed_bytes clamped to [0, range_sum]
  std::vector<int64_t> atom_extra;          // atom_backward_extra_bytes, or n zeros
  std::vector<int64_t> recompute_bytes;     // per candidate, see recompute()
  std::vector<std::vector<int>> ending_at;  // candidate indices by end, ascending
  std::vector<std::vector<int>> shared_of;  // per candidate, the shared inputs it keeps

  int64_t range_sum(int c) const {
    const Candidate& cand = problem.candidates[c];
    return prefix[cand.end] - prefix[cand.begin];
  }
  int64_t kept(int c) const { return range_sum(c) - freed[c]; }
  // What its recompute and backward hold on top of base and the kept bytes before it: its
  // atoms' bytes, its input_bytes, and the larger of its recompute_extra_bytes (the
  // recompute) and its atoms' largest backward extra less the bytes of its atoms after each,
  // freed by then, plus its backward_extra_bytes for those before its backward_extra_end
  // (the backward through it).
  int64_t recompute(int c) const { return recompute_bytes[c]; }
};

// Range maxima of a fixed array in O(1) per query after O(n log n) set-up.
class RangeMax {
 public:
  explicit RangeMax(std::vector<int64_t> values) {
    table_.push_back(std::move(values));
    const size_t n = table_[0].size();
    for (size_t width = 2; width <= n; width *= 2) {
      const std::vector<int64_t>& prev = table_.back();
      std::vector<int64_t> next(n - width + 1);
      for (size_t i = 0; i < next.size(); ++i) next[i] = std::max(prev[i], prev[i + width / 2]);
      table_.push_back(std::move(next));
    }
  }
  // max of values[begin, end); needs begin < end.
  int64_t max(int begin, int end) const {
    int level = 0;
    while ((2 << level) <= end - begin) ++level;
    return std::max(table_[level][begin], table_[level][end - (1 << level)]);
  }

 private:
  std::vector<std::vector<int64_t>> table_;
};

std::string candidate_field(size_t i, const char* field) {
  return "candidates[" + std::to_string(i) + "]." + field;
}

Prepared prepare(const Problem& problem) {
  Prepared prep{problem, 0, {}, {}, {}, {}, {}, {}};
  if (problem.base_bytes < 0) throw std::invalid_argument("base_bytes must be >= 0");
  if (problem.atom_saved_bytes.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    throw std::invalid_argument("atom_saved_bytes: too many atoms");
  }
  prep.n = static_cast<int>(problem.atom_saved_bytes.size());
  prep.prefix.assign(prep.n + 1, 0);
  for (int k = 0; k < prep.n; ++k) {
    const int64_t bytes = problem.atom_saved_bytes[k];
    if (bytes < 0) {
      throw std::invalid_argument("atom_saved_bytes[" + std::to_string(k) + "] must be >= 0");
    }
    if (bytes > kInt64Max - prep.prefix[k]) {
      throw std::invalid_argument("atom_saved_bytes: the sum overflows int64");
    }
    prep.prefix[k + 1] = prep.prefix[k] + bytes;
  }
  if (problem.base_bytes > kInt64Max - prep.prefix[prep.n]) {
    throw std::invalid_argument("base_bytes + sum(atom_saved_bytes) overflows int64");
  }
  const std::vector<int64_t>& extras = problem.atom_backward_extra_bytes;
  if (!extras.empty() && extras.size() != static_cast<size_t>(prep.n)) {
    throw std::invalid_argument("atom_backward_extra_bytes: " + std::to_string(extras.size()) +
                                " values for " + std::to_string(prep.n) +
                                " atoms (give one per atom, or none)");
  }
  prep.atom_extra = extras.empty() ? std::vector<int64_t>(prep.n, 0) : extras;
  const int64_t headroom = kInt64Max - problem.base_bytes - prep.prefix[prep.n];
  for (int k = 0; k < prep.n; ++k) {
    if (prep.atom_extra[k] < 0 || prep.atom_extra[k] > headroom) {
      throw std::invalid_argument("atom_backward_extra_bytes[" + std::to_string(k) +
                                  "] must be >= 0 and keep the peak within int64");
    }
  }
  // The backward extra of atom k seen from the end of a candidate: extra + prefix[k + 1].
  std::vector<int64_t> reach(prep.n);
  for (int k = 0; k < prep.n; ++k) reach[k] = prep.atom_extra[k] + prep.prefix[k + 1];
  // (Less the deferred gradients of the atoms after it, where given: reach + deferred prefix.)
  const std::vector<int64_t>& deferred = problem.atom_deferred_bytes;
  if (!deferred.empty() && deferred.size() != static_cast<size_t>(prep.n)) {
    throw std::invalid_argument("atom_deferred_bytes: " + std::to_string(deferred.size()) +
                                " values for " + std::to_string(prep.n) +
                                " atoms (give one per atom, or none)");
  }
  std::vector<int64_t> deferred_prefix(prep.n + 1, 0);
  if (!deferred.empty()) {
    const int64_t largest = *std::max_element(prep.atom_extra.begin(), prep.atom_extra.end());
    for (int k = 0; k < prep.n; ++k) {
      if (deferred[k] < 0 || deferred[k] > headroom - largest - deferred_prefix[k]) {
        throw std::invalid_argument("atom_deferred_bytes[" + std::to_string(k) +
                                    "] must be >= 0 and keep the peak within int64");
      }
      deferred_prefix[k + 1] = deferred_prefix[k] + deferred[k];
      reach[k] += deferred_prefix[k + 1];
    }
  }
  const RangeMax reach_max(std::move(reach));
  // The end of a candidate's atoms, as reach counts it.
  auto end_of = [&](int e) { return prep.prefix[e] + deferred_prefix[e]; };
  prep.ending_at.resize(prep.n + 1);
  prep.freed.resize(problem.candidates.size());
  prep.recompute_bytes.resize(problem.candidates.size());
  for (size_t i = 0; i < problem.candidates.size(); ++i) {
    const Candidate& c = problem.candidates[i];
    if (c.begin < 0 || c.end > prep.n || c.begin >= c.end) {
      throw std::invalid_argument(candidate_field(i, "begin/end") + ": need 0 <= begin (" +
                                  std::to_string(c.begin) + ") < end (" + std::to_string(c.end) +
                                  ") <= " + std::to_string(prep.n) + " atoms");
    }
    if (c.freed_bytes < 0) {
      throw std::invalid_argument(candidate_field(i, "freed_bytes") + " must be >= 0");
    }
    // Its atoms' backward extras, less the bytes of its atoms after each (freed by then): >= 0
    // (the last atom's term is its extra) and <= headroom.
    const int64_t backward = reach_max.max(c.begin, c.end) - end_of(c.end);
    if (c.recompute_extra_bytes < 0 || c.recompute_extra_bytes > headroom) {
      throw std::invalid_argument(candidate_field(i, "recompute_extra_bytes") +
                                  " must be >= 0 and keep the peak within int64");
    }
    if (c.backward_extra_bytes < 0 || c.backward_extra_bytes > headroom - backward) {
      throw std::invalid_argument(candidate_field(i, "backward_extra_bytes") +
                                  " must be >= 0 and keep the peak within int64");
    }
    const int until = c.backward_extra_end == 0 ? c.end : c.backward_extra_end;
    if (until <= c.begin || until > c.end) {
      throw std::invalid_argument(candidate_field(i, "backward_extra_end") + ": need begin (" +
                                  std::to_string(c.begin) + ") < it (" + std::to_string(until) +
                                  ") <= end (" + std::to_string(c.end) + "), or 0");
    }
    // With the gradients it holds apart: the backward through its atoms [begin, until).
    const int64_t apart = c.backward_extra_bytes == 0
                              ? 0
                              : reach_max.max(c.begin, until) - end_of(c.end) +
                                    c.backward_extra_bytes;
    const int64_t held = std::max({c.recompute_extra_bytes, backward, apart});
    if (c.input_bytes < 0 || c.input_bytes > headroom - held) {
      throw std::invalid_argument(candidate_field(i, "input_bytes") +
                                  " must be >= 0 and keep the peak within int64");
    }
    if (!std::isfinite(c.seconds) || c.seconds < 0) {
      throw std::invalid_argument(candidate_field(i, "seconds") + " must be finite and >= 0");
    }
    if (c.forward_bytes < 0 || c.forward_bytes > headroom - c.input_bytes) {
      throw std::invalid_argument(candidate_field(i, "forward_bytes") +
                                  " must be >= 0 and keep the peak within int64");
    }
    if (c.recompute_held_bytes < -problem.base_bytes ||
        c.recompute_held_bytes > c.recompute_extra_bytes) {
      throw std::invalid_argument(candidate_field(i, "recompute_held_bytes") +
                                  " must be in [-base_bytes, recompute_extra_bytes]");
    }
    if (c.nested_peak_bytes < -1 || c.nested_peak_bytes > headroom - c.input_bytes) {
      throw std::invalid_argument(candidate_field(i, "nested_peak_bytes") +
                                  " must be -1 (derived) or >= 0 and keep the peak within int64");
    }
    prep.freed[i] = std::min(c.freed_bytes, prep.range_sum(static_cast<int>(i)));
    // (At least what it keeps, which a given nested peak may be below: the programs take a
    // path's peak from its moves' terms, and the forward's end, base + all kept bytes, is at
    // least base + the kept bytes before it + its own: the predicted peak is unchanged.)
    prep.recompute_bytes[i] = std::max(
        prep.kept(static_cast<int>(i)),
        c.input_bytes + (c.nested_peak_bytes >= 0 ? c.nested_peak_bytes
                                                  : prep.range_sum(static_cast<int>(i)) + held));
    prep.ending_at[c.end].push_back(static_cast<int>(i));
  }
  prep.shared_of.resize(problem.candidates.size());
  for (size_t s = 0; s < problem.shared_inputs.size(); ++s) {
    const SharedInput& shared = problem.shared_inputs[s];
    const std::string field = "shared_inputs[" + std::to_string(s) + "]";
    if (shared.bytes < 0) throw std::invalid_argument(field + ".bytes must be >= 0");
    for (int c : shared.candidates) {
      if (c < 0 || static_cast<size_t>(c) >= problem.candidates.size()) {
        throw std::invalid_argument(field + ".candidates: index " + std::to_string(c) +
                                    " out of range");
      }
      std::vector<int>& of = prep.shared_of[c];
      if (!of.empty() && of.back() == static_cast<int>(s)) {
        throw std::invalid_argument(field + ".candidates: index " + std::to_string(c) +
                                    " repeated");
      }
      of.push_back(static_cast<int>(s));
    }
  }
  for (size_t c = 0; c < problem.candidates.size(); ++c) {
    int64_t room = problem.candidates[c].input_bytes;  // (subtracting: no overflow)
    for (int s : prep.shared_of[c]) {
      room -= problem.shared_inputs[s].bytes;
      if (room < 0) {
        throw std::invalid_argument(
            "shared_inputs: the bytes of those listing candidate " + std::to_string(c) +
            " sum above " + candidate_field(c, "input_bytes") + " (" +
            std::to_string(problem.candidates[c].input_bytes) + ")");
      }
    }
  }
  return prep;
}

// predicted_peak on prepared data; `chosen` must be sorted by begin and disjoint.
// A shared input is counted once from its first chosen reader on: a later chosen reader's
// recompute does not count it again, nor does what that reader keeps (its kept bytes, at most).
// share == false: counted once per chosen reader, as the programs count it.
// forward, if given: the most a chosen candidate's forward without grad holds above base (the
// kept bytes before it, its input_bytes and forward_bytes; shared inputs as `share` counts
// them), 0 if none.
int64_t peak_of_sorted(const Prepared& prep, const std::vector<int>& chosen, bool share = true,
                       int64_t* forward = nullptr) {
  const int64_t base = prep.problem.base_bytes;
  // Freed by the chosen candidates already passed, and their shared inputs counted again.
  int64_t freed_before = 0;
  std::vector<bool> counted(prep.problem.shared_inputs.size(), false);
  int64_t peak = base;
  if (forward != nullptr) *forward = 0;
  int k = 0;  // the next atom
  auto atoms_until = [&](int end) {  // the backward terms of the atoms no candidate covers
    for (; k < end; ++k) {
      peak = std::max(peak, base + prep.prefix[k + 1] - freed_before + prep.atom_extra[k]);
    }
  };
  for (int c : chosen) {
    const Candidate& cand = prep.problem.candidates[c];
    atoms_until(cand.begin);
    const int64_t kept_before = prep.prefix[cand.begin] - freed_before;
    int64_t again = 0;  // its shared inputs that an earlier chosen reader counts
    int64_t kept_again = 0;  // of those, what its kept bytes count (they may be clamped)
    if (share) {
      for (int s : prep.shared_of[c]) {
        if (!counted[s]) {
          counted[s] = true;
          continue;
        }
        const int64_t bytes = prep.problem.shared_inputs[s].bytes;
        again += bytes;
        kept_again += std::min(bytes, prep.kept(c) - kept_again);
      }
    }
    peak = std::max(peak, base + kept_before + prep.recompute(c) - again);
    if (forward != nullptr) {
      *forward = std::max(*forward, kept_before + cand.input_bytes - again + cand.forward_bytes);
    }
    freed_before += prep.freed[c] + kept_again;
    k = cand.end;
  }
  atoms_until(prep.n);
  return std::max(peak, base + prep.prefix[prep.n] - freed_before);
}

// The Plan for a disjoint chosen set: forward order, exact peak, seconds summed in that order.
Plan make_plan(const Prepared& prep, std::vector<int> chosen) {
  const auto& cands = prep.problem.candidates;
  std::sort(chosen.begin(), chosen.end(),
            [&](int a, int b) { return cands[a].begin < cands[b].begin; });
  Plan result;
  result.feasible = true;
  for (int c : chosen) result.recompute_seconds += cands[c].seconds;
  result.predicted_peak_bytes = peak_of_sorted(prep, chosen);
  result.planned_peak_bytes = prep.problem.shared_inputs.empty()
                                  ? result.predicted_peak_bytes
                                  : peak_of_sorted(prep, chosen, /*share=*/false);
  result.chosen = std::move(chosen);
  return result;
}

// The plan order: less time, then a lower peak, then fewer candidates.
bool better(double seconds_a, int64_t peak_a, size_t count_a, double seconds_b, int64_t peak_b,
            size_t count_b) {
  if (seconds_a != seconds_b) return seconds_a < seconds_b;
  if (peak_a != peak_b) return peak_a < peak_b;
  return count_a < count_b;
}

bool better(const Plan& a, const Plan& b) {
  return better(a.recompute_seconds, a.predicted_peak_bytes, a.chosen.size(),
                b.recompute_seconds, b.predicted_peak_bytes, b.chosen.size());
}

// The exact feasibility program: the least kept bytes with which each position can be reached
// under the budget (ties to less time). The constraints only tighten as kept grows, so the least
// kept dominates, and a fitting plan exists iff position n is reachable. Needs budget >= base.
// Returns the chosen candidates of that path, or nothing.
std::optional<std::vector<int>> least_kept_path(const Prepared& prep, int64_t budget) {
  const int n = prep.n;
  const int64_t room = budget - prep.problem.base_bytes;  // kept + recompute bytes must fit
  std::vector<int64_t> kept(n + 1, -1);                   // -1: unreachable
  std::vector<double> seconds(n + 1, 0);
  std::vector<int> choice(n + 1, -1);  // candidate that ends here, or -1: atom p-1 kept
  kept[0] = 0;
  for (int p = 1; p <= n; ++p) {
    auto relax = [&](int64_t k, double s, int c) {
      if (k <= room && (kept[p] < 0 || k < kept[p] || (k == kept[p] && s < seconds[p]))) {
        kept[p] = k;
        seconds[p] = s;
        choice[p] = c;
      }
    };
    if (kept[p - 1] >= 0 && kept[p - 1] + prep.problem.atom_saved_bytes[p - 1] +
                                    prep.atom_extra[p - 1] <= room) {
      relax(kept[p - 1] + prep.problem.atom_saved_bytes[p - 1], seconds[p - 1], -1);
    }
    for (int c : prep.ending_at[p]) {
      const int b = prep.problem.candidates[c].begin;
      if (kept[b] >= 0 && prep.recompute(c) <= room - kept[b]) {
        relax(kept[b] + prep.kept(c), seconds[b] + prep.problem.candidates[c].seconds, c);
      }
    }
  }
  if (kept[n] < 0) return std::nullopt;
  std::vector<int> chosen;
  for (int p = n; p > 0;) {
    if (choice[p] < 0) {
      --p;
    } else {
      chosen.push_back(choice[p]);
      p = prep.problem.candidates[choice[p]].begin;
    }
  }
  return chosen;
}

// The quantised program (see planner.h): state (position p, kept bucket b), value the least
// (seconds, partial peak, count) reaching it, where the partial peak is the exact peak of the
// path so far. Position p is computed from p - 1 and from the begins of the candidates ending at
// p; a position's values are dropped (their buffers reused) after its last such use, so a
// nested family keeps about its depth of positions in memory. Needs budget >= base. Returns the
// chosen candidates of the best plan, or nothing.
std::optional<std::vector<int>> quantised_path(const Prepared& prep, int64_t budget,
                                               int resolution) {
  const int n = prep.n;
  const std::vector<Candidate>& cands = prep.problem.candidates;
  const int64_t base = prep.problem.base_bytes;
  const int64_t room = budget - base;
  const int64_t q = std::max<int64_t>(1, room / resolution + (room % resolution != 0));
  const int64_t max_bucket = room / q;  // base + b * q <= budget, and max_bucket <= resolution
  const size_t width = static_cast<size_t>(max_bucket) + 1;
  auto buckets = [q](int64_t bytes) { return bytes / q + (bytes % q != 0); };  // rounded up

  // The values of one position's states, by bucket; lo..hi bounds the reached ones.
  struct Layer {
    std::vector<double> seconds;  // kInf: unreached (then the rest is not read)
    std::vector<int64_t> kept;    // exact kept bytes
    std::vector<int64_t> peak;    // exact partial peak
    std::vector<int32_t> count;
    int64_t lo = 0, hi = -1;
  };
  std::vector<std::unique_ptr<Layer>> layers(n + 1), pool;
  auto acquire = [&] {
    std::unique_ptr<Layer> layer;
    if (pool.empty()) {
      layer = std::make_unique<Layer>();
      layer->kept.resize(width);
      layer->peak.resize(width);
      layer->count.resize(width);
    } else {
      layer = std::move(pool.back());
      pool.pop_back();
    }
    layer->seconds.assign(width, kInf);
    layer->lo = max_bucket + 1;
    layer->hi = -1;
    return layer;
  };
  // released_at[e]: the positions whose last use is computing position e.
  std::vector<int> last_use(n + 1, n);
  for (int p = 0; p < n; ++p) last_use[p] = p + 1;
  for (const Candidate& c : cands) last_use[c.begin] = std::max(last_use[c.begin], c.end);
  std::vector<std::vector<int>> released_at(n + 1);
  for (int p = 0; p < n; ++p) released_at[last_use[p]].push_back(p);
  // The move into each state (a candidate, or -1: atom p-1 kept), indexed p * width + b.
  auto choice = std::make_unique_for_overwrite<int32_t[]>((static_cast<size_t>(n) + 1) * width);

  layers[0] = acquire();
  layers[0]->seconds[0] = 0;
  layers[0]->kept[0] = 0;
  layers[0]->peak[0] = base;
  layers[0]->count[0] = 0;
  layers[0]->lo = layers[0]->hi = 0;

  // Moves every reached state of `from` with b <= last by `w` buckets into `to` (position p),
  // adding `add` kept bytes; the move's peak term is base + the kept bytes before it + `top`
  // (an atom kept: its bytes and its backward extra; c >= 0 checkpoints candidate c: its
  // recompute bytes).
  auto relax = [&](const Layer& from, Layer& to, int p, int64_t w, int64_t add, int c,
                   int64_t top, double cost, int64_t last) {
    last = std::min({last, from.hi, max_bucket - w});
    int32_t* to_choice = choice.get() + static_cast<size_t>(p) * width;
    for (int64_t b = from.lo; b <= last; ++b) {
      const double s = from.seconds[b];
      if (s == kInf) continue;
      const double ns = s + cost;
      const int64_t nk = from.kept[b] + add;
      const int64_t np = std::max(from.peak[b], base + from.kept[b] + top);
      const int32_t nc = from.count[b] + (c >= 0);
      const int64_t t = b + w;
      if (to.seconds[t] == kInf || better(ns, np, nc, to.seconds[t], to.peak[t], to.count[t])) {
        to.seconds[t] = ns;
        to.kept[t] = nk;
        to.peak[t] = np;
        to.count[t] = nc;
        to_choice[t] = c;
        to.lo = std::min(to.lo, t);
        to.hi = std::max(to.hi, t);
      }
    }
  };

  for (int p = 1; p <= n; ++p) {
    layers[p] = acquire();
    const int64_t saved = prep.problem.atom_saved_bytes[p - 1];
    const int64_t top = saved + prep.atom_extra[p - 1];
    if (top <= room) {  // base + b * q + top <= budget (b * q bounds the kept bytes)
      relax(*layers[p - 1], *layers[p], p, buckets(saved), saved, -1, top, 0.0, (room - top) / q);
    }
    for (int c : prep.ending_at[p]) {
      const int64_t range = prep.recompute(c);
      if (range > room) continue;
      // Recompute fits while base + b * q + range <= budget (b * q bounds the kept bytes).
      relax(*layers[cands[c].begin], *layers[p], p, buckets(prep.kept(c)), prep.kept(c), c, range,
            cands[c].seconds, (room - range) / q);
    }
    for (int s : released_at[p]) pool.push_back(std::move(layers[s]));
  }

  const Layer& last = *layers[n];
  int64_t best = -1;
  for (int64_t b = last.lo; b <= last.hi; ++b) {
    if (last.seconds[b] == kInf) continue;
    if (best < 0 || better(last.seconds[b], last.peak[b], last.count[b], last.seconds[best],
                           last.peak[best], last.count[best])) {
      best = b;
    }
  }
  if (best < 0) return std::nullopt;
  std::vector<int> chosen;
  for (int p = n, b = static_cast<int>(best); p > 0;) {
    const int c = choice[static_cast<size_t>(p) * width + b];
    if (c < 0) {
      b -= static_cast<int>(buckets(prep.problem.atom_saved_bytes[p - 1]));
      --p;
    } else {
      chosen.push_back(c);
      b -= static_cast<int>(buckets(prep.kept(c)));
      p = cands[c].begin;
    }
  }
  return chosen;
}

void check_resolution(int resolution) {
  if (resolution < 1) throw std::invalid_argument("resolution must be >= 1");
}

}  // namespace

void validate(const Problem& problem) { prepare(problem); }

int64_t predicted_peak(const Problem& problem, const std::vector<int>& chosen) {
  const Prepared prep = prepare(problem);
  std::vector<int> sorted = chosen;
  for (int c : sorted) {
    if (c < 0 || static_cast<size_t>(c) >= problem.candidates.size()) {
      throw std::invalid_argument("chosen: index " + std::to_string(c) + " out of range");
    }
  }
  const auto& cands = problem.candidates;
  std::sort(sorted.begin(), sorted.end(),
            [&](int a, int b) { return cands[a].begin < cands[b].begin; });
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (cands[sorted[i - 1]].end > cands[sorted[i]].begin) {
      throw std::invalid_argument("chosen: candidates " + std::to_string(sorted[i - 1]) +
                                  " and " + std::to_string(sorted[i]) + " overlap");
    }
  }
  return peak_of_sorted(prep, sorted);
}

Plan plan(const Problem& problem, int64_t budget_bytes, int resolution) {
  check_resolution(resolution);
  const Prepared prep = prepare(problem);
  if (budget_bytes < problem.base_bytes) return Plan{};
  // The best of: the exact least-kept path (it exists iff any plan fits), the eager step when
  // it fits (the quantised program may not see it when q > 1), and the quantised optimum.
  const std::optional<std::vector<int>> exact = least_kept_path(prep, budget_bytes);
  if (!exact) return Plan{};
  Plan best = make_plan(prep, *exact);
  if (peak_of_sorted(prep, {}) <= budget_bytes) {  // the eager step fits
    Plan eager = make_plan(prep, {});
    if (better(eager, best)) best = std::move(eager);
  }
  if (std::optional<std::vector<int>> quantised = quantised_path(prep, budget_bytes, resolution)) {
    Plan candidate = make_plan(prep, std::move(*quantised));
    if (better(candidate, best)) best = std::move(candidate);
  }
  if (best.planned_peak_bytes > budget_bytes) {  // both programs are conservative
    throw std::logic_error("memlean::fit::plan: a plan exceeds its budget");
  }
  return best;
}

Plan least_peak_plan(const Problem& problem, int resolution) {
  check_resolution(resolution);
  const Prepared prep = prepare(problem);
  // Every peak is >= base, and the empty plan reaches the eager peak.
  int64_t infeasible = problem.base_bytes - 1;
  int64_t feasible = peak_of_sorted(prep, {});
  while (feasible - infeasible > 1) {
    const int64_t mid = infeasible + (feasible - infeasible) / 2;
    if (least_kept_path(prep, mid)) {
      feasible = mid;
    } else {
      infeasible = mid;
    }
  }
  return plan(problem, feasible, resolution);
}

Problem with_compounds(const Problem& problem, const std::vector<std::vector<int>>& excluded,
                       int resolution, std::vector<Compound>* made) {
  check_resolution(resolution);
  const Prepared prep = prepare(problem);
  const int plain = static_cast<int>(problem.candidates.size());
  if (!excluded.empty() && excluded.size() != static_cast<size_t>(plain)) {
    throw std::invalid_argument("excluded: " + std::to_string(excluded.size()) + " lists for " +
                                std::to_string(plain) +
                                " candidates (give one per candidate, or none)");
  }
  Problem out = problem;
  const std::vector<Candidate>& cands = problem.candidates;
  const std::vector<std::vector<int>>& shared_of = prep.shared_of;  // (a compound: its outer's)
  std::vector<Compound> compounds;  // made, in order: compound `plain + k` is compounds[k]
  std::vector<int> order(plain);  // smallest first: a compound's inner ones are made before it
  for (int i = 0; i < plain; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return cands[a].end - cands[a].begin < cands[b].end - cands[b].begin;
  });
  std::vector<int> compound_of(plain, -1);  // its compound's index, or -1
  for (const int c : order) {
    const Candidate& outer = cands[c];
    const int b = outer.begin, e = outer.end;
    std::vector<int> inner;
    for (int j = 0; j < plain; ++j) {
      const Candidate& d = cands[j];
      if (d.begin < b || d.end > e || (d.begin == b && d.end == e)) continue;
      if (!excluded.empty() &&
          std::find(excluded[c].begin(), excluded[c].end(), j) != excluded[c].end()) {
        continue;
      }
      inner.push_back(j);
      if (compound_of[j] >= 0) inner.push_back(compound_of[j]);
    }
    if (inner.empty()) continue;
    Problem sub;
    sub.atom_saved_bytes.assign(problem.atom_saved_bytes.begin() + b,
                                problem.atom_saved_bytes.begin() + e);
    sub.atom_backward_extra_bytes.assign(e - b, 0);
    const int until = outer.backward_extra_end == 0 ? e : outer.backward_extra_end;
    for (int k = b; k < e; ++k) {
      if (!problem.atom_backward_extra_bytes.empty()) {
        sub.atom_backward_extra_bytes[k - b] = problem.atom_backward_extra_bytes[k];
      }
      if (k < until) sub.atom_backward_extra_bytes[k - b] += outer.backward_extra_bytes;
    }
    std::vector<int> index(out.candidates.size(), -1);
    for (const int j : inner) {
      index[j] = static_cast<int>(sub.candidates.size());
      Candidate d = out.candidates[j];
      const int plain_j = j < plain ? j : compounds[j - plain].outer;
      for (const int s : shared_of[plain_j]) {  // kept by c too: c counts it
        const std::vector<int>& readers = problem.shared_inputs[s].candidates;
        if (std::find(readers.begin(), readers.end(), c) == readers.end()) continue;
        const int64_t bytes = problem.shared_inputs[s].bytes;
        d.input_bytes = std::max<int64_t>(0, d.input_bytes - bytes);
        d.freed_bytes += bytes;
      }
      d.begin -= b;
      d.end -= b;
      if (d.backward_extra_end != 0) d.backward_extra_end -= b;
      // (Its atoms for its seconds: which inner plan reaches the least peak fastest must not
      // hang on measured times, which differ from call to call: a later fit at the least an
      // earlier one named must find the same compounds.)
      d.seconds = d.end - d.begin;
      // (Relative to the step's base, which the sub-problem does not have; it plans no
      // compounds of its own, so nothing reads it there.)
      d.recompute_held_bytes = 0;
      sub.candidates.push_back(d);
    }
    for (size_t s = 0; s < problem.shared_inputs.size(); ++s) {
      const std::vector<int>& readers = out.shared_inputs[s].candidates;
      if (std::find(readers.begin(), readers.end(), c) != readers.end()) continue;
      SharedInput kept{out.shared_inputs[s].bytes, {}};
      for (const int r : readers) {
        if (r < static_cast<int>(index.size()) && index[r] >= 0) {
          kept.candidates.push_back(index[r]);
        }
      }
      if (kept.candidates.size() > 1) sub.shared_inputs.push_back(std::move(kept));
    }
    // The end of c's recompute, what the inner plan keeps plus c's recompute extra, as one
    // more atom after its own (no bytes; that extra its backward term): the inner plan then
    // reaches the least of the larger of the two, not the least of its own peak alone.
    sub.atom_saved_bytes.push_back(0);
    sub.atom_backward_extra_bytes.push_back(outer.recompute_extra_bytes);
    if (!problem.atom_deferred_bytes.empty()) {
      sub.atom_deferred_bytes.assign(problem.atom_deferred_bytes.begin() + b,
                                     problem.atom_deferred_bytes.begin() + e);
      sub.atom_deferred_bytes.push_back(0);
    }
    const Plan inside = least_peak_plan(sub, resolution);
    if (!inside.feasible || inside.chosen.empty()) continue;
    const int64_t range = prep.range_sum(c);
    int64_t forward = 0;  // (a shared input once, as the predicted peak counts it)
    peak_of_sorted(prepare(sub), inside.chosen, /*share=*/true, &forward);
    const int64_t top = std::max({inside.predicted_peak_bytes,
                                  outer.recompute_held_bytes > 0 &&
                                          forward > kInt64Max - outer.recompute_held_bytes
                                      ? kInt64Max
                                      : forward + outer.recompute_held_bytes});
    if (top >= range + outer.recompute_extra_bytes) continue;
    Candidate compound = outer;
    for (const int i : inside.chosen) compound.seconds += out.candidates[inner[i]].seconds;
    compound.nested_peak_bytes = top;
    compound.backward_extra_bytes = 0;  // (in the nested peak: its atoms' extras)
    compound.backward_extra_end = 0;
    const int at = static_cast<int>(out.candidates.size());
    for (const int s : shared_of[c]) out.shared_inputs[s].candidates.push_back(at);
    out.candidates.push_back(compound);
    compound_of[c] = at;
    Compound m{c, {}};
    for (const int i : inside.chosen) m.inner.push_back(inner[i]);
    compounds.push_back(std::move(m));
  }
  if (made != nullptr) *made = std::move(compounds);
  return out;
}

std::vector<Candidate> chain_candidates(const std::vector<int64_t>& saved_bytes,
                                        const std::vector<int64_t>& output_bytes,
                                        const std::vector<double>& seconds) {
  const size_t n = saved_bytes.size();
  if (output_bytes.size() != n || seconds.size() != n) {
    throw std::invalid_argument("chain_candidates: saved_bytes, output_bytes and seconds differ "
                                "in size");
  }
  int64_t total = 0;
  for (size_t k = 0; k < n; ++k) {
    if (saved_bytes[k] < 0 || saved_bytes[k] > kInt64Max - total || output_bytes[k] < 0) {
      throw std::invalid_argument("chain_candidates: saved_bytes or output_bytes negative, or "
                                  "saved_bytes overflowing");
    }
    total += saved_bytes[k];
  }
  std::vector<Candidate> result;
  result.reserve(n * (n + 1) / 2);
  for (size_t i = 0; i < n; ++i) {
    int64_t bytes = 0;
    double time = 0;
    for (size_t j = i + 1; j <= n; ++j) {
      bytes += saved_bytes[j - 1];
      time += seconds[j - 1];
      result.push_back(Candidate{static_cast<int>(i), static_cast<int>(j),
                                 std::max<int64_t>(0, bytes - output_bytes[j - 1]), time});
    }
  }
  return result;
}

std::string to_json(const Plan& plan) {
  std::string out = std::string("{\"feasible\": ") + (plan.feasible ? "true" : "false") +
                    ", \"chosen\": [";
  for (size_t i = 0; i < plan.chosen.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(plan.chosen[i]);
  }
  char seconds[32];  // the shortest round-trip form: valid JSON for every finite double
  const std::to_chars_result written =
      std::to_chars(seconds, seconds + sizeof seconds, plan.recompute_seconds);
  out += "], \"predicted_peak_bytes\": " + std::to_string(plan.predicted_peak_bytes) +
         ", \"recompute_seconds\": " + std::string(seconds, written.ptr) + "}";
  return out;
}

}  // namespace memlean::fit
