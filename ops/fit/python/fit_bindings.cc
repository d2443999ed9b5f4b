// memlean._C.fit: the planner of //ops/fit (memlean.fit plans with it: one planner for C++ and
// Python) and the budget parser. std::invalid_argument becomes ValueError.
#include "ops/fit/python/fit_bindings.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "ops/fit/budget.h"
#include "ops/fit/planner.h"
#include "ops/fit/search.h"

namespace memlean::python {
namespace {

namespace py = pybind11;
// begin, end, freed_bytes, seconds, recompute_extra_bytes, input_bytes
using CandidateTuple = std::tuple<int, int, int64_t, double, int64_t, int64_t>;
// bytes, the candidates keeping it
using SharedTuple = std::tuple<int64_t, std::vector<int>>;
// backward_extra_bytes, backward_extra_end
using ApartTuple = std::tuple<int64_t, int>;

fit::Problem problem_of(int64_t base_bytes, std::vector<int64_t> atom_saved_bytes,
                        const std::vector<CandidateTuple>& candidates,
                        std::vector<int64_t> atom_backward_extra_bytes,
                        const std::vector<SharedTuple>& shared_inputs,
                        const std::vector<ApartTuple>& candidate_backward_extras,
                        const std::vector<int64_t>& candidate_nested_peaks,
                        std::vector<int64_t> atom_deferred_bytes) {
  fit::Problem p;
  p.base_bytes = base_bytes;
  p.atom_saved_bytes = std::move(atom_saved_bytes);
  p.atom_backward_extra_bytes = std::move(atom_backward_extra_bytes);
  p.atom_deferred_bytes = std::move(atom_deferred_bytes);
  p.candidates.reserve(candidates.size());
  for (const auto& [begin, end, freed, seconds, extra, input] : candidates) {
    p.candidates.push_back({begin, end, freed, seconds, extra, input});
  }
  // An optional per-candidate list: empty, or one value per candidate.
  auto per_candidate = [&](size_t size, const char* name) {
    if (size != 0 && size != candidates.size()) {
      throw std::invalid_argument(std::string(name) + ": " + std::to_string(size) +
                                  " values for " + std::to_string(candidates.size()) +
                                  " candidates (give one per candidate, or none)");
    }
    return size != 0;
  };
  if (per_candidate(candidate_backward_extras.size(), "candidate_backward_extras")) {
    for (size_t i = 0; i < candidates.size(); ++i) {
      std::tie(p.candidates[i].backward_extra_bytes, p.candidates[i].backward_extra_end) =
          candidate_backward_extras[i];
    }
  }
  if (per_candidate(candidate_nested_peaks.size(), "candidate_nested_peaks")) {
    for (size_t i = 0; i < candidates.size(); ++i) {
      p.candidates[i].nested_peak_bytes = candidate_nested_peaks[i];
    }
  }
  p.shared_inputs.reserve(shared_inputs.size());
  for (const auto& [bytes, readers] : shared_inputs) p.shared_inputs.push_back({bytes, readers});
  return p;
}

py::tuple plan_tuple(const fit::Plan& plan) {
  return py::make_tuple(plan.feasible, plan.chosen, plan.predicted_peak_bytes,
                        plan.recompute_seconds);
}

// Defines s.`name`(base_bytes, atom_saved_bytes, candidates, <own>, atom_backward_extra_bytes=[],
// shared_inputs=[], candidate_backward_extras=[], candidate_nested_peaks=[],
// atom_deferred_bytes=[]) as f(the Problem, <own>): every planner function takes the problem
// so, its own arguments (of types Own, named by own_args) between its three required and five
// optional fields.
template <typename... Own>
struct OnProblem {
  template <typename F, typename... OwnArgs>
  static void def(py::module_& s, const char* name, F f, const char* doc, OwnArgs... own_args) {
    s.def(
        name,
        [f](int64_t base, std::vector<int64_t> atoms, const std::vector<CandidateTuple>& candidates,
            Own... own, std::vector<int64_t> extras, const std::vector<SharedTuple>& shared,
            const std::vector<ApartTuple>& apart, const std::vector<int64_t>& nested,
            std::vector<int64_t> deferred) {
          return f(problem_of(base, std::move(atoms), candidates, std::move(extras), shared, apart,
                              nested, std::move(deferred)),
                   std::move(own)...);
        },
        py::arg("base_bytes"), py::arg("atom_saved_bytes"), py::arg("candidates"), own_args...,
        py::arg("atom_backward_extra_bytes") = std::vector<int64_t>{},
        py::arg("shared_inputs") = std::vector<SharedTuple>{},
        py::arg("candidate_backward_extras") = std::vector<ApartTuple>{},
        py::arg("candidate_nested_peaks") = std::vector<int64_t>{},
        py::arg("atom_deferred_bytes") = std::vector<int64_t>{}, doc);
  }
};

}  // namespace

void init_fit(py::module_& m) {
  py::module_ s = m.def_submodule("fit", "memlean::fit: the memory-budget planner (private).");
  OnProblem<int64_t, int>::def(
      s, "plan",
      [](const fit::Problem& p, int64_t budget, int resolution) {
        fit::Plan plan;
        {
          py::gil_scoped_release release;
          plan = fit::plan(p, budget, resolution);
        }
        return plan_tuple(plan);
      },
      "memlean::fit::plan: (feasible, chosen, predicted_peak_bytes, recompute_seconds); "
      "candidates are (begin, end, freed_bytes, seconds, recompute_extra_bytes, input_bytes); "
      "shared_inputs are (bytes, [candidate, ...]); candidate_backward_extras, one per "
      "candidate (or none), (backward_extra_bytes, backward_extra_end); candidate_nested_peaks, "
      "one per candidate (or none), nested_peak_bytes (-1: a plain checkpoint).",
      py::arg("budget_bytes"), py::arg("resolution") = 4096);
  OnProblem<int>::def(
      s, "least_peak_plan",
      [](const fit::Problem& p, int resolution) {
        fit::Plan plan;
        {
          py::gil_scoped_release release;
          plan = fit::least_peak_plan(p, resolution);
        }
        return plan_tuple(plan);
      },
      "memlean::fit::least_peak_plan, as plan().", py::arg("resolution") = 4096);
  OnProblem<std::vector<int>>::def(
      s, "predicted_peak",
      [](const fit::Problem& p, const std::vector<int>& chosen) {
        return fit::predicted_peak(p, chosen);
      },
      "memlean::fit::predicted_peak.", py::arg("chosen"));
  OnProblem<int64_t, int64_t, int64_t, py::function, int>::def(
      s, "search",
      [](const fit::Problem& p, int64_t budget, int64_t floor, int64_t empty_peak,
         const py::function& measure, int resolution) {
        fit::SearchOptions options;
        options.resolution = resolution;
        // The GIL stays held: measure is Python, and the planner's calls are short.
        const fit::SearchResult r = fit::search(
            p, budget, floor, empty_peak,
            [&measure](const fit::Plan& plan) { return measure(plan.chosen).cast<int64_t>(); },
            options);
        const fit::Plan none;
        const fit::Plan& fastest = r.fastest ? *r.fastest : none;
        return py::make_tuple(r.fastest.has_value(), fastest.chosen, r.fastest_peak_bytes,
                              fastest.predicted_peak_bytes, fastest.recompute_seconds,
                              r.least_measured_peak_bytes, r.measured_plans);
      },
      "memlean::fit::search with measure(chosen) -> measured peak: (found, chosen, "
      "measured_peak_bytes, predicted_peak_bytes, recompute_seconds, "
      "least_measured_peak_bytes, measured_plans).",
      py::arg("budget_bytes"), py::arg("floor_bytes"), py::arg("empty_peak_bytes"),
      py::arg("measure"), py::arg("resolution") = 4096);
  OnProblem<std::vector<std::vector<int>>, int>::def(
      s, "with_compounds",
      [](const fit::Problem& p, const std::vector<std::vector<int>>& excluded, int resolution) {
        std::vector<fit::Compound> made;
        fit::Problem out;
        {
          py::gil_scoped_release release;
          out = fit::with_compounds(p, excluded, resolution, &made);
        }
        py::list tuples, shared_out, apart_out, nested_out, made_out;
        for (const fit::Candidate& c : out.candidates) {
          tuples.append(py::make_tuple(c.begin, c.end, c.freed_bytes, c.seconds,
                                       c.recompute_extra_bytes, c.input_bytes));
          apart_out.append(py::make_tuple(c.backward_extra_bytes, c.backward_extra_end));
          nested_out.append(c.nested_peak_bytes);
        }
        for (const fit::SharedInput& si : out.shared_inputs) {
          shared_out.append(py::make_tuple(si.bytes, si.candidates));
        }
        for (const fit::Compound& m : made) made_out.append(py::make_tuple(m.outer, m.inner));
        return py::make_tuple(tuples, shared_out, apart_out, nested_out, made_out);
      },
      "memlean::fit::with_compounds: (candidates, shared_inputs, candidate_backward_extras, "
      "candidate_nested_peaks, made), the problem's own first, then one per compound made; "
      "made: (outer, [inner, ...]) per compound.",
      py::arg("excluded") = std::vector<std::vector<int>>{}, py::arg("resolution") = 64);
  s.def("parse_budget", &fit::parse_budget, py::arg("text"), py::arg("argument"),
        "memlean::fit::parse_budget: '6GiB' -> bytes (ValueError naming `argument`).");
  s.def("describe_bytes", &fit::describe_bytes, py::arg("bytes"),
        "'2,885,716,560 bytes (2.69 GiB)'.");
  s.def("cuda_margin", &fit::cuda_margin, py::arg("budget_bytes"),
        "memlean::fit::cuda_margin: how far below the budget fit plans a step on CUDA.");
}

}  // namespace memlean::python
