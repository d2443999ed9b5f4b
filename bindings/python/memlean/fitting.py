"""memlean.fit (memlean/fitting.py): one call that makes a training step fit a memory budget (eager PyTorch).

    import memlean
    plan = memlean.fit(model, x, "6GiB", loss_fn=lambda out: F.cross_entropy(out, y),
                       optimizer=opt)
    print(plan)                 # what changed, the measured peak, the budget
    ...train as before: model(x), loss.backward(), opt.step()...
    plan.undo()                 # the model as it was

The budget is the peak of one whole training step on the model's device: the model's
parameters, buffers, gradients, the optimizer's state and the example batch, plus the most
that the step (forward, loss, backward, optimizer.step(), optimizer.zero_grad()) allocates
above them: what memlean.memstats counts (exact on the CPU) and torch.cuda.max_memory_allocated
counts on CUDA when nothing else lives on the device.

How: fit measures one real training step with memlean.memstats and module hooks (per module
call: its forward time, and the bytes of the tensors autograd saves for backward while it runs,
each storage counted once, to the innermost module that saved it first). Then, cheapest
first:

1. Swish/SiLU modules (nn.SiLU, memlean.Swish, timm's Swish/SiLU) become memlean's in-place
   Swish (one bit per element kept) where a dataflow check of the measured step shows it is
   safe: the activation's input is a tensor made in this forward, no op saved it before the
   activation and no op reads it after (so autograd's version counter cannot fire); a naive
   Swish that is not safe in place becomes the memory-efficient one. In the same step (CPU,
   eager steps) every training BatchNorm gets memlean's lean backward (memlean.batch_norm:
   the input gradient written over the incoming one) and every depthwise Conv2d its own
   (memlean.conv2d: the input gradient the one tensor of the input's size allocated). No
   recompute.
2. If the step is still over budget: a set of modules (any depth: a stage, a block, a
   ModuleList entry) runs under memlean.checkpoint, chosen by memlean's planner
   (ops/fit/planner.h, the one C++ planner of both languages): it minimises the sum of the
   chosen modules' forward times (the recompute) subject to the predicted step peak <= the
   budget, exactly under its model (a dynamic program over forward positions and kept bytes),
   see docs/fit.md.
3. It runs one step under the plan and measures it. Over budget (the model is an estimate),
   it lowers the planner's budget by the excess and plans again. It never returns a plan whose
   measured step exceeds the budget: a budget below the least peak it reaches raises FitError,
   naming that peak.
4. Below the least peak checkpoints reach (CPU eager steps): chains of channelwise modules
   (an inverted residual block's expansion, BatchNorm, activation, depthwise convolution)
   are recomputed one slice of channels at a time (memlean.sliced_chain), so their wide
   tensors never exist whole; then 2. and 3. again on that step.

Afterwards the parameters, buffers, gradients (the batch's too), optimizer state, RNG state and
each module's train/eval flag are as they were before the call; the model is changed in place
(its modules' forwards are wrapped, activations swapped for parameterless ones): state_dict
keys do not change, and plan.undo() puts everything back.

torch.compile: the wrapped modules of a plan for eager steps run memlean.checkpoint, which
dynamo runs as in eager mode while it compiles the rest; compiled, memlean's Swish computes
what nn.SiLU does. A plan fitted for eager steps may peak higher compiled (inductor's graphs
keep other tensors): fit(..., compile=True) measures every plan on the compiled step instead,
so the budget holds there, and its wrapped modules, traced by dynamo, run torch's
non-reentrant checkpoint, which the compiler recomputes inside its graph (_traced_checkpoint)
where that reaches the budget. Under compile, torch's own activation_memory_budget is the
compiler's peer of this; memlean.fit's savings are for eager mode (and LibTorch:
memlean::fit).
"""
from __future__ import annotations

import bisect
import contextlib
import copy
import enum
import inspect
import json
import numbers
import os
import threading
import time
import types
import warnings
import weakref
from dataclasses import asdict, dataclass, replace
from typing import Callable, List, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memlean import _C, memstats, sliced
from memlean.lean import lean_forward
from memlean.checkpoint import (_module_buffers, buffer_copies, changed_since,
                                checkpoint_module_forward, checkpoint_run_forward,
                                module_parameters, put_back, rewound_buffers, unwrap_forwards,
                                wrap_forward)
from memlean.swish import Swish

__all__ = ["FitAction", "FitError", "FitPlan", "fit", "parse_budget"]

_NAME = "memlean.fit"


class FitError(ValueError):
    """The budget is below the least step peak memlean.fit can reach for this model and
    batch. ``least_peak_bytes``: that peak (measured); ``budget_bytes``: the budget asked."""

    def __init__(self, message: str, budget_bytes: int, least_peak_bytes: int):
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.least_peak_bytes = least_peak_bytes


@dataclass(frozen=True)
class FitAction:
    """One change fit made. action: "inplace swish", "memory_efficient swish", "lean
    batchnorm" (memlean.batch_norm's backward, CPU eager steps), "lean depthwise conv"
    (memlean.conv2d's backward, CPU eager steps), "sliced recompute" (a run of channelwise
    modules recomputed slice by slice of channels, memlean.sliced; CPU eager steps), "sliced
    mlp" (an MLP, Linear-activation-Linear, recomputed slice by slice of its hidden features,
    memlean.sliced_mlp; CPU eager steps) or "checkpoint". bytes_saved: for a checkpoint, the saved bytes it frees under the planner's
    model; for a sliced run, the saved bytes its calls lost, measured; for a Swish, a
    BatchNorm or a convolution, the measured saving of all these swaps shared in proportion
    to the modules' output bytes (0 for the lean backwards where fit did not measure their
    step apart: below the least of checkpoints, it may go to the sliced step directly).
    recompute_seconds: the module's measured forward time (the mean over the modules that do
    the same work, e.g. a model's repeated blocks; a sliced run's modules' forward time; 0
    for a swap). depth: for a checkpoint, how many of the plan's checkpoints it is nested in
    (0: none; 1: inside one, whose recompute runs it; ...), else 0. A checkpoint's actions
    come inside out (those nested in it, then it: the order apply_plan wraps them in); str()
    of the plan shows each under the one it is nested in."""

    path: str
    action: str
    bytes_saved: int
    recompute_seconds: float
    depth: int = 0


def _loaded_plan(data: dict) -> "FitPlan":
    """The FitPlan whose to_dict() is `data`, loaded (pickle) or copied: its undo() raises."""
    plan = FitPlan(data["budget_bytes"], data["peak_bytes"], data["predicted_peak_bytes"],
                   data["fixed_bytes"], data["eager_peak_bytes"],
                   [FitAction(**a) for a in data["actions"]], [], data["device"],
                   data["fit_seconds"], data["eager_only_runs"], data["fine_slices"],
                   data["compile"], data["traced"])
    plan._undo_steps = None
    plan._loaded = True
    return plan


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _size(n: int) -> str:
    return _gib(n) if n >= 2**30 else _mib(n)


# Actions that swap a module's implementation (no recompute): str(FitPlan) shows a kind done
# to more than _LISTED modules as one row.
_SWAPS = ("inplace swish", "memory_efficient swish", "lean batchnorm", "lean depthwise conv")
_LISTED = 3


class FitPlan:
    """What memlean.fit changed, and the step's memory under it.

    budget_bytes: the budget. peak_bytes: the step's peak measured under the plan.
    predicted_peak_bytes: the planner's prediction for it. fixed_bytes: what no plan changes
    (parameters, buffers, optimizer state and the batch at the step's start). eager_peak_bytes:
    the step's peak measured before any change. actions: the FitActions, in forward order.
    undo() puts the model back as it was (memlean.unfit: a fitted model loaded with torch.load
    or copied, which this plan does not undo); to_json() and str() report the plan (str() also
    says when runs of sibling modules are checkpointed or sliced: in eager steps only);
    memlean.apply_plan applies the plan, or its to_json(), to a twin of the model.
    fit may be called again on a fitted model (another budget): the new plan is made on top
    of the earlier one, and undoing the earlier one undoes the later ones first.
    """

    def __init__(self, budget_bytes, peak_bytes, predicted_peak_bytes, fixed_bytes,
                 eager_peak_bytes, actions, undo_steps, device, seconds, eager_only_runs=0,
                 fine_slices=False, compiled=False, traced=False):
        self.budget_bytes = int(budget_bytes)
        self.peak_bytes = int(peak_bytes)
        self.predicted_peak_bytes = int(predicted_peak_bytes)
        self.fixed_bytes = int(fixed_bytes)
        self.eager_peak_bytes = int(eager_peak_bytes)
        self.actions: List[FitAction] = list(actions)
        self.device = str(device)
        self.fit_seconds = float(seconds)
        self._undo_steps = list(undo_steps)
        self._eager_only_runs = int(eager_only_runs)
        self._fine_slices = bool(fine_slices)  # the sliced chains' finer slices (step 5b)
        self._compiled = bool(compiled)  # made with fit(compile=...)
        self._traced = bool(traced)  # (compiled) its checkpoints traced into the graph
        self._later: List[FitPlan] = []  # plans fit made on the model after (on top of) it
        self._loaded = False  # (_loaded_plan) a copy of a plan: it changed no model here

    def _applied_to(self, model):
        """Registers the plan as the model's latest: the one before it (if not undone) undoes
        it first when undone, and holds it so."""
        plans = _APPLIED.setdefault(model, [])
        plans[:] = [r for r in plans if r() is not None and not r().undone]
        if plans:
            plans[-1]()._later.append(self)
        plans.append(weakref.ref(self))

    @property
    def undone(self) -> bool:
        return self._undo_steps is None

    def undo(self) -> None:
        """Put every module fit changed back as it was (original activations, unwrapped
        forwards). Plans fit made on the same model after this one (on top of it) are undone
        first. Undoing twice is harmless. A plan loaded from a pickle raises a RuntimeError:
        it changed no model of this process."""
        if self._loaded:
            raise RuntimeError(
                "memlean: this FitPlan was loaded from a pickle (or copied): it holds the "
                "plan's figures and actions, not the changes fit made to a model, so there is "
                "nothing here for undo() to put back. memlean.unfit(model) puts back what fit "
                "changed in a model (one loaded or copied fitted too); memlean.apply_plan(model, "
                "x, plan) makes the changes on a model, and undo() of the plan it returns puts "
                "them back")
        if self._undo_steps is None:
            return
        for later in reversed(self._later):
            later.undo()
        self._later = []
        for step in reversed(self._undo_steps):
            step()
        self._undo_steps = None

    def to_dict(self) -> dict:
        return {
            "budget_bytes": self.budget_bytes,
            "peak_bytes": self.peak_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "fixed_bytes": self.fixed_bytes,
            "eager_peak_bytes": self.eager_peak_bytes,
            "device": self.device,
            "fit_seconds": self.fit_seconds,
            # Runs of sibling modules checkpointed or sliced: eager steps only (see __str__).
            "eager_only_runs": self._eager_only_runs,
            # What memlean.apply_plan needs besides the actions: the chains' finer slices,
            # whether the plan was made for compiled steps, and then whether its checkpoints
            # are traced into the compiled graph (else run between graphs).
            "fine_slices": self._fine_slices,
            "compile": self._compiled,
            "traced": self._traced,
            "actions": [asdict(a) for a in self.actions],
        }

    def __reduce__(self):
        # pickle (torch.save of a dict holding the plan) and copy/deepcopy: the plan's
        # figures and actions (to_dict()), not its undo, which holds this process's modules.
        return _loaded_plan, (self.to_dict(),)

    def to_json(self, path=None) -> str:
        """The plan as JSON (written to `path` too when given)."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            with open(path, "w") as f:
                f.write(text + "\n")
        return text

    def __repr__(self) -> str:
        return (f"FitPlan(budget_bytes={self.budget_bytes}, peak_bytes={self.peak_bytes}, "
                f"eager_peak_bytes={self.eager_peak_bytes}, actions={len(self.actions)})")

    def __str__(self) -> str:
        lines = [
            f"memlean.fit on {self.device}: step peak {_size(self.peak_bytes)} (measured) <= "
            f"budget {_size(self.budget_bytes)}; eager {_size(self.eager_peak_bytes)}, "
            f"predicted {_size(self.predicted_peak_bytes)}, fixed {_size(self.fixed_bytes)}",
        ]
        if self.device.startswith("cuda"):
            lines[0] += (f" (on CUDA, planned {_size(_cuda_margin(self.budget_bytes))} below "
                         f"the budget: the allocator's blocks vary from step to step)")
        if not self.actions:
            lines.append("  no change: the step fits as it is")
            return "\n".join(lines)
        rows = []  # (module, action, bytes saved, seconds): a swap done to more than
        # _LISTED modules is one row (plan.actions and to_json() name each module)
        kinds = {}
        for a in self.actions:
            kinds.setdefault(a.action, []).append(a)
        for a in _outer_first(self.actions):
            same = kinds[a.action]
            if a.action in _SWAPS and len(same) > _LISTED:
                if a is same[0]:
                    rows.append((f"{same[0].path} .. {same[-1].path} ({len(same)})", a.action,
                                 sum(b.bytes_saved for b in same),
                                 sum(b.recompute_seconds for b in same)))
            else:
                rows.append(("  " * a.depth + a.path, a.action, a.bytes_saved,
                             a.recompute_seconds))
        width = max(len("module"), max(len(r[0]) for r in rows))
        lines.append(f"  {'module':<{width}}  {'action':<22}  {'saves':>12}  {'recompute':>10}")
        for path, action, saved, seconds in rows:
            lines.append(f"  {path:<{width}}  {action:<22}  {_mib(saved):>12}  "
                         f"{seconds * 1e3:>8.1f} ms")
        swaps = sum(1 for a in self.actions if a.action.endswith("swish"))
        norms = sum(1 for a in self.actions if a.action == "lean batchnorm")
        convs = sum(1 for a in self.actions if a.action == "lean depthwise conv")
        slices = sum(1 for a in self.actions if a.action == "sliced recompute")
        mlps = sum(1 for a in self.actions if a.action == "sliced mlp")
        checkpoints = len(self.actions) - swaps - norms - convs - slices - mlps
        total = sum(a.recompute_seconds for a in self.actions)
        lean = f"{norms} BatchNorm(s) with the lean backward, " if norms else ""
        lean += f"{convs} depthwise Conv2d(s) with the lean backward, " if convs else ""
        lean += f"{slices} chain(s) recomputed in channel slices, " if slices else ""
        lean += f"{mlps} MLP(s) recomputed in hidden-feature slices, " if mlps else ""
        lines.append(f"  {swaps} Swish swapped, {lean}{checkpoints} module(s) checkpointed, "
                     f"{total * 1e3:.1f} ms recomputed per step")
        if self._eager_only_runs:
            lines.append(f"  {self._eager_only_runs} of them run(s) of sibling modules or "
                         f"gated MLPs, "
                         f"checkpointed or sliced in eager steps only: under torch.compile this "
                         f"model is not held to the budget (fit with compile=True for that)")
        return "\n".join(lines)


def _outer_first(actions) -> list:
    """actions with each checkpoint before those nested in it (they come inside out, each
    checkpoint after those of depth one more just before it), else in order."""
    pending = {}  # depth -> the subtrees (lists of actions) not yet under their outer one
    for a in actions:
        pending.setdefault(a.depth, []).append(
            [a] + [b for tree in pending.pop(a.depth + 1, []) for b in tree])
    return [a for depth in sorted(pending) for tree in pending[depth] for a in tree]


# ---- arguments -----------------------------------------------------------------------------


_INT64_MAX = 2**63 - 1


def parse_budget(budget, argument: str = "budget_bytes") -> int:
    """Bytes of a budget: a positive int, or a string such as "6GiB", "512MiB", "2.5GB"
    (KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB of 1024; the C++ parser of
    memlean::fit::parse_budget). ValueError or TypeError naming `argument` otherwise."""
    if isinstance(budget, bool) or type(budget).__name__ == "bool_":
        raise TypeError(f"{_NAME}: {argument} must be an int or a string such as '6GiB', got a bool")
    if isinstance(budget, numbers.Integral):
        budget = int(budget)
        if budget <= 0:
            raise ValueError(f"{_NAME}: {argument} must be > 0 bytes, got {budget}")
        if budget > _INT64_MAX:  # as the string form (memlean::fit::parse_budget) and C++
            raise ValueError(f"{_NAME}: {argument}: more than int64 bytes, got {budget}")
        return budget
    if isinstance(budget, str):
        try:
            return int(_C.fit.parse_budget(budget, argument))
        except ValueError as e:
            raise ValueError(f"{_NAME}: {e}") from None
    raise TypeError(f"{_NAME}: {argument} must be an int or a string such as '6GiB', got "
                    f"{type(budget).__name__}")


def _sum_floating_leaves(output):
    leaves = [t for t in tree_flatten(output)[0]
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError(
            f"{_NAME}: the model's output on example_inputs holds no floating-point tensor to "
            f"make the default loss of (the sum of its floating-point tensors); pass loss_fn= "
            f"(a function of the output returning a scalar)")
    loss = leaves[0].sum()
    for t in leaves[1:]:
        loss = loss + t.sum()
    return loss


def _call(forward, inputs):
    """forward on the example inputs: a tuple of positional arguments, or a dict of keyword
    ones (_check)."""
    if isinstance(inputs, dict):
        return forward(**inputs)
    return forward(*inputs)


def _tensors(obj):
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


# What a module's arguments may hold for fit to checkpoint it: tensors, plain values, and
# tuples, lists and dicts of them (any depth). Anything else is an object whose state the
# module's forward may change (transformers' key-value caches: a DynamicCache's update()
# appends the keys and values it is given), so that a recompute in backward would change it
# again and compute from the changed state: with use_cache=True (transformers' default in
# training without gradient checkpointing), a checkpointed GPT-2 attention recomputed over
# twice the keys and gave gradients 100 % off, silently (2026-11-28).
_PLAIN = (torch.Tensor, numbers.Number, str, bytes, type(None), type(Ellipsis), slice,
          torch.dtype, torch.device, torch.layout, torch.memory_format, torch.nn.Module,
          enum.Enum, types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def _opaque_argument(obj, depth: int = 0) -> Optional[type]:
    """The type of the first object in a call's arguments that is not a tensor, a plain value
    or a tuple, list or dict of them (an object whose state a forward may change), or None."""
    if isinstance(obj, _PLAIN):
        return None
    if depth > 32:  # (a deeper structure: counted as one fit cannot see into)
        return type(obj)
    if isinstance(obj, dict):
        values = obj.values()
    elif isinstance(obj, (tuple, list)):
        values = obj
    else:
        return type(obj)
    for v in values:
        found = _opaque_argument(v, depth + 1)
        if found is not None:
            return found
    return None


def _storage_parts(tensors):
    """The tensors whose storages hold `tensors`: a sparse tensor's indices and values (it has
    no storage of its own; e.g. SGD's momentum for a sparse gradient), others as they are."""
    parts = []
    for t in tensors:
        if t.layout == torch.sparse_coo:
            parts += [t._indices(), t._values()]
        elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
            parts += [t.crow_indices(), t.col_indices(), t.values()]
        elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
            parts += [t.ccol_indices(), t.row_indices(), t.values()]
        else:
            parts.append(t)
    return parts


def _key(t: torch.Tensor):
    """(memstats.storage_key(t), its storage's bytes), or (None, 0) without a storage."""
    try:
        return memstats.storage_key(t), t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # no storage (sparse, nested, fake)
        return None, 0


def _cuda_allocated_bytes(tensors, device: torch.device) -> int:
    """What torch.cuda.memory_allocated counts for the storages of `tensors` on `device`, each
    once: the caching allocator's block of each (its request rounded up to 512 bytes, or more
    where a cached block was not split; memstats.allocated_bytes_of, which memlean::fit uses
    too). On CUDA the step's figures above its start come from the same counter (memstats' CUDA
    tracker), so the resident bytes must be counted as it counts them, or the budget would be
    short of what torch.cuda.max_memory_allocated reports by the rounding of every parameter,
    gradient and optimizer state tensor."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _C.memstats.allocated_bytes_of(list(tensors), str(device))


# ---- one measured step ---------------------------------------------------------------------


@dataclass
class _Call:
    """One module call of the measured forward."""

    module: torch.nn.Module
    begin: int  # its first atom
    end: int = -1  # one past its last atom
    seq_begin: int = 0  # dataflow: op numbers it spans
    seq_end: int = 0
    seconds: float = 0.0
    inputs: tuple = ()  # (storage identity, nbytes) of its tensor inputs (_Identities)
    outputs: tuple = ()
    mutates_input: bool = False
    parent: object = None  # the _Call it runs inside (None: the outermost)
    input_id: int = 0  # id() of its argument when that is one tensor, positional; else 0
    output_id: int = 0  # id() of its output when that is one tensor; else 0
    input_view: tuple = ()  # _view of that argument, of that output (else ())
    output_view: tuple = ()
    # Per tensor input (as inputs): the bytes of its gradient where it requires one, else 0.
    input_grad_bytes: tuple = ()
    # (id, nbytes) of the buffers of its tree that a checkpoint would rewind and that its
    # forward changed: a checkpoint of it keeps a copy of each until its backward.
    changed_buffers: tuple = ()
    # The type of an object among its arguments whose state its forward may change
    # (_opaque_argument; e.g. a key-value cache), or None: fit checkpoints no such call.
    opaque: Optional[type] = None
    # What it ran under, which a run's chain must share with each call it makes (grad mode,
    # saved-tensors region, autocast: _Recorder._context).
    context: tuple = ()

    @property
    def input_key(self):
        """Its first tensor input's storage identity (the Swish check), or None."""
        return self.inputs[0][0] if self.inputs else None


class _Identities:
    """Storage identities over one recorded step. Not addresses (memstats.storage_key): a
    storage freed in the forward leaves its address to a later one, whose reads, saves and
    calls would count as the first's (a run's inner tensor then looked read after it, or an
    input saved, depending on the allocator). An identity is the storage's StorageImpl: the
    weak reference kept here keeps that object (not its data) allocated, so no later
    storage can have it while these identities are in use."""

    def __init__(self):
        self._seen = {}  # identity -> a weak reference to its storage

    def key(self, t: torch.Tensor):
        """(its storage's identity, the storage's bytes), or (None, 0) without a storage."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (sparse, nested, fake)
            return None, 0
        identity = storage._cdata
        if identity not in self._seen:
            self._seen[identity] = StorageWeakRef(storage)
        return identity, storage.nbytes()


def _view(t: torch.Tensor) -> tuple:
    """(storage offset, shape, strides) of t: where in its storage it lies; () for a tensor
    without strides (sparse, nested)."""
    try:
        return t.storage_offset(), tuple(t.shape), tuple(t.stride())
    except (RuntimeError, NotImplementedError):
        return ()


class _Dataflow(TorchDispatchMode):
    """Numbers the ops of the forward and notes which storages each reads (every tensor
    argument) and writes (the arguments its schema marks as written: an in-place op's self,
    an out= argument)."""

    def __init__(self, identities: _Identities):
        super().__init__()
        self.identities = identities
        self.seq = 0
        self.reads = {}  # storage identity -> op numbers that read it, in order
        self.writes = {}  # storage identity -> op numbers that write it
        # op number -> (the op, identities of its tensor arguments, of its tensor results,
        # whether it is the recorder's own: the detach of a tensor autograd saves, _pack; its
        # keyword arguments where it is one of _FUNCTIONAL_ACTS, e.g. F.gelu's approximate,
        # else None)
        self.ops = {}
        # op number -> _view of each of its tensor arguments (those of `read`), for the ops a
        # gated MLP's own forward may make (a product, one of _FUNCTIONAL_ACTS): which half of
        # a packed gate-and-up output each takes.
        self.views = {}
        self.packing = False

    def last_reads(self) -> dict:
        """Storage identity -> the number of the last op that read it."""
        return {key: seqs[-1] for key, seqs in self.reads.items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.seq += 1
        seq = self.seq
        read, views = [], []
        viewed = func in _FUNCTIONAL_ACTS or func is torch.ops.aten.mul.Tensor
        for t in _tensors((args, kwargs)):
            identity, _ = self.identities.key(t)
            if identity is not None:
                self.reads.setdefault(identity, []).append(seq)
                read.append(identity)
                if viewed:
                    views.append(_view(t))
        if viewed:
            self.views[seq] = tuple(views)
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in _tensors(value):
                identity, _ = self.identities.key(t)
                if identity is not None:
                    self.writes.setdefault(identity, []).append(seq)
        out = func(*args, **kwargs)
        options = dict(kwargs) if func in _FUNCTIONAL_ACTS else None
        self.ops[seq] = (func, tuple(read), tuple(self.identities.key(t)[0]
                                                  for t in _tensors(out)), self.packing,
                         options)
        return out


# Modules whose parameters autocast casts to its lower-precision dtype (conv*, linear in its
# lists for CPU and CUDA).
_AUTOCAST_CAST_MODULES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
                          torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d,
                          torch.nn.ConvTranspose3d)


def _cached_by_autocast(p) -> bool:
    """Whether autocast caches its lower-precision copy of tensor p when an op it runs in its
    dtype casts p (until the autocast region ends): a float32 leaf that requires grad (a
    parameter) and is no view."""
    return (isinstance(p, torch.Tensor) and p.dtype == torch.float32 and p.requires_grad
            and not p._is_view())


def _autocast_weight_copy(t) -> Optional[torch.Tensor]:
    """Whether t, a tensor autograd saves in a step that runs in an autocast region with its
    cache on, is autocast's cached lower-precision copy of a parameter (a float32 leaf that
    requires grad, cast by an op autocast runs in its dtype):
    the cache holds it until its region ends whether or not the module that saved it is
    checkpointed (a checkpoint's forward makes it too, under no_grad), so it is no saving of
    that module's but one of the step's base bytes. (Counted as saved, a checkpoint's
    predicted saving included every weight copy of its modules: bfloat16 plans were predicted
    2-7 % below their measured peak.) Returns that parameter, else None."""
    if t._is_view():
        t = t._base  # (a Linear saves its weight's copy transposed)
    fn = t.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0" or t.dtype == torch.float32:
        return None
    source = fn.next_functions[0][0] if fn.next_functions else None
    v = getattr(source, "variable", None)  # (an AccumulateGrad node's leaf)
    return v if _cached_by_autocast(v) else None


class _Recorder:
    """Module hooks and a saved-tensors hook over one forward: the calls (atoms spanned,
    time, inputs and outputs) and the bytes autograd saved, by atom. An atom is a stretch of
    the forward between two module boundaries (a call's start or end), so every module call
    spans a contiguous run of atoms. In the backward that follows (between backward_begin()
    and backward_end()), the step's bytes at their highest while backward uses each atom's
    saved tensors: backward_levels[atom]."""

    def __init__(self, model, identities: _Identities, preexisting, cuda, dataflow=None):
        self.model = model
        self.identities = identities
        self.preexisting = preexisting  # identities of the storages alive before the step
        self.cuda = cuda
        self.dataflow = dataflow
        self.atom = 0
        self.atom_bytes = [0]
        self.atom_seqs = [0]  # per atom: the dataflow's op number before its first op
        self.saved = {}  # storage identity -> atom that saved it first
        self.saved_bytes = {}  # storage identity -> the bytes its first save counted
        # storage identity -> the later atoms that saved it again, in order (_as_sliced)
        self.saved_again = {}
        self.calls: List[_Call] = []
        self.stack: List[tuple] = []
        self.handles = []
        self._regions = {}  # id of a saved-tensors pack hook -> (its reference, its number)
        self._region_count = 0
        self.backward_levels = {}  # atom -> the step's highest bytes while backward runs it
        # The step's highest bytes in backward before it first uses a saved tensor (the loss's
        # gradient), None before backward
        self.backward_start_level = None
        # atom -> the step's bytes when backward first reaches it (the gradients it brings)
        self.backward_entries = {}
        # storage identity of a call's output -> the step's bytes when backward reached it
        # (its gradient made), where the call's last atom ran ops that save nothing (_post)
        self.reached = {}
        self._tracker = None  # a nested memstats tracker during backward
        self._offset = 0  # step bytes = resident + tracker figure - the step's start
        self._backward_atom = None
        # In the forward (between forward_begin() and forward_end()), per atom: the bytes
        # alive when it began and the most alive while it ran, as a nested tracker counts
        # them (differences only): the atoms [b, e) held at their highest
        # max(forward_peaks[b:e]) - forward_starts[e] more than they left.
        self.forward_starts, self.forward_peaks = [], []
        self._forward = None
        self._casts_cached = False  # (forward_begin)
        # atom -> the bytes of its weights' gradients that a checkpoint's backward holds in
        # lower precision until its end, where the step without it had them in float32 by
        # the atoms before it (the planner's atom_deferred_bytes): the autocast copies it
        # saved first. A checkpoint's recompute reuses the copy autocast cached in the
        # forward, and autograd runs that cast's backward, older than every node of the
        # recompute, last.
        self.deferred = {}
        self._deferred_weights = set()  # id() of the parameters deferred counts

    def forward_begin(self, device):
        # (read here: inside an op, where the saved-tensors hook runs, autocast is off)
        self._casts_cached = (torch.is_autocast_enabled(device.type)
                              and torch.is_autocast_cache_enabled())
        self._forward = memstats.track(device)
        self.forward_starts.append(self._forward.current)

    def forward_end(self):
        self.forward_peaks.append(self._forward.peak)
        self._forward.stop()
        self._forward = None

    def _next_atom(self):
        self.atom += 1
        self.atom_bytes.append(0)
        self.atom_seqs.append(self._seq())
        if self._forward is not None:
            self.forward_peaks.append(self._forward.peak)
            self._forward.reset_peak()
            self.forward_starts.append(self._forward.current)

    def _seq(self):
        return self.dataflow.seq if self.dataflow is not None else 0

    def _context(self):
        """A call's context (_Call.context): grad mode, the innermost saved-tensors region
        (0: the recorder's own; else a number per region, torch.utils.checkpoint's each its
        own) and autocast's state on CPU and CUDA. A run's chain
        calls its modules inside its first one's call, so a run spans no change of context
        (timm's set_grad_checkpointing made a run of efficientnet_b0's last block, inside its
        checkpoint region, and the head after it, whose recompute failed, 2026-11-29)."""
        top = torch._C._autograd._top_saved_tensors_default_hooks(True)
        region = 0
        if top is not None and top[0] != self._pack:
            # (By its pack hook, while that lives: a weak reference, since the hook may hold
            # the region's tensors; a new number where a dead one's id comes again.)
            known = self._regions.get(id(top[0]))
            if known is None or known[0]() is not top[0]:
                try:
                    ref = weakref.ref(top[0])
                except TypeError:  # (a builtin: it lives on)
                    ref = lambda f=top[0]: f  # noqa: E731
                self._region_count += 1
                known = self._regions[id(top[0])] = (ref, self._region_count)
            region = known[1]
        return (torch.is_grad_enabled(), region) + tuple(
            (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda"))

    def _pre(self, module, args, kwargs):
        self._next_atom()
        tensors = _tensors((args, kwargs))
        single = len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor)
        call = _Call(module, self.atom, seq_begin=self._seq(),
                     inputs=tuple(map(self.identities.key, tensors)),
                     input_grad_bytes=tuple(t.numel() * t.element_size() if t.requires_grad
                                            else 0 for t in tensors),
                     parent=self.stack[-1][0] if self.stack else None,
                     input_id=id(args[0]) if single else 0,
                     input_view=_view(args[0]) if single else (),
                     opaque=_opaque_argument((args, kwargs)), context=self._context())
        if self._casts_cached and call.context[0] and call.context[1] != 0:
            self._foreign_casts(module, call.context[3 if self.cuda else 2])
        rewound = rewound_buffers([module], _module_buffers(module))
        self.stack.append((call, [t._version for t in tensors],
                           [(b, b._version) for b in rewound]))
        if self.cuda:
            torch.cuda.synchronize()
        call.seconds = time.perf_counter()

    def _post(self, module, args, kwargs, output):
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        call, versions, buffer_versions = self.stack.pop()
        call.changed_buffers = tuple((id(b), b.numel() * b.element_size())
                                     for b, v in buffer_versions if b._version != v)
        call.seconds = now - call.seconds
        call.end = self.atom + 1
        call.seq_end = self._seq() + 1
        tensors = _tensors((args, kwargs))
        call.mutates_input = any(t._version != v for t, v in zip(tensors, versions))
        call.outputs = tuple(map(self.identities.key, _tensors(output)))
        call.output_id = id(output) if isinstance(output, torch.Tensor) else 0
        call.output_view = _view(output) if isinstance(output, torch.Tensor) else ()
        key = call.outputs[0][0] if isinstance(output, torch.Tensor) else None
        if (key is not None and output.grad_fn is not None and self.dataflow is not None
                and self.atom_bytes[self.atom] == 0 and self._seq() > self.atom_seqs[self.atom]):
            # Its own code after its last submodule ran ops that save nothing (NF-ResNet's
            # `out * alpha + shortcut`): backward runs them before it reaches an atom that
            # saves, so the level where backward reaches the call is taken here. Only so, and
            # only in the eager step (recorded with its dataflow): the hook's reference to the
            # gradient keeps a lean backward it flows into from writing over it
            # (grad_owned_alone), and the step would hold more than the steps it predicts.
            output.register_hook(lambda grad: self._reached(key))
        self.calls.append(call)
        self._next_atom()

    def _foreign_casts(self, module, autocast):
        """deferred for a call inside a saved-tensors region of another's (timm's
        set_grad_checkpointing), where _pack sees nothing saved: an nn.Linear or convolution
        there casts its float32 parameters to autocast's dtype, and the copies stay cached, as
        those _pack finds do (their first call's atom, each parameter once). Without it, a
        checkpoint around such regions was predicted as if their weights' gradients came in
        float32: convnext_atto and fastvit_t8 (bfloat16, batch 4, 96x96, set_grad_checkpointing,
        runs) 3.5-6.2 % high at their least. autocast: (enabled, dtype) on the step's device
        where the call ran."""
        enabled, low = autocast
        if not enabled or not isinstance(module, _AUTOCAST_CAST_MODULES):
            return
        for p in module.parameters(recurse=False):
            if _cached_by_autocast(p) and id(p) not in self._deferred_weights:
                self._defer(p, p.nbytes - p.numel() * low.itemsize)

    def _defer(self, weight, nbytes):
        """Count `nbytes` of `weight`'s gradient as deferred at the current atom (deferred:
        each parameter once, at its first cast)."""
        self._deferred_weights.add(id(weight))
        self.deferred[self.atom] = self.deferred.get(self.atom, 0) + nbytes

    def _pack(self, t):
        key, nbytes = self.identities.key(t)
        if key is not None and key not in self.preexisting:
            first = self.saved.get(key)
            if first is None:
                self.saved[key] = self.atom
                weight = _autocast_weight_copy(t) if self._casts_cached else None
                if weight is not None and id(weight) in self._deferred_weights:
                    weight, nbytes = None, 0  # (counted where a region cast it first)
                if weight is not None:
                    self._defer(weight, max(0, weight.nbytes - nbytes))
                    nbytes = 0
                self.saved_bytes[key] = nbytes
                self.atom_bytes[self.atom] += nbytes
            elif first != self.atom:
                again = self.saved_again.setdefault(key, [])
                if again[-1:] != [self.atom]:
                    again.append(self.atom)
        # (not t: memstats.saved_storages says why; the detached tensor shares t's version
        # counter)
        if self.dataflow is None:
            return t.detach(), self.atom, t._version
        self.dataflow.packing = True
        try:
            return t.detach(), self.atom, t._version
        finally:
            self.dataflow.packing = False

    def _unpack(self, packed):
        t, atom, version = packed
        memstats._check_saved_version(t, version)
        if self._tracker is not None and atom != self._backward_atom:
            # Backward moves on to the tensors one atom saved: what it held since the last
            # move belongs to the atom before.
            self.backward_entries.setdefault(atom, self._offset + self._tracker.current)
            self._close_level()
            self._backward_atom = atom
        return t

    def _reached(self, key):
        if self._tracker is not None and key not in self.reached:
            self.reached[key] = self._offset + self._tracker.current

    def _close_level(self):
        level = self._offset + self._tracker.peak
        if self._backward_atom is not None:
            previous = self.backward_levels.get(self._backward_atom, 0)
            self.backward_levels[self._backward_atom] = max(previous, level)
        else:
            self.backward_start_level = max(self.backward_start_level or 0, level)
        self._tracker.reset_peak()

    def backward_begin(self, device, offset):
        self._tracker = memstats.track(device)
        self._offset = offset
        self._backward_atom = None

    def backward_end(self):
        self._close_level()
        self._tracker.stop()
        self._tracker = None

    def __enter__(self):
        for m in self.model.modules():
            self.handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(m.register_forward_hook(self._post, with_kwargs=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for h in self.handles:
            h.remove()
        self.handles = []
        return False


@dataclass
class _Measured:
    """A step's bytes: each the resident bytes plus what the step had allocated above them."""

    forward_backward_peak: int
    forward_end: int  # when the loss is computed
    forward_peak: int  # the most up to then (the forward and the loss)
    optimizer_peak: int  # during optimizer.step() and zero_grad()
    resident: int  # parameters, buffers, optimizer state, batch
    recorder: Optional[_Recorder] = None

    @property
    def peak(self) -> int:
        return max(self.forward_backward_peak, self.optimizer_peak)


def _needs_closure(optimizer) -> bool:
    """Whether optimizer.step() cannot be called without arguments (LBFGS.step(closure))."""
    try:
        signature = inspect.signature(optimizer.step)
    except (TypeError, ValueError):
        return False  # (a builtin without a signature: called as it is)
    return any(p.default is inspect.Parameter.empty
               and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               for p in signature.parameters.values())


def _input_leaves(inputs) -> list:
    """The tensors of a batch whose gradient backward makes (leaves that require grad)."""
    return [t for t in _tensors(inputs) if t.requires_grad and t.is_leaf]


class _Step:
    """Runs and measures training steps of one model, and puts its state back."""

    def __init__(self, model, inputs, loss_fn, optimizer, device, keep_grads=False):
        self.model, self.inputs, self.loss_fn, self.optimizer = model, inputs, loss_fn, optimizer
        self.device = device
        # The loop keeps gradients allocated between steps (fit(keep_grads=True)): each step
        # begins with them zeroed, resident as parameters are, and ends zeroing them.
        self.keep_grads = keep_grads
        self.cuda = device.type == "cuda"
        self.params = _trained_parameters(model, optimizer)
        self.input_leaves = _input_leaves(inputs)
        self.all_dense_grads = True  # set by each recorded step

    def _resident_tensors(self):
        tensors = list(self.params) + list(self.model.buffers()) + _tensors(self.inputs)
        if self.keep_grads:
            tensors += [p.grad for p in self.params if p.grad is not None]
        if self.optimizer is not None:
            tensors += _tensors(list(self.optimizer.state.values()))
        return _storage_parts(tensors)

    def storages(self, key=None):
        """{storage key: nbytes} of what lives through a step: parameters, buffers, optimizer
        state, the batch (on the model's device). key: what keys them (default _key)."""
        found = {}
        for t in self._resident_tensors():
            if t.device == self.device:
                k, nbytes = (key or _key)(t)
                if k is not None:
                    found[k] = nbytes
        return found

    def run(self, record=False, dataflow=False, forward=None) -> _Measured:
        """One measured step; `forward`: what runs the model (default the model itself, e.g.
        torch.compile(model))."""
        forward = forward if forward is not None else self.model
        for p in self.params:
            if not self.keep_grads:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
            elif p.requires_grad:
                p.grad = torch.zeros_like(p)
        for t in self.input_leaves:  # (each step's batch is a fresh one: no gradient yet)
            t.grad = None
        resident = (_cuda_allocated_bytes(self._resident_tensors(), self.device) if self.cuda
                    else sum(self.storages().values()))
        identities = _Identities()
        mode = _Dataflow(identities) if dataflow else None
        recorder = (_Recorder(self.model, identities, set(self.storages(identities.key)),
                              self.cuda, mode) if record else None)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        # Inside an autocast region, autocast keeps its lower-precision copies of the weights
        # until the region ends: a step of a loop that enters a region per step makes them
        # afresh, so each measured step starts without them (and leaves none behind).
        torch.clear_autocast_cache()
        # The collector off, not run first (it would cost each of fit's steps a collection):
        # earlier garbage freed inside a measured step would lower its peak (a test's eager
        # peak moved by 118,200 bytes between two fit calls that way).
        # A training step records autograd whatever the caller's grad mode (fit called under
        # torch.no_grad(), e.g. inside a validation loop, measures the training step too).
        with torch.enable_grad(), memstats._collector_off(collect=False), memstats.track(
                self.device) as t:
            start = t.current
            if recorder is not None:
                recorder.forward_begin(self.device)
            with recorder or contextlib.nullcontext(), mode or contextlib.nullcontext():
                output = _call(forward, self.inputs)
                loss = self.loss_fn(output)
            if recorder is not None:
                recorder.forward_end()
            if (not isinstance(loss, torch.Tensor) or loss.numel() != 1
                    or not loss.is_floating_point() or not loss.requires_grad):
                what = (type(loss).__name__ if not isinstance(loss, torch.Tensor) else
                        f"a {loss.dtype} tensor of shape {tuple(loss.shape)}"
                        f"{'' if loss.requires_grad else ' that does not require grad'}")
                raise ValueError(f"{_NAME}: loss_fn must return a floating-point scalar tensor "
                                 f"that requires grad, got {what}")
            forward_end, forward_peak = t.current, t.peak
            if recorder is not None:
                recorder.backward_begin(self.device, resident - start)
            loss.backward()
            if recorder is not None:
                # Whether every trainable parameter got a dense gradient (what fit's warm-up
                # on zero gradients assumes; fit asks after its recorded eager step).
                self.all_dense_grads = all(p.grad is not None and p.grad.layout == torch.strided
                                           for p in self.params if p.requires_grad)
            if self.cuda:
                torch.cuda.synchronize(self.device)
            if recorder is not None:
                recorder.backward_end()
            forward_backward = t.peak
            t.reset_peak()
            if self.optimizer is not None:
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=not self.keep_grads)
            else:
                for p in self.params:
                    if not self.keep_grads:
                        p.grad = None
                    elif p.grad is not None:
                        p.grad.zero_()
            if self.cuda:
                torch.cuda.synchronize(self.device)
            optimizer_peak = t.peak
            del output, loss
        torch.clear_autocast_cache()
        return _Measured(resident + forward_backward - start, resident + forward_end - start,
                         resident + forward_peak - start,
                         resident + optimizer_peak - start, resident, recorder)


def _trained_parameters(model, optimizer) -> list:
    """The model's parameters, then those of the optimizer's groups that are not the model's
    (a learnable parameter of the loss, another module trained by the same optimizer): each
    once. The step's memory counts them, and fit puts them back."""
    found = {id(p): p for p in model.parameters()}
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                found.setdefault(id(p), p)
    return list(found.values())


class _Saved:
    """Parameters, buffers, gradients, optimizer state, RNG and train flags, put back by
    restore() exactly (copies held on the CPU, outside a CUDA device's budget)."""

    def __init__(self, model, optimizer, device, inputs=()):
        self.model, self.optimizer = model, optimizer
        params = _trained_parameters(model, optimizer)
        self.params = [(p, p.detach().to("cpu", copy=True)) for p in params]
        self.grads = [(p, p.grad) for p in params]
        # The example batch's gradients too (a batch that requires grad: adversarial training,
        # input attributions), which fit's steps make.
        self.grads += [(t, t.grad) for t in _input_leaves(inputs)]
        self.buffers = [(b, b.detach().to("cpu", copy=True)) for b in model.buffers()]
        self.training = {id(m): (m, m.training) for m in model.modules()}
        self.optimizer_state = None
        if optimizer is not None:
            state = optimizer.state_dict()
            self.optimizer_state = torch.utils._pytree.tree_map(
                lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x,
                state)
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = (torch.cuda.get_rng_state_all()
                         if torch.cuda.is_available() and torch.cuda.is_initialized() else None)

    def restore(self):
        with torch.no_grad():
            for p, saved in self.params:
                p.copy_(saved)
            for b, saved in self.buffers:
                b.copy_(saved)
        for p, g in self.grads:
            p.grad = g
        for m, training in self.training.values():
            m.training = training
        if self.optimizer is not None:
            self._restore_optimizer()
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def _restore_optimizer(self):
        """The optimizer's state put back into its own tensors where fit's steps left the same
        tensors (as every step after the first does): the caller's references to them stay
        valid, and on CUDA their allocator blocks, which the budget counts, stay the same
        (load_state_dict makes new tensors, whose blocks may be larger). Otherwise (fit's
        steps gave a fresh optimizer its state) load_state_dict."""
        opt, saved = self.optimizer, self.optimizer_state
        order = {}
        for group in opt.param_groups:  # the numbering state_dict() uses
            for p in group["params"]:
                order.setdefault(id(p), (len(order), p))
        params = {i: p for i, p in order.values()}

        def same(i, entries):
            live = opt.state.get(params[i]) if i in params else None
            return live is not None and live.keys() == entries.keys() and all(
                not isinstance(v, torch.Tensor) or (isinstance(live[k], torch.Tensor)
                                                    and live[k].shape == v.shape
                                                    and live[k].dtype == v.dtype)
                for k, v in entries.items())

        in_place = (len(opt.state) == len(saved["state"])
                    and len(opt.param_groups) == len(saved["param_groups"])
                    and all(same(i, e) for i, e in saved["state"].items()))
        if not in_place:
            opt.load_state_dict(saved)
            return
        with torch.no_grad():
            for i, entries in saved["state"].items():
                live = opt.state[params[i]]
                for k, v in entries.items():
                    if isinstance(v, torch.Tensor):
                        live[k].copy_(v)
                    else:
                        live[k] = v
        for group, saved_group in zip(opt.param_groups, saved["param_groups"]):
            for k, v in saved_group.items():
                if k == "params":
                    continue
                if isinstance(v, torch.Tensor) and isinstance(group[k], torch.Tensor):
                    with torch.no_grad():
                        group[k].copy_(v)
                else:
                    group[k] = v


# ---- the Swish swap ------------------------------------------------------------------------


def _swish_beta(module) -> Optional[float]:
    """beta if `module` is a Swish/SiLU module fit may swap, else None."""
    if isinstance(module, Swish):
        return None if module.variant == "inplace" else module.beta
    if isinstance(module, torch.nn.SiLU):
        return 1.0
    cls = type(module)
    if cls.__module__.startswith("timm.") and cls.__name__ in ("Swish", "SwishMe", "SiLU"):
        return 1.0
    if sliced.transformers_activation(module) == "SiLUActivation":
        return 1.0  # transformers' F.silu module (Llama's, Qwen2's, Mistral's MLPs)
    return None


def _naive(module) -> bool:
    """Whether the module keeps more than its input for backward (so the memory-efficient
    Swish saves memory even where the in-place one is not safe)."""
    if isinstance(module, Swish):
        return module.variant == "naive"
    return type(module).__name__ == "Swish"  # timm's x * sigmoid(x)


def _safe_in_place(call: _Call, recorder: _Recorder) -> bool:
    """Overwriting this call's input is invisible to autograd and to the rest of the
    forward: the input is a tensor made in this forward, no op after the call writes its
    output (memlean's in-place Swish saves its output, which is its input's storage: an
    in-place op on it after, e.g. a residual's `out += x` or a ReLU(inplace=True), would make
    autograd's version check fire in backward), and either the call overwrote its input
    already, or no op saved its storage before the call and no op reads it after."""
    key = call.input_key
    if key is None or key in recorder.preexisting:
        return False
    written = recorder.dataflow.writes
    for storage in {key} | {k for k, _ in call.outputs[:1] if k is not None}:
        if any(s >= call.seq_end for s in written.get(storage, ())):
            return False
    if call.mutates_input:
        # It overwrites its input already (nn.SiLU(inplace=True), timm's act layers) and
        # autograd accepted that: memlean's in-place Swish overwrites the same storage, and
        # keeps one bit per element where torch's silu_ keeps its whole output.
        return True
    # (Atoms, not op numbers: autograd saves an op's inputs before the op runs.)
    saved_in = recorder.saved.get(key)
    if saved_in is not None and saved_in < call.begin:
        return False
    return all(s <= call.seq_end - 1 for s in recorder.dataflow.reads.get(key, ()))


def _replace(model, old, new):
    """Put `new` wherever `old` is a child in `model`; returns the undo (which gives `old`
    the train/eval mode `new` has by then)."""
    places = [(parent, name) for parent in model.modules()
              for name, child in parent._modules.items() if child is old]
    for parent, name in places:
        parent._modules[name] = new

    def undo():
        old.train(new.training)
        for parent, name in places:
            parent._modules[name] = old

    return undo


# The attribute of a module fit swapped in (a Swish variant) that holds the module it replaced.
_REPLACED = "_memlean_fit_replaced"


def unfit(model: torch.nn.Module) -> bool:
    """Put back every change memlean.fit and memlean.apply_plan made to ``model``: the
    plans' undo() where they were made in this process, and otherwise (a fitted model that
    ``torch.load`` loaded or ``copy.deepcopy`` copied, whose plan undoes the original only)
    the changes themselves: every checkpoint, lean backward, run and sliced chain's forward
    unwrapped, every Swish fit swapped in replaced by the module it replaced (in the model's
    train/eval mode). Parameters, buffers and state_dict keys are untouched. Returns whether
    there was anything to put back (False for a model fit did not change; unfit twice is
    harmless).

    Example::

        model = torch.load("fitted.pt", weights_only=False)
        memlean.unfit(model)  # the model as it was before fit"""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"memlean.unfit: model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    changed = False
    for ref in list(_APPLIED.get(model, [])):
        plan = ref()
        if plan is not None and not plan.undone:
            plan.undo()
            changed = True
    for module in list(model.modules()):
        changed |= unwrap_forwards(module) > 0
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            original = child.__dict__.get(_REPLACED) if child is not None else None
            if original is not None:
                while _REPLACED in original.__dict__:  # (fit twice: what the first replaced)
                    original = original.__dict__[_REPLACED]
                original.train(child.training)
                parent._modules[name] = original
                changed = True
    return changed


# ---- checkpoint wrapping -------------------------------------------------------------------


def _wrap(module, traced=False):
    """Run `module`'s forward under memlean.checkpoint (its hooks, state_dict keys and place
    in its parent unchanged); returns the undo. A _Run: see _wrap_run. traced (a plan made
    with compile=): where dynamo traces the forward, torch's checkpoint instead
    (_traced_checkpoint), which the compiler recomputes inside its graph."""
    if isinstance(module, _GatedSlice):
        return _wrap_gated(module)
    if isinstance(module, _Nest):  # inside out: the outer forward calls the wrapped ones
        undos = [_wrap(part, traced) for part in module.parts]

        def undo():
            for u in reversed(undos):
                u()
        return undo
    if isinstance(module, _Run):
        return _wrap_run(module)
    original = module.forward

    # memlean.checkpoint, which dynamo does not trace into: disabled for dynamo (under
    # torch.compile a graph break, and the checkpoint runs eagerly), so that dynamo neither
    # traces the wrapper's prelude nor compiles it once per wrapped module (every wrapper
    # shares one code object, and the recompiles would reach dynamo's recompile limit after 8
    # modules).
    import torch._dynamo  # (not at import: it takes a while to load)

    forward = torch._dynamo.disable(
        lambda *args, **kwargs: checkpoint_module_forward(module, original, args, kwargs))
    if traced:
        eager = forward

        def forward(*args, **kwargs):  # noqa: F811
            if torch.compiler.is_compiling():
                return _traced_checkpoint(module, original, args, kwargs)
            return eager(*args, **kwargs)

    forward.__memlean_fit__ = True
    forward.__memlean_traced__ = traced
    # (A deep copy of the module, e.g. an EMA model, gets a checkpoint of its own.)
    return wrap_forward(module, forward, (_wrap, (traced,)))


def _traced(call: _Call, traced: bool) -> bool:
    """Whether a plan for compiled steps (traced) traces this checkpoint into the graph: not
    where the module's forward changed a buffer a checkpoint rewinds (one it reads: a spectral
    norm's vectors, an observer's statistics). Traced, torch's checkpoint recomputes from the
    updated buffer (gradients silently off; pytorch's compiled checkpoint as its eager one):
    such a module runs under memlean.checkpoint between graphs instead, which rewinds."""
    return traced and not call.changed_buffers


def _traced_checkpoint(module, original, args, kwargs):
    """`original(*args, **kwargs)` checkpointed while dynamo traces it: torch's non-reentrant
    checkpoint, which dynamo makes one region of the compiled graph that the compiler
    recomputes in backward (no graph break; inductor fuses across it, and a BatchNorm in it is
    updated once: the graph's buffer mutations run once, in the forward). Where dynamo cannot
    trace the region (a graph break inside the module), torch's checkpoint runs eagerly
    instead, and its recompute would update a BatchNorm a second time (pytorch#96136): there
    the module's buffers are put back after the recompute, as memlean.checkpoint does, and
    the recompute begins from the buffers the forward began from (those it changed and
    reads: rewound_buffers, copied before the eager forward)."""
    buffers = _module_buffers(module)
    starts = []  # (buffer, its value before the eager forward) of those that forward changed

    def region(*inputs):
        # is_compiling() first: while dynamo traces, the rest is not evaluated.
        if not torch.compiler.is_compiling():
            if torch._C._current_graph_task_id() != -1:  # eager, recomputing
                kept = [(b, b.detach().clone()) for b in buffers]
                put_back(starts)  # (no version bump, as put_back puts the values back after)
                try:
                    return original(*inputs, **kwargs)
                finally:
                    put_back(kept)
            # eager, the forward
            copies = buffer_copies(rewound_buffers([module], buffers))
            out = original(*inputs, **kwargs)
            starts[:] = changed_since(copies)
            return out
        return original(*inputs, **kwargs)

    return torch.utils.checkpoint.checkpoint(region, *args, use_reentrant=False)


def _wrap_run(run: _Run):
    """Checkpoint a run of sibling modules as one; returns the undo. While their parent's
    forward runs a training step (grad enabled, the first module in training mode), the first
    module's forward runs them all (their own forwards, in turn) under memlean.checkpoint
    with all their parameters and buffers, and each later one hands on the tensor the run
    returned, called in turn as in the measured forward. Anything else (eval, no_grad, a
    module called on its own outside its parent's forward) runs the modules' own forwards.
    A parent forward that strays from the measured chain (another tensor handed to a later
    module, a module skipped or called out of turn) raises, naming the run, never a wrong
    value in silence."""
    modules, parent = run.modules, run.parent
    originals = [m.forward for m in modules]
    state = _RunState()

    def chain(x):
        # (A run nested inside this one, a compound's inner checkpoint of sibling modules,
        # runs its modules as one while this chain calls them: in the recompute, where their
        # parent's forward, which makes the runs of its modules active, is not running.)
        depth = _CHAINS.depth
        _CHAINS.depth = depth + 1
        try:
            for f in originals:
                x = f(x)
        finally:
            _CHAINS.depth = depth
        return x

    def strayed(what):
        state.handed, state.out = 0, None
        raise RuntimeError(
            f"memlean.fit: {what}: the run {run.path(_paths(parent))} is checkpointed "
            f"as one because the measured forward called its modules one after the other, each "
            f"on the output of the one before; this forward does not. Undo the plan "
            f"(plan.undo()) or fit again with this forward.")

    def head(*args, **kwargs):
        if state.handed:
            strayed(f"{type(modules[0]).__name__} was called again inside the run")
        if not (state.active or _CHAINS.depth):
            return originals[0](*args, **kwargs)
        if torch.is_grad_enabled() and modules[0].training:
            hooked()
        out = run.run(chain, args, kwargs)
        if out is None:
            return originals[0](*args, **kwargs)
        state.handed, state.out = 1, out
        return out

    def hooked():
        # (Hooks around the first module's call would run around all of them, a later
        # one's around its hand-on.)
        _refuse_hooks(modules, parent, lambda: (
            f"the run {run.path(_paths(parent))} is checkpointed as one (fit(..., runs=True)): "
            f"the call of its first module runs the forwards of all {len(modules)}"))

    def later(k):
        def forward(*args, **kwargs):
            if state.handed == 0:
                return originals[k](*args, **kwargs)  # no run in progress
            if state.handed != k or len(args) != 1 or kwargs or args[0] is not state.out:
                strayed(f"module {k + 1} of {len(modules)} was not called on the run's output "
                        f"in turn")
            state.handed = k + 1 if k + 1 < len(modules) else 0
            out = state.out
            if state.handed == 0:
                state.out = None
            return out
        return forward

    parent_forward = parent.forward
    compiled_note = (f"{_NAME}: torch.compile traced the forward of "
                     f"{run.where or run.path(_paths(parent))}, a run of modules the plan "
                     f"{run.ACTION} in eager steps only: "
                     f"compiled, its modules run as they are and the step is not held to the "
                     f"plan's budget (it may peak far above it). For a model that trains "
                     f"compiled, fit with compile=True.")

    def enter():
        # Each call of the parent starts afresh (a forward that raised left its state).
        state.active, state.handed, state.out = 1, 0, None

    def leave():
        state.active = 0
        if state.handed:
            strayed("the parent's forward ended inside the run")

    def parent_wrapper(*args, **kwargs):
        # (Its own forward, not hooks: torch.compile(model) skips the root module's hooks.
        # No try/finally: dynamo compiles no frame with a graph break inside one, and every
        # child of the parent would be a graph of its own.)
        if torch.compiler.is_compiling():
            # Compiled (torch.compile of the fitted model), the run is not checkpointed: it
            # would split the parent's graph, and inductor's graphs around it kept more than
            # the run saved (fit_test's ConvNet: above the model compiled without fit).
            # Said once, with no graph break: _note_eager_only_compiled.
            if _NOTE_IN_GRAPH:
                _note_eager_only_compiled(compiled_note)
            return parent_forward(*args, **kwargs)
        enter_()
        out = parent_forward(*args, **kwargs)
        leave_()
        return out

    import torch._dynamo  # (as in _wrap)

    _note_in_graph()
    enter_, leave_ = torch._dynamo.disable(enter), torch._dynamo.disable(leave)
    forwards = [head] + [later(k) for k in range(1, len(modules))]
    undos = []
    for m, f in zip(modules, forwards):
        f = torch._dynamo.disable(f)
        f.__memlean_fit__ = True
        undos.append(wrap_forward(m, f))  # (a deep copy: its parent's rewrap wraps them)
    # A deep copy of the parent (with the run's modules) gets the run of its own modules.
    undos.append(wrap_forward(parent, parent_wrapper, (_rewrap_run, (run,))))

    def undo():
        for u in reversed(undos):
            u()

    return undo


_NOTED: set = set()  # the notes _note_eager_only_compiled gave
_NOTE_IN_GRAPH = False  # whether dynamo defers it past the graph (set by _note_in_graph)


def _note_eager_only_compiled(note: str) -> None:
    """Warns (once per note) that torch.compile traced the parent of a run fit checkpoints or
    slices in eager steps only. A logging function for dynamo (_note_in_graph): called in the
    compiled forward, it runs after the graph, with no graph break."""
    if note not in _NOTED:
        _NOTED.add(note)
        warnings.warn(note, UserWarning, stacklevel=2)


def _note_in_graph() -> None:
    """Lets dynamo trace _note_eager_only_compiled as a logging call it defers past the
    graph (torch._dynamo.config.reorderable_logging_functions, as print and logging calls);
    with a torch without that setting, no note (a call dynamo cannot trace would break the
    graph)."""
    global _NOTE_IN_GRAPH
    functions = getattr(torch._dynamo.config, "reorderable_logging_functions", None)
    if functions is not None:
        functions.add(_note_eager_only_compiled)
        _NOTE_IN_GRAPH = True


class _Chains(threading.local):
    """How many checkpointed runs' chains (_wrap_run) this thread is inside: a run's modules
    called by an enclosing run's chain are called in turn, as their parent's forward calls
    them (the enclosing run's modules are siblings of theirs, or they are its own)."""

    depth = 0


_CHAINS = _Chains()


class _RunState:
    """One checkpointed run's progress through its parent's forward."""

    def __init__(self):
        self.active = 0  # 1 while the parent's forward runs (each call starts afresh)
        self.handed = 0  # the next module of the run in progress to hand on; 0: none
        self.out = None  # the run's output, until its last module handed it on


def _paths(model):
    paths = {}
    for name, m in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(m), name or type(model).__name__)
    return paths


# ---- fit -----------------------------------------------------------------------------------


def _compiled(module) -> bool:
    """Whether `module` is what torch.compile(module) returns (dynamo's OptimizedModule)."""
    kind = type(module)
    return kind.__name__ == "OptimizedModule" and kind.__module__.startswith("torch._dynamo")


def _check(model, example_inputs, loss_fn, optimizer):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{_NAME}: model must be a torch.nn.Module, got {type(model).__name__}")
    compiled = next((name for name, m in model.named_modules() if _compiled(m)), None)
    if compiled is not None:
        what = "model" if not compiled else f"model's submodule '{compiled}'"
        raise ValueError(
            f"{_NAME}: {what} is a torch.compile'd module: fit measures and changes the eager "
            f"modules, which compiled code hides from it. Fit the module before compiling it "
            f"(the one compiled is its ._orig_mod), with compile=True to measure compiled "
            f"steps, then torch.compile the fitted model")
    if torch.is_inference_mode_enabled():
        raise RuntimeError(f"{_NAME}: called inside torch.inference_mode(), where no training "
                           f"step can run (autograd records nothing there); call fit outside it")
    lazy = next((n for n, p in model.named_parameters()
                 if isinstance(p, torch.nn.parameter.UninitializedParameter)), None)
    if lazy is not None:
        raise ValueError(f"{_NAME}: model has parameters not made yet ({lazy}: a lazy module, "
                         f"e.g. nn.LazyLinear): run its forward once on a batch before fit, "
                         f"which measures them (and before making the optimizer)")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{_NAME}: model has no parameters that require grad: there is no "
                         f"training step to fit")
    device = params[0].device
    for name, p in model.named_parameters():
        if p.device != device:
            raise ValueError(f"{_NAME}: model has parameters on {device} and {p.device} "
                             f"({name}); fit measures one device")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    elif isinstance(example_inputs, list):
        example_inputs = tuple(example_inputs)
    elif isinstance(example_inputs, dict):
        if not all(isinstance(k, str) for k in example_inputs):
            raise TypeError(f"{_NAME}: example_inputs as a dict holds the forward's keyword "
                            f"arguments: its keys must be str")
        example_inputs = dict(example_inputs)
    if not isinstance(example_inputs, (tuple, dict)):
        raise TypeError(f"{_NAME}: example_inputs must be a tensor, a tuple of the forward's "
                        f"arguments or a dict of its keyword arguments, got "
                        f"{type(example_inputs).__name__}")
    for t in _tensors(example_inputs):
        if t.device != device:
            raise ValueError(f"{_NAME}: example_inputs holds a tensor on {t.device} but the "
                             f"model is on {device}; move the batch to the model's device")
        if t.is_inference():
            raise ValueError(f"{_NAME}: example_inputs holds a tensor made in "
                             f"torch.inference_mode(), which autograd cannot use in a training "
                             f"step; make the batch outside it (or clone it outside it)")
    if loss_fn is None:
        loss_fn = _sum_floating_leaves
    elif not callable(loss_fn):
        raise TypeError(f"{_NAME}: loss_fn must be callable, got {type(loss_fn).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{_NAME}: optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if optimizer is not None and _needs_closure(optimizer):
        raise ValueError(f"{_NAME}: optimizer ({type(optimizer).__name__}) has a step() that needs "
                         f"a closure that evaluates the loss again (torch.optim.LBFGS: up to "
                         f"max_eval forward and backward passes per step); fit measures steps "
                         f"of one forward and backward and calls optimizer.step() without one, "
                         f"so it cannot fit this optimizer's step")
    return example_inputs, loss_fn, device


class _Run:
    """Consecutive sibling module calls that hand one tensor along, x -> m1 -> m2 -> ...,
    with nothing between them (a stretch of a block's forward, e.g. an inverted residual
    block's middle without its 1x1 convolutions; two blocks of a stage): checkpointed as
    one, so the tensors passed inside it are not kept. A candidate finer than a module."""

    ACTION = "checkpoints"  # what fit does with it (the note under torch.compile)

    def __init__(self, modules, parent):
        self.modules = tuple(modules)
        self.parent = parent  # the module whose forward calls them
        self.where = ""  # its path in the model, path() (fit sets it; "": in its parent)

    def parameters(self):
        return list({id(p): p for m in self.modules for p in module_parameters(m)}.values())

    def run(self, chain, args, kwargs):
        """The run's output in a training step (grad enabled, the first module training):
        checkpointed; None where its modules run as they are."""
        if not (torch.is_grad_enabled() and self.modules[0].training):
            return None
        buffers = self.buffers()
        return checkpoint_run_forward(chain, self.parameters(), buffers,
                                      rewound_buffers(self.modules, buffers), args, kwargs)

    def buffers(self):
        return list({id(b): b for m in self.modules for b in _module_buffers(m)}.values())

    def path(self, paths) -> str:
        first = paths.get(id(self.modules[0]), "?")
        last = paths.get(id(self.modules[-1]), "?")
        parent, _, name = first.rpartition(".")
        if parent and last.startswith(parent + "."):
            last = last[len(parent) + 1:]
        return f"{parent + '.' if parent else ''}({name}..{last})"


class _Nest:
    """A compound checkpoint: `outer` (a module or _Run) checkpointed around checkpoints of
    modules or runs inside it (`inner`, inside out: an inner compound's parts, then its
    outer), which its recompute runs: while it is recomputed only their inputs are kept (and
    what no inner checkpoint holds), and each of them is recomputed again in the backward
    through it. costs: (bytes saved, recompute seconds) of each of `parts`; depths: of each
    of `inner`, how many of `parts` it is nested in (depths adds the outer's, 0)."""

    def __init__(self, outer, inner, costs, depths):
        self.outer, self.inner, self.costs = outer, tuple(inner), tuple(costs)
        self.depths = tuple(depths) + (0,)

    @property
    def parts(self) -> tuple:
        """The checkpointed modules and runs, in the order they are wrapped: inside out."""
        return self.inner + (self.outer,)


def _parts(module) -> tuple:
    """The modules and runs a candidate's checkpoint wraps: a _Nest's parts, else itself."""
    return module.parts if isinstance(module, _Nest) else (module,)


def _part_depths(module) -> tuple:
    """How many of _parts(module) each of them is nested in (its outer: 0)."""
    return module.depths if isinstance(module, _Nest) else (0,)


def _part_costs(module, candidate) -> tuple:
    """(bytes saved, recompute seconds) of each of _parts(module), `candidate` its planner
    tuple (begin, end, freed_bytes, seconds, ...)."""
    return module.costs if isinstance(module, _Nest) else (tuple(candidate[2:4]),)


class _Slice(_Run):
    """A run fit recomputes channel slice by channel slice (memlean.sliced): an optional
    ungrouped convolution, then BatchNorms, elementwise activations and depthwise
    convolutions of one channel count."""

    ACTION = "recomputes in channel slices"

    def __init__(self, modules, parent, channels):
        super().__init__(modules, parent)
        self.roles = [sliced.role(m) for m in self.modules]
        self.channels = channels
        self.fine = False  # sliced.slices_for: finer slices behind a 1x1 head, slower
        self.finer = False  # whether fine slices are more than the others (the last run's)
        self._pointwise = self.roles[0] == "head" and sliced.pointwise(self.modules[0])

    def run(self, chain, args, kwargs):
        if not (self.modules[0].training and len(args) == 1 and not kwargs
                and sliced.applies(args[0])):
            return None  # (eval, CUDA, other dtypes: the modules in turn)
        x = args[0]
        head = self.roles[0] == "head"
        wide = sliced.widest(x, self.modules, self.roles, self.channels)
        counts = [sliced.slices_for(x, head, self.channels, wide, fine)
                  for fine in (False, self._pointwise)]
        self.finer = counts[1] > counts[0]
        return sliced.run_sliced(x, self.modules, self.roles, self.channels,
                                 slices=counts[self.fine])


class _MlpSlice(_Run):
    """An MLP run fit recomputes slice by slice of its hidden features (memlean.sliced's
    sliced MLP): an nn.Linear, elementwise activations, an nn.Linear (timm's Mlp: a ViT's,
    ConvNeXt's)."""

    ACTION = "recomputes in hidden-feature slices"

    def __init__(self, modules, parent, parts):
        super().__init__(modules, parent)
        self.parts = parts  # (fc1, acts, fc2): sliced.mlp_parts
        self.fine = False  # (no finer slicing: the slices' fc1 reads x once in all)
        self.finer = False

    def run(self, chain, args, kwargs):
        if not (self.modules[0].training and len(args) == 1 and not kwargs
                and sliced.applies(args[0], mlp=True)):
            return None  # (eval, CUDA, other dtypes: the modules in turn)
        return sliced.run_sliced_mlp(args[0], *self.parts)


class _SplitMlpSlice(_MlpSlice):
    """An MLP split between two modules, fit recomputes slice by slice of its hidden features:
    a module whose forward is an nn.Linear and elementwise activations (transformers'
    BertIntermediate, ViTIntermediate), and the nn.Linear another module calls on its output
    right after (BertOutput's, ViTOutput's `dense`). While fitted, the first module computes
    the whole MLP sliced and the Linear hands that output on, inside their nearest common
    ancestor's forward (`parent`); the modules on the way from it to the two (`between`:
    BertOutput) are no checkpoint candidates, as their recompute would run outside it."""

    def __init__(self, modules, parent, parts, between):
        super().__init__(modules, parent, parts)
        self.between = tuple(between)


class _GatedSlice(_Run):
    """A gated MLP module (SwiGLU, GeGLU: its whole forward is down(act(gate(x)) * up(x)),
    checked on the recorded dataflow) fit recomputes slice by slice of its hidden features
    (memlean.sliced_gated_mlp): its forward is replaced while fitted."""

    ACTION = "recomputes in hidden-feature slices"

    def __init__(self, module, parent, gate, acts, up, down, gate_first=True):
        super().__init__((module,), parent)
        self.gate, self.acts, self.up, self.down = gate, tuple(acts), up, down
        self.gate_first = gate_first  # (up None: which half of gate's output is the gate's)
        self.fine = False
        self.finer = False

    def run(self, chain, args, kwargs):
        if not (self.modules[0].training and len(args) == 1 and not kwargs
                and sliced.applies(args[0], mlp=True)):
            return None  # (eval, CUDA, other dtypes: its own forward)
        module = self.modules[0]
        _refuse_hooks(list(module.modules())[1:], module, lambda: (
            f"{type(module).__name__}'s forward is computed slice by slice of its hidden "
            f"features (a sliced MLP), its layers' forwards not called"))
        return sliced.run_sliced_gated_mlp(args[0], self.gate, self.acts, self.up, self.down,
                                           gate_first=self.gate_first)

    def path(self, paths) -> str:
        return paths.get(id(self.modules[0]), "?")


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _has_hooks(module) -> bool:
    """Whether `module` has forward or backward hooks, fit's own recorder's aside (they are
    on every module while it records a step)."""
    return any(not isinstance(getattr(f, "__self__", None), _Recorder)
               for h in _HOOKS for f in (getattr(module, h, None) or {}).values())


def _refuse_hooks(modules, root, what):
    """RuntimeError where a module of `modules` has hooks whose forward the plan does not
    call through the module (what(): how, made only then; paths under root). fit plans
    nothing of the kind through a module with hooks (_runs); these were added since (FSDP2's
    fully_shard, a user's) and would not run around their module's forward. Runs in every
    training forward of a run: nothing but the hook dicts is read unless one is found."""
    for m in modules:
        if _has_hooks(m):
            raise RuntimeError(
                f"memlean.fit: {what()}, so no hook of theirs would run around its own module's "
                f"forward, and {type(m).__name__} {_paths(root).get(id(m), '?')} has hooks "
                f"since fit planned it. A hook of yours: fit again with it in place (fit plans "
                f"around modules with hooks). FSDP2's fully_shard, which adds them to each "
                f"module it shards after fit: fully_shard the run's parent rather than its "
                f"modules, or fit without runs=True. Or undo the plan (plan.undo()).")


def _wrap_gated(gated: _GatedSlice):
    """Run the gated MLP's forward sliced (gated.run) in eager training steps, its own
    forward otherwise (traced by torch.compile: the printed plan says eager steps only);
    returns the undo."""
    module = gated.modules[0]
    original = module.forward
    note = (f"{_NAME}: torch.compile traced the forward of {gated.where or type(module).__name__},"
            f" a gated MLP the plan {gated.ACTION} in eager steps only: compiled, it runs as it "
            f"is and the step is not held to the plan's budget (it may peak far above it). For "
            f"a model that trains compiled, fit with compile=True.")

    def forward(*args, **kwargs):
        if torch.compiler.is_compiling():
            if _NOTE_IN_GRAPH:
                _note_eager_only_compiled(note)
        else:
            out = gated.run(None, args, kwargs)
            if out is not None:
                return out
        return original(*args, **kwargs)

    import torch._dynamo  # noqa: F401  (as in _wrap; _note_in_graph reads its config)

    _note_in_graph()
    forward.__memlean_fit__ = True
    return wrap_forward(module, forward, (_rewrap_gated, (gated,)))


def _rewrap_run(parent, run: _Run) -> None:
    """wrap_forward's rewrap of a copy of a run's parent: `run` copied with it (deepcopy,
    pickle), its modules the copy's."""
    if run.parent is not parent:
        raise TypeError(_SHALLOW.format(type(parent).__name__, "a run of its submodules"))
    _wrap_run(run)


def _rewrap_gated(module, gated: _GatedSlice) -> None:
    """wrap_forward's rewrap of a copy of a gated MLP fit slices (as _rewrap_run)."""
    if gated.modules[0] is not module:
        raise TypeError(_SHALLOW.format(type(module).__name__, "its gated MLP's slices"))
    _wrap_gated(gated)


_SHALLOW = ("memlean: cannot copy.copy {} as fitted: memlean.fit recomputes {}, whose modules "
            "a shallow copy shares with the original; copy.deepcopy(model) makes a fitted copy")


_LONGEST_RUN = 32  # module calls


def _runs(eager: _Recorder, current: _Recorder, root, whole=False,
          exclude=frozenset()) -> List[List[int]]:
    """The runs of 2 or more sibling calls that can be checkpointed as one, as indices into
    current.calls (the step planned on), checked on eager's dataflow (its op numbers and
    reads; current is the same forward after the Swish swap). A run's calls each take one
    positional tensor, the one the call before returned (the same tensor, no op between),
    return one tensor, are the only calls of their modules and have no hooks; the tensors
    passed inside it are read by no op after it nor handed to any call outside it; its
    first call does not write its input, nor does a later one write that input's storage;
    and it is not all of a parent whose forward does nothing else (whole: it may be); none of
    its modules is in exclude (id()s)."""
    calls, found = current.calls, []
    flow = eager.dataflow
    if flow is None or not _same_forward(eager, current):
        return []  # not the same forward: no runs (module candidates only)
    counts = _call_counts(calls)
    last_read = flow.last_reads()
    users = {}  # storage identity -> (begin, end) of the calls taking or returning it
    for c in eager.calls:
        for key, _ in c.inputs + c.outputs:
            users.setdefault(key, []).append((c.begin, c.end))
    index = {id(c): k for k, c in enumerate(eager.calls)}
    siblings = {}
    for k, c in enumerate(eager.calls):
        siblings.setdefault(index.get(id(c.parent)), []).append(k)

    def member(k):
        # (called in its parent's grad mode and saved-tensors region: a region its parent's
        # forward enters, as torchvision's memory-efficient DenseNet layer checkpoints its
        # bottleneck with torch.utils.checkpoint, recomputes its modules in backward without
        # the parent's forward, which runs a run's chain: that recompute ran them in turn,
        # saved other tensors and raised torch's CheckpointError in fit's sliced step, which
        # fit then gave up, 2026-11-30)
        c, m = eager.calls[k], calls[k].module
        return (c.input_id and c.output_id and c.module is not root and id(m) not in exclude
                and counts[id(m)] == 1 and not _has_hooks(m)
                and (c.parent is None or _same_region(c.parent, c)))

    def linked(k, n):
        a, b = eager.calls[k], eager.calls[n]
        return (b.input_id == a.output_id and b.seq_begin == a.seq_end - 1
                and b.inputs[:1] == a.outputs[:1] and b.context == a.context)

    for parent, kids in siblings.items():
        if parent is None:
            continue
        kids.sort(key=lambda k: eager.calls[k].begin)
        p = eager.calls[parent]
        everything = (eager.calls[kids[0]].seq_begin == p.seq_begin
                      and eager.calls[kids[-1]].seq_end == p.seq_end)  # nothing but its children
        start = 0
        while start < len(kids):
            stop = start + 1  # [start, stop): a chain of linked members
            if member(kids[start]):
                while (stop < len(kids) and member(kids[stop])
                       and linked(kids[stop - 1], kids[stop])):
                    stop += 1
            for i in range(start, stop):
                for j in range(i + 1, min(stop, i + _LONGEST_RUN)):
                    if everything and not whole and i == 0 and j == len(kids) - 1:
                        continue  # the parent itself is the candidate
                    run = kids[i:j + 1]
                    if _run_is_safe(eager, current, run, last_read, users):
                        found.append(run)
            start = stop
    return found


def _same_forward(eager: _Recorder, current: _Recorder) -> bool:
    """Whether current recorded the forward eager did (the same calls; a Swish swapped)."""
    if len(eager.calls) != len(current.calls):
        return False
    return all((a.begin, a.end) == (b.begin, b.end) and (
        a.module is b.module or (_swish_beta(a.module) is not None
                                 and isinstance(b.module, Swish)))
        for a, b in zip(eager.calls, current.calls))


def _run_is_safe(eager, current, run, last_read, users) -> bool:
    first, last = eager.calls[run[0]], eager.calls[run[-1]]
    head = current.calls[run[0]]
    if head.mutates_input or any(current.calls[k].mutates_input
                                 and current.calls[k].input_key == head.input_key
                                 for k in run[1:]):
        return False  # memlean.checkpoint refuses a function that writes its input
    ends = {first.inputs[0][0], last.outputs[0][0]}
    inner = {eager.calls[k].outputs[0][0] for k in run[:-1]} - ends - {None}
    if any(last_read.get(key, 0) >= last.seq_end for key in inner):
        return False  # an op after the run reads a tensor passed inside it
    return not any(not (first.begin <= b and e <= last.end)
                   for key in inner for b, e in users.get(key, ()))  # a call outside takes it


def _call_counts(calls):
    """{id(module): how many times the recorded forward called it}."""
    counts = {}
    for c in calls:
        counts[id(c.module)] = counts.get(id(c.module), 0) + 1
    return counts


def _with_unversioned_writers(model, run):
    """run() (a measured step) and the id() of every module whose tree holds a buffer that a
    checkpoint would rewind (rewound_buffers) and that the step changed without moving its
    version counter: through `.data` (`b.data.mul_(...)`, `b.data = ...`). memlean.checkpoint
    sees such a change by value (changed_since), but fit's planner counts the buffer copies a
    checkpoint keeps from the recorded step's version counters (_Call.changed_buffers), so
    fit checkpoints none of these modules, nor a run or sliced chain holding one. (Found by
    value, memlean::unversioned_changes, the check memlean::fit makes: copies made before the
    step, outside its counted bytes.)"""
    buffers = rewound_buffers([model], [b for b in model.buffers() if b is not None])
    result = []
    flags = _C.unversioned_changes(buffers, lambda: result.append(run()))
    changed = {id(b) for b, flag in zip(buffers, flags) if flag}
    if not changed:
        return result[0], frozenset()
    return result[0], frozenset(id(m) for m in model.modules()
                                if any(id(b) in changed for b in m.buffers()))


def _stateful_modules(rec: _Recorder, paths) -> frozenset:
    """The id() of every module a call of which had an object among its arguments whose state
    its forward may change (_Call.opaque: a key-value cache), and of the modules it ran
    inside, with a warning naming the first: fit checkpoints none of them, nor a run or sliced
    chain holding one (a recompute would change the object again and compute from its
    changed state). paths: _paths(model)."""
    calls = [c for c in rec.calls if c.opaque is not None]
    if not calls:
        return frozenset()
    names = sorted({paths.get(id(c.module), type(c.module).__name__) for c in calls})
    kinds = sorted({c.opaque.__name__ for c in calls})
    hint = ("; for a transformers model, use_cache=False (as gradient_checkpointing_enable() "
            "sets it) passes no cache, and its layers become candidates"
            if any("Cache" in k for k in kinds) else "")
    warnings.warn(f"{_NAME}: {len(names)} module(s) ({', '.join(names[:3])}"
                  f"{', ...' if len(names) > 3 else ''}) are called with "
                  f"{' or '.join(kinds)} object(s), whose state their forward may change: fit "
                  f"checkpoints none of them (a recompute in backward would change it again)"
                  f"{hint}.", RuntimeWarning, stacklevel=3)
    # Their callers too: one may hand down an object it did not make (its attribute), and a
    # recompute of the caller would change that again.
    found = set()
    for c in calls:
        while c is not None:
            found.add(id(c.module))
            c = c.parent
    return frozenset(found)


def _buffers_of(module):
    return module.buffers() if isinstance(module, _Run) else _module_buffers(module)


_SLICE_MIN_BYTES = 1 << 20  # a chain narrower than this is not sliced (tests lower it)


def _slices(eager: _Recorder, current: _Recorder, root, exclude=frozenset()) -> List[_Slice]:
    """The chains memlean.sliced can recompute slice by slice, among the runs of sibling
    calls (_runs, a parent's whole forward included) that pay for their recompute: the
    widest output 1 MiB or more (not, e.g., a squeeze-excitation's), and a head convolution
    only where its output is at least twice its input (an inverted residual block's
    expansion; not its projection, whose slices would each make a gradient of the whole wide
    input): the longest first, none overlapping another; none holding a module in exclude."""
    found = []
    for run in _runs(eager, current, root, whole=True, exclude=exclude):
        modules = [current.calls[k].module for k in run]
        first = current.calls[run[0]]
        wide = max(n for k in run for _, n in current.calls[k].outputs[:1])
        widens = first.outputs[0][1] >= 2 * sum(n for _, n in first.inputs[:1])
        parts = sliced.mlp_parts(modules)
        if parts is not None:
            # An MLP whose first Linear widens (a ViT's 4x): sliced over its hidden features.
            if wide >= _SLICE_MIN_BYTES and widens:
                found.append((run, modules, parts))
            continue
        channels = sliced.chain_channels(modules)
        if (channels is not None and wide >= _SLICE_MIN_BYTES
                and (sliced.role(modules[0]) != "head" or widens)):
            found.append((run, modules, channels))
    found.sort(key=lambda f: (-len(f[0]), f[0][0]))
    taken, chains = set(), []
    for k, gated, inside in _gated_mlps(eager, current, exclude) + _split_mlps(
            eager, current, exclude):
        if not taken & inside:
            taken |= inside
            chains.append((k, gated))
    for run, modules, what in found:
        if not taken & set(run):
            taken |= set(run)
            parent = current.calls[run[0]].parent.module
            chains.append((run[0], _MlpSlice(modules, parent, what) if isinstance(what, tuple)
                           else _Slice(modules, parent, what)))
    paths = _paths(root)
    for _, c in chains:
        c.where = c.path(paths)
    return [c for _, c in sorted(chains, key=lambda c: c[0])]


# The activations a gated MLP may apply as an op of its own forward (F.silu, F.relu, F.gelu:
# SwiGLU, ReGLU, GeGLU), and, from the op's keyword arguments, the module that computes the
# same (memlean.sliced_gated_mlp takes modules). Their schemas have no other arguments than
# the input and these keywords (gelu's approximate), so the module repeats the op exactly.
_FUNCTIONAL_ACTS = {
    torch.ops.aten.silu.default: lambda options: torch.nn.SiLU(),
    torch.ops.aten.relu.default: lambda options: torch.nn.ReLU(),
    torch.ops.aten.gelu.default: lambda options: torch.nn.GELU(
        approximate=options.get("approximate", "none")),
}


def _gated_mlps(eager: _Recorder, current: _Recorder, exclude=frozenset()) -> list:
    """The gated MLPs of the recorded forward: (index of its call, _GatedSlice, indices of
    its call and its children's calls) for every module called once, one positional tensor
    in, whose whole forward is down(act(gate(x)) * up(x)) as the dataflow shows it, with
    gate and up two nn.Linear children (_separate_gated) or one that packs both
    (_packed_gated: timm's GluMlp), the activations elementwise children or one op of its
    own forward (F.silu, F.relu, F.gelu: _FUNCTIONAL_ACTS), its own ops otherwise nothing
    but one multiplication (and, packed, the views that split gate's output), whose result
    down takes through modules that pass it on (timm's Dropout(0) and Identity), and down's
    output returned (through such modules too); hidden tensors of 1 MiB or more; none of its
    modules in exclude."""
    flow = eager.dataflow
    if flow is None or not _same_forward(eager, current):
        return []
    index, kids = _children(eager.calls)
    counts = _call_counts(current.calls)
    found = []
    for p, ks in sorted(kids.items()):
        parent, module = eager.calls[p], current.calls[p].module
        if (not parent.input_id or not parent.output_id or counts[id(module)] != 1
                or _has_hooks(module)
                or any(id(m) in exclude for m in module.modules())):
            continue
        ks.sort(key=lambda k: eager.calls[k].seq_begin)
        calls, mods = [eager.calls[k] for k in ks], [current.calls[k].module for k in ks]
        # down: the last Linear child, after it only modules that pass its output on (drop2)
        tail = len(mods)
        while tail > 2 and sliced._passes(mods[tail - 1]):
            tail -= 1
        d = tail - 1
        inner = [(c.seq_begin, c.seq_end) for c in calls]
        own = [s for s in range(parent.seq_begin + 1, parent.seq_end)
               if not any(b < s < e for b, e in inner) and not flow.ops.get(s, (0,) * 5)[3]]
        if (not own or any(s not in flow.ops for s in own) or calls[d].output_id
                != parent.output_id or not all(calls[i].input_id == calls[d].output_id
                                               for i in range(tail, len(mods)))):
            continue
        linears = [i for i in range(tail) if isinstance(mods[i], torch.nn.Linear)]
        if linears[:1] != [0] or linears[-1:] != [d] or len(linears) not in (2, 3):
            continue
        parts = (_separate_gated if len(linears) == 3 else _packed_gated)(
            flow, parent, calls, mods, own, d)
        if parts is None:
            continue
        gate, acts, up, gate_first, g = parts
        wide = max(n for _, n in calls[g].outputs[:1]) if calls[g].outputs else 0
        if wide < _SLICE_MIN_BYTES or not sliced.gated_parts(gate, acts, up, mods[d]):
            continue
        gated = _GatedSlice(module, parent.parent.module if parent.parent else None, gate,
                            acts, up, mods[d], gate_first)
        found.append((p, gated, {p, *ks}))
    return found


def _children(calls):
    """({id(call): its index}, {a call's index: the indices of the calls it made}) of the
    recorded calls."""
    index = {id(c): k for k, c in enumerate(calls)}
    kids = {}
    for k, c in enumerate(calls):
        if id(c.parent) in index:
            kids.setdefault(index[id(c.parent)], []).append(k)
    return index, kids


def _split_mlps(eager: _Recorder, current: _Recorder, exclude=frozenset()) -> list:
    """The MLPs split between two modules (_SplitMlpSlice): (index of the first module's call,
    the _SplitMlpSlice, indices of the calls it holds and of those between) for every module
    called once, one positional tensor in and one out, whose forward is nothing but its
    children's calls, an nn.Linear (transformers' Conv1D) on its input then elementwise
    activations each on the one before's output, the last one's output its own; whose output
    an nn.Linear (Conv1D) called once takes next, no op between, its input features fc1's
    output features; the tensors made inside read by no op after that Linear and handed to no
    other call (but the Linear's ancestors, which hand it on); the module and the Linear
    called in one context (_Recorder._context), their common ancestor in its grad mode and
    saved-tensors region (_runs says why); no hooks on the modules or those between; a
    hidden tensor of 1 MiB or more; none of them in exclude."""
    flow = eager.dataflow
    if flow is None or not _same_forward(eager, current):
        return []
    calls = eager.calls
    counts = _call_counts(current.calls)
    index, kids = _children(calls)
    last_read = flow.last_reads()
    users = {}  # storage identity -> the calls taking or returning it
    taking = {}  # id() of a call's one tensor argument -> the calls taking it
    for k, c in enumerate(calls):
        for key, _ in c.inputs + c.outputs:
            users.setdefault(key, set()).add(k)
        if c.input_id:
            taking.setdefault(c.input_id, []).append(k)

    def plain(k):
        m = current.calls[k].module
        return (counts[id(m)] == 1 and id(m) not in exclude
                and not _has_hooks(m))

    def ancestors(k):
        out, c = [], calls[k].parent
        while c is not None:
            out.append(index[id(c)])
            c = c.parent
        return out

    found = []
    for a, ks in sorted(kids.items()):
        first = calls[a]
        if not (first.input_id and first.output_id and plain(a) and first.outputs):
            continue
        ks = sorted(ks, key=lambda k: calls[k].seq_begin)
        mods = [current.calls[k].module for k in ks]
        chained = all(calls[j].input_id == calls[i].output_id and calls[j].input_id
                      and calls[j].seq_begin == calls[i].seq_end - 1
                      for i, j in zip(ks, ks[1:]))
        if (len(ks) < 2 or not chained or not all(map(plain, ks))
                or calls[ks[0]].input_id != first.input_id
                or calls[ks[0]].seq_begin != first.seq_begin
                or calls[ks[-1]].output_id != first.output_id
                or calls[ks[-1]].seq_end != first.seq_end
                or current.calls[ks[0]].mutates_input):
            continue
        if first.outputs[0][0] is None or first.outputs[0][1] < _SLICE_MIN_BYTES:
            continue  # (the hidden tensor: its identity, its bytes)
        takers = [f for f in taking.get(first.output_id, ())
                  if calls[f].seq_begin == first.seq_end - 1 and not calls[f].inputs[1:]
                  and calls[f].inputs[:1] == first.outputs[:1]
                  and sliced._linear(current.calls[f].module) and f not in ks and f != a]
        if len(takers) != 1 or not plain(takers[0]):
            continue
        f = takers[0]
        if calls[f].context != first.context:
            # (fc1 inside a saved-tensors region and fc2 outside it: timm's
            # set_grad_checkpointing's last block and the head after it. Sliced as one, the
            # region's recompute saved another number of tensors: torch's CheckpointError.)
            continue
        parts = sliced.mlp_parts(mods + [current.calls[f].module])
        if parts is None or len(parts[1]) != len(mods) - 1:
            continue
        up_a, up_f = ancestors(a), ancestors(f)
        common = next((k for k in up_f if k in up_a), None)
        if common is None or not _same_region(calls[common], first):
            continue  # (a region its common ancestor's forward enters: as for runs, _runs)
        above_f = up_f[:up_f.index(common)]  # f's ancestors below the common one
        between = up_a[:up_a.index(common)] + above_f
        if not all(map(plain, between)):
            continue
        inner = {calls[k].outputs[0][0] for k in ks if calls[k].outputs} - {None}
        allowed = {a, f, *ks, *above_f}
        if (any(last_read.get(key, 0) >= calls[f].seq_end for key in inner)
                or any(users.get(key, set()) - allowed for key in inner)):
            continue
        split = _SplitMlpSlice((current.calls[a].module, current.calls[f].module),
                               current.calls[common].module, parts,
                               [current.calls[k].module for k in between])
        found.append((a, split, {a, f, *ks, *between}))
    return found


def _functional_act(flow, s):
    """The module computing op number s when it is one of _FUNCTIONAL_ACTS, else None."""
    make = _FUNCTIONAL_ACTS.get(flow.ops[s][0])
    return make(flow.ops[s][4]) if make is not None else None


def _product_taken(flow, calls, s, d, between) -> bool:
    """Whether op number s is a multiplication whose result down (calls[d]) takes, through
    the children `between` that pass it on."""
    func, made = flow.ops[s][0], flow.ops[s][2]
    return (func is torch.ops.aten.mul.Tensor and bool(calls[d].inputs)
            and made[:1] == (calls[d].inputs[0][0],) and all(
                sliced._passes(c_m[1]) and c_m[0].inputs[:1] == calls[d].inputs[:1]
                for c_m in between))


def _separate_gated(flow, parent, calls, mods, own, d):
    """(gate, acts, up, True, gate's index) of a gated MLP whose children are gate, up and
    down (nn.Linear: mods[0], another, mods[d]), called in this order: the activations after
    gate ([gate, acts..., up], [up, gate, acts...]) or after both ([gate, up, acts...]:
    timm's SwiGLU), then children that pass the product on; or gate, up, ..., down with
    the activation one op of its own forward. Else None."""
    linears = [i for i in range(d + 1) if isinstance(mods[i], torch.nn.Linear)]
    if linears[1] == 1:  # gate is the one whose output the next child takes
        g = 1 if calls[2].input_id and calls[2].input_id == calls[1].output_id else 0
        u, k = 1 - g, 2
    else:
        g, u, k = 0, linears[1], 1
    acts, taken = [], calls[g].output_id
    while k < d and k != u and taken and calls[k].input_id == taken:
        acts.append(k)
        taken = calls[k].output_id
        k += 1
    if linears[1] != 1:
        if k != u or not acts:
            return None
        k = u + 1
    if not acts:  # the activation is an op of its own: which gate's output it takes
        g = next((i for i in (0, 1) if calls[i].outputs and len(own) == 2
                  and flow.ops[own[0]][1] == (calls[i].outputs[0][0],)), None)
        act = _functional_act(flow, own[0]) if g is not None else None
        if act is None:
            return None
        u, act_modules = 1 - g, [act]
        act_out = flow.ops[own[0]][2][0] if flow.ops[own[0]][2] else None
        own = own[1:]
    else:
        act_modules = [mods[i] for i in acts]
        act_out = calls[acts[-1]].outputs[0][0] if calls[acts[-1]].outputs else None
    chained = calls[g].input_id == calls[u].input_id == parent.input_id and all(
        calls[i].input_id == calls[j].output_id and calls[i].input_id
        for j, i in zip([g] + acts, acts))
    up_out = calls[u].outputs[0][0] if calls[u].outputs else None
    between = [(calls[i], mods[i]) for i in range(k, d)]
    if (not chained or len(own) != 1 or not _product_taken(flow, calls, own[0], d, between)
            or sorted(map(str, flow.ops[own[0]][1])) != sorted(map(str, (act_out, up_out)))):
        return None
    return mods[g], act_modules, mods[u], True, g


def _packed_gated(flow, parent, calls, mods, own, d):
    """(gate, acts, None, gate_first, 0) of a gated MLP whose first child, an nn.Linear,
    makes gate's and up's outputs as two halves of its own (timm's GluMlp, SwiGLUPacked;
    `g, u = w12(x).chunk(2, -1)`): the activations (children called in turn on one half, or
    one op of its own forward on it), children that pass the product of their output and the
    other half on, down (mods[d]). Its own ops besides the activation and the product only
    view gate's output (split, chunk). Else None."""
    first = calls[0]
    if (not first.input_id or first.input_id != parent.input_id or not first.outputs
            or len(first.output_view) != 3):
        return None
    whole, (offset, shape, strides) = first.outputs[0][0], first.output_view
    if not shape or shape[-1] % 2 or strides[-1] != 1:
        return None
    hidden = shape[-1] // 2

    def half(view):
        """0, 1: the first or second half of gate's output that view is; else None."""
        if len(view) != 3 or view[1] != shape[:-1] + (hidden,) or view[2] != strides:
            return None
        return {offset: 0, offset + hidden: 1}.get(view[0])

    acts, k = [], 1
    while k < d and not sliced._passes(mods[k]) and (
            calls[k].input_id == calls[k - 1].output_id if acts
            else calls[k].inputs[:1] and calls[k].inputs[0][0] == whole
            and half(calls[k].input_view) is not None):
        acts.append(k)
        k += 1
    if acts:
        g_half = half(calls[acts[0]].input_view)
        act_modules = [mods[i] for i in acts]
        act_out = calls[acts[-1]].outputs[0][0] if calls[acts[-1]].outputs else None
        rest = own
    else:  # one op of its own forward on a half
        ss = [s for s in own if flow.ops[s][0] in _FUNCTIONAL_ACTS]
        if len(ss) != 1 or flow.ops[ss[0]][1] != (whole,) or len(flow.views[ss[0]]) != 1:
            return None
        g_half = half(flow.views[ss[0]][0])
        act_modules = [_functional_act(flow, ss[0])]
        act_out = flow.ops[ss[0]][2][0] if flow.ops[ss[0]][2] else None
        rest = [s for s in own if s != ss[0]]
    products = [s for s in rest if flow.ops[s][0] is torch.ops.aten.mul.Tensor]
    if g_half is None or act_out is None or len(products) != 1:
        return None
    s = products[0]
    operands = dict(zip(flow.ops[s][1], flow.views.get(s, ())))
    between = [(calls[i], mods[i]) for i in range(k, d)]
    if (sorted(map(str, flow.ops[s][1])) != sorted(map(str, (act_out, whole)))
            or half(operands.get(whole, ())) != 1 - g_half
            or not _product_taken(flow, calls, s, d, between)):
        return None
    # The other ops: views of gate's output (they read it alone and make it alone).
    if any(flow.ops[o][1] != (whole,) or set(flow.ops[o][2]) != {whole}
           for o in rest if o != s):
        return None
    return mods[0], act_modules, None, g_half == 0, 0


def _inside(chains) -> set:
    """id() of every module of the sliced chains and of their submodules (and of those between
    a split MLP's parts and their common ancestor)."""
    return {id(sub) for c in chains for m in c.modules + getattr(c, "between", ())
            for sub in m.modules()}


def _runs_beside(runs, before: _Measured, after: _Measured, chains) -> List[List[int]]:
    """The runs found before slicing (indices into before's calls) that share no module with
    the sliced chains, as indices into after's calls (slicing drops the calls inside a chain's
    modules, e.g. a BatchNormAct2d's act)."""
    inside = _inside(chains)
    index = {id(c.module): k for k, c in enumerate(after.recorder.calls)}
    kept = []
    for run in runs:
        modules = [before.recorder.calls[k].module for k in run]
        if any(id(m) in inside for m in modules) or any(id(m) not in index for m in modules):
            continue
        kept.append([index[id(m)] for m in modules])
    return kept


def _slice_actions(chains, before: _Measured, after: _Measured, paths) -> List[FitAction]:
    """A FitAction per sliced chain: the saved bytes its calls' atoms lost, and its modules'
    forward time (what its backward recomputes)."""

    def spans(measured):
        rec, out = measured.recorder, {}
        for c in rec.calls:
            out[id(c.module)] = (c.begin, c.end)
        return rec.atom_bytes, out

    atoms_b, calls_b = spans(before)
    atoms_a, calls_a = spans(after)
    seconds = _module_seconds(before)
    actions = []
    for chain in chains:
        first, last = id(chain.modules[0]), id(chain.modules[-1])
        saved_b = sum(atoms_b[calls_b[first][0]:calls_b[last][1]])
        saved_a = sum(atoms_a[calls_a[first][0]:calls_a[last][1]])
        actions.append(FitAction(chain.path(paths), _slice_action(chain),
                                 max(0, saved_b - saved_a), _chain_seconds(chain, seconds)))
    return actions


def _slice_action(chain) -> str:
    return "sliced mlp" if isinstance(chain, (_MlpSlice, _GatedSlice)) else "sliced recompute"


def _module_seconds(measured: _Measured) -> dict:
    """{id(module): its forward time} in a recorded step."""
    return {id(c.module): c.seconds for c in measured.recorder.calls}


def _chain_seconds(chain, seconds: dict) -> float:
    """The forward time of a chain's modules (what its backward recomputes); seconds:
    _module_seconds of the recorded step."""
    return float(sum(seconds.get(id(m), 0.0) for m in chain.modules))


@dataclass
class _Uses:
    """What the ops after a module's call do with its inputs and outputs (_uses)."""

    begin: int  # its first atom
    end: int  # one past its last
    seq_begin: int  # the op number before its forward's first
    seq_end: int  # the op number after its forward's last
    # per tensor input: the numbers of the ops reading it, in order
    input_reads: tuple
    atom_seqs: list  # the recorder's: op r runs in atom a where atom_seqs[a] < r <= [a + 1]


def _uses(eager: _Recorder) -> dict:
    """Per module called once (its id()), from eager's dataflow: when each of its inputs is
    read (a later reader, e.g. a residual, gives that input a gradient before the module's
    backward). Checked against a later step's call of the module by its count of inputs
    (_problem). Empty without eager's dataflow."""
    flow = eager.dataflow
    if flow is None:
        return {}
    counts = _call_counts(eager.calls)
    uses = {}
    for c in eager.calls:
        if counts[id(c.module)] != 1:
            continue
        reads = tuple(flow.reads.get(key, ()) if key is not None else () for key, _ in c.inputs)
        uses[id(c.module)] = _Uses(c.begin, c.end, c.seq_begin, c.seq_end, reads,
                                   eager.atom_seqs)
    return uses


def _outlives(rec: _Recorder) -> dict:
    """Per storage identity, the last atom after which the step may still hold it: the last
    atom saving it, or a later one whose module call reads it (a checkpoint of that call
    would keep it); len(atoms) for the step's output. An output that a module's atoms save
    and that nothing after it saves, reads as a module's input or returns is freed in
    forward once its module is checkpointed, and the checkpoint keeps none of it: HRNet's
    incre_modules' Bottlenecks, read by an add alone (each was predicted its output's bytes
    high, HRNet-W18-small's least +2.1 %, until 2026-11-29), a transformers attention's
    weights, returned beside its output and dropped by its layer (GPT-J's least 16 % high
    until 2026-11-28)."""
    last = {}
    for key, atom in rec.saved.items():
        last[key] = max([atom] + rec.saved_again.get(key, []))
    for c in rec.calls:
        for key, _ in c.inputs:
            if key is not None:
                last[key] = max(last.get(key, -1), c.begin)
        if c.parent is None:
            for key, _ in c.outputs:
                if key is not None:
                    last[key] = len(rec.atom_bytes)
    return last


def _problem(measured: _Measured, root, runs=(), exclude=frozenset(), uses=None, memo=None,
             nest=True):
    """The planner's problem from a recorded step: base bytes, atoms, the candidates
    (modules called once, not the root, not writing their inputs in place, returning a
    tensor, keeping some bytes), their calls, and each atom's backward extra (what backward
    held above base and the saved bytes up to that atom: activation gradients and
    temporaries, largest in the early, wide layers, where checkpointed steps peak). exclude:
    id() of modules that are no candidates (those of sliced chains). uses: _uses of the
    step's eager forward (outputs that a checkpoint keeps not, though saved inside it; inputs
    whose gradients it holds apart). memo: a dict kept across the problems of one step's
    recordings (_chains_needed makes several), for what depends on the modules alone. nest:
    with compound candidates (_with_compounds; not for compiled steps, nor apply_plan's
    offers, which name each module's own checkpoint)."""
    rec = measured.recorder
    atoms = list(rec.atom_bytes)
    prefix = [0]
    for b in atoms:
        prefix.append(prefix[-1] + b)
    counts = _call_counts(rec.calls)
    # base: what the step holds besides saved tensors, at its highest where the per-atom
    # backward extras below do not count it: in the forward and the loss, and in backward
    # before backward first uses a saved tensor, all of them alive. (Not the whole step's
    # peak less all saved bytes: where that peak comes late in backward, e.g. in a sliced
    # MLP's backward, which makes its weights' gradients and a float32 input gradient, the
    # saved bytes of the atoms after it are freed by then, and every plan was predicted that
    # much too high: 8 % on a GPT-NeoX, 27 % on a GPT-2, 2026-11-28.)
    if rec.backward_levels:
        top = max(measured.forward_peak, rec.backward_start_level or 0)
    else:
        top = measured.forward_backward_peak
    base = max(0, top - prefix[-1])
    backward_extras = [max(0, rec.backward_levels.get(k, 0) - base - prefix[k + 1])
                       for k in range(len(atoms))]
    outlives = _outlives(rec)
    candidates, calls = [], []
    readers = {}  # key of an input no atom saves -> (its bytes, the candidates keeping it)
    backward_apart = []  # per candidate: the planner's backward_extra_bytes and _end
    run_calls, leftovers = [], {}
    paths = _paths(root) if runs else {}
    uses = uses or {}
    run_ends = {}  # id() of a run's call -> its first and last modules
    for run in runs:
        first, last = rec.calls[run[0]], rec.calls[run[-1]]
        candidate = _Run((rec.calls[k].module for k in run), first.parent.module)
        candidate.where = candidate.path(paths)
        changed = {}
        for k in run:
            changed.update(rec.calls[k].changed_buffers)
        call = _Call(candidate, first.begin, last.end,
                     seconds=sum(rec.calls[k].seconds for k in run),
                     inputs=first.inputs, outputs=last.outputs,
                     changed_buffers=tuple(changed.items()))
        # The last module's input, made inside the run and saved by none of its atoms: the
        # parent's forward still holds it when the run ends (as nn.Sequential's loop and the
        # checkpoint's chain do while the last module runs), so the measured level there
        # counts it although the run leaves nothing of it (below).
        ends = {key for key, _ in first.inputs} | {key for key, _ in last.outputs}
        leftovers[id(call)] = sum(dict(
            (key, n) for key, n in last.inputs
            if key is not None and key not in ends and key not in rec.saved
            and key not in rec.preexisting).values())
        run_calls.append(call)
        run_ends[id(call)] = (first.module, last.module)
    for c in sorted(rec.calls + run_calls, key=lambda c: (c.begin, -c.end)):
        if (c.module is root or counts.get(id(c.module), 1) != 1 or c.mutates_input
                or not c.outputs or id(c.module) in exclude):
            continue
        span = prefix[c.end] - prefix[c.begin]
        if span <= 0:
            continue
        kept = 0  # bytes a checkpoint of it keeps: its new inputs, and outputs saved inside it
        held = 0  # of those, inputs that none of its atoms saves (alive through its backward)
        seen = set()
        for key, nbytes in c.inputs:
            if key is None or key in seen or key in rec.preexisting:
                continue
            seen.add(key)
            atom = rec.saved.get(key)
            if atom is None or atom >= c.begin:
                kept += nbytes
            if atom is None:
                held += nbytes
                readers.setdefault(key, (nbytes, []))[1].append(len(candidates))
        head, tail = run_ends.get(id(c), (c.module, c.module))
        head, tail = uses.get(id(head)), uses.get(id(tail))
        for key, nbytes in c.outputs:
            if key is None or key in seen:
                continue
            seen.add(key)
            atom = rec.saved.get(key)
            if atom is not None and c.begin <= atom < c.end and outlives.get(key, -1) >= c.end:
                kept += nbytes
        # The gradients its checkpoint's backward makes for inputs that an op after it reads
        # (a residual's add, which gave them a gradient already): the checkpoint hands them
        # on whole once its backward is done, where autograd would have summed each into that
        # gradient in place (the last of a model's attentions, its backward the step's peak,
        # was predicted its input's gradient low). Alive from the backward of the last of its
        # atoms reading them on, through that of the atoms before it: `until` (a DenseNet
        # layer's concatenation of its block's maps, in its first atom, holds none apart).
        apart, until, held_apart = 0, 0, set()
        if (head is not None and tail is not None and len(head.input_reads) == len(c.inputs)
                and tail.end - head.begin == c.end - c.begin):
            for (key, _), grad, reads in zip(c.inputs, c.input_grad_bytes, head.input_reads):
                if key is None or not grad or key in held_apart or not reads:
                    continue
                inside = [r for r in reads if head.seq_begin < r < tail.seq_end]
                if reads[-1] < tail.seq_end or not inside:
                    continue  # not read after it, or not inside it
                last = bisect.bisect_left(head.atom_seqs, inside[-1]) - 1  # (eager's atom)
                if last == head.begin:
                    continue  # read by its first atom alone
                held_apart.add(key)
                apart += grad
                until = max(until, c.begin + last - head.begin)
        # What its recompute holds besides base, the kept bytes before it, its atoms' saved
        # bytes and its held inputs: its recomputed output (memlean.checkpoint frees it once
        # its nodes hold what they need; one that its own atoms saved is in span already);
        # at the recompute's highest, what its forward held above what it left (an
        # intermediate alive while the next op makes the output, e.g. a SiLU's output while a
        # scaling makes the block's; measured against all it left, bytes autograd keeps
        # outside saved tensors included, so never more than it holds; for a run, less the
        # last module's input the parent still held there: a Table-like last module's input
        # and temporary were counted 262,112-524,288 bytes low, 2026-11-28); a copy of its buffers
        # (put back after it); and from its start, what backward brings to it: the gradient
        # of its output and the parameter gradients made by then (the bytes above base and
        # the saved bytes when backward first reached its atoms in the measured step;
        # negative where base, the eager peak's catch-all, counts more than was alive then:
        # the sum is kept >= 0). The backward through it then holds what backward held there
        # without checkpoints (the planner's per-atom backward extras).
        extra = sum(n for key, n in dict(c.outputs).items()
                    if key is not None and not c.begin <= rec.saved.get(key, -1) < c.end)
        if c.end < len(rec.forward_starts):
            extra += max(0, max(rec.forward_peaks[c.begin:c.end]) - rec.forward_starts[c.end]
                         + leftovers.get(id(c), 0))
        reached = [a for a in range(c.begin, c.end) if a in rec.backward_entries]
        if reached:
            # (Where its last atoms save nothing, backward ran them before it reached atom a:
            # the level where it reached the call's output, if lower; a Sequential or run
            # ending in the call that made it has the same output.)
            a = max(reached)
            level = rec.backward_entries[a]
            reached_at = rec.reached.get(c.outputs[0][0]) if len(c.outputs) == 1 else None
            if a < c.end - 1 and reached_at is not None:
                level = min(level, reached_at)
            extra = max(0, extra + level - base - prefix[a + 1])
        extra += _memoized(memo, ("buffers", c.module), lambda m=c.module: sum(
            b.numel() * b.element_size() for b in _buffers_of(m)))
        # The copies of the buffers its forward changed (a spectral norm's vectors, an
        # observer's statistics), kept from its forward to the end of its backward so that
        # the recompute begins where the forward did: kept, and held as its unsaved inputs
        # are, through the recompute and the backward through it.
        rewind = sum(dict(c.changed_buffers).values())
        kept += rewind
        held += rewind
        candidates.append((c.begin, c.end, max(0, span - kept), extra, held))
        backward_apart.append((apart, until))
        calls.append(c)
    candidates = [(b, e, freed, s, extra, held)
                  for (b, e, freed, extra, held), s in zip(candidates,
                                                           _twin_seconds(calls, memo))]
    # Inputs that several candidates keep (a DenseNet layer's input is the list of its block's
    # earlier feature maps, which no op saves): each counts them, but they live once, and the
    # planner's predictions count them once (ops/fit/planner.h, "Shared inputs"; DenseNet-121's
    # least was predicted 6 % high without, 2026-11-28).
    shared = [(n, ks) for n, ks in readers.values() if len(ks) > 1]
    deferred = [rec.deferred.get(k, 0) for k in range(len(atoms))] if rec.deferred else []
    problem = _Problem(base, atoms, candidates, calls, backward_extras, shared, backward_apart,
                       deferred=deferred)
    return _with_compounds(problem) if nest else problem


def _with_compounds(problem):
    """`problem` with compound candidates (checkpoints nested in a checkpoint, to any depth):
    memlean::fit::with_compounds (ops/fit/planner.h, the planner of both languages) plans
    them, each candidate's sub-problem at its least peak; here each gets its call, whose
    module is a _Nest of the candidate's module (or run) and those of its inner checkpoints.
    A run inside a candidate nests where the run's parent forward runs in the candidate's
    recompute, or where the candidate is a run of the same parent, whose chain calls the
    inner run's modules in turn (_CHAINS; ResNet-50's least, batch 32 with runs: from
    865,023,248 to 839,616,784 predicted). Nowhere else does a recompute run a run's modules
    as one (before _CHAINS, a run inside a sibling run was recomputed module by module, and
    measured above its prediction)."""
    calls = list(problem.calls)
    under = []  # per candidate: id() of the parents whose runs its recompute runs as one
    for c in calls:
        outer = c.module
        mine = {id(m) for part in (outer.modules if isinstance(outer, _Run) else (outer,))
                for m in part.modules()}
        if isinstance(outer, _Run):
            mine.add(id(outer.parent))
        under.append(mine)
    runs = [(j, id(c.module.parent)) for j, c in enumerate(calls) if isinstance(c.module, _Run)]
    excluded = [[j for j, parent in runs if parent not in mine] for mine in under]
    candidates, shared, apart, nested, made = _C.fit.with_compounds(
        problem.base, problem.atoms, problem.candidates, excluded, **problem.options)
    if not made:
        return problem
    for outer, inner in made:
        parts, costs, depths = [], [], []  # (inside out: an inner one's parts, then its outer)
        for j in inner:
            parts += _parts(calls[j].module)
            costs += _part_costs(calls[j].module, candidates[j])
            depths += [d + 1 for d in _part_depths(calls[j].module)]
        total = candidates[len(calls)][3]
        calls.append(replace(calls[outer], module=_Nest(
            calls[outer].module, parts, costs + [candidates[outer][2:4]], depths),
            seconds=total))
    return replace(problem, candidates=candidates, calls=calls, shared=shared, apart=apart,
                   nested=nested)


def _without_compounds(problem):
    """`problem` with its plain candidates alone (_with_compounds appends the compounds)."""
    plain = sum(n < 0 for n in problem.nested)
    shared = [(n, [k for k in ks if k < plain]) for n, ks in problem.shared]
    return replace(problem, candidates=problem.candidates[:plain], calls=problem.calls[:plain],
                   shared=[(n, ks) for n, ks in shared if len(ks) > 1],
                   apart=problem.apart[:plain], nested=())


@dataclass
class _Problem:
    """The planner's problem (ops/fit/planner.h) and the module call of each candidate."""

    base: int
    atoms: list
    candidates: list  # (begin, end, freed_bytes, seconds, recompute_extra_bytes, input_bytes)
    calls: list
    backward_extras: list
    shared: list = ()  # (bytes, [candidate, ...]): inputs several candidates keep
    apart: list = ()  # per candidate: (gradients held apart through its backward, until)
    nested: list = ()  # per candidate: a compound's nested peak (_with_compounds), else -1
    deferred: list = ()  # per atom (or none): the planner's atom_deferred_bytes

    @property
    def options(self) -> dict:
        """The planner's optional arguments for this problem (_C.fit's keywords)."""
        return dict(atom_backward_extra_bytes=self.backward_extras,
                    shared_inputs=[(n, list(ks)) for n, ks in self.shared],
                    candidate_backward_extras=list(self.apart),
                    candidate_nested_peaks=list(self.nested),
                    atom_deferred_bytes=list(self.deferred))


def _memoized(memo, what, make):
    """make(), kept in `memo` (a dict, or None: not kept) under `what`, (a name, a module or
    run): by the identities of its modules."""
    if memo is None:
        return make()
    name, module = what
    key = (name, type(module), tuple(map(id, module.modules)) if isinstance(module, _Run)
           else id(module))
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _twin_seconds(calls, memo=None) -> List[float]:
    """Each call's recompute time, the same for calls that do the same work (same module
    class, parameter shapes, input and output sizes): their mean. The repeated blocks of a
    model cost the same, and timing noise must not decide which of them is recomputed; the
    planner then breaks the tie by the lower peak, so the plan depends on the budget alone,
    not on the noise of one measurement (a fitted peak that rose as the budget fell came
    from that)."""
    signatures = [(tuple(map(type, c.module.modules)) if isinstance(c.module, _Run)
                   else type(c.module),
                   _memoized(memo, ("parameters", c.module), lambda m=c.module: tuple(
                       (tuple(p.shape), p.dtype) for p in m.parameters())),
                   tuple(n for _, n in c.inputs), tuple(n for _, n in c.outputs)) for c in calls]
    groups = {}
    for signature, c in zip(signatures, calls):
        groups.setdefault(signature, []).append(c.seconds)
    return [float(sum(groups[s]) / len(groups[s])) for s in signatures]


def fit(model: torch.nn.Module, example_inputs, budget_bytes, *,
        loss_fn: Optional[Callable] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        compile=False, runs: bool = False, keep_grads: bool = False) -> FitPlan:
    """Make one training step of ``model`` on batches like ``example_inputs`` peak at or
    under ``budget_bytes`` on the model's device, changing the model in place.

    Args:
        model (nn.Module): the model, on its training device (all parameters on one device).
        example_inputs (Tensor, tuple or dict): the forward's arguments (a dict: its keyword
            arguments, e.g. ``{"input_ids": ids, "attention_mask": mask}``), a batch of the
            size you will train with, on the model's device.
        budget_bytes (int or str): the peak of one whole training step, in bytes, or a
            string such as ``"6GiB"``, ``"512MiB"``, ``"2.5GB"``.
        loss_fn (callable, optional): ``loss_fn(output) -> scalar``. Default: the sum of the
            output's floating-point tensors.
        optimizer (torch.optim.Optimizer, optional): stepped in the measured steps (its state
            is part of the step's memory); its state is put back afterwards.
        compile (bool or dict): the model will train as ``torch.compile(model, **compile)``
            (True: ``torch.compile(model, dynamic=False)``): fit measures every step it
            decides on that way (compiling afresh for each plan, ``torch._dynamo.reset()``
            before each and after the last), so the budget holds for the compiled step: first
            unchanged, then with the Swish swap (it still saves memory where the plan's
            checkpoints break the graph), then each plan. Shapes are static
            (``dynamic=False``) unless the dict sets ``dynamic``: fit measures the one example
            batch; compile the fitted model the same way (docs/fit.md says why).
            Default False: the budget is for eager steps.
        runs (bool): also checkpoint runs of sibling module calls as one (a stretch of a
            block's forward, e.g. an inverted residual block's middle without its 1x1
            convolutions; two blocks of a stage): lower peaks at less recompute in eager
            mode (EfficientNet-B0: docs/results.md). Eager only: under torch.compile the
            runs are not checkpointed (they split inductor's graphs, which then kept more
            than the runs saved), so a model fitted with runs and then compiled peaks above
            the budget (39-84 % on the tests' ConvNet: docs/fit.md; ``print(plan)`` says
            when the plan checkpoints runs); ignored with
            ``compile``. Default False. docs/fit.md says where a run is one.
        keep_grads (bool): the training loop keeps the parameters' gradients allocated
            between steps: ``optimizer.zero_grad(set_to_none=False)``, or gradient
            accumulation (each micro-batch's backward adds to gradients already there). fit
            then measures steps that begin with the gradients alive (zeroed) and end with
            ``zero_grad(set_to_none=False)``: the step's peak is higher by up to the
            gradients' bytes (all of them are alive at forward's end, where the loop that
            frees them has few), and a budget made for one loop does not hold for the other.
            Default False (torch's default, ``set_to_none=True``).

    Returns:
        FitPlan: what changed, the measured and predicted peaks, undo().

    Raises:
        FitError (a ValueError): the budget is below the least peak fit reaches; the message
            and ``least_peak_bytes`` name it. The model is left unchanged.
        ValueError / TypeError: bad arguments, named (a budget of 0, negative or
            unparsable; a model without parameters; an output without a floating-point
            tensor; a batch on another device than the model).

    Below the least peak that checkpoints reach (CPU eager steps), fit also recomputes the
    model's chains of channelwise modules (an inverted residual block's expansion,
    BatchNorm, activation and depthwise convolution) one slice of channels at a time
    (memlean.sliced_chain; action "sliced recompute") and its MLPs one slice of hidden
    features at a time (memlean.sliced_mlp, sliced_gated_mlp; plain, gated, and split between
    two modules as in transformers' encoders; action "sliced mlp"), those the budget needs
    (the ones saving the most first: each costs its forward again), then plans checkpoints
    again, and below that slices the chains behind 1x1 heads finer (fewer bytes, more time):
    docs/fit.md, steps 5, 5a, 5b and 5c.

    fit runs a few real training steps (forward, backward, optimizer step) to measure:
    one eager step (when the optimizer has no state yet, after an optimizer step on zero
    gradients that gives it its state, or a real step where that would differ and on CUDA), one after the
    swaps (predicted instead where only lean backwards were swapped and the step would only
    lead to slicing), one per slicing tried (the finer slicing predicted instead where its
    prediction holds; all the chains after fewer, where the fewer do not fit), and one per
    plan tried (with compile: two per plan, the first
    compiling). Everything the steps change is put back.
    """
    started = time.perf_counter()
    budget = parse_budget(budget_bytes)
    inputs, loss_fn, device = _check(model, example_inputs, loss_fn, optimizer)
    compile_options = _compile_options(compile, _NAME)
    if not isinstance(runs, bool):
        raise TypeError(f"{_NAME}: runs must be a bool, got {type(runs).__name__}")
    if not isinstance(keep_grads, bool):
        raise TypeError(f"{_NAME}: keep_grads must be a bool, got {type(keep_grads).__name__}")
    saved = _Saved(model, optimizer, device, inputs)
    fitting = None  # (the call, once its step is made)
    try:
        model.train()
        step = _Step(model, inputs, loss_fn, optimizer, device, keep_grads)
        for p in step.params:
            p.grad = None  # the caller's stay in `saved`, untouched (keep_grads zeroes in place)
        fitting = _Fitting(step, saved, budget, compile_options, runs, started)
        return fitting.run()
    except BaseException:
        if fitting is not None:
            fitting.undo_all()
        saved.restore()
        raise
    finally:
        if compile_options is not None:
            import torch._dynamo

            torch._dynamo.reset()  # fit's compiled code: the caller compiles the fitted model


class _Fitting:
    """One call of memlean.fit: its steps (docs/fit.md numbers them) and the state they share.

    run() takes them in turn: the eager step measured (1); the swaps, no recompute (_swap:
    2); checkpoints alone, planned (3) and verified and tightened (4) by checkpointed(); the
    chains and MLPs recomputed in slices, then checkpoints again (_slice and _sliced: 5, 5c);
    the chains' finer slices (_finer: 5b); checkpoints alone after all where slicing went no
    lower (_sliced). Each returns a FitPlan where the step fits, else the least peak it
    measured; run() raises the FitError. undo_all() undoes what they changed (fit calls it on
    any exception).

    State: `current` is the step the search measures plans against (its optimizer peak);
    `lean_step` the step after the swaps (`deferred`: predicted, not measured, until
    measure_lean()); `problem`, `floor` and `empty_peak` are checkpoints alone's on the lean
    step; `chains` the chains recomputed in slices, once found (empty where slicing is given
    up); `actions` and `undo_steps` what was changed so far."""

    def __init__(self, step: _Step, saved: _Saved, budget: int, compile_options, runs: bool,
                 started: float):
        self.step, self.model, self.saved = step, step.model, saved
        self.started = started
        # On CUDA every decision is made against the budget less a margin (_cuda_margin), and
        # the least a FitError names includes twice that margin: fit's measured step is one
        # history of the caching allocator, the caller's steps are others.
        self.requested = budget
        self.budget = budget - _cuda_margin(budget) if step.cuda else budget
        self.compile_options = compile_options
        # With compile=: every decision on the compiled step (compiled afresh each time).
        self.compiled = compile_options is not None
        # Plans whose checkpoints run eagerly between compiled graphs (search(); the compiler
        # failed on them traced: _measure_plan). Not traced at all for dynamo's "eager"
        # backend: it runs the traced region as torch's eager checkpoint, whose recompute
        # repeats the region's buffer updates (a BatchNorm's: its backward then fails).
        self.untraced = set()
        self.trace = self.compiled and compile_options.get("backend", "inductor") != "eager"
        self.runs = runs
        self.undo_steps: List[Callable] = []
        self.actions: List[FitAction] = []
        # Set by run(): the eager step, the modules no checkpoint may hold, the fixed bytes,
        # the unchanged step's peak (compiled where compile= is given).
        self.eager: Optional[_Measured] = None
        self.unversioned: set = set()
        self.fixed = self.plain = 0
        # Set by _swap(): whether lean backwards apply (CPU eager steps), the lean modules,
        # the model's paths, eager's uses (_uses), the runs found; the lean step (`deferred`:
        # its prediction, until measure_lean()); `current`; checkpoints alone's problem,
        # floor (set by _slice()) and empty plan's peak; where the lean actions go.
        self.lean = False
        self.leans: list = []
        self.paths: dict = {}
        self.uses: dict = {}
        self.runs_found: list = []
        self.lean_step: Optional[_Measured] = None
        self.deferred: Optional[_Measured] = None
        self.current: Optional[_Measured] = None
        self.problem = None
        self.floor: Optional[int] = None
        self.empty_peak = 0
        self.lean_actions = 0
        self.lean_kept = None  # the deferred lean modules, (path, action, bytes), once kept
        self.chains: list = []  # the chains recomputed in slices (_slice), once found

    def undo_all(self) -> None:
        for undo in reversed(self.undo_steps):
            undo()
        self.undo_steps.clear()

    def unwrap(self, wraps) -> None:
        """Undo the chains' wrappers `wraps` (of undo_steps)."""
        for w in reversed(wraps):
            w()
            self.undo_steps.remove(w)

    def done(self, peak, predicted, eager_only_runs=0, traced=False) -> FitPlan:
        """The plan of what was changed so far, with the training state put back (traced:
        its checkpoints are traced into the compiled graph; its chains are sliced finer where
        their `fine` is set, as only while step 5b's plans are tried). Deferred lean modules
        not kept yet (a plan on the sliced step predicted: _sliced_predicted) are kept as the
        plan's steps ran them."""
        if self.deferred is not None and self.lean_kept is None:
            self.keep_leans(_inside(self.chains))
        self.saved.restore()
        plan = FitPlan(self.requested, peak, predicted, self.fixed, self.eager.peak,
                       self.actions, self.undo_steps, self.step.device,
                       time.perf_counter() - self.started, eager_only_runs,
                       fine_slices=any(c.fine for c in self.chains), compiled=self.compiled,
                       traced=traced)
        plan._applied_to(self.model)
        return plan

    def run(self) -> FitPlan:
        step = self.step
        self.eager, self.unversioned = _eager_step(self.model, step, self.saved,
                                                   step.optimizer)
        self.fixed = self.eager.resident
        self.plain = (_measure_plan(step, [], (), self.compile_options) if self.compiled
                      else self.eager.peak)
        if self.plain <= self.budget:
            return self.done(self.plain, self.plain)
        plan = self._swap()
        if plan is not None:
            return plan
        plan, least = self._slice()
        if plan is not None:
            return plan
        raise self._error(least)

    def runs_of(self, measured) -> list:
        # Runs of sibling modules are eager-only (not checkpointed under torch.compile).
        return (_runs(self.eager.recorder, measured.recorder, self.model,
                      exclude=self.unversioned) if self.runs and not self.compiled else [])

    def _swap(self) -> Optional[FitPlan]:
        """2. Swish and BatchNorm, no recompute (the lean BatchNorm backward: CPU eager steps
        only; compiled, torch's runs): the plan where the step so fits, else None with
        checkpoints alone's problem made (3)."""
        model, step, eager = self.model, self.step, self.eager
        rec = eager.recorder
        self.lean = not step.cuda and not self.compiled
        swapped = _swap_swish(model, rec, True, self.undo_steps, self.saved.training)
        self.leans = _lean_modules(model, rec, self.undo_steps) if self.lean else []
        # Modules called with an object whose state their forward may change (a key-value
        # cache): no checkpoint holds them (_opaque_argument says why).
        self.paths = _paths(model)
        self.unversioned = self.unversioned | _stateful_modules(eager.recorder, self.paths)
        self.uses = _uses(eager.recorder)
        self.current = eager
        # The lean backwards alone (no Swish swapped), predicted rather than measured where
        # the step with them would only decide to slice (_lean_step_predicted); measure_lean()
        # measures it where a later decision needs it.
        if self.leans and not swapped:
            self.runs_found = self.runs_of(eager)  # (the prediction's: its recorder is eager's)
            self.deferred = _lean_step_predicted(eager, model, self.budget, self.runs_found,
                                                 self.unversioned, self.uses)
        if self.deferred is not None:
            self.current = self.deferred
        elif swapped or self.leans:
            try:
                self.current = step.run(record=True)
            except RuntimeError as e:
                if "inplace operation" not in str(e):
                    raise
                # The dataflow check missed something (an op it cannot see): no in-place swap.
                self.undo_all()
                swapped = _swap_swish(model, rec, False, self.undo_steps, self.saved.training)
                self.leans = _lean_modules(model, rec, self.undo_steps) if self.lean else []
                self.current = step.run(record=True) if swapped or self.leans else eager
            swapped += _keep_taken(self.leans, self.undo_steps)
            self.actions += _swap_actions(swapped, max(0, eager.peak - self.current.peak))
        self.empty_peak = self.current.peak if not self.compiled else (
            _measure_plan(step, [], (), self.compile_options) if swapped else self.plain)
        if self.empty_peak <= self.budget:
            return self.done(self.empty_peak, self.empty_peak)
        self.lean_step = self.current
        if self.deferred is None:
            self.runs_found = self.runs_of(self.current)
        self.problem = _problem(self.current, model, self.runs_found, exclude=self.unversioned,
                                uses=self.uses, nest=not self.compiled)
        self.lean_actions = len(self.actions)  # where the deferred lean modules' actions go
        return None

    def keep_leans(self, inside=frozenset()) -> None:
        """Keep the deferred lean modules as _keep_taken keeps them after a step that ran
        them; their actions' saving 0 until measure_lean() measures it. Once: a later call
        (measure_lean's, a second slicing's) keeps nothing more."""
        if self.lean_kept is not None:
            return
        self.lean_kept = _keep_taken(self.leans, self.undo_steps, inside)
        self.actions[self.lean_actions:self.lean_actions] = _swap_actions(self.lean_kept, 0)

    def measure_lean(self, wrapped=None) -> None:
        """Measure the lean step where it was predicted (deferred): its problem, floor and
        empty plan's peak replace the predicted ones, and the lean modules' actions get its
        measured saving. The chains' wrappers (`wrapped`) are off while it runs."""
        if self.deferred is None:
            return
        self.deferred = None
        self.unwrap(wrapped or [])
        self.lean_step = self.step.run(record=True)
        if wrapped:
            wrapped[:] = [_wrap(c) for c in self.chains]
            self.undo_steps.extend(wrapped)
        self.keep_leans()
        at = self.lean_actions
        self.actions[at:at + len(self.lean_kept)] = _swap_actions(
            self.lean_kept, max(0, self.eager.peak - self.lean_step.peak))
        self.problem = _problem(self.lean_step, self.model, self.runs_found,
                                exclude=self.unversioned, uses=self.uses, nest=not self.compiled)
        self.floor = _floor(self.problem, self.lean_step) if self.chains else None
        self.empty_peak = self.lean_step.peak

    def search(self, problem, empty_peak, seen=None):
        """The search (ops/fit/search.h, the one loop of both languages): plan, measure each
        plan, lower the target by any excess, bisect back up; the fastest plan measured to
        fit, never one over the budget. Returns (chosen or None, peak, predicted, least).
        With compile=: first with the checkpoints traced into the compiled graph (faster), if
        the planner's least-peak plan fits so; if no plan fits so, again with them run
        eagerly between graphs (the compiler's regions may keep more: EfficientNet-B0's least
        compiled peak was 12 % lower so, docs/fit.md); plans of that pass go to `untraced`."""
        if not self.trace:
            return self.search_as(problem, empty_peak, False, {}, seen)
        # The planner's least-peak plan first, traced: over the budget, the traced search
        # would only compile plans that do not fit (EfficientNet-B0: 298 s), so the second
        # search runs at once.
        least_plan = tuple(_C.fit.least_peak_plan(
            problem.base, problem.atoms, problem.candidates, **problem.options)[1])
        probe = _measure_plan(self.step, problem.calls, least_plan, self.compile_options,
                              self.untraced)
        found = (None, probe, 0, probe)
        if probe <= self.budget:
            found = self.search_as(problem, empty_peak, True, {least_plan: probe})
            if found[0] is not None:
                return found
        again = self.search_as(problem, empty_peak, False, {}, seen)
        return again[:3] + (min(found[3], again[3]),)

    def search_as(self, problem, empty_peak, traced, known, seen=None):
        """search() with the checkpoints traced or not; known: chosen -> peak measured
        already (so); seen (where given): _PlansSeen, across searches of one step."""
        measured = {}  # chosen -> measured peak, every plan the search measured

        def measure(chosen):
            key = tuple(chosen)
            if not traced:
                self.untraced.add(key)
            wraps = _checkpointed_modules(problem.calls, chosen) if seen is not None else None
            if key in known:
                measured[key] = known[key]
            elif wraps in (seen or {}):
                measured[key] = seen[wraps]
            else:
                measured[key] = _measure_plan(self.step, problem.calls, chosen,
                                              self.compile_options, self.untraced)
            if seen is not None:
                seen[wraps] = measured[key]
                if seen.strict and measured[key] > max(
                        self.current.optimizer_peak, _C.fit.predicted_peak(
                            problem.base, problem.atoms, problem.candidates, chosen,
                            **problem.options)):
                    raise _Mispredicted
            return measured[key]

        found, chosen, peak, predicted, _, least, _ = _C.fit.search(
            problem.base, problem.atoms, problem.candidates, self.budget,
            self.current.optimizer_peak, empty_peak, measure, **problem.options)
        signature = _signature(problem, self.compile_options) + (traced,)
        remembered = _LEAST_PLANS.get(self.model, {}).get(signature)
        if not found and remembered is not None and remembered[1] <= self.budget:
            # The plan that reached the least an earlier FitError named for this step.
            chosen = list(remembered[0])
            peak = measure(chosen)
            found = peak <= self.budget
            predicted = _C.fit.predicted_peak(
                problem.base, problem.atoms, problem.candidates, chosen, **problem.options)
        if found:
            return chosen, peak, predicted, least
        reached = [c for c, p in measured.items() if p == least]
        if reached:
            _LEAST_PLANS.setdefault(self.model, {})[signature] = (reached[0], least)
        return None, peak, predicted, least

    def checkpointed(self, problem, empty_peak, taken=(), eager_only=0, seen=None):
        """search(problem): (the plan, with the actions `taken` to reach this step, its
        checkpoints wrapped; or None, the least peak the search measured)."""
        chosen, peak, predicted, least = self.search(problem, empty_peak, seen)
        plain = _without_compounds(problem) if chosen is None and problem.nested else None
        if plain is not None and least > _least_predicted(plain, self.current):
            # Where plans with compounds measured above their predictions (a compound's nested
            # peak is a model too), the search can walk past plain plans that fit: timm's
            # NF-ResNet-26 (bfloat16, channels_last, runs, batch 4, 64²) named a least 2 %
            # above the plain search's. Where the least measured is above what plain plans
            # are predicted to reach, their search, and the lower least.
            problem = plain
            chosen, peak, predicted, plain_least = self.search(problem, empty_peak, seen)
            least = min(least, plain_least)
        if chosen is None:
            return None, least
        self.actions.extend(taken)
        traced = self.compiled and tuple(chosen) not in self.untraced
        calls = problem.calls
        self.undo_steps.extend(_wrap(calls[i].module, traced=_traced(calls[i], traced))
                               for i in chosen)
        self.actions.extend(_checkpoint_actions(calls, problem.candidates, chosen, self.paths))
        return self.done(peak, max(predicted, self.current.optimizer_peak), eager_only + sum(
            isinstance(m, _Run) for i in chosen for m in _parts(calls[i].module)), traced), least

    def _slice(self):
        """3 and 4: checkpoints alone; 5: below what they reach, chains of channelwise modules
        (and MLPs) recomputed slice by slice (memlean.sliced; CPU eager steps), then
        checkpoints again (_sliced). (plan, least) or (None, least)."""
        budget = self.budget
        self.chains = (_slices(self.eager.recorder, self.current.recorder, self.model,
                               self.unversioned) if self.lean else [])
        # A budget well below the least peak the planner predicts for checkpoints alone (its
        # predictions are exact in most steps: docs/fit.md) skips their search, which would
        # only measure plans that do not fit; it runs after all if slicing goes no lower.
        self.floor = _floor(self.problem, self.current) if self.chains else None
        least = every_sliced = None
        if self.chains and budget < self.floor:
            # Slicing predicted, at its lowest (_as_sliced), to go no lower than checkpoints
            # alone (ResNet-50 with runs, whose blocks' runs hold its chains): neither sliced
            # step is measured (each as long as an eager step), only checkpoints alone.
            every_sliced = _sliced_problem(self.current, self.chains, self.model,
                                           self.runs_found, self.unversioned, self.uses)
            bound = _sliced_floor(every_sliced)
            if bound is not None and bound >= self.floor:
                self.chains = []
        if not (self.chains and budget < self.floor):
            plan, least = self.checkpointed(self.problem, self.empty_peak)
            if plan is not None:
                return plan, least
        if not self.chains:
            return None, least
        every = self.chains
        self.chains = _chains_needed(self.current, every, self.model, self.runs_found,
                                     self.unversioned, self.uses, budget, every_sliced)
        wraps = []
        plan, least2 = self._slicing(least, wraps)
        if plan is None and self.chains and len(self.chains) < len(every):
            # The fewer chains, measured, did not fit (5a predicts them at their lowest):
            # all of them, from the lean step again.
            self.unwrap([w for w in wraps if w in self.undo_steps])
            self.chains, self.current = every, self.lean_step
            plan, least3 = self._slicing(least, [])
            least2 = min(least2, least3)
        return plan, least2

    def _slicing(self, least, wraps):
        """5 with self.chains: the step with them sliced predicted (_sliced_predicted), else
        measured, then _sliced; their wrappers go to `wraps`. (plan, least) or (None, least)."""
        wraps.extend(_wrap(c) for c in self.chains)
        self.undo_steps.extend(wraps)
        seen = _PlansSeen()  # (plans measured on the predicted sliced step: not again)
        plan = self._sliced_predicted(seen)
        if plan is not None:
            return plan, plan.peak_bytes
        try:
            thin = self.step.run(record=True)
        except RuntimeError as e:
            # A sliced chain failed where its modules in turn ran (something its checks did
            # not foresee): fit goes on without slicing, and says so.
            self.unwrap(wraps)
            warnings.warn(f"{_NAME}: the step with {len(self.chains)} chain(s) recomputed in "
                          f"slices failed ({type(e).__name__}: {e}); fit goes on without "
                          f"slicing. Please report this.", RuntimeWarning, stacklevel=5)
            self.chains = []
            self.measure_lean()
            if least is None:
                return self.checkpointed(self.problem, self.empty_peak)
            return None, least
        return self._sliced(thin, wraps, least, seen)

    def _sliced_predicted(self, seen) -> Optional[FitPlan]:
        """5 without the sliced step measured (one step less, each as long as an eager step
        or longer: ViT-S at batch 32, 224², its sliced step 1.3x eager's): checkpoints searched
        on the step with self.chains sliced as _as_sliced predicts it from the step before,
        with what each chain's sliced backward holds measured on the chain alone (_chain_rise;
        exact to the byte on every chain tried: timm's ViT-S, EfficientNet-B0, MixNet-S,
        ConvNeXt-atto, MobileNetV3, fit_test's ViT), every plan measured as always. Tried where
        measuring the chains costs well below a step (equal chains measured once), the chains
        alone are predicted above the budget (a sliced step that fits is measured anyway: fit
        returns it as it is) and checkpoints are predicted to reach it; the first
        plan measured above its prediction ends it (_Mispredicted: the sliced step is measured
        then, and the plans measured here go to `seen`, not measured again), as does a search
        that finds no plan (the least a FitError names is one measured on the sliced step).
        Where the lean step was not measured (deferred: _lean_step_predicted) and its lean
        modules are depthwise convolutions (ConvNeXt's), their backward is measured alone
        too (exact to the byte on ConvNeXt-atto's; a lean BatchNorm's is not, beside the
        in-place ReLU after it: there, and where a lean BatchNorm is, the sliced step is
        measured), from the eager step. The plan, or None. Not under autocast or
        torch.compile, or off the CPU (where the chains run in turn)."""
        current = measured = self.current
        chains = self.chains
        if (self.compiled or self.step.cuda
                or not all(isinstance(c, (_Slice, _MlpSlice, _GatedSlice)) for c in chains)):
            return None
        deferred = self.deferred is not None
        if deferred:
            if any(action != "lean depthwise conv" for _, action, _, _ in self.leans):
                return None
            measured = self.eager  # (the deferred step is eager's at its lowest)
        rec = measured.recorder
        first = _first_calls(rec)
        calls = [first.get(id(c.modules[0])) for c in chains]
        inside = _inside(chains)
        lean_ids = {id(module) for _, _, _, (_, _, module) in self.leans} if deferred else ()
        lean_calls = [c for c in rec.calls if id(c.module) in lean_ids
                      and id(c.module) not in inside]
        if any(c is None or not c.context or c.context[2][0] or c.context[3][0]
               for c in calls + lean_calls):
            return None  # (no call: a chain not run; autocast on)
        keys = [_rise_key(chain, call) for chain, call in zip(chains, calls)]
        lean_keys = [_rise_key(_Run((c.module,), None), c) for c in lean_calls]
        if None in keys or None in lean_keys:
            return None
        # Worth it only where the chains alone, each kind once, cost well below the step
        # they spare (a step is about three forwards; each chain's forward, backward and
        # recompute about three of its forwards): ViT-S's 12 equal MLPs measure one; an
        # EfficientNet's chains, nearly all its forward and few equal, would cost 0.8 of the
        # step.
        seconds = _module_seconds(measured)
        distinct = dict(zip(keys, chains))
        distinct_leans = dict(zip(lean_keys, lean_calls))
        forward = sum(c.seconds for c in rec.calls if c.parent is None)
        if sum(3 * _chain_seconds(c, seconds) for c in distinct.values()) + sum(
                3 * c.seconds for c in distinct_leans.values()) > forward:
            return None
        runs = _runs_beside(self.runs_found, measured, measured, chains)

        def problem_of(sliced_step):
            return _problem(sliced_step, self.model, runs, exclude=inside | self.unversioned,
                            uses=self.uses)

        # (a lower bound, nothing measured for it: the chains' and lean modules' backward
        # holding nothing above the saved bytes)
        lowest = _as_sliced(measured, chains, [c.module for c in lean_calls])
        if lowest is None or _least_predicted(problem_of(lowest), lowest) > self.budget:
            return None
        rise = {k: _chain_rise(c, first[id(c.modules[0])]) for k, c in distinct.items()}
        # (its forward, the lean one, not the module's call: no hook of the user's runs on
        # the random input)
        rise.update({k: _backward_rise(c.module.forward, c, list(c.module.parameters()))
                     for k, c in distinct_leans.items()})
        if None in rise.values():
            return None
        as_sliced = _as_sliced(measured, chains, rises=[rise[k] for k in keys],
                               risen=[(c.begin, c.end, rise[k])
                                      for k, c in zip(lean_keys, lean_calls)])
        if as_sliced is None:
            return None
        problem = problem_of(as_sliced)
        empty = max(as_sliced.optimizer_peak, _C.fit.predicted_peak(
            problem.base, problem.atoms, problem.candidates, [], **problem.options))
        if empty <= self.budget or _least_predicted(problem, as_sliced) > self.budget:
            return None
        self.current = as_sliced
        seen.strict = True
        plan = None
        try:
            plan, _ = self.checkpointed(problem, empty, _slice_actions(
                chains, self.lean_step, as_sliced, self.paths), len(chains), seen)
        except _Mispredicted:
            pass
        finally:
            seen.strict = False
        if plan is None:
            self.current = current
        return plan

    def _sliced(self, thin, wraps, least, seen=None):
        """5. Checkpoints on the step with the chains sliced (`thin`, their wrappers `wraps`;
        `least`: checkpoints alone's, None where not searched), then 5b (_finer), then
        checkpoints alone where slicing went no lower than they are predicted to. seen: the
        plans _sliced_predicted measured on this sliced step (not measured again)."""
        model, budget, chains = self.model, self.budget, self.chains
        if self.deferred is not None:
            self.keep_leans(_inside(chains))
        slice_actions = _slice_actions(chains, self.lean_step, thin, self.paths)
        if thin.peak <= budget:
            self.actions.extend(slice_actions)
            return self.done(thin.peak, thin.peak, len(chains)), least
        runs2 = _runs_beside(self.runs_found, self.current, thin, chains)
        problem2 = _problem(thin, model, runs2, exclude=_inside(chains) | self.unversioned,
                            uses=self.uses)
        self.current = thin  # (the step the search measures against)
        finer_possible = any(c.finer for c in chains)
        floor2 = _floor(problem2, thin)
        # Checkpoints alone, not searched (the budget is below their floor), predicted to go
        # lower than this slicing (where the bound above did not tell: a small ResNet's
        # chains' backward held more than it counts): its search would only measure plans
        # that go no lower; theirs follows below.
        if self.deferred is not None and self.floor <= floor2:
            self.measure_lean(wraps)  # (its floor, predicted at its lowest, cannot decide)
        worse = least is None and self.floor <= floor2
        bar = self.floor if worse else floor2  # the least the planner predicts so far
        if finer_possible:
            # Finer slices lower only what the backward through the chains holds: where the
            # planner's least goes no lower with none held there (_as_sliced on this step),
            # the finer step is not measured.
            finer_sliced = _sliced_problem(thin, chains, model, runs2, self.unversioned,
                                           self.uses)
            bound = _sliced_floor(finer_sliced)
            finer_possible = bound is None or bound < bar
        skipped = (finer_possible and budget < floor2) or worse  # (as for those above)
        least2 = thin.peak
        if not skipped:
            plan, least2 = self.checkpointed(problem2, thin.peak, slice_actions, len(chains),
                                             seen=seen)
            if plan is not None:
                return plan, least2
            least2 = min(least2, thin.peak)
        if finer_possible:
            plan, least2 = self._finer(thin, finer_sliced, least2, bar, skipped)
            if plan is not None:
                return plan, least2
            if skipped and least2 >= floor2 and not worse:
                # Finer slices went no lower than the first slicing is predicted to: its
                # search after all.
                plan, least3 = self.checkpointed(problem2, thin.peak, slice_actions,
                                                 len(chains))
                if plan is not None:
                    return plan, least3
                least2 = min(least2, least3)
        if self.deferred is not None and least is None and least2 >= self.floor:
            self.measure_lean(wraps)  # (as above)
        if least is None and least2 >= self.floor:
            # Slicing went no lower than checkpoints alone are predicted to: their search,
            # for the least it measures (and a plan, were the prediction high).
            self.unwrap(wraps)
            self.current = self.lean_step
            plan, least = self.checkpointed(self.problem, self.empty_peak)
            if plan is not None:
                return plan, least
        return None, least2 if least is None else min(least, least2)

    def _finer(self, thin, sliced, least2, bar, skipped):
        """5b. Finer slices behind 1x1 heads: fewer bytes, more time (each slice reads the
        head's whole input): only below what the first slicing (`thin`, as `sliced` predicts
        it at its lowest) reaches. `least2`: the least measured so far on it; `bar`: the least
        the planner predicts so far; `skipped`: the first slicing's search was skipped.
        (plan, least2) or (None, least2), the chains sliced as in `thin` again."""
        budget, chains = self.budget, self.chains
        for c in chains:
            c.fine = True
        # The finer step predicted, not measured, where it can be (_finer_predicted); measured
        # after all where a plan measures above its prediction, or no plan fits and the least
        # plan measured above the predicted least. Every plan returned or named is measured
        # either way.
        finer, problem3 = _finer_predicted(thin, sliced, budget)
        seen = _PlansSeen()  # (plans measured with the prediction: not again)
        for predicted in (True, False) if finer is not None else (False,):
            if not predicted:
                finer = self.step.run(record=True)
                if finer.peak <= budget:
                    self.actions.extend(_slice_actions(chains, self.lean_step, finer,
                                                       self.paths))
                    return self.done(finer.peak, finer.peak, len(chains)), least2
                problem3 = _problem(finer, self.model,
                                    _runs_beside(self.runs_found, self.lean_step, finer, chains),
                                    exclude=_inside(chains) | self.unversioned, uses=self.uses)
                least2 = min(least2, finer.peak)
            self.current = finer
            if _floor(problem3, finer) >= bar and skipped:
                break  # (the planner predicts no lower least than the first slicing's, which
                # was not searched: at its lowest if predicted)
            seen.strict = predicted
            try:
                plan, least3 = self.checkpointed(problem3, finer.peak, _slice_actions(
                    chains, self.lean_step, finer, self.paths), len(chains), seen)
            except _Mispredicted:
                continue  # (a plan measured above the prediction: the finer step)
            if plan is not None:
                return plan, least2
            least2 = min(least2, least3)
            if least3 <= _least_predicted(problem3, finer):
                break  # (the prediction held for the least plan: no lower least)
        for c in chains:
            c.fine = False
        self.current = thin
        return None, least2

    def _error(self, least) -> FitError:
        """The FitError naming `least`, the least step peak measured."""
        # The step as it was is one fit can return (the empty plan) where it fits: the least
        # named is never above it, even if what fit changed went no lower.
        least = min(least, self.plain)
        margin = ""
        if self.step.cuda:
            margin = (f" (the least measured, {_C.fit.describe_bytes(least)}, plus twice the "
                      f"margin fit keeps on CUDA)")
            least += 2 * _cuda_margin(least)
        requested = self.requested
        return FitError(
            f"{_NAME}: budget_bytes={requested} ({_gib(requested)}) is below the least step "
            f"peak memlean.fit reaches for this model and batch: "
            f"{_C.fit.describe_bytes(least)}{margin} "
            f"(in-place Swish where safe, lean BatchNorm and depthwise-convolution "
            f"backwards, {'sliced recompute, ' if self.chains else ''}and checkpoints"
            f"{', compiled with torch.compile' if self.compiled else ''}), measured; the eager "
            f"step peaks at {_C.fit.describe_bytes(self.eager.peak)}, of which "
            f"{_C.fit.describe_bytes(self.fixed)} are parameters, buffers, optimizer state "
            f"and the batch. Use a larger budget or a smaller batch.", requested, least)


_APPLY = "memlean.apply_plan"
_SLICE_ACTIONS = ("sliced recompute", "sliced mlp")


def _plan_dict(plan) -> dict:
    """The dict of a plan given to apply_plan: a FitPlan, its to_dict(), its to_json() text,
    or the path of a file to_json(path) wrote."""
    if isinstance(plan, FitPlan):
        return plan.to_dict()
    if isinstance(plan, (str, os.PathLike)) and not (isinstance(plan, str)
                                                     and plan.lstrip().startswith("{")):
        try:
            with open(plan) as f:
                plan = f.read()
        except OSError as e:
            raise ValueError(f"{_APPLY}: plan is neither JSON text nor a file that can be "
                             f"read ({e})") from None
    if isinstance(plan, str):
        try:
            plan = json.loads(plan)
        except json.JSONDecodeError as e:
            raise ValueError(f"{_APPLY}: plan is not the JSON of a FitPlan ({e})") from None
    if not isinstance(plan, dict):
        raise TypeError(f"{_APPLY}: plan must be a FitPlan, its to_dict(), its to_json() text "
                        f"or the path of a file to_json(path) wrote, got {type(plan).__name__}")
    missing = [k for k in ("budget_bytes", "actions") if k not in plan]
    if missing:
        raise ValueError(f"{_APPLY}: plan has no {', '.join(missing)}: not a FitPlan's "
                         f"to_dict()")
    actions = plan["actions"]
    if not isinstance(actions, list) or not all(
            isinstance(a, dict) and isinstance(a.get("path"), str)
            and isinstance(a.get("action"), str) for a in actions):
        raise ValueError(f"{_APPLY}: plan's actions must be a list of {{path, action, ...}} "
                         f"objects, as to_dict() writes them")
    known = _SWAPS + _SLICE_ACTIONS + ("checkpoint",)
    for a in actions:
        if a["action"] not in known:
            raise ValueError(f"{_APPLY}: plan's action {a['action']!r} on {a['path']!r} is none "
                             f"of fit's ({', '.join(known)})")
        depth = a.get("depth", 0)
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0 or (
                depth and a["action"] != "checkpoint"):
            raise ValueError(f"{_APPLY}: plan's {a['action']} of {a['path']!r} has depth "
                             f"{depth!r}: a checkpoint's is an int >= 0, every other "
                             f"action's 0")
    return plan


def _mismatch(what: str) -> ValueError:
    return ValueError(f"{_APPLY}: plan does not match this model's training step: {what}. "
                      f"The plan was made for another model, batch or setting; call "
                      f"memlean.fit for this one")


def _same_changes(planned: set, made: set) -> None:
    """Raises _mismatch naming the first (path, action) in one set and not the other."""
    if made != planned:
        path, action = sorted(planned - made or made - planned)[0]
        raise _mismatch(f"fit's {action} of {path} is " + (
            "not possible here" if (path, action) in planned else "not in the plan"))


def apply_plan(model: torch.nn.Module, example_inputs, plan, *,
               loss_fn: Optional[Callable] = None,
               optimizer: Optional[torch.optim.Optimizer] = None,
               compile=False, keep_grads: bool = False) -> FitPlan:
    """Apply a plan memlean.fit made, without searching again, and check that the step keeps
    its budget: for another process that trains the same model on the same batches (each
    rank of a data-parallel job; a job restarted), which then needs three measured steps
    (one more where the optimizer's state comes from a real step, as in fit) where fit
    measures one per stage and plan it tries, and gets the same plan as the others.

    Args:
        model, example_inputs, loss_fn, optimizer, keep_grads: as for memlean.fit (the model
            as it was when fit was called, e.g. freshly built: not fitted already).
        compile (bool or dict): as given to the fit that made the plan (a plan for compiled
            steps is applied with compile=, an eager plan without): with it the step under
            the plan is measured compiled (torch.compile(model, **compile), compiled afresh),
            its checkpoints traced into the graph where fit's were.
        plan: the FitPlan, its ``to_dict()``, its ``to_json()`` text, or the path of the file
            ``to_json(path)`` wrote.

    apply_plan records one eager step (and, where the plan swaps modules and also
    checkpoints or slices runs of them, one step after the swaps), finds every module the plan
    names where fit found it (the same checks: an in-place Swish only where it is safe in this
    step, a checkpoint only where fit offers one), makes the same changes, and measures one
    step under them. Everything the steps change is put back.

    Returns:
        FitPlan: as fit's, with this step's measured peaks (on the CPU, bytes equal to the
        plan's for the same model, batch and optimizer) and the plan's actions, each
        with its recompute time measured in this step (the plan may come from another machine).

    Raises:
        FitError: the step under the plan peaks above the plan's budget (less fit's margin on
            CUDA) here; the model is left unchanged.
        ValueError / TypeError: plan is no FitPlan (or its dict, JSON or file), was made
            with ``compile=`` and is applied without (or the other way round), or names a
            module or change this model's step does not have; or a bad argument as for fit.
            The model is left unchanged.
    """
    started = time.perf_counter()
    data = _plan_dict(plan)
    requested = parse_budget(data["budget_bytes"], "plan's budget_bytes")
    inputs, loss_fn, device = _check(model, example_inputs, loss_fn, optimizer)
    if not isinstance(keep_grads, bool):
        raise TypeError(f"{_APPLY}: keep_grads must be a bool, got {type(keep_grads).__name__}")
    compile_options = _compile_options(compile, _APPLY)
    if bool(data.get("compile", False)) != (compile_options is not None):
        raise ValueError(f"{_APPLY}: plan was made for " + (
            "compiled steps (fit(compile=...)): apply it with compile= as given to fit"
            if data.get("compile") else "eager steps (fit without compile=): apply it without "
            "compile=, or fit with compile= for compiled steps"))
    traced = compile_options is not None and bool(data.get("traced", False))
    budget = requested - _cuda_margin(requested) if device.type == "cuda" else requested
    wanted = [FitAction(a["path"], a["action"], int(a.get("bytes_saved", 0)),
                        float(a.get("recompute_seconds", 0.0)), int(a.get("depth", 0)))
              for a in data["actions"]]
    swaps = {(a.path, a.action) for a in wanted if a.action in _SWAPS}
    slices = {(a.path, a.action) for a in wanted if a.action in _SLICE_ACTIONS}
    checkpoints = [a.path for a in wanted if a.action == "checkpoint"]
    saved = _Saved(model, optimizer, device, inputs)
    undo_steps: List[Callable] = []
    try:
        model.train()
        step = _Step(model, inputs, loss_fn, optimizer, device, keep_grads)
        for p in step.params:
            p.grad = None
        eager, unversioned = _eager_step(model, step, saved, optimizer)
        rec = eager.recorder
        # 1. The swaps fit made (it swaps every Swish it may, and keeps every lean module
        # whose forward ran lean): the same set here, or the plan is another model's.
        made = set()
        if any(action.endswith("swish") for _, action in swaps):
            in_place = any(action == "inplace swish" for _, action in swaps)
            made |= {(path, action) for path, action, _ in
                     _swap_swish(model, rec, in_place, undo_steps, saved.training)}
        if any(not action.endswith("swish") for _, action in swaps):
            for path, action, _, (undo, _taken, _) in _lean_modules(model, rec, undo_steps):
                if (path, action) in swaps:
                    made.add((path, action))
                else:
                    undo()
                    undo_steps.remove(undo)
        _same_changes(swaps, made)
        # 2. The chains recomputed in slices, found as fit found them (on the step after the
        # swaps: their modules are the swapped ones).
        current = eager
        if (slices or checkpoints) and made:
            current = step.run(record=True)
        paths = _paths(model)  # (the swapped modules')
        unversioned = unversioned | _stateful_modules(rec, paths)
        chains = []
        timed = {}  # (path, action) -> its recompute seconds measured here
        if slices:
            found = {(c.path(paths), _slice_action(c)): c
                     for c in _slices(rec, current.recorder, model, unversioned)}
            # (fit slices those of them its budget needs: _chains_needed)
            _same_changes(slices, set(found) & slices)
            found = {key: found[key] for key in slices}
            chains = list(found.values())
            seconds = _module_seconds(current)
            for (path, action), c in found.items():
                c.fine = bool(data.get("fine_slices", False))
                undo_steps.append(_wrap(c))
                timed[path, action] = _chain_seconds(c, seconds)
        # 3. The checkpoints, among the candidates fit plans with (runs of sibling modules
        # among them where the plan names one).
        if checkpoints:
            plain = {paths.get(id(c.module)) for c in current.recorder.calls}
            inside = _inside(chains)
            runs_found = []
            if any(path not in plain for path in checkpoints):
                runs_found = [run for run in _runs(rec, current.recorder, model,
                                                   exclude=unversioned)
                              if not any(id(current.recorder.calls[k].module) in inside
                                         for k in run)]
            problem = _problem(current, model, runs_found, exclude=inside | unversioned,
                               uses=_uses(rec), nest=False)
            offers = _checkpoint_actions(problem.calls, problem.candidates,
                                         range(len(problem.calls)), paths)
            offered = {}
            for i, a in enumerate(offers):
                offered.setdefault(a.path, i)
            for path in checkpoints:
                if path not in offered:
                    raise _mismatch(f"fit's checkpoint of {path} is not possible here")
            chosen = [offered[path] for path in checkpoints]
            calls = problem.calls
            timed.update(((path, "checkpoint"), offers[offered[path]].recompute_seconds)
                         for path in checkpoints)
        else:
            chosen, calls = [], []
        # 4. The step under the plan, measured (compiled: as fit measured it, _measure_plan),
        # and the checkpoints wrapped.
        if compile_options is not None:
            peak = _measure_plan(step, calls, chosen, compile_options,
                                 None if traced else {tuple(chosen)})
        undo_steps.extend(_wrap(calls[i].module, traced=_traced(calls[i], traced))
                          for i in chosen)
        if compile_options is None:
            peak = step.run().peak if wanted else eager.peak
        if peak > budget:
            margin = (f" less the {_C.fit.describe_bytes(requested - budget)} fit keeps on CUDA"
                      if budget != requested else "")
            raise FitError(
                f"{_APPLY}: the step under the plan peaks at "
                f"{_C.fit.describe_bytes(peak)}, above the plan's budget_bytes="
                f"{requested} ({_gib(requested)}){margin}: the plan was made for another "
                f"model, batch or setting (fit measured "
                f"{_C.fit.describe_bytes(int(data.get('peak_bytes', 0)))}); call memlean.fit "
                f"for this one", requested, peak)
        saved.restore()
        # The plan's actions, each with the recompute time measured here (this machine's,
        # where the plan may come from another).
        actions = [replace(a, recompute_seconds=timed.get((a.path, a.action),
                                                           a.recompute_seconds))
                   for a in wanted]
        result = FitPlan(requested, peak,
                         int(data.get("predicted_peak_bytes", peak)), eager.resident,
                         eager.peak, actions, undo_steps, device,
                         time.perf_counter() - started,
                         int(data.get("eager_only_runs", 0)),
                         fine_slices=bool(data.get("fine_slices", False)),
                         compiled=compile_options is not None, traced=traced)
        result._applied_to(model)
        return result
    except BaseException:
        for undo in reversed(undo_steps):
            undo()
        saved.restore()
        raise
    finally:
        if compile_options is not None:
            import torch._dynamo

            torch._dynamo.reset()  # (as fit: the caller compiles the fitted model)


def _compile_options(compile, name: str) -> Optional[dict]:
    """torch.compile's keyword arguments for fit's compile= argument (None: eager steps)."""
    if isinstance(compile, bool):
        options = {} if compile else None
    elif isinstance(compile, dict):
        options = dict(compile)
    else:
        raise TypeError(f"{name}: compile must be a bool or a dict of torch.compile keyword "
                        f"arguments, got {type(compile).__name__}")
    if options is not None:
        # fit measures one example batch: static shapes, unless the caller says otherwise.
        # (With dynamo's automatic dynamic shapes, recompiling a plan's graphs made inductor
        # fail on timm convnext_tiny: "cannot determine truth value of Relational".)
        options.setdefault("dynamic", False)
    return options


def _cuda_margin(budget: int) -> int:
    """How far below the budget fit keeps a CUDA step: max(2 MiB, 0.25 %), memlean::fit's
    (ops/fit/budget.h says why: the caching allocator's blocks depend on its history)."""
    return _C.fit.cuda_margin(budget)


def _floor(problem, measured: _Measured) -> int:
    """2 % below the least step peak the planner predicts for checkpoints on this step: a
    budget under it skips their search (it would only measure plans that do not fit)."""
    floor = _least_predicted(problem, measured)
    return floor - floor // 50


class _PlansSeen(dict):
    """What a plan checkpoints (_checkpointed_modules) -> its measured peak, filled and read
    across the searches of one step (each of its recordings indexes its calls anew). strict: a
    plan measured above its predicted peak ends the search (_Mispredicted): the problem was
    predicted, and it did not hold."""

    strict = False


class _Mispredicted(Exception):
    """A plan measured above its predicted peak in a search on a predicted problem."""


def _checkpointed_modules(calls, chosen) -> frozenset:
    """What the plan `chosen` (indices into `calls`) checkpoints, by the modules' identities:
    the same plan in the problems of two recordings of one step."""
    return frozenset(tuple(id(m) for m in (c.modules if isinstance(c, _Run) else (c,)))
                     for i in chosen for c in _parts(calls[i].module))


def _finer(chains) -> list:
    """Of `chains`, those that slicing finer changes (finer, as the last step ran them: the
    others' fine slices are their slices, and a step sliced finer holds for them what the
    sliced step measured); all of them before the sliced step ran (finer not yet known)."""
    return [c for c in chains if c.finer] or chains


def _least_predicted(problem, measured: _Measured) -> int:
    """The least step peak the planner predicts for checkpoints on this step (_floor without
    its margin)."""
    return max(measured.optimizer_peak, _C.fit.least_peak_plan(
        problem.base, problem.atoms, problem.candidates, **problem.options)[2])


def _first_calls(rec: _Recorder) -> dict:
    """{id(module): its first call} in a recorded step."""
    first = {}
    for c in rec.calls:
        first.setdefault(id(c.module), c)
    return first


def _as_sliced(measured: _Measured, chains, lowest=(), rises=None,
               risen=()) -> Optional[_Measured]:
    """The recorded step `measured` as it would be recorded with `chains` recomputed in
    slices, at its lowest, for a lower bound of the planner's least peak (_sliced_floor) before
    the sliced step is measured or, on a sliced step, for one of finer slices. A sliced chain
    saves its input alone (memlean.sliced): a tensor first saved by an atom of a chain is saved
    then by the first of the atoms that saved it again outside the chains (the module after a
    chain saves its output: ResNet's conv2 the output of bn1..act1), by the first atom of a
    chain whose input it is, or by none; and the backward through a chain's atoms holds
    nothing above base and the saved bytes (memlean.sliced holds one slice's temporaries,
    finer slices less: only the sliced step measures them). All else as measured. None where
    a chain's first or last module made no call in the step. lowest: modules whose backward
    holds nothing above base and the saved bytes either (the lean backwards, which save what
    torch saves and hold less in backward: _lean_step_predicted). None too where a chain's
    or a `lowest` module's call ran inside a saved-tensors region of another's
    (torch.utils.checkpoint's: timm's set_grad_checkpointing) or without grad: the recorder
    sees nothing such a region saves, and its recompute in backward holds what slicing
    lowers (efficientnet_b0 with timm's checkpointing, batch 8, 128², runs: predicted no lower
    than checkpoints alone, 97,525,567 bytes, so never measured; sliced, 78,553,238).
    rises: per chain, what its sliced backward holds above the level it starts at
    (_chain_rise, measured on the chain alone): the backward through its atoms then holds that
    above the level backward reaches it at here, less what slicing drops (exact, where the
    lower bound above misses the parameters' gradients made by then: _sliced_predicted). None
    too where a chain's atoms show no such level (none saved). risen: (first atom, end atom,
    rise) of calls that save what they saved here but whose backward is another, measured
    alone (the deferred lean depthwise convolutions: _sliced_predicted), counted alike."""
    rec = measured.recorder
    first = _first_calls(rec)
    ranges = []  # (first atom, end atom, input's identity) per chain
    for chain in chains:
        head, tail = first.get(id(chain.modules[0])), first.get(id(chain.modules[-1]))
        if head is None or tail is None:
            return None
        ranges.append((head.begin, tail.end, head.inputs[0][0] if head.inputs else None))
    low = {id(m) for m in lowest}
    if any(_foreign_region(c) for c in first.values()
           if id(c.module) in low or any(b <= c.begin < e for b, e, _ in ranges)):
        return None

    def chain_of(atom):
        return next((r for r in ranges if r[0] <= atom < r[1]), None)

    atoms = list(rec.atom_bytes)
    for b, e, _ in ranges:
        atoms[b:e] = [0] * (e - b)
    saved, dropped = dict(rec.saved), 0
    for key, atom in rec.saved.items():
        if chain_of(atom) is None:
            continue
        for later in [atom] + rec.saved_again.get(key, []):
            r = chain_of(later)
            if r is None or (later == r[0] and key == r[2]):
                saved[key] = later
                atoms[later] += rec.saved_bytes[key]
                break
        else:
            del saved[key]
            dropped += rec.saved_bytes[key]
    before, after = 0, 0
    gone, upto = [], []  # per atom: saved bytes no longer alive at its backward; those alive
    for old, new in zip(rec.atom_bytes, atoms):
        before, after = before + old, after + new
        gone.append(before - after)
        upto.append(after)
    # base (_problem's) stays: the forward's and backward's start levels lose what is dropped.
    start = rec.backward_start_level
    top = (max(measured.forward_peak, start or 0) if rec.backward_levels
           else measured.forward_backward_peak)
    base = max(0, top - before)
    held_least = {k for c in rec.calls if id(c.module) in low for k in range(c.begin, c.end)}
    levels = {k: base + upto[k] if k in held_least or chain_of(k) else level - gone[k]
              for k, level in rec.backward_levels.items()}
    for b, e, rise in [(b, e, r) for (b, e, _), r in zip(ranges, rises or ())] + list(risen):
        # Backward reaches the chain at its last atom that saved a tensor (where it first
        # unpacks one); the sliced backward runs there, all at once.
        reached = [k for k in range(b, e) if k in rec.backward_entries]
        if not reached:
            return None
        top = rec.backward_entries[max(reached)] - gone[max(reached)] + rise
        for k in range(b, e):
            if k in levels:
                levels[k] = top
    sliced_rec = copy.copy(rec)
    sliced_rec.atom_bytes, sliced_rec.saved = atoms, saved
    sliced_rec.backward_levels = levels
    sliced_rec.backward_start_level = None if start is None else start - dropped
    sliced_rec.backward_entries = {k: v - gone[k] for k, v in rec.backward_entries.items()}
    return replace(measured, forward_peak=measured.forward_peak - dropped,
                   forward_backward_peak=measured.forward_backward_peak - dropped,
                   recorder=sliced_rec)


def _rise_key(chain, call: _Call) -> Optional[tuple]:
    """What _chain_rise of `chain` (a _Run: a module alone too) depends on (its kind, its
    modules and their settings, parameters' shapes, the input's shape and strides), so that a
    stack of equal blocks measures one; None where its input is not one tensor with strides,
    or it has no floating-point parameter."""
    if not call.input_view or not call.inputs:
        return None
    params = chain.parameters()
    if not any(p.is_floating_point() for p in params):
        return None
    _, shape, strides = call.input_view
    return (type(chain), tuple((type(m), m.extra_repr()) for m in chain.modules),
            tuple((tuple(p.shape), p.dtype) for p in params), shape, strides,
            getattr(chain, "fine", False))


def _chain_rise(chain, call: _Call) -> Optional[int]:
    """What the backward of `chain` sliced (chain.run) holds at its highest above the level it
    starts at (_backward_rise, on an input like the one `call`, its first module's, took): the
    bytes of its input's and its parameters' gradients, one slice's recompute and its
    temporaries. None where the chain would not run sliced on such an input (_rise_key None
    too), or fails (the sliced step, measured then, fails too and fit says so)."""
    if _rise_key(chain, call) is None:
        return None
    return _backward_rise(lambda x: chain.run(None, (x,), {}), call, chain.parameters())


def _backward_rise(run, call: _Call, params) -> Optional[int]:
    """What the backward of run(x) holds at its highest above the level it starts at,
    measured by running it alone on an x like the one `call` took (its shape and strides, in
    the dtype of the first floating-point parameter of `params`). Exact on CPU, where memstats
    counts every byte; the values do not matter (random, from a generator of its own: the
    step's RNG is untouched). The parameters' gradients are put back, and the buffers by
    fit's restore (a BatchNorm's statistics move). None where run gives no tensor with a
    gradient, or fails."""
    _, shape, strides = call.input_view
    floating = next(p for p in params if p.is_floating_point())
    generator = torch.Generator(device=floating.device).manual_seed(0)
    x = torch.empty_strided(shape, strides, dtype=floating.dtype, device=floating.device)
    x.normal_(generator=generator)
    x.requires_grad_(True)
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        with torch.enable_grad():
            y = run(x)
        if not isinstance(y, torch.Tensor) or y.grad_fn is None:
            return None
        g = torch.empty_like(y).normal_(generator=generator)
        with memstats.track(floating.device.type) as tracker:
            start = tracker.current
            tracker.reset_peak()
            y.backward(g)
            return tracker.peak - start
    except Exception:  # noqa: BLE001  (the step, measured instead, fails and says so)
        return None
    finally:
        for p, grad in zip(params, grads):
            p.grad = grad


def _same_region(a: _Call, b: _Call) -> bool:
    """Whether calls a and b ran in the same grad mode and saved-tensors region
    (_Recorder._context): a module whose forward enters a region (torch.utils.checkpoint)
    around its submodules does not run them when that region recomputes them in backward."""
    return a.context[:2] == b.context[:2]


def _foreign_region(call: _Call) -> bool:
    """Whether `call` ran inside a saved-tensors region of another's (_Recorder._context:
    the recorder's own is region 0), or without grad: what it saved the recorder did not
    see."""
    return bool(call.context) and (not call.context[0] or call.context[1] != 0)


def _sliced_problem(measured: _Measured, chains, root, runs, exclude, uses, memo=None):
    """(the step with `chains` sliced, or sliced finer where `measured` is sliced: _finer,
    predicted at its lowest from the recorded step `measured` by _as_sliced; its planner
    problem), with `runs` (indices into its calls) and `exclude` as _problem takes them; None
    where _as_sliced cannot tell. memo: as _problem takes it."""
    as_sliced = _as_sliced(measured, _finer(chains))
    if as_sliced is None:
        return None
    return as_sliced, _problem(as_sliced, root, _runs_beside(runs, measured, measured, chains),
                               exclude=_inside(chains) | exclude, uses=uses, memo=memo)


def _chains_needed(measured: _Measured, chains, root, runs, exclude, uses, budget,
                   every_sliced=None) -> list:
    """5a. Of `chains`, those to slice for `budget`, on the recorded step `measured` (the lean
    step, or its prediction): slicing every chain is the lowest, but each costs its forward
    again, and at a budget between what checkpoints alone reach and slicing's least some
    chains cost more recompute than the checkpoints that would do without them (MobileNetV3,
    batch 32, 224², runs, at half of per-block checkpointing's peak: 24 chains sliced ran at
    1.25-1.55x eager's step time, 9 at 1.01-1.08x, the same peak within 0.1 %). The chains in
    order of the saved bytes slicing each drops (_as_sliced of it alone); of the first k of
    them, for k from the fewest the planner predicts to fit (sliced at their lowest,
    _sliced_problem; planned 2 % below the budget) up to all, the most whose predicted time
    (the chains' forward time and the recompute of the planner's plan) is within 5 % of the
    least (as good as equal: the lower peak, so that noise in the times does not make the peak
    rise as the budget falls). All of them where none but all is predicted to fit, or nothing
    is (the least is then slicing all's); fit slices them all after all where the fewer,
    measured, do not fit (_Fitting._slice). every_sliced: _sliced_problem of all of them, where
    the caller made it already."""
    if len(chains) < 2:
        return chains
    seconds = _module_seconds(measured)
    saved = sum(measured.recorder.atom_bytes)
    gain = []
    for chain in chains:
        alone = _as_sliced(measured, [chain])
        if alone is None:
            return chains
        gain.append(saved - sum(alone.recorder.atom_bytes))
    order = sorted(range(len(chains)), key=lambda i: -gain[i])
    target = budget - budget // 50
    costs, memo = {}, {}

    def cost(k):  # the predicted time with the first k chains sliced; None: not predicted to fit
        if k not in costs:
            subset = [chains[i] for i in sorted(order[:k])]
            sliced = (every_sliced if k == len(chains) and every_sliced is not None
                      else _sliced_problem(measured, subset, root, runs, exclude, uses, memo))
            costs[k] = None
            if sliced is not None and sliced[0].optimizer_peak <= target:
                problem = sliced[1]
                feasible, _, _, recompute = _C.fit.plan(
                    problem.base, problem.atoms, problem.candidates, target, **problem.options)
                if feasible:
                    costs[k] = recompute + sum(_chain_seconds(c, seconds) for c in subset)
        return costs[k]

    n = len(chains)
    if cost(n) is None:
        return chains
    low, high = 1, n  # the fewest predicted to fit, by bisection (more chains, lower peaks)
    while low < high:
        mid = (low + high) // 2
        if cost(mid) is None:
            low = mid + 1
        else:
            high = mid
    tried = [k for k in sorted({min(n, low + step) for step in (0, 1, 2, 4, 8, 16)} | {n})
             if cost(k) is not None]
    least = min(cost(k) for k in tried)
    best = max(k for k in tried if cost(k) <= 1.05 * least)
    return [chains[i] for i in sorted(order[:best])]


def _sliced_floor(sliced) -> Optional[int]:
    """At most _floor of the step that _sliced_problem predicted (`sliced`, its result); None
    where it could not tell."""
    return None if sliced is None else _floor(sliced[1], sliced[0])


def _lean_step_predicted(eager: _Measured, root, budget, runs, exclude,
                         uses) -> Optional[_Measured]:
    """The step with the lean backwards alone (no Swish swapped), predicted from the eager
    step at its lowest (_as_sliced with `lowest`: they save what torch saves, and their
    backward holds less, at most nothing above base and the saved bytes), where fit need not
    measure it before the sliced step: the budget is below the planner's least for
    checkpoints on it (their search is skipped, as it would be on the measured step, whose
    least is no lower) and slicing's bound (_sliced_floor) is lower still (the sliced step is
    measured, as it would be). None otherwise: fit measures it first. ResNet-50 without runs,
    ConvNeXt-T, MobileNetV3: an eager step's time less per fit below those leasts."""
    chains = _slices(eager.recorder, eager.recorder, root, exclude)
    if not chains:
        return None
    predicted = _as_sliced(eager, [], [c.module for c in eager.recorder.calls
                                       if _lean_action(c.module) is not None])
    if predicted is None:
        return None
    floor = _floor(_problem(predicted, root, runs, exclude=exclude, uses=uses), predicted)
    if budget >= floor:
        return None
    bound = _sliced_floor(_sliced_problem(predicted, chains, root, runs, exclude, uses))
    return predicted if bound is not None and bound < floor else None


def _finer_predicted(thin: _Measured, sliced, budget):
    """The step with the chains sliced finer (step 5b), predicted from the measured sliced
    step `thin` rather than measured (one step less, as long as an eager step), and its
    planner problem: `sliced`, _sliced_problem on `thin` (finer slices save what the first
    slicing saves and change only what the backward through the chains holds, predicted at
    its lowest: nothing above base and the saved bytes; MobileNetV3's measured finer step gave
    the same problem, its least to the byte). Its peak stays `thin`'s, a step measured (the
    search takes it for the empty plan's, never returned above the budget). (None, None)
    where _sliced_problem could not tell or the empty plan is predicted to fit the budget
    (that finer step is measured: fit may return it without checkpoints)."""
    if sliced is None:
        return None, None
    finer, problem = sliced
    empty = _C.fit.predicted_peak(problem.base, problem.atoms, problem.candidates, [],
                                  **problem.options)
    if empty <= budget:
        return None, None
    return replace(finer, forward_backward_peak=thin.forward_backward_peak), problem


# Per model (weakly held), weak references to the plans fit returned for it, oldest first
# (each plan holds those made after it: FitPlan._later).
_APPLIED: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()

# Per model (weakly held), the plan that reached the least step peak a FitError named, by the
# step's planner problem: a later fit of the same step at that budget or more tries it when
# its own search finds none. Which plans a search measures depends on the recompute times,
# measured afresh by every call; where a plan measures above its prediction (the planner's
# model is exact in most steps, not all: docs/fit.md), a search at exactly the least an
# earlier call named could otherwise walk past the plan that reached it.
_LEAST_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def _signature(problem, compile_options) -> tuple:
    """What a step's planner problem is, times left out (they differ between calls)."""
    return (problem.base, tuple(problem.atoms), tuple(problem.backward_extras),
            tuple((n, tuple(ks)) for n, ks in problem.shared), tuple(problem.apart),
            tuple(problem.nested), tuple(problem.deferred),
            tuple((b, e, freed, extra, held)
                  for b, e, freed, _, extra, held in problem.candidates),
            repr(compile_options))


def _eager_step(model, step: _Step, saved: _Saved, optimizer):
    """The eager step, recorded with its dataflow, after the optimizer got the state every
    later step has; and the modules no checkpoint may hold (unversioned:
    _with_unversioned_writers). The optimizer's state comes, on the CPU, from an optimizer
    step on zero gradients (a whole training step less), unless the optimizer refuses them or
    a parameter then gets no gradient or a sparse one (a real first step would give it other
    state): then from a real step. On CUDA always a real step: it also makes lazily allocated
    workspaces (cuBLAS's) before anything is measured."""
    fresh = optimizer is not None and len(optimizer.state) == 0
    warmed = fresh and not step.cuda and _warm_on_zero_gradients(optimizer, step.params)
    if fresh and not warmed and not step.cuda:
        saved.restore()  # a partial step on zero gradients
    if (fresh and not warmed) or step.cuda:
        step.run()

    def recorded():
        return step.run(record=True, dataflow=True)

    eager, unversioned = _with_unversioned_writers(model, recorded)
    if warmed and not step.all_dense_grads:
        saved.restore()
        step.run()
        eager, unversioned = _with_unversioned_writers(model, recorded)
    return eager, unversioned


def _warm_on_zero_gradients(optimizer, params) -> bool:
    """Give a stateless optimizer the state its first step would, by a step on zero gradients
    of every trainable parameter: the state's shapes, dtypes and layouts are what fit's steps
    measure with, and _Saved.restore() puts back the caller's empty state and parameters.
    False where the optimizer refuses dense zero gradients (it may have stepped partly)."""
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
        return True
    except Exception:  # e.g. SparseAdam ("does not support dense gradients"): a real step
        return False
    finally:
        for p in params:
            p.grad = None


def _swap_swish(model, rec: _Recorder, in_place: bool, undo_steps, training) -> list:
    """Swap the Swish modules of the recorded forward (recorded with the dataflow mode);
    returns (path, action, output bytes) per swapped module. in_place False: memory-efficient
    only, where it saves."""
    paths = _paths(model)
    by_module = {}
    for c in rec.calls:
        if _swish_beta(c.module) is not None:
            by_module.setdefault(id(c.module), []).append(c)
    swapped = []
    for calls in sorted(by_module.values(), key=lambda cs: cs[0].begin):
        module = calls[0].module
        beta = _swish_beta(module)
        safe = in_place and all(_safe_in_place(c, rec) and c.outputs for c in calls)
        if safe:
            variant = "inplace"
        elif _naive(module):
            variant = "memory_efficient"
        else:
            continue
        replacement = Swish(beta=beta, variant=variant)
        replacement.train(training[id(module)][1] if id(module) in training  # the caller's
                          else module.training)
        # What memlean.unfit puts back where no plan's undo can (a model loaded or copied):
        # an attribute, not a child (the model's modules and state_dict keys stay as fit made
        # them); it is pickled and copied with the replacement.
        replacement.__dict__[_REPLACED] = module
        undo_steps.append(_replace(model, module, replacement))
        out_bytes = sum(n for c in calls for _, n in c.outputs[:1])
        swapped.append((paths.get(id(module), "?"), f"{variant} swish", out_bytes))
    return swapped


def _lean_action(module):
    """The lean backward fit gives this module ("lean batchnorm", "lean depthwise conv"), or
    None: torch BatchNorms (BatchNorm1d/2d/3d and their subclasses, e.g. timm's
    BatchNormAct2d; not SyncBatchNorm) and depthwise Conv2ds with zero padding (subclasses
    that pad their own way first, e.g. timm's Conv2dSame, included: the call itself decides)."""
    if (isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
            and not isinstance(module, torch.nn.SyncBatchNorm)):
        return "lean batchnorm"
    if (isinstance(module, torch.nn.Conv2d) and module.padding_mode == "zeros"
            and module.groups > 1 and module.groups == module.in_channels
            and module.out_channels == module.groups):
        return "lean depthwise conv"
    return None


def _lean_modules(model, rec: _Recorder, undo_steps) -> list:
    """Give every module of the recorded forward that _lean_action names memlean's lean
    backward (memlean.lean.lean_forward). Returns (path, action, output bytes, taken) per
    module; taken() counts the calls its forward ran lean since."""
    paths = _paths(model)
    by_module, actions = {}, {}
    for c in rec.calls:
        if id(c.module) not in actions:
            actions[id(c.module)] = _lean_action(c.module)
        if actions[id(c.module)] is not None:
            by_module.setdefault(id(c.module), []).append(c)
    leans = []
    for calls in sorted(by_module.values(), key=lambda cs: cs[0].begin):
        module = calls[0].module
        undo, taken = lean_forward(module)
        undo_steps.append(undo)
        out_bytes = sum(n for c in calls for _, n in c.outputs[:1])
        leans.append((paths.get(id(module), "?"), actions[id(module)], out_bytes,
                      (undo, taken, module)))
    return leans


def _swap_actions(swapped, saving: int) -> List[FitAction]:
    """The FitActions of swapped modules, (path, action, output bytes) each: `saving`, the
    measured saving of them all, shared in proportion to their output bytes."""
    total = sum(n for _, _, n in swapped) or 1
    return [FitAction(path, action, saving * n // total, 0.0) for path, action, n in swapped]


def _keep_taken(leans, undo_steps, inside=frozenset()) -> list:
    """The lean modules whose forward ran lean in the step since (path, action, bytes); the
    others (a forward that made no call a lean backward applies to) are put back. inside:
    id() of modules kept as well (those of sliced chains, which memlean.sliced runs in
    slices, not through their forward: unsliced, they run lean as the others)."""
    kept = []
    for path, action, n, (undo, taken, module) in leans:
        if taken() or id(module) in inside:
            kept.append((path, action, n))
        else:
            undo()
            undo_steps.remove(undo)
    return kept


def _measure_plan(step: _Step, calls, chosen, compile_options=None, untraced=None) -> int:
    """The measured step peak with the chosen modules checkpointed (unwrapped again after).
    compile_options not None (fit(compile=...)): the step of torch.compile(model,
    **compile_options), compiled afresh (torch._dynamo.reset() first, as the caller's own
    compile of the fitted model will be) in a step before the measured one, its checkpoints
    traced into the compiled graph (_traced_checkpoint); where the compiler fails on that
    graph, measured again with them run eagerly between graphs, and the plan (tuple(chosen))
    added to the set `untraced`."""
    traced = compile_options is not None and tuple(chosen) not in (untraced or ())
    wraps = [_wrap(calls[i].module, traced=_traced(calls[i], traced)) for i in chosen]
    try:
        if compile_options is None:
            return step.run().peak
        import torch._dynamo

        torch._dynamo.reset()
        compiled = torch.compile(step.model, **compile_options)
        try:
            step.run(forward=compiled)  # compiles
        except torch._dynamo.exc.BackendCompilerFailed:
            if not traced or untraced is None:
                raise
            untraced.add(tuple(chosen))
        else:
            return step.run(forward=compiled).peak
    finally:
        for w in reversed(wraps):
            w()
    return _measure_plan(step, calls, chosen, compile_options, untraced)  # now untraced


def _checkpoint_actions(calls, candidates, chosen, paths):
    """A "checkpoint" action per checkpointed module or run of the plan `chosen` (a compound's
    inner ones first, then its outer: the order apply_plan wraps them in)."""
    def path(m):
        return m.path(paths) if isinstance(m, _Run) else paths.get(id(m), "?")

    return [FitAction(path(part), "checkpoint", int(saved), float(seconds), depth)
            for i in chosen
            for part, (saved, seconds), depth in zip(
                _parts(calls[i].module), _part_costs(calls[i].module, candidates[i]),
                _part_depths(calls[i].module))]

