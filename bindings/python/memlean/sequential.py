"""checkpoint_sequential and the segment planner: a chain of layers in checkpointed
segments, where the segments come from a count, explicit starts, or a plan that keeps the
modelled activation peak under a budget (memlean._C binds the C++ planner and argument
checks of ops/checkpoint/sequential.h, so both languages plan and check alike).

    import memlean
    y = memlean.checkpoint_sequential(model, 4, x)             # 4 segments (or a plan)
    plan = memlean.plan_segments(memlean.measure_layer_costs(model, x), budget_bytes=2**30)
    y = memlean.checkpoint_sequential(model, plan, x)

One loop for both languages: memlean.checkpoint_sequential runs the C++
memlean::checkpoint_sequential's loop (memlean._C.checkpoint_sequential) over the Python
layers, each segment a memlean::checkpoint: the same RNG, autocast, buffer and BatchNorm
handling, and the same errors, and a buffer shared by layers of a segment is copied and put
back once.
"""
import numbers
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from memlean import _C
from memlean.checkpoint import (_BatchNormStatisticsKept, _describe, _fsdp_calls_noted,
                                _module_buffers, module_parameters, rewound_buffers)

__all__ = [
    "LayerCost",
    "SegmentPlan",
    "checkpoint_sequential",
    "measure_layer_costs",
    "plan_segments",
]


@dataclass(frozen=True)
class LayerCost:
    """The memory one layer of a chain costs in training."""

    input_bytes: int  # its input: what a checkpoint starting at this layer keeps
    activation_bytes: int  # what its forward creates and keeps alive (saved tensors, output)


@dataclass(frozen=True)
class SegmentPlan:
    """Segments of a chain: starts[j] is the first layer of segment j (starts[0] == 0).

    estimated_peak_bytes: max over segments j of the inputs kept by the segments before j,
    plus segment j's input and activations (gradients and temporaries are not counted).
    fits_budget: whether that is within the budget asked for (True without a budget).
    """

    starts: List[int]
    estimated_peak_bytes: int
    fits_budget: bool = True

    @property
    def num_segments(self) -> int:
        return len(self.starts)


def _check_costs(costs):
    costs = list(costs)
    for i, c in enumerate(costs):
        if not isinstance(c, LayerCost):
            raise TypeError(f"memlean.plan_segments: costs[{i}] is {_describe(c)}, not a LayerCost")
    return costs


def plan_segments(costs: Sequence[LayerCost], budget_bytes: Optional[int] = None) -> SegmentPlan:
    """Segments for a chain with these layer costs (see memlean.measure_layer_costs).

    Without a budget: round(sqrt(n)) segments of (nearly) equal numbers of layers (Chen et
    al. 2016). With one: of the plans whose estimated peak fits, the one that recomputes the
    fewest layers (the longest last segment, which is not recomputed), then keeps the fewest
    bytes; if none fits, the plan with the lowest estimated peak, with fits_budget=False.
    The same planner as the C++ memlean::plan_segments.

    Args:
        costs (Sequence[LayerCost]): one per layer of the chain, in order.
        budget_bytes (int, optional): the activation memory the plan should fit in.

    Returns:
        SegmentPlan: the segments' starts, the estimated peak, whether it fits.

    Raises:
        TypeError: a cost that is not a LayerCost, a budget that is not an int.
        ValueError: a negative budget or cost.

    .. note::
        The estimate counts the inputs kept between segments and one segment's activations
        at a time; gradients and temporaries are not modelled, so compare it with what
        measure_layer_costs measured, not with a whole step's peak.
    """
    costs = _check_costs(costs)
    if budget_bytes is not None and (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)):
        raise TypeError(f"memlean.plan_segments: budget_bytes must be an int or None, got {_describe(budget_bytes)}")
    if budget_bytes is not None and budget_bytes < 0:
        raise ValueError(f"memlean.plan_segments: budget_bytes must be >= 0, got {budget_bytes}")
    for i, c in enumerate(costs):
        if c.input_bytes < 0 or c.activation_bytes < 0:
            raise ValueError(f"memlean.plan_segments: layer {i} has a negative cost ({c})")
    starts, peak, fits = _C.plan_segments([c.input_bytes for c in costs],
                                          [c.activation_bytes for c in costs], budget_bytes)
    return SegmentPlan(list(starts), int(peak), bool(fits))


def measure_layer_costs(functions, input: torch.Tensor) -> List[LayerCost]:
    """Run the chain once on ``input`` with grad mode on and measure each layer's cost.

    Args:
        functions (iterable): the layers (an ``nn.Sequential``, or modules and callables
            each taking and returning one tensor).
        input (Tensor): a sample input, of the size the chain will train on.

    Returns:
        List[LayerCost]: per layer, its input's storage bytes, and the bytes allocated
        while it ran that are still alive after the whole chain ran: its saved tensors, its
        output and whatever else it keeps.

    Raises:
        TypeError: an input or a layer output that is not a tensor.

    .. note::
        This is the C++ ``memlean::measure_layer_costs``'s measurement (one
        implementation): the allocations are counted exactly by the allocators' memory
        reports. Parameters and buffers already allocated are not counted, nor a storage
        allocated by an earlier layer. The chain's buffers (e.g. running statistics) and the
        RNG state are left as they were.

    .. warning::
        Under ``torch.profiler`` with ``profile_memory`` (which takes the same allocator
        reports) the allocations cannot be counted: each layer's cost is then its output's
        storage bytes alone.
    """
    layers = list(functions)
    name = "memlean.measure_layer_costs"
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{name}: input must be a tensor, got {_describe(input)}")
    buffers = [b for m in layers if isinstance(m, torch.nn.Module) for b in m.buffers()]
    costs = _C.measure_layer_costs(_Chain(name, layers), len(layers), buffers, input, name)
    return [LayerCost(*c) for c in costs]


class _Chain:
    """The layers of a Python chain as the C++ loop (memlean._C.checkpoint_sequential, and
    memlean._C.measure_layer_costs) runs them: chain(i, h) is layer i's output on h, a
    tensor (else a TypeError naming the layer). A layer that is not a module, recomputed,
    has the statistics of the BatchNorms it calls put back (a module's buffers are put back
    by the C++ loop); backward_in_full(begin, end) tells whether layers in [begin, end)
    called FSDP2 modules in their forward."""

    __slots__ = ("name", "layers", "fsdp_layers")

    def __init__(self, name, layers):
        self.name = name
        self.layers = layers
        self.fsdp_layers = set()

    def __call__(self, i, h):
        layer = self.layers[i]
        if _C.is_recomputing():
            if isinstance(layer, torch.nn.Module):
                out = layer(h)
            else:
                with _BatchNormStatisticsKept():
                    out = layer(h)
        else:
            found = []
            with _fsdp_calls_noted(found):
                out = layer(h)
            if found:
                self.fsdp_layers.add(i)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{self.name}: layer {i} returned {_describe(out)}, not a tensor")
        return out

    def backward_in_full(self, begin, end):
        return any(begin <= i < end for i in self.fsdp_layers)


def _segment_starts(segments, n):
    name = "memlean.checkpoint_sequential"
    accepted = ("an int (the number of segments), 'sqrt', a list of ints (the first layer of "
                "each segment) or a memlean.SegmentPlan")
    if isinstance(segments, SegmentPlan):
        segments = segments.starts
    if isinstance(segments, bool) or type(segments).__name__ == "bool_":
        raise TypeError(f"{name}: segments must be {accepted}, got a bool")
    if isinstance(segments, numbers.Integral):  # int, numpy's integers
        return list(_C.equal_segment_starts(n, int(segments), name))
    if isinstance(segments, str):
        if segments != "sqrt":
            raise ValueError(f"{name}: segments must be {accepted}, got {segments!r}")
        return list(_C.sqrt_segment_starts(n))
    if isinstance(segments, (bytes, dict, set, frozenset)) or not hasattr(segments, "__iter__"):
        raise TypeError(f"{name}: segments must be {accepted}, got {_describe(segments)}")
    starts = list(segments)
    for i, s in enumerate(starts):
        if isinstance(s, bool) or not isinstance(s, numbers.Integral):
            raise TypeError(f"{name}: segments must be {accepted}; segments[{i}] is {_describe(s)}, not an int")
    starts = [int(s) for s in starts]
    _C.check_segment_starts(starts, n, name)  # the C++ checkpoint_sequential's own checks
    return starts


def checkpoint_sequential(functions, segments, input, *, preserve_rng_state: bool = True):
    """Run a chain of layers in segments, each but the last checkpointed.

    Args:
        functions (iterable): the layers (an ``nn.Sequential``, or modules and callables
            each taking and returning one tensor).
        segments (int, str, Sequence[int] or SegmentPlan): a number of (nearly) equal
            segments, ``"sqrt"`` for round(sqrt(n)), the first layer of each segment, or a
            plan from :func:`plan_segments`.
        input (Tensor): the chain's input.
        preserve_rng_state (bool, optional): as for :func:`memlean.checkpoint`.
            Default: ``True``.

    Returns:
        Tensor: the chain's output.

    Raises:
        TypeError or ValueError: segments that are not one of the above, or starts that
        are not increasing from 0 and below the number of layers (the C++
        checkpoint_sequential's own checks, one specification); an input or a layer's
        output that is not a tensor.

    .. note::
        The last segment runs as usual: its backward comes first, so keeping its
        activations costs no more at the peak than recomputing them, and saves one
        recompute. Each other segment is a :func:`memlean.checkpoint` (RNG, autocast,
        buffers, BatchNorm counted once, the same errors); its modules' buffers are put back
        after its recompute, each once however many layers share it. The loop is the C++
        memlean::checkpoint_sequential's (one implementation), calling the layers back.
    """
    layers = list(functions)
    name = "memlean.checkpoint_sequential"
    starts = _segment_starts(segments, len(layers))
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{name}: input must be a tensor, got {_describe(input)}")
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"{name}: preserve_rng_state must be a bool, got {_describe(preserve_rng_state)}")
    modules = [m if isinstance(m, torch.nn.Module) else None for m in layers]
    buffers = [_module_buffers(m) if m is not None else [] for m in modules]
    return _C.checkpoint_sequential(
        _Chain(name, layers),
        [module_parameters(m) if m is not None else [] for m in modules], buffers,
        starts, input, preserve_rng_state, name, _HOW_TO_LIST,
        [rewound_buffers([m], b) if m is not None else [] for m, b in zip(modules, buffers)])


# The remedy named when a recomputed segment reaches a tensor requiring grad that is not a
# parameter of its modules (the C++ loop checks it and names this remedy).
_HOW_TO_LIST = ("Make it a parameter of a module of the chain (a layer that is a plain function "
                "cannot list tensors: make it an nn.Module that registers them).")
