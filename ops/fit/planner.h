// memlean::fit planner: choose which modules to checkpoint so that a training step's predicted
// peak memory fits a budget at the least recompute time.
//
// The model. A step's forward runs n atoms (the finest measured modules, in forward order); atom
// k leaves atom_saved_bytes[k] alive for backward, and everything else at the step's peak is
// base_bytes, so the eager peak is base_bytes + sum(atom_saved_bytes) (or a backward term of
// atom_backward_extra_bytes, below, when that is higher). A candidate covers atoms
// [begin, end); checkpointing it frees freed_bytes (clamped to [0, its atoms' bytes]) and costs
// `seconds` of recompute. A chosen set S is pairwise disjoint; a chosen c keeps
// range_sum(c) - freed_bytes, every other atom its saved bytes, and
//   predicted_peak(S) = max(base + sum of all kept,
//                           max over c in S of base + kept_before(c.begin) + range_sum(c)
//                                              + input_bytes(c)
//                                              + max(recompute_extra_bytes(c), backward(c)),
//                           max over atoms k outside S of base + kept_before(k + 1)
//                                              + atom_backward_extra_bytes[k])
// (while c is recomputed in backward its whole activation memory is back, everything after it
// has been freed, and the inputs it keeps that none of its atoms saved are alive: input_bytes.
// Two moments follow: the recompute, which adds what only it holds (its recomputed output,
// until its graph's nodes hold what they need; the buffer copies a recompute puts back):
// recompute_extra_bytes; then the backward through its atoms, which holds what backward held
// there without checkpoints: backward(c), from the per-atom extras below. memlean's
// checkpoint frees the recomputed output and the incoming gradient as soon as they are used,
// so the two do not add up: on CPU, where bytes are exact, the planner's plans are then
// predicted to the byte (docs/fit.md). A compound candidate (checkpoints nested inside it)
// has range_sum(c) + max(...) given instead: its nested_peak_bytes (Candidate, below), the
// term at least its kept bytes.
// plan() minimises the sum of seconds over S subject to
// predicted_peak(S) <= budget; ties go to the lower peak, then to fewer candidates (the
// fewest is not guaranteed: a state keeps the lower partial peak, which may tie at the end).
//
// The algorithm and its caveat. A dynamic program over atom positions and kept bytes quantised
// into `resolution` buckets of q = max(1, ceil((budget - base) / resolution)) bytes, every
// addition rounded up, so each plan it finds truly fits (the exact peak is recomputed and
// checked). It is optimal under the model except that it may miss plans whose peak is within
// n * (q - 1) bytes of the budget: its time is at most that of the best plan with
// predicted_peak <= budget - n * (q - 1), and exactly optimal (least time, then least peak)
// when q == 1.
// Feasibility is exact: when the quantised program finds nothing, or something slower, an exact
// least-kept-bytes program supplies a fitting plan, so plan() is infeasible only when no choice
// of candidates fits; and a budget >= the eager peak always gets the empty plan unless an
// equally fast (zero-second) choice has a lower peak. Time O((n + candidates) * resolution),
// memory O(n * resolution) at most (about the nesting depth * resolution for nested modules).
//
// Candidates need not be laminar: any intervals are accepted (chain_candidates gives every run
// of layers, which overlap without nesting); only the chosen ones must be disjoint.
//
// Shared inputs. A tensor that no atom saves but several candidates read (a DenseNet layer's
// input is the list of every earlier feature map of its block) is kept by each chosen reader,
// and each counts it among its kept and input bytes; but it lives once, from its forward until
// the backward of the earliest chosen reader. Listed in Problem::shared_inputs, it is counted
// once in every term of predicted_peak that counts it at all (the forward's end, a recompute
// and the backward of an atom after a chosen reader). The programs below still count it once
// per chosen reader (their sums are per candidate; exact sharing needs to know which earlier
// reader was chosen), so they stay conservative: every plan they return fits, its
// predicted_peak_bytes is exact and its planned_peak_bytes is what they counted;
// least_peak_plan's planned_peak_bytes is the least of the programs' count, and its choice may
// miss one whose shared inputs bring it lower.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace memlean::fit {

// A module that may be checkpointed: atoms [begin, end).
struct Candidate {
  int begin = 0;
  int end = 0;
  int64_t freed_bytes = 0;  // clamped to the sum of its atoms' saved bytes
  double seconds = 0;       // its forward time: the cost of recomputing it
  // Bytes alive while it is recomputed besides base, the kept bytes before it, its atoms' and
  // input_bytes (its recomputed output, copies of buffers the recompute puts back; without
  // per-atom extras, also the gradients backward has made by then); >= 0.
  int64_t recompute_extra_bytes = 0;
  // Bytes of its inputs that none of its atoms saves: the checkpoint keeps them, alive
  // through its recompute and the backward through it; >= 0.
  int64_t input_bytes = 0;
  // Bytes alive through the backward through its atoms [begin, backward_extra_end) (not its
  // recompute) besides what backward held there without checkpoints: the gradients its
  // backward makes for inputs that later readers have given a gradient already (a residual),
  // which the checkpoint hands on whole where autograd would have summed them into that
  // gradient in place, from the backward of the last atom reading them; >= 0.
  int64_t backward_extra_bytes = 0;
  int backward_extra_end = 0;  // in (begin, end]; 0: end
  // A compound candidate (checkpoints nested inside it, which its recompute runs: only their
  // inputs and the bytes of the atoms outside them are back while it is recomputed, and each
  // is recomputed again in the backward through it): the most its recompute and the backward
  // through it hold besides base, the kept bytes before it and input_bytes, given (the caller
  // predicts it: the sub-problem of its atoms with the nested checkpoints chosen) instead of
  // derived from its atoms' bytes and extras. -1: derived (a plain checkpoint). Its seconds
  // are then its forward's and the nested candidates' together.
  int64_t nested_peak_bytes = -1;
  // For compounds (with_compounds, below). forward_bytes: the most its forward holds when run
  // without grad, as a checkpoint nested in a compound's recompute runs it (a layer's input,
  // output and temporaries), above the kept bytes before it and its input_bytes; >= 0.
  // recompute_held_bytes: of its recompute_extra_bytes, what is alive from the start of its
  // recompute (the gradients backward brought, the buffer copies), through the forwards of the
  // checkpoints nested in it as a compound; in [-base_bytes, recompute_extra_bytes]: negative
  // where base, the step's highest catch-all (the forward's, the loss's), counts more than is
  // alive then (recompute_extra_bytes is that sum with its recompute's own bytes, clamped to
  // >= 0). Both 0: no such moment above the others (a caller that does not measure them).
  int64_t forward_bytes = 0;
  int64_t recompute_held_bytes = 0;
};

// A tensor kept by several candidates (see "Shared inputs" above): each of them counts its
// bytes in its input_bytes and in what it keeps (range sum - freed_bytes).
struct SharedInput {
  int64_t bytes = 0;
  std::vector<int> candidates;  // indices into Problem::candidates, distinct
};

struct Problem {
  int64_t base_bytes = 0;
  std::vector<int64_t> atom_saved_bytes;
  std::vector<Candidate> candidates;
  // Optional (empty: all 0), one per atom: the bytes backward holds above base and the saved
  // bytes of atoms [0, k] while it runs atom k (activation gradients, temporaries, the parameter
  // gradients made by then). An atom k that no chosen candidate covers adds the peak term
  //   base + kept bytes of atoms [0, k] + atom_backward_extra_bytes[k],
  // and a chosen c = [b, e) recomputes with
  //   backward(c) = max over k in [b, e) of atom_backward_extra_bytes[k]
  //                                        - sum(atom_saved_bytes(k, e))
  //                                        + (k < its backward_extra_end: its
  //                                           backward_extra_bytes, else 0)
  // bytes more (0 without extras). In a step without checkpoints
  // these terms are what backward reaches atom by atom, so measured ones keep the eager
  // prediction exact.
  std::vector<int64_t> atom_backward_extra_bytes;
  // Optional (empty: all 0), one per atom, >= 0: gradient bytes that the backward through a
  // checkpoint holds less than the step without checkpoints held, from the backward of atom
  // k on, through the backward of the atoms before k inside that checkpoint: a chosen
  // c = [b, e) has
  //   backward(c) = max over k in [b, e) of atom_backward_extra_bytes[k]
  //                 - sum(atom_saved_bytes(k, e)) - sum(atom_deferred_bytes(k, e)) + ...
  // (memlean.fit under autocast: the recompute reuses the weights' lower-precision copies
  // autocast cached in the forward, whose casts' backward autograd runs after the
  // recompute's, so each weight's gradient waits in the lower precision until the
  // checkpoint's backward ends, where the step without it had accumulated it in float32: k
  // the atom that first used the copy, its bytes the float32 gradient's less the copy's.)
  std::vector<int64_t> atom_deferred_bytes;
  // Optional: tensors several candidates keep, counted once where more than one is chosen.
  std::vector<SharedInput> shared_inputs;
};

struct Plan {
  bool feasible = false;
  std::vector<int> chosen;           // indices into Problem::candidates, in forward order
  int64_t predicted_peak_bytes = 0;  // predicted_peak(problem, chosen), exact
  double recompute_seconds = 0;      // sum of the chosen candidates' seconds
  // The peak as the programs count it (shared inputs once per chosen reader; without shared
  // inputs, predicted_peak_bytes): plan() finds a plan for every budget at or above it.
  int64_t planned_peak_bytes = 0;
};

// Throws std::invalid_argument, naming the field, for: negative base_bytes, atom_saved_bytes,
// freed_bytes, recompute_extra_bytes, input_bytes, backward_extra_bytes, forward_bytes,
// nested_peak_bytes (but -1), recompute_held_bytes below -base_bytes or above
// recompute_extra_bytes, or
// atom_backward_extra_bytes, or the latter
// not empty and not one per atom; atom_deferred_bytes likewise, or its sum with the largest
// backward extra overflowing the peak; a candidate with begin >= end or outside [0, n]; negative or
// non-finite seconds; base_bytes + sum(atom_saved_bytes) overflowing int64; a shared input
// with negative bytes or a candidate index out of range or repeated; a candidate whose shared
// inputs sum above its input_bytes.
void validate(const Problem& problem);

// The exact predicted peak of a set of candidates (any order). Throws std::invalid_argument if
// an index is out of range or two of them overlap.
int64_t predicted_peak(const Problem& problem, const std::vector<int>& chosen);

// The least-time plan whose predicted peak fits budget_bytes (see the caveat above). Infeasible:
// feasible == false and chosen empty. Throws std::invalid_argument for resolution < 1.
Plan plan(const Problem& problem, int64_t budget_bytes, int resolution = 4096);

// The least predicted peak that any disjoint choice reaches, exactly (a bisection over budgets
// with the exact feasibility test), with plan(problem, that peak, resolution): the least time
// that reaches it, up to the caveat above. With shared inputs, the least as the programs count
// it: that is the plan's planned_peak_bytes, and its predicted_peak_bytes may be lower.
Plan least_peak_plan(const Problem& problem, int resolution = 4096);

// The chain case (torch::nn::Sequential): every run [i, j) of the n layers, ordered by i then j,
// with freed_bytes = max(0, sum(saved_bytes[i..j)) - output_bytes[j-1]) and seconds =
// sum(seconds[i..j)). Throws std::invalid_argument if the three sizes differ.
std::vector<Candidate> chain_candidates(const std::vector<int64_t>& saved_bytes,
                                        const std::vector<int64_t>& output_bytes,
                                        const std::vector<double>& seconds);

// A compound candidate made by with_compounds: candidates[outer] checkpointed around the
// checkpoints `inner` inside it, which its recompute runs (indices into the candidates, the
// compounds made before it among them: nesting to any depth).
struct Compound {
  int outer = 0;
  std::vector<int> inner;
};

// `problem` with a compound candidate appended for each candidate c (smallest first) that holds
// less with checkpoints inside it: the sub-problem of c's atoms (base 0; c's gradients held
// apart added to its atoms' backward extras; the candidates strictly inside it but those in
// excluded[c] (when given: one list per candidate), and the compounds of those; a shared input
// that c keeps too counted by c alone: the inner ones' input_bytes less it, their freed_bytes
// more; the end of c's recompute, what the inner plan keeps plus c's recompute_extra_bytes, one
// more moment of it) planned at its least peak (least_peak_plan at `resolution`; the fewest
// atoms recomputed among the plans reaching it, so that the compounds depend on bytes alone,
// not on measured times). The compound covers c's atoms and keeps what c keeps (freed_bytes,
// recompute_extra_bytes, input_bytes and shared inputs as c's); its seconds are c's and the
// inner plan's; its nested_peak_bytes the larger of the inner plan's predicted peak (that end
// included) and, for each nested checkpoint d, the kept bytes before it, its input_bytes and
// forward_bytes plus c's recompute_held_bytes (d's forward inside c's recompute). None where
// that is not below c's atoms' bytes plus its recompute_extra_bytes, or where the inner plan
// chooses nothing. `made`, if given, receives
// one Compound per appended candidate, in order. Throws as validate() does, and
// std::invalid_argument for excluded of the wrong size.
Problem with_compounds(const Problem& problem, const std::vector<std::vector<int>>& excluded = {},
                       int resolution = 64, std::vector<Compound>* made = nullptr);

// {"feasible": true, "chosen": [0, 3], "predicted_peak_bytes": 123, "recompute_seconds": 0.5}
std::string to_json(const Plan& plan);

}  // namespace memlean::fit
