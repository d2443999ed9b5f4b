"""Swish-beta, y = x * sigmoid(beta * x), in three variants with the same forward.

- ``"naive"``: the autograd composition ``x * torch.sigmoid(beta * x)``; saves x and the
  sigmoid (the baseline).
- ``"memory_efficient"`` (default): saves only x; backward recomputes sigmoid(beta * x).
- ``"inplace"``: overwrites x with y and saves one bit per element (which side of swish's
  minimum beta * x lies on); backward recovers x from y and the bit. As for any in-place
  op, a leaf that requires grad is refused, and a tensor saved earlier in the graph that is
  overwritten makes backward fail (version counter) instead of giving a wrong gradient.

beta is a constant: any finite real scalar (int, float, numpy's integer and floating
scalars such as np.float32(2.0) and 0-dim arrays, fractions.Fraction, or a 0-dim integer or
floating tensor that does not require grad), used as a Python float. bool (also
numpy.bool_), complex, strings, tensors of other shapes, and inf/nan are refused, as is a
tensor that requires grad (no gradient flows to beta; it would be lost silently).
"""
import math
import numbers
import sys

import torch

VARIANTS = ("naive", "memory_efficient", "inplace")


def _check_beta(beta):
    """beta as a Python float: any finite real scalar (see the module docstring)."""
    if type(beta) is not float and type(beta) is not int:  # the usual case needs no more
        beta = _real_scalar(beta)
    try:
        value = float(beta)
    except OverflowError:  # an int beyond float's range
        raise ValueError("memlean.swish: beta must be finite, got an int beyond float's range") from None
    if not math.isfinite(value):
        raise ValueError(f"memlean.swish: beta must be finite, got {value}")
    return value


def _real_scalar(beta):
    if isinstance(beta, torch.Tensor):
        if beta.dim() != 0:
            raise TypeError(
                f"memlean.swish: beta must be a real number or a 0-dim tensor, got a tensor of "
                f"shape {list(beta.shape)}")
        if beta.dtype == torch.bool or beta.is_complex():
            raise TypeError(f"memlean.swish: beta must be a real number, got a {beta.dtype} tensor")
        if beta.requires_grad:
            raise ValueError(
                "memlean.swish: beta is a constant (no gradient flows to it), but the tensor given "
                "requires grad; pass beta.detach() or a float, or use the naive formula "
                "x * torch.sigmoid(beta * x) to learn beta")
        return beta.item()
    if type(beta).__module__ == "numpy" and getattr(beta, "ndim", None) == 0 \
            and getattr(getattr(beta, "dtype", None), "kind", "") in ("i", "u", "f"):
        return beta.item()  # a 0-dim numpy array (what torch.compile makes of numpy scalars)
    # numbers.Real: int, float, fractions.Fraction, numpy's integer and floating scalars;
    # not complex, not numpy.bool_. bool is a Real (an int) too, but never meant as beta.
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real):
        raise TypeError(f"memlean.swish: beta must be a real number, got {_type_name(beta)}")
    return beta


def _type_name(value):
    t = type(value)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _check_variant(variant):
    if variant not in VARIANTS:
        raise ValueError(f"memlean.swish: unknown variant {variant!r}; expected one of {VARIANTS}")
    return variant


def _check_x(x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"memlean.swish: x must be a torch.Tensor, got {type(x).__name__}")


_FLOAT_MAX = torch.finfo(torch.float32).max


def _check_naive(x: torch.Tensor, beta: float, float_max: float = _FLOAT_MAX) -> None:
    # The same dtypes and beta range, and the same errors, as the operators behind the other
    # variants: the composition alone would promote integers to float32, accept complex
    # numbers, and turn a beta beyond float's range into inf (and inf * 0 into NaN). The
    # errors are the operator's own (ops/swish/internal/checks.cc): an input it refuses is
    # handed to it, empty, to raise them; valid input costs two comparisons, no call.
    # (Comparisons and a default argument, not a tuple and a global: TorchScript compiles
    # this too.)
    dtype = x.dtype
    if not (dtype == torch.float32 or dtype == torch.float64 or dtype == torch.bfloat16
            or dtype == torch.float16) or (dtype != torch.float64 and abs(beta) > float_max):
        torch.ops.memlean.swish(x.new_empty(0), beta)  # raises the operator's error


def _exporting_to_onnx() -> bool:
    # torch.onnx is imported by every ONNX export; not importing it here keeps eager fast.
    return "torch.onnx" in sys.modules and torch.onnx.is_in_onnx_export()


def _swish_inplace(x: torch.Tensor, beta: float) -> torch.Tensor:
    if _exporting_to_onnx():
        return _swish_inplace_for_onnx(x, beta)
    # Under torch.compile too: torch's own in-place silu_/mul_ fail there when x is a graph
    # input (AOTAutograd saves x, then copies the new value into it); memlean::swish_ saves
    # only y and its bits, and keeps its one-bit saving compiled.
    return _ops(x, beta, "inplace")


def _whole_base(x: torch.Tensor):
    """The tensor x views all of, element for element, where autograd records the in-place op
    on x (e.g. nn.Linear's output for a 3-d input: a view of its 2-d matmul result); else
    None. Overwriting x then overwrites that base, and autograd records an in-place op on a
    view as one on its base (CopySlices), whose backward makes a zeroed gradient of the base
    and copies into it: two more tensors of x's size at the backward. Overwriting the base
    itself, and returning a view of it, records none of that: the same memory written, the
    same values, a backward as for a tensor that is no view (x itself, if used again, gets
    its gradient through its base's history, as after any in-place op on a base)."""
    if type(x) is not torch.Tensor or not torch.is_grad_enabled() or not x.requires_grad:
        return None  # (first: an FX proxy or a tensor subclass is left alone)
    base = x._base
    if (base is None or type(base) is not torch.Tensor or base.is_leaf
            or base.dtype != x.dtype or base.numel() != x.numel()
            or base.storage_offset() != x.storage_offset()
            or not base.is_contiguous() or not x.is_contiguous()
            or torch.compiler.is_compiling() or _exporting_to_onnx()):
        return None
    return base


def _compiled(x: torch.Tensor, beta: float) -> torch.Tensor:
    """What torch.compile (and torch.export) trace for the memory-efficient variant: torch's
    own ops.

    A compiler's partitioner already keeps no more than x for backward and recomputes the
    sigmoid, and it fuses Swish into its neighbours (BatchNorm, the next op's prologue); an
    opaque custom op would stop both. So compiled, this variant is exactly F.silu (beta = 1)
    or x * sigmoid(beta * x): never worse than torch's own activation. memlean's kernel is
    for eager mode and LibTorch, where there is no compiler to do this.
    """
    return torch.nn.functional.silu(x) if beta == 1.0 else x * torch.sigmoid(x * beta)


def _swish_inplace_for_onnx(x: torch.Tensor, beta: float) -> torch.Tensor:
    # memlean::swish_ mutates x and returns nothing: the TorchScript exporter's dead-code
    # elimination drops it, and the dynamo exporter cannot translate its functionalized form.
    # Both export torch's in-place mul_ (as Sigmoid and Mul), also on a graph input.
    return x.mul_(torch.sigmoid(x if beta == 1.0 else x * beta))


def swish(x: torch.Tensor, beta: float = 1.0, variant: str = "memory_efficient") -> torch.Tensor:
    """Swish-beta of x with the given variant's backward (see the module docstring).

    x: a float32, float64, bfloat16 or float16 tensor. beta: any finite real scalar (1 is
    SiLU, 0 gives x / 2; see the module docstring for the types accepted). With
    variant="inplace", x is overwritten and returned; where x is a view of all of a tensor
    and autograd records the op (nn.Linear's output for a 3-d input), that tensor is
    overwritten and a view of it returned (the same memory; autograd's in-place-on-a-view
    machinery would hold two more tensors of x's size at the backward).
    """
    _check_x(x)
    return _swish(x, _check_beta(beta), _check_variant(variant))


def _swish(x: torch.Tensor, beta: float, variant: str) -> torch.Tensor:
    """memlean.swish and memlean.Swish.forward in Python (beta and variant checked)."""
    if variant == "inplace":
        base = _whole_base(x)
        if base is not None:
            _swish_inplace(base, beta)
            return base.view(x.shape)
        return _swish_inplace(x, beta)
    if variant != "naive" and torch.compiler.is_compiling():  # see _compiled: torch's ops,
        _check_naive(x, beta)                                   # fused by the compiler
        return _compiled(x, beta)
    return _ops(x, beta, variant)


def _ops(x: torch.Tensor, beta: float, variant: str) -> torch.Tensor:
    """Each variant as torch's ops or memlean's operator: what eager mode runs once the
    special cases (ONNX export, torch.compile) are out of the way, and all of it that
    TorchScript compiles (Swish.forward's scripted branch)."""
    if variant == "naive":
        _check_naive(x, beta)
        if beta == 1.0:
            return x * torch.sigmoid(x)
        return x * torch.sigmoid(x * beta)
    if variant == "inplace":
        torch.ops.memlean.swish_(x, beta)
        return x
    return torch.ops.memlean.swish(x, beta)


def swish_(x: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """In-place Swish-beta: overwrites x with y, saves one bit per element; returns x."""
    _check_x(x)
    return _swish_inplace(x, _check_beta(beta))


class Swish(torch.nn.Module):
    """nn.Module for Swish-beta, y = x * sigmoid(beta * x).

    variant: "naive", "memory_efficient" (default) or "inplace" (see memlean.swish).
    inplace: timm's activation convention (``act_layer(inplace=True)``): True selects the
    "inplace" variant when no variant is given; a variant given explicitly always wins, so
    ``functools.partial(memlean.Swish, variant="memory_efficient")`` works as timm's
    act_layer (timm then calls it with inplace=True, and gets the memory-efficient variant).

    Under torch.compile, the memory-efficient and in-place variants compute what nn.SiLU does
    (F.silu, or x * sigmoid(beta * x)), out of place: the compiler then fuses and recomputes
    the activation as it does torch's own, and a compiled model is never worse with memlean
    than with nn.SiLU. The variants' own savings are for eager mode and LibTorch.

        timm.create_model("efficientnet_b0", act_layer=memlean.Swish)   # in-place variant
        timm.create_model("efficientnet_b0",
                          act_layer=functools.partial(memlean.Swish, variant="memory_efficient"))
    """

    beta: float
    variant: str

    def __init__(self, beta: float = 1.0, variant: str = None, inplace: bool = False):
        super().__init__()
        self.beta = _check_beta(beta)
        if not isinstance(inplace, bool):
            raise TypeError(f"memlean.Swish: inplace must be a bool, got {type(inplace).__name__}")
        if variant is None:
            variant = "inplace" if inplace else "memory_efficient"
        self.variant = _check_variant(variant)  # an explicit variant wins over inplace=

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.jit.is_scripting():
            if self.variant == "inplace" and torch.compiler.is_compiling():
                # Compiled, the module computes out of place with torch's ops (see _compiled):
                # the compiler keeps and fuses no worse than for nn.SiLU, where the one-bit
                # custom op would be opaque to it. Overwriting x is an eager-mode memory saving;
                # memlean.swish_ and memlean.swish(variant="inplace") still overwrite x.
                _check_naive(x, self.beta)
                return _compiled(x, self.beta)
            return _swish(x, self.beta, self.variant)
        # TorchScript compiles this part only (it prunes the branch above).
        return _ops(x, self.beta, self.variant)

    def extra_repr(self) -> str:
        if self.variant == "memory_efficient":
            return f"beta={self.beta}"
        return f"beta={self.beta}, variant={self.variant!r}"


def _trace_swish_(x: torch.Tensor, beta: float = 1.0) -> None:
    """memlean::swish_ under torch.jit.trace (the Tracer dispatch key; only while tracing).

    The TorchScript ONNX exporter traces, then deletes nodes whose outputs are unused, side
    effects or not: a direct torch.ops.memlean.swish_ call would vanish from the exported
    model. During an ONNX export the trace records x.mul_(sigmoid(beta * x)) instead; any
    other trace records memlean::swish_ itself, as torch's tracer does.
    """
    if _exporting_to_onnx():
        _swish_inplace_for_onnx(x, beta)  # the tracer is still on here: recorded
        return
    state = torch._C._get_tracing_state()
    graph = state.graph()
    node = graph.create("memlean::swish_",
                        [torch._C._get_value_trace(x), graph.insertConstant(beta)], 0)
    graph.insertNode(node)
    torch._C._set_tracing_state(None)  # run the op itself untraced
    try:
        torch.ops.memlean.swish_(x, beta)
    finally:
        torch._C._set_tracing_state(state)


_TRACER_LIB = torch.library.Library("memlean", "IMPL")
_TRACER_LIB.impl("swish_", _trace_swish_, "Tracer")
