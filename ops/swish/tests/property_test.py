"""Property-based tests (hypothesis) of every Swish variant against a float64 reference.

Cases: shapes from 0-dim and empty to odd sizes and sizes that cross memlean's vector, block
(256) and thread (parallel_for grain) boundaries; layouts contiguous, permuted, sliced with
step 2, channels_last and expanded; dtypes float32, float64, bfloat16, float16; beta in
[-4, 4] (0, 1, -0.0 and subnormals included); values with |x| <= 20 (|beta x| <= 80: both
tails) plus points at and around swish's minimum x* = t*/beta. For each: the forward value
and the gradient (for a random upstream gradient) of naive, memory_efficient and inplace,
through memlean.swish, memlean.swish_, memlean.Swish and the operators torch.ops.memlean.swish
and torch.ops.memlean.swish_ directly; the in-place variant both on a non-leaf and on a view
of one (the gradient taken w.r.t. the leaf), with and without autograd.

Reference: float64 autograd of x * sigmoid(beta * x) at the input as rounded to its dtype.
Bounds, with u the unit roundoff of the dtype (half its eps: 2^-53, 2^-24, 2^-8 for bfloat16,
2^-11 for float16), ua that of the type memlean computes in (float64 for float64, float32
otherwise), t = beta x, s = sigmoid(t), tiny = the dtype's smallest subnormal, G the upstream
gradient:
- forward (memlean's kernels): |y - ref| <= (u + 8 ua (2 + |t| (1 - s))) |ref| + tiny: one
  rounding to the dtype, plus the math in ua (exp(-t) carries t's rounding, |t| ua, weighted
  by 1 - s, its share of the denominator).
- forward (naive, torch's ops in the dtype): t and sigmoid(t) are rounded too:
  (3u + u |t| (1 - s) + 8 ua (...)) |ref| + tiny (1 + |x|).
- gradient (memory_efficient): u |ref| + 8 ua (2 + |t|) |G| + tiny.
- gradient (naive): a first-order rounding analysis of torch's backward ops in the dtype
  (see naive_grad_bound).
- gradient (inplace): the README's bounds on the gradient's worst error against float64
  autograd (float32 2e-4, bfloat16 and float16 3e-2, float64 1e-8) times |G|, plus u |ref|.
Measured against these bounds (200k points per dtype and beta), the worst errors use 98-99.6%
of the half types' forward and memory_efficient gradient bounds (a half-ulp rounding), 50%
of the in-place gradient bound in bfloat16, 68% in float32.

How it runs: the hypothesis tests (test_inner_*) run only in a child process, started by the
outer tests with MEMLEAN_PROPERTY_DEVICE set: on CPU once per capability the CPU has
(ATEN_CPU_CAPABILITY=default, avx2, avx512; memlean picks its kernel copy from
at::get_cpu_capability(), so the variable selects memlean's kernels too; torch takes the
variable on trust, so a capability the CPU lacks is skipped rather than run into SIGILL),
and on CUDA when there is a GPU. Examples are derandomized (the same on every run) and
bounded in number.
"""
import contextlib
import dataclasses
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

import memlean

DEVICE = os.environ.get("MEMLEAN_PROPERTY_DEVICE") or None  # set in the child processes only
if os.environ.get("TEST_TMPDIR"):  # under Bazel: hypothesis's files (.hypothesis/) go there
    set_hypothesis_home_dir(os.path.join(os.environ["TEST_TMPDIR"], "hypothesis"))
inner = pytest.mark.skipif(DEVICE is None, reason="runs in the child processes of the outer tests")

T_STAR = -1.2784645427610738  # argmin of t * sigmoid(t)
XMAX = 20.0
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
U = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
INPLACE_BOUND = {torch.float32: 2e-4, torch.float64: 1e-8, torch.bfloat16: 3e-2, torch.float16: 3e-2}
# Examples per inner test and device. MEMLEAN_PROPERTY_EXAMPLES=N searches longer, with
# fresh random examples each run (e.g. 5000: minutes).
EXAMPLES = int(os.environ.get("MEMLEAN_PROPERTY_EXAMPLES", 200))

PROPERTY_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    # The same examples on every run and machine, unless asked to search further.
    derandomize="MEMLEAN_PROPERTY_EXAMPLES" not in os.environ,
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# The references and bounds run on one thread: on a loaded machine (a test suite on two
# cores) OpenMP's threads wait on each other, and a float64 op on 70k elements takes
# milliseconds instead of microseconds. memlean runs on two threads (or more where the machine
# has them), so that its kernels' parallel_for splits (elements past 4096 in backward, past
# 32768 in forward) are exercised.
MEMLEAN_THREADS = max(2, torch.get_num_threads())
if DEVICE is not None:
    torch.set_num_threads(1)


@contextlib.contextmanager
def memlean_threads():
    torch.set_num_threads(MEMLEAN_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(1)


def tiny(dtype):
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps


def acc_u(dtype):
    return U[torch.float64] if dtype == torch.float64 else U[torch.float32]


# ---- cases --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    shape: tuple
    layout: tuple  # ("contiguous",) ("permute", perm) ("slice", dim, start) ("channels_last",) ("expand", dim)
    beta: float
    seed: int
    scale: float  # values: N(0, scale^2) clipped to [-XMAX, XMAX]
    near_star: float  # the share of elements within 0.05 / |beta| of x*
    specials: tuple = ()  # the first elements (row-major), drawn by hypothesis itself
    as_view: bool = False  # in place: on a view of a non-leaf (else on a non-leaf with the layout)
    grad: bool = True  # with autograd (else the forward alone)
    entry: str = "function"  # memlean.swish / memlean.swish_ / memlean.Swish / torch.ops


def x_star(beta):
    """Swish's minimum in x, where it is a sensible point to probe (else None)."""
    if beta == 0:
        return None
    xs = T_STAR / beta
    return xs if abs(xs) <= 1000 else None


def special_values(beta):
    choices = [
        st.floats(-XMAX, XMAX, allow_nan=False),
        st.sampled_from([0.0, -0.0, XMAX, -XMAX, 1e-30, -1e-30]),
    ]
    xs = x_star(beta)
    if xs is not None:
        width = 0.05 / abs(beta)
        choices.append(st.just(xs))
        choices.append(st.floats(-1, 1).map(lambda e: xs + e * width))
        choices.append(st.floats(-1, 1).map(lambda e: xs + e * 1e-4 * width))
    return st.one_of(*choices)


@st.composite
def shapes(draw):
    if draw(st.integers(0, 5)) == 0:  # sizes that cross block and thread boundaries
        n = draw(st.sampled_from([255, 257, 1023, 4097, 33_001, 70_001]))
        return (n,) if draw(st.booleans()) else (n // 7 + 1, 7)
    ndim = draw(st.integers(0, 4))
    cap = {0: 0, 1: 300, 2: 40, 3: 12, 4: 7}[ndim]
    size = st.one_of(st.integers(0, cap), st.sampled_from([1, 3, 7, min(cap, 17)]))
    return tuple(draw(st.lists(size, min_size=ndim, max_size=ndim)))


@st.composite
def layouts(draw, shape, expand):
    ndim = len(shape)
    kinds = ["contiguous"]
    if ndim >= 2:
        kinds.append("permute")
    if ndim >= 1:
        kinds.append("slice")
    if ndim == 4:
        kinds.append("channels_last")
    if expand and ndim >= 1:
        kinds.append("expand")
    kind = draw(st.sampled_from(kinds))
    if kind == "permute":
        return (kind, tuple(draw(st.permutations(range(ndim)))))
    if kind == "slice":
        return (kind, draw(st.integers(0, ndim - 1)), draw(st.integers(0, 1)))
    if kind == "expand":
        return (kind, draw(st.integers(0, ndim - 1)))
    return (kind,)


@st.composite
def cases(draw, expand=False, entries=("function",)):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(shapes())
    layout = draw(layouts(shape, expand))
    beta = draw(st.one_of(st.sampled_from([0.0, 1.0, -1.0, 0.5, 4.0, -4.0]),
                          st.floats(-4.0, 4.0, allow_nan=False),
                          st.floats(-4.0, 4.0, allow_nan=False, allow_subnormal=False)))
    return Case(
        dtype=dtype, shape=shape, layout=layout, beta=beta,
        seed=draw(st.integers(0, 2**31 - 1)),
        scale=draw(st.sampled_from([0.1, 1.0, 4.0, 30.0])),
        near_star=draw(st.sampled_from([0.0, 0.0, 0.3, 1.0])),
        specials=tuple(draw(st.lists(special_values(beta), max_size=6))),
        as_view=layout[0] == "slice" or draw(st.booleans()),
        grad=draw(st.integers(0, 4)) > 0,
        entry=draw(st.sampled_from(entries)),
    )


def logical_values(case, gen):
    """The float64 values of x (its logical shape), before rounding to the dtype."""
    n = math.prod(case.shape)
    v = (torch.randn(n, generator=gen, dtype=torch.float64) * case.scale).clamp_(-XMAX, XMAX)
    xs = x_star(case.beta)
    if xs is not None and case.near_star > 0 and n > 0:
        pick = torch.rand(n, generator=gen, dtype=torch.float64) < case.near_star
        jitter = (torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1) * 0.05 / abs(case.beta)
        v = torch.where(pick, xs + jitter, v)
    k = min(n, len(case.specials))
    v[:k] = torch.tensor(case.specials[:k], dtype=torch.float64)
    return v.reshape(case.shape)


def materialize(case, gen):
    """(base, view): a contiguous float64 tensor and the function that makes x from it.

    view(base) has the case's shape and layout and holds logical_values(case) (the slice
    layout's base also holds random values between the elements of x)."""
    values = logical_values(case, gen)
    kind, shape, ndim = case.layout[0], case.shape, len(case.shape)
    if kind == "contiguous":
        return values.clone(), lambda b: b
    if kind == "permute":
        perm = case.layout[1]
        inverse = tuple(sorted(range(ndim), key=lambda i: perm[i]))
        return values.permute(perm).contiguous(), lambda b: b.permute(inverse)
    if kind == "channels_last":
        return values.permute(0, 2, 3, 1).contiguous(), lambda b: b.permute(0, 3, 1, 2)
    if kind == "slice":
        _, dim, start = case.layout
        base_shape = list(shape)
        base_shape[dim] = start + 2 * shape[dim] + 1
        base = (torch.randn(base_shape, generator=gen, dtype=torch.float64) * 4).clamp_(-XMAX, XMAX)
        index = [slice(None)] * ndim
        index[dim] = slice(start, start + 2 * shape[dim], 2)
        index = tuple(index)
        base[index] = values
        return base, lambda b: b[index]
    if kind == "expand":
        dim = case.layout[1]
        if shape[dim] == 0:
            return values.clone(), lambda b: b
        return values.narrow(dim, 0, 1).contiguous(), lambda b: b.expand(shape)
    raise AssertionError(kind)


def upstream(shape, dtype, gen):
    """A random upstream gradient, |G| in [0.25, 2] (no subnormals: they round coarsely)."""
    mag = torch.rand(shape, generator=gen, dtype=torch.float64) * 1.75 + 0.25
    sign = torch.where(torch.rand(shape, generator=gen, dtype=torch.float64) < 0.5, -1.0, 1.0)
    return (mag * sign).to(dtype)


def reference(x64, beta, g64):
    """Float64 autograd: (y, dy/dx * g)."""
    x = x64.detach().clone().requires_grad_(True)
    y = x * torch.sigmoid(beta * x)
    y.backward(g64)
    return y.detach(), x.grad


# ---- bounds -------------------------------------------------------------------------

def forward_bound(x64, ref, beta, dtype, naive):
    u, ua, t = U[dtype], acc_u(dtype), beta * x64
    one_minus_s = torch.sigmoid(-t)
    rel = u + 8 * ua * (2 + t.abs() * one_minus_s)
    if naive:
        return (rel + 2 * u + u * t.abs() * one_minus_s) * ref.abs() + tiny(dtype) * (1 + x64.abs())
    return rel * ref.abs() + tiny(dtype)


def naive_grad_bound(x64, ref_grad, beta, dtype, g64):
    """torch's backward of x * sigmoid(beta * x) in the dtype: each op rounds (a few u times
    the terms' size, s and |t| s (1 - s)); 1 - s loses u absolutely where s rounds near 1,
    times |t|; and t's own rounding moves the slope by u |t| |d slope / dt|."""
    u, ua, t = U[dtype], acc_u(dtype), beta * x64
    s = torch.sigmoid(t)
    one_minus_s = torch.sigmoid(-t)
    curvature = (s * one_minus_s * (2 + t * (1 - 2 * s))).abs()
    g = g64.abs()
    terms = (4 * (s + t.abs() * s * one_minus_s)
             + 2 * t.abs() * s * torch.clamp(one_minus_s / u, max=1)
             + t.abs() * curvature)
    return (u * g * terms + 8 * ua * (2 + t.abs()) * g + tiny(dtype) * g * (1 + t.abs())
            + u * ref_grad.abs())


def grad_bound(x64, ref_grad, beta, dtype, g64, variant):
    if variant == "naive":
        return naive_grad_bound(x64, ref_grad, beta, dtype, g64)
    u = U[dtype]
    if variant == "inplace":
        return INPLACE_BOUND[dtype] * g64.abs() + u * ref_grad.abs() + tiny(dtype)
    t = beta * x64
    return u * ref_grad.abs() + 8 * acc_u(dtype) * (2 + t.abs()) * g64.abs() + tiny(dtype)


def assert_within(what, got, ref, bound, x64, case):
    """Every element of got within bound of ref (NaN fails); names the worst element."""
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    got64 = got.detach().to("cpu", torch.float64)
    diff = (got64 - ref).abs()
    bad = ~(diff <= bound)
    if bad.any():
        ratio = torch.where(bad, torch.nan_to_num(diff / bound, nan=math.inf), 0.0).flatten()
        i = int(ratio.argmax())
        idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), ref.shape)) if ref.dim() else ()
        flat = lambda a: a.reshape(-1)[i].item()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {ref.numel()} elements out of bounds; worst at index "
            f"{idx}: x={flat(x64)!r} (beta*x={case.beta * flat(x64)!r}), expected {flat(ref)!r}, "
            f"got {flat(got64)!r}, |error| {flat(diff):.3e} > bound {flat(bound):.3e}; "
            f"dtype={case.dtype}, shape={case.shape}, layout={case.layout}, beta={case.beta!r}, "
            f"device={DEVICE}")


def same_layout(a, b):
    """Same strides on every dimension that has more than one element."""
    return [s for s, n in zip(a.stride(), a.shape) if n > 1] == \
        [s for s, n in zip(b.stride(), b.shape) if n > 1]


# ---- the properties (child processes) -----------------------------------------------

OUT_OF_PLACE = {
    "naive": {"function": lambda x, b: memlean.swish(x, b, "naive"),
              "module": lambda x, b: memlean.Swish(b, variant="naive")(x)},
    "memory_efficient": {"function": lambda x, b: memlean.swish(x, b, "memory_efficient"),
                         "module": lambda x, b: memlean.Swish(b)(x),
                         "op": lambda x, b: torch.ops.memlean.swish(x, b)},
}


@inner
@pytest.mark.parametrize("variant", ["naive", "memory_efficient"])
@PROPERTY_SETTINGS
@given(data=st.data())
def test_inner_out_of_place(variant, data):
    check_out_of_place(variant, data.draw(
        cases(expand=True, entries=tuple(OUT_OF_PLACE[variant])), label="case"))


def check_out_of_place(variant, case):
    gen = torch.Generator().manual_seed(case.seed)
    base64, view = materialize(case, gen)
    base_d = base64.to(case.dtype, copy=True)
    x = view(base_d.to(DEVICE)).detach().requires_grad_(case.grad)
    x64 = view(base_d.double().clone())
    g = upstream(case.shape, case.dtype, gen)
    g64 = g.double().clone()
    ref, ref_grad = reference(x64, case.beta, g64)

    with memlean_threads():
        y = OUT_OF_PLACE[variant][case.entry](x, case.beta)
    assert y.dtype == case.dtype and y.shape == x.shape and y.device == x.device
    if case.layout[0] in ("contiguous", "permute", "channels_last") and y.numel() > 0:
        assert same_layout(y, x), (case, y.stride(), x.stride())
    assert_within(f"{variant} forward", y, ref, forward_bound(x64, ref, case.beta, case.dtype,
                                                              variant == "naive"), x64, case)
    if not case.grad:
        assert not y.requires_grad
        return
    with memlean_threads():
        y.backward(g.to(DEVICE))
    assert x.grad.dtype == case.dtype and x.grad.shape == x.shape
    assert_within(f"{variant} gradient", x.grad, ref_grad,
                  grad_bound(x64, ref_grad, case.beta, case.dtype, g64, variant), x64, case)


INPLACE = {
    "function": lambda x, b: memlean.swish(x, b, "inplace"),
    "swish_": memlean.swish_,
    "module": lambda x, b: memlean.Swish(b, variant="inplace")(x),
    "op": lambda x, b: torch.ops.memlean.swish_(x, b),  # returns None
}


@inner
@PROPERTY_SETTINGS
@given(case=cases(entries=tuple(INPLACE)))
def test_inner_inplace(case):
    check_inplace(case)


def check_inplace(case):
    gen = torch.Generator().manual_seed(case.seed)
    base64, view = materialize(case, gen)
    base_d = base64.to(case.dtype, copy=True)
    x64 = view(base_d.double().clone())
    if case.as_view:
        # x is a view of a non-leaf: swish_ writes into base through it.
        leaf = base_d.clone().to(DEVICE).requires_grad_(case.grad)
        base = leaf * 1 if case.grad else leaf
        x = view(base)
        h = upstream(base.shape, case.dtype, gen)
        g64 = view(h.double().clone())
    else:
        # x is a non-leaf with the layout itself.
        leaf = view(base_d.to(DEVICE)).detach().requires_grad_(case.grad)
        x = leaf * 1 if case.grad else leaf.clone()
        if x.numel() > 1:
            assert same_layout(x, leaf), (case, x.stride(), leaf.stride())
        h = upstream(case.shape, case.dtype, gen)
        g64 = h.double().clone()
    ref, ref_grad = reference(x64, case.beta, g64)
    version = x._version

    with memlean_threads():
        out = INPLACE[case.entry](x, case.beta)
    if case.entry == "op":
        assert out is None
    elif case.entry == "swish_" or x._base is None:
        assert out is x
    else:
        # memlean.swish and the module: x itself, or where x views all of a non-leaf that
        # autograd records, a view of it in x's place (the same memory, shape and strides).
        assert out is x or (out._base is x._base and out.data_ptr() == x.data_ptr()
                            and out.shape == x.shape and out.stride() == x.stride()), case
    assert x._version > version
    assert x.dtype == case.dtype and x.shape == case.shape
    assert_within("inplace forward", x, ref, forward_bound(x64, ref, case.beta, case.dtype, False),
                  x64, case)
    if case.as_view:  # base outside the view is untouched
        outside = torch.ones(base.shape, dtype=torch.bool)
        view(outside).fill_(False)
        assert torch.equal(base.detach().cpu()[outside], base_d[outside]), case
    if not case.grad:
        return
    if case.as_view:
        with memlean_threads():
            torch.autograd.backward(base, h.to(DEVICE))
        expected = h.double().clone()  # d base / d leaf is 1 outside the view
        view(expected).copy_(ref_grad)
        bound = torch.zeros_like(expected)
        view(bound).copy_(grad_bound(x64, ref_grad, case.beta, case.dtype, g64, "inplace"))
        assert_within("inplace gradient (view of a non-leaf)", leaf.grad, expected, bound,
                      base_d.double(), case)
    else:
        with memlean_threads():
            x.backward(h.to(DEVICE))
        assert_within("inplace gradient", leaf.grad, ref_grad,
                      grad_bound(x64, ref_grad, case.beta, case.dtype, g64, "inplace"), x64, case)


@st.composite
def expanded_cases(draw):
    """An in-place case whose x repeats elements: a size-1 dimension expanded to 2 or more."""
    case = draw(cases(entries=tuple(INPLACE)))
    shape = list(draw(st.lists(st.integers(1, 9), min_size=1, max_size=4)))
    dim = draw(st.integers(0, len(shape) - 1))
    shape[dim] = draw(st.integers(2, 9))
    return dataclasses.replace(case, shape=tuple(shape), layout=("expand", dim))


@inner
@settings(PROPERTY_SETTINGS, max_examples=EXAMPLES // 4)
@given(case=expanded_cases())
def test_inner_inplace_on_an_expanded_tensor_is_refused(case):
    """Elements that share memory cannot be written in place: a clear error, nothing written."""
    gen = torch.Generator().manual_seed(case.seed)
    base64, view = materialize(case, gen)
    base_d = base64.to(case.dtype, copy=True)
    leaf = base_d.clone().to(DEVICE).requires_grad_(case.grad)
    base = leaf * 1 if case.grad else leaf
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        INPLACE[case.entry](view(base), case.beta)
    assert torch.equal(base.detach().cpu(), base_d)


@inner
def test_inner_runs_where_asked():
    if DEVICE == "cpu":
        # memlean's kernels follow at::get_cpu_capability() too (ops/swish/cpu/capability.cc).
        asked = os.environ.get("MEMLEAN_PROPERTY_CAPABILITY")
        if asked is None:
            pytest.skip("MEMLEAN_PROPERTY_CAPABILITY names the capability the parent asked for")
        assert torch.backends.cpu.get_cpu_capability() == asked
    else:
        assert DEVICE == "cuda" and torch.cuda.is_available()


def fixed_cases():
    """Cases every run checks, whatever hypothesis draws: the edges named in the issue."""
    common = dict(seed=1, scale=4.0, near_star=0.3)
    out = []
    for dtype in DTYPES:
        out += [
            Case(dtype, (0,), ("contiguous",), 1.0, **common),
            Case(dtype, (3, 0, 5), ("permute", (2, 0, 1)), -2.0, **common),
            Case(dtype, (), ("contiguous",), 0.7, seed=1, scale=4.0, near_star=0.0,
                 specials=(T_STAR / 0.7,)),
            Case(dtype, (1023,), ("contiguous",), 0.0, **common),
            Case(dtype, (17, 7), ("permute", (1, 0)), 1.0, **common),
            Case(dtype, (2, 3, 5, 7), ("channels_last",), -4.0, **common),
            Case(dtype, (2, 3, 5, 7), ("channels_last",), 2.5, as_view=True, **common),
            Case(dtype, (33, 9), ("slice", 1, 1), 4.0, as_view=True, **common),
            Case(dtype, (70_001,), ("contiguous",), 1.7, **common),
            Case(dtype, (5, 4, 3), ("expand", 1), -0.5, **common),
        ]
    return out


@inner
@pytest.mark.parametrize("variant", ["naive", "memory_efficient", "inplace"])
def test_inner_fixed_cases(variant):
    for case in fixed_cases():
        if variant == "inplace":
            if case.layout[0] != "expand":
                for entry in INPLACE:
                    check_inplace(dataclasses.replace(case, entry=entry))
        else:
            for entry in OUT_OF_PLACE[variant]:
                check_out_of_place(variant, dataclasses.replace(case, entry=entry))


# ---- the outer tests: one child process per CPU capability, and CUDA ------------------

def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# What memlean's and torch's kernel copies for each capability are compiled for.
CAPABILITY_FLAGS = {
    "default": set(),
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"},
}

CHILD_DEADLINE_S = 250  # all children together (the Bazel target's timeout is 300 s)
_START = time.monotonic()


def run_child(device, extra_env):
    env = dict(os.environ, MEMLEAN_PROPERTY_DEVICE=device, **extra_env)
    # The same imports as this process (memlean from the runfiles), from another folder.
    paths = [os.path.abspath(p) for p in sys.path if p]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TEST_TMPDIR")) as tmp:
        env["HYPOTHESIS_STORAGE_DIRECTORY"] = tmp
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", os.path.abspath(__file__), "-q", "-p", "no:cacheprovider",
             "-k", "inner", "-x"],
            env=env, cwd=tmp, capture_output=True, text=True,
            timeout=max(30, CHILD_DEADLINE_S - (time.monotonic() - _START)))
        elapsed = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-20000:]
    summary = output.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, output[-5000:]
    print(f"{device} {extra_env}: {summary} ({elapsed:.1f} s)")
    return output


@pytest.mark.skipif(DEVICE is not None, reason="the outer tests run in the parent only")
@pytest.mark.parametrize("capability", sorted(CAPABILITY_FLAGS))
def test_cpu_capability(capability):
    if os.uname().machine not in ("x86_64", "AMD64") and capability != "default":
        pytest.skip("x86 capabilities")
    missing = CAPABILITY_FLAGS[capability] - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)} for {capability}")
    run_child("cpu", {"ATEN_CPU_CAPABILITY": capability,
                      "MEMLEAN_PROPERTY_CAPABILITY": capability.upper()})


@pytest.mark.skipif(DEVICE is not None, reason="the outer tests run in the parent only")
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_cuda():
    run_child("cuda", {})


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
