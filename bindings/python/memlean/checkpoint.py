"""Checkpointing: run a segment of a model without keeping its activations, and recompute
them in backward (seed 003's CheckpointFunction, with RNG preservation, buffers, replicas).

    import memlean
    y = memlean.checkpoint(block, x)                           # an nn.Module: its parameters
    y = memlean.checkpoint(fn, x, h, params=[w, b])            # any callable: list what it uses
    y = memlean.CheckpointFunction.apply(fn, 2, x, h, w, b)    # seed 003's call form

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
per training step: every torch BatchNorm module the recompute calls (any _BatchNorm:
BatchNorm1d/2d/3d, SyncBatchNorm, subclasses such as timm's BatchNormAct2d) has its
running statistics put back as the forward left them after the recompute, whether the
segment is an nn.Module, a plain function or a checkpoint_sequential chain of callables;
an nn.Module's other buffers are restored after the recompute too. (Only modules are seen:
a bare F.batch_norm call on tensors of your own is updated by the recompute too.)

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

This is the Python implementation of the same design as the C++ memlean::checkpoint
(ops/checkpoint/checkpoint.h): Python callables are run from a Python autograd.Function.
is_recomputing() is one flag, kept in C++, shared with the C++ checkpoint, and so are the
recompute's gradients and their check (memlean::recomputed_grad). checkpoint_sequential and
the segment planner are in memlean/sequential.py, as ops/checkpoint/sequential.h is apart
from checkpoint.h.
"""
import contextlib
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
    BatchNormAct2d's activation and dropout)."""

    __slots__ = ("kept", "calls")

    def __init__(self):
        self.kept = {}  # id(module) -> (module, [(buffer, copy)])
        self.calls = _ModuleCallsSeen(self._keep)

    def _keep(self, module):
        if not isinstance(module, _BatchNorm) or id(module) in self.kept:
            return
        buffers = [b for b in module._buffers.values()
                   if isinstance(b, torch.Tensor) and not torch.nn.parameter.is_lazy(b)]
        with torch.no_grad():
            self.kept[id(module)] = (module, [(b, b.clone()) for b in buffers])

    def __enter__(self):
        self.calls.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self.calls.__exit__(*exc)
        finally:
            with torch.no_grad():
                for _, pairs in self.kept.values():
                    for b, c in pairs:
                        b.data.copy_(c)
        return False


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


# ---- RNG, autocast, buffers --------------------------------------------------------------


def _cuda_devices(tensors):
    devices = []
    for t in tensors:
        if t.is_cuda:
            index = t.get_device()
            if index not in devices:
                devices.append(index)
    return devices


def _get_rng_state(devices):
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


_AUTOCAST_DEVICES = ("cpu", "cuda")


def _autocast_state():
    return [(torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES]


def _set_autocast_state(state):
    for d, (enabled, dtype) in zip(_AUTOCAST_DEVICES, state):
        torch.set_autocast_enabled(d, enabled)
        torch.set_autocast_dtype(d, dtype)


class _BuffersKept:
    """`with _BuffersKept(buffers):` copies the buffers, and puts the copies back on exit
    without bumping their version counters (as batch norm's in-kernel statistics updates do
    not), so saved graphs stay valid."""

    __slots__ = ("buffers", "copies")

    def __init__(self, buffers):
        self.buffers = buffers
        self.copies = None

    def __enter__(self):
        if self.buffers:
            with torch.no_grad():
                self.copies = [b.clone() for b in self.buffers]
        return self

    def __exit__(self, *exc):
        if self.copies is not None:
            with torch.no_grad():
                for b, c in zip(self.buffers, self.copies):
                    b.data.copy_(c)
        return False


def _recompute(segment, inputs):
    """segment.function(*inputs) again, as the forward ran it: with the forward's RNG state
    (when preserved) and autocast state, grad enabled and the recompute flag set; afterwards
    the RNG and autocast states are the caller's again, and the buffers of the checkpointed
    module and of every BatchNorm called are as the forward left them. Plain try/finally
    and small context classes: this runs once per segment in every backward."""
    rng = segment.rng
    if rng is not None:
        devices = segment.devices
        caller_rng = _get_rng_state(devices)
        torch.set_rng_state(rng[0])
        for d, state in zip(devices, rng[1]):
            torch.cuda.set_rng_state(state, d)
    try:
        caller_autocast = _autocast_state()
        autocast_differs = caller_autocast != segment.autocast
        if autocast_differs:
            _set_autocast_state(segment.autocast)
        try:
            with _BuffersKept(segment.buffers), _C.Recomputing(), \
                    _BatchNormStatisticsKept(), torch.enable_grad():
                return segment.function(*inputs)
        finally:
            if autocast_differs:
                _set_autocast_state(caller_autocast)
    finally:
        if rng is not None:
            torch.set_rng_state(caller_rng[0])
            for d, state in zip(devices, caller_rng[1]):
                torch.cuda.set_rng_state(state, d)


def module_parameters(module: torch.nn.Module) -> List[torch.Tensor]:
    """A module's parameters, also for DataParallel replicas (whose parameters are plain
    attributes, kept in _former_parameters, so module.parameters() is empty)."""
    if not module._modules and not getattr(module, "_is_replica", False):
        # A leaf module (the common segment): no tree to walk (one parameter registered
        # under two names is still listed once).
        return list({id(p): p for p in module._parameters.values()
                     if isinstance(p, torch.Tensor)}.values())
    params, seen = [], set()
    for m in module.modules():
        source = m._former_parameters if getattr(m, "_is_replica", False) else m._parameters
        for p in source.values():
            if isinstance(p, torch.Tensor) and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params


def _module_buffers(module):
    if not module._modules:
        return [b for b in module._buffers.values() if b is not None]
    return [b for b in module.buffers() if b is not None]


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


def _check_outputs(name, leaves):
    if not any(isinstance(x, torch.Tensor) for x in leaves):
        got = ", ".join(_describe(x) for x in leaves) or "nothing"
        raise TypeError(
            f"{name}: the function returned no tensor (it returned {got}); a checkpointed "
            f"function must return at least one tensor"
        )


# The remedy named when the recomputed graph reaches a leaf the checkpoint was not given
# (memlean._C.recomputed_grad checks it, as the C++ checkpoint does).
_HOW_TO_LIST = ("Pass it in params= (memlean.checkpoint) or among the parameters after the n "
                "inputs (CheckpointFunction.apply).")


# ---- the autograd function ---------------------------------------------------------------


class _Segment:
    """One checkpoint call: its options, and what its forward leaves for the backward (one
    slotted object, attached to ctx once: attribute writes on ctx cost more)."""

    __slots__ = ("name", "preserve_rng_state", "buffers", "function", "length", "spec",
                 "template", "slots", "repeated", "devices", "rng", "autocast", "fsdp",
                 "is_tensor")

    def __init__(self, name, function, length, preserve_rng_state, buffers):
        self.name = name
        self.function = function
        self.length = length
        self.preserve_rng_state = preserve_rng_state
        self.buffers = buffers
        self.spec = None  # the structure of the outputs, set by forward


def _flatten(outputs):
    """tree_flatten, with the common single-tensor output spared pytree's cost."""
    if isinstance(outputs, torch.Tensor):
        return [outputs], None
    return tree_flatten(outputs)


def _unflatten(leaves, spec):
    return leaves[0] if spec is None else tree_unflatten(list(leaves), spec)


class _Checkpoint(torch.autograd.Function):
    """args: the `segment.length` inputs of its function, then the parameters it uses.
    Returns the leaves of the function's output (segment.spec is its structure)."""

    @staticmethod
    def forward(ctx, segment, *args):
        ctx.set_materialize_grads(False)
        ctx.segment = segment
        length = segment.length
        inputs = args[:length]
        params = args[length:]
        slots = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        segment.slots = slots
        segment.template = [None if isinstance(a, torch.Tensor) else a for a in inputs]
        # A parameter listed twice gets its gradient once (the engine would add both).
        ids = [id(p) for p in params]
        if len(set(ids)) == len(ids):
            segment.repeated = None
        else:
            seen = set()
            segment.repeated = []
            for i in ids:
                segment.repeated.append(i in seen)
                seen.add(i)
        tensors = [inputs[i] for i in slots]
        tensors += params
        # A tensor on a GPU implies CUDA is initialized: skip the scan otherwise.
        devices = _cuda_devices(tensors) if torch.cuda.is_initialized() else []
        segment.devices = devices
        segment.rng = _get_rng_state(devices) if segment.preserve_rng_state else None
        segment.autocast = _autocast_state()

        versions = [inputs[i]._version for i in slots]
        fsdp_modules = []
        with _fsdp_calls_noted(fsdp_modules):
            outputs = segment.function(*inputs)
        segment.fsdp = bool(fsdp_modules)
        for i, v in zip(slots, versions):
            if inputs[i]._version != v:
                raise RuntimeError(
                    f"{segment.name}: the function modified its input {i} in place; a "
                    f"checkpointed function must not modify its inputs (the recompute in "
                    f"backward would see the modified values). Clone the input first, or start "
                    f"the segment after the in-place op."
                )
        leaves, segment.spec = _flatten(outputs)
        _check_outputs(segment.name, leaves)
        segment.is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        ctx.save_for_backward(*tensors)
        return tuple(leaves)

    @staticmethod
    def backward(ctx, *grad_outputs):
        create_graph = torch.is_grad_enabled()
        with torch.no_grad():
            grads = _Checkpoint._backward(ctx, grad_outputs)
        if not create_graph:
            return grads
        # create_graph=True: the gradients are returned, but differentiating them again is
        # an error (the recomputed graph is not connected to the outer one). Unlike
        # @once_differentiable, also when the incoming gradients do not require grad (a
        # gradient penalty would otherwise silently lose this segment's part).
        where = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor) and g.is_floating_point()]
        if not where:
            return grads
        error = torch._C._functions.DelayedError(
            f"{ctx.segment.name}: double backward (create_graph=True) through a checkpoint is "
            f"not supported".encode(), len(where))
        wrapped = error(*[grads[i].detach().requires_grad_(True) for i in where])
        if isinstance(wrapped, torch.Tensor):
            wrapped = (wrapped,)
        grads = list(grads)
        for i, w in zip(where, wrapped):
            grads[i] = w
        return tuple(grads)

    @staticmethod
    def _backward(ctx, grad_outputs):
        segment = ctx.segment
        name = segment.name
        try:
            saved = ctx.saved_tensors
        except RuntimeError as e:
            if "backward through the graph a second time" not in str(e):
                raise  # e.g. an input modified in place since the forward
            raise RuntimeError(
                f"{name}: backward ran through this checkpoint a second time, but the first "
                f"backward freed the inputs it saved. Pass retain_graph=True to the first "
                f"backward to run backward twice."
            ) from None
        n_in = len(segment.slots)
        detached = []
        for t in saved[:n_in]:
            d = t.detach()
            d.requires_grad_(t.requires_grad)
            detached.append(d)
        params = saved[n_in:]
        inputs = list(segment.template)
        for slot, d in zip(segment.slots, detached):
            inputs[slot] = d

        outputs = _recompute(segment, inputs)
        leaves, _ = _flatten(outputs)
        if len(leaves) != len(segment.is_tensor):
            raise RuntimeError(
                f"{name}: the function returned {len(segment.is_tensor)} values in forward but "
                f"{len(leaves)} when recomputed in backward; it must do the same both times"
            )
        outs, grads = [], []
        for leaf, was_tensor, g in zip(leaves, segment.is_tensor, grad_outputs):
            if not was_tensor:
                continue
            if not isinstance(leaf, torch.Tensor):
                raise RuntimeError(
                    f"{name}: an output that was a tensor in forward is {_describe(leaf)} when "
                    f"recomputed in backward; the function must do the same both times"
                )
            if leaf.requires_grad and g is not None:
                outs.append(leaf)
                grads.append(g)

        if segment.fsdp:
            return _fsdp_backward(segment, detached, params, outs, grads)
        args = detached + list(params)
        repeated = segment.repeated
        targets, where = [], []
        for k, t in enumerate(args):
            if repeated is not None and k >= n_in and repeated[k - n_in]:
                continue
            if t.requires_grad:
                targets.append(t)
                where.append(k)
        result = [None] * len(args)
        if outs and targets:
            got = _C.recomputed_grad(outs, targets, grads, name, _HOW_TO_LIST)
            for k, g in zip(where, got):
                result[k] = g

        input_grads = [None] * segment.length
        for slot, g in zip(segment.slots, result[:n_in]):
            input_grads[slot] = g
        return (None, *input_grads, *result[n_in:])


def _fsdp_backward(segment, detached, params, outs, grads):
    """Backward of a segment that called FSDP2 (fully_shard) modules.

    Their forward hooks ran again in the recompute: they gathered the sharded parameters
    into unsharded tensors, which the recomputed graph uses (not the sharded parameters
    listed), and hooked that graph so that FSDP gathers them for its backward and
    reduce-scatters the gradients they accumulate into the sharded parameters' .grad. So the
    recomputed graph's backward is run here, accumulating as FSDP expects, and only the
    inputs' gradients are returned. Every leaf of the recomputed graph gets its gradient
    (none is lost), each once; the parameters get theirs here, not from the outer backward.
    """
    if outs:
        torch.autograd.backward(outs, grads)
    input_grads = [None] * segment.length
    for slot, d in zip(segment.slots, detached):
        input_grads[slot] = d.grad if d.requires_grad else None
    return (None, *input_grads, *([None] * len(params)))


def _run(name, function, length, args, preserve_rng_state, buffers):
    _check_arguments(name, function, length, args)
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"{name}: preserve_rng_state must be a bool, got {_describe(preserve_rng_state)}")
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        # Nothing to differentiate: an ordinary call.
        outputs = function(*args[:length])
        _check_outputs(name, tree_flatten(outputs)[0])
        return outputs
    segment = _Segment(name, function, length, preserve_rng_state, buffers)
    leaves = _Checkpoint.apply(segment, *args)
    return _unflatten(leaves, segment.spec)


def checkpoint(function: Callable, *args, params: Optional[Sequence[torch.Tensor]] = None,
               preserve_rng_state: bool = True):
    """function(*args), keeping none of its activations: they are recomputed in backward.

    Forward runs ``function`` under no_grad and saves only its tensor inputs (parameters exist
    anyway). Backward runs it again with grad mode on, with the forward's RNG and autocast
    state, and takes the gradients of exactly its inputs and parameters.

    Args:
        function (Callable): an ``nn.Module`` (its parameters are collected, and its buffers
            are restored after the recompute), or any callable.
        *args: its inputs. Tensors that require grad get gradients; anything else is passed
            through as it is. Its output may be any structure (tensor, tuple, list, dict ...)
            holding at least one tensor.
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
            recomputed, or on a second backward without ``retain_graph=True``.
        TypeError: for a ``function`` that is not callable, a non-bool
            ``preserve_rng_state``, or an output without a tensor.

    .. note::
        BatchNorm is updated once: every torch ``_BatchNorm`` module the recompute calls has
        its running statistics put back as the forward left them. Double backward
        (``create_graph=True``) through a checkpoint is an error, raised when the second
        backward reaches it. Under ``torch.compile`` the checkpoint runs as in eager mode.
        See the module docstring for DDP, FSDP2 and torch.compile.
    """
    if isinstance(function, torch.nn.Module):
        listed = module_parameters(function)
        buffers = _module_buffers(function)
    else:
        listed, buffers = [], []
    if params is not None:
        extra = [params] if isinstance(params, torch.Tensor) else list(params)
        ids = {id(p) for p in listed}
        listed += [p for p in extra if id(p) not in ids]
    return _run("memlean.checkpoint", function, len(args), tuple(args) + tuple(listed),
                preserve_rng_state, buffers)


class CheckpointFunction:
    """Seed 003's call form: CheckpointFunction.apply(function, n, *args).

    args holds the n inputs of function, then the parameters it uses (e.g.
    prev_features + tuple(norm1.parameters()) + tuple(conv1.parameters())). Same behaviour
    as memlean.checkpoint; the RNG state is preserved.
    """

    @staticmethod
    def apply(function: Callable, n: int, *args):
        return _run("memlean.CheckpointFunction", function, n, args, True, [])
