"""Checkpointing: run a segment of a model without keeping its activations, and recompute
them in backward (pytorch-checkpoint's CheckpointFunction, with RNG preservation, buffers,
replicas; docs/sources.md).

    import memlean
    y = memlean.checkpoint(block, x)                           # an nn.Module: its parameters
    y = memlean.checkpoint(fn, x, h, params=[w, b])            # any callable: list what it uses
    y = memlean.CheckpointFunction.apply(fn, 2, x, h, w, b)    # pytorch-checkpoint's call form

Forward runs the function under no_grad, so none of the segment's activations are kept:
only its inputs (and the parameters, which exist anyway) are saved. Backward recomputes
the segment with grad mode on and asks autograd for the gradients of exactly its inputs and
parameters, which it returns as this node's gradients. So backward never walks past the
segment, and every parameter's gradient is accumulated once, by the outer backward: DDP's
hooks fire once per parameter (find_unused_parameters=True works), and several GPUs stay
fast. A function that uses a tensor requiring grad that is neither an input nor a parameter
given is an error in backward (its gradient would otherwise be lost silently).

The RNG state (CPU, and every CUDA device holding an input or a parameter) is saved before
the forward and restored for the recompute (dropout drops the same units twice); the
autocast state of the forward is restored for the recompute too. BatchNorm is updated once
per training step. A module's buffers that its forward reads and updates (spectral norm's
power-iteration vectors, a QAT observer's statistics; not BatchNorm statistics, which a
training forward does not read) are copied before the forward, and the recompute begins
from the copies of those the forward changed (its version counter moved, or, for a change
through ``.data``, its values differ), so it computes what the forward computed
(rewound_buffers, changed_since; for a plain function, the buffers of the modules it calls:
_BuffersSeen). A segment that is an nn.Module (or a checkpoint_sequential segment of
modules) has all the buffers of its module tree put back after the recompute as the
forward left them, the running statistics of its BatchNorms included, as the C++
checkpoint does for a module. A segment that is a plain function (or has a callable that is
not a module) is watched instead: every torch BatchNorm module its recompute calls (any
_BatchNorm: BatchNorm1d/2d/3d, SyncBatchNorm, subclasses such as timm's BatchNormAct2d) has
its buffers put back (a global module pre-hook while it recomputes). Not covered: a
BatchNorm that a module's forward calls without holding it in its tree (checkpoint a
function that calls the module instead), and a bare F.batch_norm call on tensors of your
own.

Under FSDP2 (torch.distributed.fsdp.fully_shard: e.g. fully_shard on each block and on the
root, and memlean.checkpoint(block, h) in the model's forward), a segment that calls FSDP
modules runs their hooks again in the recompute, which gathers the sharded parameters; its
backward then runs the recomputed graph's backward itself, so that the gradients reach the
unsharded parameters and FSDP reduce-scatters them into the sharded parameters' .grad (the
check for unlisted tensors is not needed there: every leaf gets its gradient).

Under torch.compile, dynamo does not trace into the checkpoint: the checkpointed call runs
as in eager mode (its segment is neither compiled nor fused, and it still saves only its
inputs and the parameters), while the code around it is compiled; values and gradients are
eager's (tested with aot_eager and inductor). To compile the segment itself, compile the
function you pass in; to let the compiler decide what to recompute across the whole model,
use torch.compile's own activation memory budget instead of a checkpoint.

One implementation for C++ and Python: memlean.checkpoint runs the C++ memlean::checkpoint
(ops/checkpoint/checkpoint.h) with a Python function (memlean._C.checkpoint): the same
autograd node (memlean::CheckpointBackward), RNG and autocast handling, buffer restore,
checks and error messages, and one recompute flag (is_recomputing()). This module adds what
only Python has: arbitrary input and output structures, the BatchNorm watch of plain
functions, and FSDP2. Like any autograd node, the checkpoint's node holds the function (and
what its closure holds) until backward runs or the graph is freed; a function that keeps a
reference to the checkpoint's own output (e.g. a bound method of a module that stores that
output on itself) makes a reference cycle that Python's garbage collector cannot see
through the C++ node, which only backward (or dropping the stored output) breaks.
checkpoint_sequential and the segment planner are in memlean/sequential.py, as
ops/checkpoint/sequential.h is apart from checkpoint.h.
"""
import contextlib
import copy
import sys
import threading
from typing import Callable, List, Optional, Sequence

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_flatten, tree_unflatten

from memlean import _C

__all__ = [
    "CheckpointFunction",
    "checkpoint",
    "is_recomputing",
]

def is_recomputing() -> bool:
    """True while a memlean checkpoint (this Python one, or the C++ memlean::checkpoint)
    recomputes its forward on this thread (in backward). One flag, kept in C++: C++ modules
    such as memlean::BatchNorm2d inside a Python checkpoint see it too."""
    return _C.is_recomputing()


class _ModuleCallsSeen:
    """`with _ModuleCallsSeen(seen):` calls seen(module) before the forward of every
    nn.Module called on this thread while the body runs (a global forward pre-hook, removed
    on exit)."""

    __slots__ = ("seen", "thread", "handle")

    def __init__(self, seen):
        self.seen = seen
        self.thread = threading.get_ident()
        self.handle = None

    def _hook(self, module, args):
        if threading.get_ident() == self.thread:
            self.seen(module)

    def __enter__(self):
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self._hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()
        return False


class _BatchNormStatisticsKept:
    """`with _BatchNormStatisticsKept():` every torch BatchNorm module (any
    torch.nn.modules.batchnorm._BatchNorm: BatchNorm1d, 2d, 3d, SyncBatchNorm, and subclasses
    such as timm's BatchNormAct2d) called on this thread while the body runs has its buffers
    (running_mean, running_var, num_batches_tracked, and any a subclass adds) copied before
    its first call, and put back when the body ends, without bumping their version
    counters. So a recompute leaves the statistics as the forward left them, however the
    module is reached (a Module, a plain function, checkpoint_sequential of callables), and
    the module's forward runs unchanged (a subclass keeps what it adds, e.g.
    BatchNormAct2d's activation and dropout). It runs once per watched segment in every
    backward: no grad-mode switches (buffers do not require grad, and .data copies are not
    recorded)."""

    __slots__ = ("kept", "calls")

    def __init__(self):
        self.kept = None  # {id(module): [(buffer, copy)]}, made at the first BatchNorm
        self.calls = _ModuleCallsSeen(self._keep)

    def _keep(self, module):
        if not isinstance(module, _BatchNorm):
            return
        if self.kept is None:
            self.kept = {}
        elif id(module) in self.kept:
            return
        self.kept[id(module)] = [(b, b.detach().clone()) for b in module._buffers.values()
                                 if isinstance(b, torch.Tensor) and not torch.nn.parameter.is_lazy(b)]

    def __enter__(self):
        self.calls.__enter__()
        return self

    def __exit__(self, *exc):
        self.calls.__exit__(*exc)
        if self.kept:
            for pairs in self.kept.values():
                put_back(pairs)
        return False


class _BuffersSeen:
    """`with _BuffersSeen() as seen:` copies the buffers of every module called on this thread
    while the body runs (at its first call; not BatchNorm and InstanceNorm statistics, as
    rewound_buffers), and seen.changed() gives (buffer, copy) for those the body changed (its
    version counter moved): what a function's recompute begins from."""

    __slots__ = ("copies", "calls")

    def __init__(self):
        self.copies = {}  # id(buffer) -> (buffer, copy, version)
        self.calls = _ModuleCallsSeen(self._copy)

    def _copy(self, module):
        if _holds_statistics(module):
            return
        fresh = [b for b in module._buffers.values()
                 if (isinstance(b, torch.Tensor) and id(b) not in self.copies
                     and not torch.nn.parameter.is_lazy(b) and _can_change(b))]
        for triple in buffer_copies(fresh):
            self.copies[id(triple[0])] = triple

    def changed(self):
        found = changed_since(self.copies.values())
        self.copies = {}
        return found

    def __enter__(self):
        self.calls.__enter__()
        return self

    def __exit__(self, *exc):
        self.calls.__exit__(*exc)
        return False


def buffer_copies(buffers):
    """(buffer, a copy of it, its version counter) for each buffer: what a forward about to
    run begins from (with changed_since, how every form of checkpoint rewinds in Python; the
    C++ checkpoint does the same in detail::checkpoint_impl)."""
    return [(b, b.detach().clone(), b._version) for b in buffers]


def changed_since(copies):
    """(buffer, copy) of the buffer_copies whose buffer the forward changed: its version
    counter moved, or its values differ from the copy (a change through ``.data``, which has
    a version counter of its own; memlean::detail::same_values, as the C++ checkpoint
    compares): what its recompute must begin from."""
    return tuple((b, c) for b, c, v in copies if b._version != v or not _C.same_values(b, c))


def put_back(pairs) -> None:
    """Copy each (buffer, copy) pair's copy into its buffer without bumping the buffer's
    version counter (.data: not recorded): what a recompute changed, as the forward left it."""
    for b, c in pairs:
        b.data.copy_(c)


_NO_FSDP = contextlib.nullcontext()


def _fsdp_calls_noted(found):
    """`with _fsdp_calls_noted(found):` appends to `found` every FSDP2 module
    (torch.distributed.fsdp.fully_shard) called on this thread while the body runs. Nothing
    to do (no hook) where FSDP was never imported."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    if fsdp_module is None:
        return _NO_FSDP

    def note(module):
        if isinstance(module, fsdp_module):
            found.append(module)

    return _ModuleCallsSeen(note)


# ---- what the checkpoint is given --------------------------------------------------------


def module_parameters(module: torch.nn.Module) -> List[torch.Tensor]:
    """A module's parameters, also for DataParallel replicas (whose parameters are plain
    attributes, kept in _former_parameters, so module.parameters() is empty)."""
    # (module.__dict__: a missing attribute would go through Module.__getattr__ and raise.)
    replica = module.__dict__.get("_is_replica", False)
    if not module._modules and not replica:
        # A leaf module (the common segment): no tree to walk (one parameter registered
        # under two names is still listed once).
        params = [p for p in module._parameters.values() if p is not None]
        if len(params) > 1 and len({id(p) for p in params}) < len(params):
            params = list({id(p): p for p in params}.values())
        return params
    params, seen = [], set()
    for m in module.modules():
        source = m._former_parameters if m.__dict__.get("_is_replica", False) else m._parameters
        for p in source.values():
            if isinstance(p, torch.Tensor) and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def _module_buffers(module):
    if not module._modules:
        return [b for b in module._buffers.values() if b is not None]
    return [b for b in module.buffers() if b is not None]


def rewound_buffers(modules, buffers) -> List[torch.Tensor]:
    """Of `buffers` (those of the trees of `modules`), the ones a checkpoint rewinds for its
    recompute where its forward changed them (memlean::detail::rewound_buffers): the recompute
    begins from their values at the forward's start, as the forward did (a spectral norm's
    power-iteration vectors, a QAT observer's statistics: read by the forward that updates
    them). All but the statistics of torch's BatchNorm and InstanceNorm layers (_NormBase:
    BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm1d/2d/3d, subclasses such as timm's
    BatchNormAct2d and memlean.BatchNorm2d), which their training forward updates without
    reading them."""
    statistics = {id(b) for m in modules for sub in m.modules() if _holds_statistics(sub)
                  for b in sub._buffers.values() if b is not None}
    return [b for b in buffers if id(b) not in statistics and _can_change(b)]


def _holds_statistics(module) -> bool:
    """Whether `module`'s buffers are statistics its training forward updates without
    reading (torch's _NormBase: BatchNorm, SyncBatchNorm, InstanceNorm, their subclasses):
    a checkpoint does not rewind them (rewound_buffers, _BuffersSeen)."""
    return isinstance(module, torch.nn.modules.batchnorm._NormBase)


def _can_change(buffer) -> bool:
    """False for an inference tensor: it cannot change outside inference_mode, and has no
    version counter to tell."""
    return not buffer.is_inference()


# ---- checks ------------------------------------------------------------------------------


def _describe(value):
    if value is None:
        return "None"
    name = type(value).__name__
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def _check_arguments(name, function, length, args):
    if not callable(function):
        raise TypeError(f"{name}: function must be callable, got {_describe(function)}")
    if isinstance(length, bool) or not isinstance(length, int):
        raise TypeError(f"{name}: n (the number of inputs) must be an int, got {_describe(length)}")
    if length < 0:
        raise ValueError(f"{name}: n (the number of inputs) must be >= 0, got {length}")
    if length > len(args):
        raise ValueError(
            f"{name}: n is {length} but only {len(args)} argument{'' if len(args) == 1 else 's'} "
            f"{'was' if len(args) == 1 else 'were'} given (args holds the n inputs, then the "
            f"parameters)"
        )
    for i, p in enumerate(args[length:]):
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"{name}: parameter {i} (argument {length + i}) is {_describe(p)}, not a tensor; "
                f"everything after the first n={length} arguments must be a parameter tensor"
            )


# The remedy named when the recomputed graph reaches a leaf the checkpoint was not given
# (the C++ checkpoint behind _C.checkpoint checks it and names this remedy).
_HOW_TO_LIST = ("Pass it in params= (memlean.checkpoint) or among the parameters after the n "
                "inputs (CheckpointFunction.apply).")


# ---- the segment ---------------------------------------------------------------------------


class _Segment:
    """A checkpointed call as memlean._C.checkpoint (the C++ memlean::checkpoint) runs it:
    called with the inputs' tensors in their slots (None elsewhere), once for the forward and
    once per backward for the recompute, it calls the function with the other inputs put
    back and returns the tensors of its output. It keeps what the caller needs to rebuild
    the output (its structure and non-tensor leaves) and what the C++ side asks after the
    forward (backward_in_full: the function called FSDP2 modules). A single tensor in and
    out, the common case, takes the shortest path."""

    __slots__ = ("name", "function", "watch_batchnorm", "template", "spec", "leaves",
                 "is_tensor", "backward_in_full", "rewind")

    def __init__(self, name, function, inputs, watch_batchnorm):
        self.name = name
        self.function = function
        self.watch_batchnorm = watch_batchnorm
        self.template = None  # the non-tensor inputs in their slots, if there are any
        for a in inputs:
            if not isinstance(a, torch.Tensor):
                self.template = [None if isinstance(a, torch.Tensor) else a for a in inputs]
                break
        self.spec = None  # the output's structure; None: a single tensor
        self.leaves = None  # the forward's output leaves, until the caller took them
        self.is_tensor = None  # per leaf: a tensor? Set by the forward
        self.backward_in_full = False
        # A function's (watch_batchnorm): (buffer, its value at the forward's start) of the
        # buffers its forward changed, of the modules it called (_BuffersSeen).
        self.rewind = ()

    def __call__(self, tensors):
        template = self.template
        if template is not None:
            tensors = [a if t is None else t for a, t in zip(template, tensors)]
        if self.is_tensor is None:
            return self._forward(tensors)
        # The recompute (in backward; the C++ side has set the forward's RNG and autocast
        # state, grad mode and the recompute flag, and puts the buffers back after it).
        if self.watch_batchnorm:
            # The buffers the forward changed begin as the forward found them (as a module's
            # do: rewound_buffers), and are put back after.
            after = [(b, b.detach().clone()) for b, _ in self.rewind]
            put_back(self.rewind)
            try:
                with _BatchNormStatisticsKept():
                    outputs = self.function(*tensors)
            finally:
                put_back(after)
        else:
            outputs = self.function(*tensors)
        if self.spec is None and isinstance(outputs, torch.Tensor):
            return [outputs]
        leaves, _ = _flatten(outputs)
        if len(leaves) != len(self.is_tensor):
            raise RuntimeError(
                f"{self.name}: the function returned {len(self.is_tensor)} values in forward but "
                f"{len(leaves)} when recomputed in backward; it must do the same both times")
        result = []
        for leaf, was_tensor in zip(leaves, self.is_tensor):
            if not was_tensor:
                continue
            if not isinstance(leaf, torch.Tensor):
                raise RuntimeError(
                    f"{self.name}: an output that was a tensor in forward is {_describe(leaf)} "
                    f"when recomputed in backward; the function must do the same both times")
            result.append(leaf)
        return result

    def _forward(self, inputs):
        fsdp_modules = []
        if self.watch_batchnorm:  # a function: its modules are known as it calls them
            seen = _BuffersSeen()
            with _fsdp_calls_noted(fsdp_modules), seen:
                outputs = self.function(*inputs)
            self.rewind = seen.changed()
        else:
            with _fsdp_calls_noted(fsdp_modules):
                outputs = self.function(*inputs)
        self.backward_in_full = bool(fsdp_modules)
        if isinstance(outputs, torch.Tensor):
            self.is_tensor = _ONE_TENSOR
            return [outputs]
        leaves, self.spec = tree_flatten(outputs)  # no tensor among them: nothing to recompute
        self.is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        self.leaves = leaves
        return [x for x in leaves if isinstance(x, torch.Tensor)]


_ONE_TENSOR = (True,)


def _flatten(outputs):
    """tree_flatten, with the common single-tensor output spared pytree's cost."""
    if isinstance(outputs, torch.Tensor):
        return [outputs], None
    return tree_flatten(outputs)


def _run(name, function, length, args, preserve_rng_state, buffers, watch_batchnorm,
         rewound=()):
    """function(*args[:length]) checkpointed, args[length:] its parameters (checked), the
    buffers put back after the recompute; with watch_batchnorm, also those of every
    BatchNorm the recompute calls (a function, whose modules are not known in advance).
    rewound: those of the buffers the recompute begins from as the forward found them
    (rewound_buffers)."""
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"{name}: preserve_rng_state must be a bool, got {_describe(preserve_rng_state)}")
    inputs = args[:length]
    if not torch.is_grad_enabled():
        # Nothing to differentiate (no_grad, inference): an ordinary call. (Without an input
        # or parameter that requires grad, _C.checkpoint makes it an ordinary call too.)
        return function(*inputs)
    segment = _Segment(name, function, inputs, watch_batchnorm)
    tensors = _C.checkpoint(segment, inputs, args[length:], preserve_rng_state, buffers, name,
                            _HOW_TO_LIST, list(rewound))
    if segment.spec is None:
        return tensors[0]
    tensors = iter(tensors)
    leaves = [next(tensors) if t else x for x, t in zip(segment.leaves, segment.is_tensor)]
    segment.leaves = None
    return tree_unflatten(leaves, segment.spec)


def checkpoint(function: Callable, *args, params: Optional[Sequence[torch.Tensor]] = None,
               preserve_rng_state: bool = True, **kwargs):
    """function(*args, **kwargs), keeping none of its activations: they are recomputed in
    backward.

    Forward runs ``function`` under no_grad and saves only its tensor inputs (parameters exist
    anyway). Backward runs it again with grad mode on, with the forward's RNG and autocast
    state, and takes the gradients of exactly its inputs and parameters.

    Args:
        function (Callable): an ``nn.Module`` (its parameters are collected, and its buffers
            are restored after the recompute), or any callable.
        *args: its inputs. Tensors that require grad get gradients, also inside lists,
            tuples and dicts; anything else is passed through as it is. Its output may be
            any structure (tensor, tuple, list, dict ...); one without a floating-point
            tensor is returned as it is (nothing to recompute).
        **kwargs: its keyword inputs (``layer(x, attn_mask=m)``), treated as the positional
            ones: tensors are saved and recomputed, and get gradients when they require
            grad; anything else is passed through. (``params`` and ``preserve_rng_state``
            are this function's own.)
        params (Sequence[Tensor], optional): the tensors requiring grad that ``function``
            uses besides its inputs (for a Module: besides its parameters).
        preserve_rng_state (bool, optional): restore the forward's RNG state (CPU, and every
            CUDA device holding an input or parameter) for the recompute. Default: ``True``.

    Returns:
        What ``function(*args)`` returns, in the same structure.

    Raises:
        RuntimeError: in backward, if ``function`` uses a tensor that requires grad but is
            neither an input nor listed (its gradient would be lost); in forward, if it
            modifies an input in place; in backward, if it returns something else when
            recomputed, or on a second backward through it without ``retain_graph=True``
            in the first.
        TypeError: for a ``function`` that is not callable or a non-bool
            ``preserve_rng_state``.

    .. note::
        BatchNorm is updated once: a Module's buffers (its tree's) are put back after the
        recompute, and for a plain function every torch ``_BatchNorm`` module its recompute
        calls has its running statistics put back as the forward left them. Double backward
        (``create_graph=True``, e.g. a gradient penalty) works as without a checkpoint:
        the recompute then keeps the inputs' history, so the gradients are differentiable
        (an FSDP2 segment is the exception: a clear error when the second backward reaches
        it). Under ``torch.compile`` the checkpoint runs as in eager mode.
        See the module docstring for DDP, FSDP2 and torch.compile.
    """
    name = "memlean.checkpoint"
    if isinstance(function, torch.nn.Module):
        listed = module_parameters(function)
        buffers = _module_buffers(function)
        rewound = rewound_buffers([function], buffers)
    else:
        listed, buffers, rewound = [], [], []
        if not callable(function):
            _check_arguments(name, function, len(args), args)  # raises
    if params is not None:
        extra = [params] if isinstance(params, torch.Tensor) else list(params)
        ids = {id(p) for p in listed}
        listed += [p for p in extra if id(p) not in ids]
        _check_arguments(name, function, len(args), args + tuple(listed))
    return _call(name, function, args, kwargs, listed, buffers, preserve_rng_state,
                 watch_batchnorm=not isinstance(function, torch.nn.Module), rewound=rewound)


_CONTAINERS = (list, tuple, dict)


def _call(name, function, args, kwargs, listed, buffers, preserve_rng_state, watch_batchnorm,
          rewound=()):
    """function(*args, **kwargs) checkpointed, `listed` its parameters, `buffers` put back
    after the recompute (`rewound` of them rewound for it: _run): memlean.checkpoint's core,
    and memlean.fit's for a module whose forward it wraps (function: the module's own
    forward, listed and buffers: its tree's)."""
    if kwargs or any(isinstance(a, _CONTAINERS) for a in args):
        # Keyword inputs, and tensors inside lists, tuples and dicts, travel as positional
        # inputs (the leaves of the arguments) and are handed back in their places: one path
        # for saving, recomputing and differentiating every input tensor.
        leaves, spec = tree_flatten((args, kwargs))
        target = function

        def function(*inputs):  # noqa: F811  (the callable the checkpoint runs)
            a, k = tree_unflatten(list(inputs), spec)
            return target(*a, **k)

        args = tuple(leaves)
    return _run(name, function, len(args), args + tuple(listed), preserve_rng_state, buffers,
                watch_batchnorm, rewound)


# What wrap_forward sets on a module (and its undo puts back as it was).
_WRAPPED = ("forward", "__deepcopy__", "__reduce_ex__")


def wrap_forward(module: torch.nn.Module, forward: Callable, rewrap=None) -> Callable:
    """Set ``forward`` over ``module``'s own, as an instance attribute (its hooks, its place in
    its parent and its state_dict keys unchanged); returns the undo, which puts back what was
    there (an earlier wrapper too). memlean.fit's checkpoint wraps and runs and
    memlean.lean.lean_forward set theirs so.

    ``rewrap``: ``(function, args)``, how a copy of the module is wrapped as it is:
    ``function(copy, *args)``, with a module-level function (pickle saves it by name) and
    arguments that pickle and deepcopy can copy (modules, memlean's runs); None: the copy is
    left unwrapped (e.g. the modules of a run, which their parent's rewrap wraps again).

    ``copy.deepcopy`` of the module, alone or within its model (an EMA copy, torch's
    AveragedModel), gives the copy a forward of its own: the copy is made without this wrapper
    (with what was there before, itself copied so), then wrapped by ``rewrap`` with its
    arguments copied alike. A function set as a forward is copied as itself: the copy's
    forward would run the original's modules, in silence.

    ``pickle`` (``torch.save(model)``, a spawned process's argument) saves the module without
    its wrappers, and each ``rewrap`` in the order they were set: loading makes the module
    and wraps it again (since 2026-11-30; before, a TypeError: the wrappers are functions of
    this process, which pickle cannot save). ``copy.copy`` of the module goes the same way,
    its parts shared: a wrapper over its own modules (a checkpoint, a lean backward) is made
    for the copy; one over a run of its submodules raises a TypeError (the run's modules are
    the original's)."""
    def mine():
        return {k: module.__dict__[k] for k in _WRAPPED if k in module.__dict__}

    def put(state):
        for k in _WRAPPED:
            module.__dict__.pop(k, None)
        module.__dict__.update(state)

    before = mine()

    def deepcopy(memo):
        current = mine()
        put(before)
        try:
            twin = copy.deepcopy(module, memo)
        finally:
            put(current)
        if rewrap is not None:
            function, args = rewrap
            function(twin, *copy.deepcopy(args, memo))
        return twin

    def reduce_ex(protocol):
        current = mine()
        put(before)
        try:
            if "__reduce_ex__" in before:  # (an earlier wrapper: its state, its rewraps)
                make, make_args, (state, rewraps) = before["__reduce_ex__"](protocol)[:3]
            else:
                make, make_args = _new_wrapped, (type(module),)
                # (the class's own state: an nn.RNN's leaves out its flat weights)
                state, rewraps = type(module).__getstate__(module), []
                if state is module.__dict__:
                    state = dict(state)
        finally:
            put(current)
        rewraps = rewraps + ([rewrap] if rewrap is not None else [])
        return make, make_args, (state, rewraps)

    def undo():
        put(before)

    reduce_ex.__memlean_undo__ = undo  # (unwrap_forwards: a module loaded or copied so)
    put({"forward": forward, "__deepcopy__": deepcopy, "__reduce_ex__": reduce_ex})
    return undo


def unwrap_forwards(module: torch.nn.Module) -> int:
    """Undo every wrapper wrap_forward set on ``module`` (the last first), those made again
    by loading or copying it included; returns how many. A forward set otherwise (as an
    instance attribute, by the caller) stays."""
    count = 0
    while True:
        reduce_ex = module.__dict__.get("__reduce_ex__")
        undo = getattr(reduce_ex, "__memlean_undo__", None)
        if undo is None:
            return count
        undo()
        count += 1


def _new_wrapped(cls) -> torch.nn.Module:
    """A module of class `cls` to be loaded (pickle) or copied (copy.copy) as wrap_forward
    wrapped one: its __setstate__ (_set_wrapped_state, an instance attribute until it runs)
    sets the state and makes the wrappers again. (The state comes after the module is made:
    it may refer to it, as a run refers to its parent.)"""
    module = cls.__new__(cls)
    module.__dict__["__setstate__"] = lambda state: _set_wrapped_state(module, state)
    return module


def _set_wrapped_state(module: torch.nn.Module, state) -> None:
    """The state of a module wrap_forward wrapped, as nn.Module sets it, then its wrappers
    made again in the order they were set."""
    del module.__dict__["__setstate__"]
    base, rewraps = state
    module.__setstate__(base)
    for function, args in rewraps:
        function(module, *args)


def checkpoint_module_forward(module: torch.nn.Module, forward: Callable, args, kwargs):
    """``forward(*args, **kwargs)`` checkpointed as ``memlean.checkpoint(module, ...)`` would
    checkpoint ``module``: its parameters listed, its tree's buffers put back after the
    recompute. ``forward`` is the module's own (unwrapped) forward: memlean.fit puts a
    function calling this in place of a module's forward, so the module keeps its hooks,
    its place in its parent and its state_dict keys."""
    buffers = _module_buffers(module)
    return checkpoint_run_forward(forward, module_parameters(module), buffers,
                                  rewound_buffers([module], buffers), args, kwargs)


def checkpoint_run_forward(forward: Callable, params: List[torch.Tensor],
                           buffers: List[torch.Tensor], rewound: List[torch.Tensor], args,
                           kwargs):
    """``forward(*args, **kwargs)`` checkpointed with ``params`` listed and ``buffers`` put
    back after the recompute (``rewound`` of them rewound for it: rewound_buffers):
    memlean.fit's checkpointed module (its own forward) or run of sibling modules (forward
    calls their own forwards in turn; params and buffers are all of theirs, each once)."""
    return _call("memlean.fit", forward, tuple(args), kwargs, params, buffers, True,
                 watch_batchnorm=False, rewound=rewound)


class CheckpointFunction:
    """pytorch-checkpoint's call form: CheckpointFunction.apply(function, n, *args).

    args holds the n inputs of function, then the parameters it uses (e.g.
    prev_features + tuple(norm1.parameters()) + tuple(conv1.parameters())). Same behaviour
    as memlean.checkpoint; the RNG state is preserved.
    """

    @staticmethod
    def apply(function: Callable, n: int, *args):
        _check_arguments("memlean.CheckpointFunction", function, n, args)
        return _run("memlean.CheckpointFunction", function, n, args, True, [], True)
