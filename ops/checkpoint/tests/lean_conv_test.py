"""memlean.conv2d (ops/checkpoint/lean_conv.h): torch's convolution forward with, for a
depthwise convolution, a backward that allocates the input gradient and nothing else of the
input's size.

Asserted: its output equals F.conv2d's exactly; its gradients (and double-backward
gradients) equal float64 autograd's, contiguous and channels_last, for strides 1 to 3,
kernels 1 to 5, dilation, asymmetric and zero padding, with and without bias, float32 and
float64; in bfloat16 and float16 (a reduced-precision model, a float32 one in a CPU autocast
region) its output is torch's exactly and its gradients no further from float64 autograd's
than torch's own; the bytes its backward allocates, exactly (memstats, CPU): the input
gradient and per-channel vectors, no other tensor of the input's size, in float32 and
bfloat16; what it leaves to torch (other groups, padding="same", no_grad, float64 in an
autocast region, other layouts) is F.conv2d itself,
errors included; lean_forward on torch's and timm's depthwise convolutions, eager and
compiled (aot_eager and inductor, fullgraph: no graph break).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memlean
from memlean import _C
from memlean.lean import lean_forward
from lean_pair import assert_double_backward_equal, backward_bytes, train_pair, twins
from optional_deps import available

D = torch.float64

CASES = [
    # (N, C, H, W, kernel (h, w), stride, padding, dilation, bias)
    (2, 3, 9, 11, (3, 3), 1, 1, 1, True),
    (2, 4, 12, 12, (3, 3), 2, 1, 1, False),
    (3, 5, 11, 8, (5, 5), 2, 2, 1, True),
    (2, 3, 10, 10, (5, 5), 1, 2, 1, False),
    (2, 2, 13, 9, (3, 5), (2, 1), (0, 2), 1, True),  # uneven kernel, stride and padding
    (2, 3, 12, 12, (3, 3), 1, 2, 2, False),  # dilated
    (1, 4, 7, 7, (1, 1), 1, 0, 1, True),
    (2, 3, 6, 6, (3, 3), 3, 0, 1, False),  # stride past the kernel: columns never read
    (2, 6, 5, 5, (3, 3), 1, 3, 1, True),  # padding wider than the kernel reaches
]


def make(n, c, h, w, kernel, bias, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=g, dtype=dtype)
    weight = torch.randn(c, 1, *kernel, generator=g, dtype=dtype)
    b = torch.randn(c, generator=g, dtype=dtype) if bias else None
    return x, weight, b


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n,c,h,w,kernel,stride,padding,dilation,bias", CASES)
def test_forward_is_torchs_gradients_float64s(n, c, h, w, kernel, stride, padding, dilation,
                                              bias, dtype, channels_last):
    x, weight, b = make(n, c, h, w, kernel, bias, dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    assert _C.lean_conv2d_applies(x, weight, c)
    args = (stride, padding, dilation, c)
    runs = {}
    for name, fn, dt in (("lean", memlean.conv2d, dtype), ("reference", F.conv2d, D)):
        xs = x.to(dt).clone().requires_grad_()
        ws = weight.to(dt).clone().requires_grad_()
        bs = b.to(dt).clone().requires_grad_() if bias else None
        y = fn(xs, ws, bs, *args)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=D)
        y.backward(dy.to(dt))
        runs[name] = (y, xs.grad, ws.grad, bs.grad if bias else None)
    lean = runs["lean"]
    assert "LeanConvFunction" in lean[0].grad_fn.name()
    assert lean[1].stride() == x.stride()  # the input's layout
    assert torch.equal(lean[0], F.conv2d(x, weight, b, *args))  # the same forward kernel
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for a, r in zip(lean[1:], runs["reference"][1:]):
        assert (a is None) == (r is None) == (r is runs["reference"][3] and not bias)
        if r is not None:
            torch.testing.assert_close(a.to(D), r, **tol)


def _error(a, r):
    return (a.to(D) - r).abs().max().item()


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,c,h,w,kernel,stride,padding,dilation,bias", CASES[:6])
def test_reduced_precision_and_autocast_no_further_from_float64_than_torchs(
        n, c, h, w, kernel, stride, padding, dilation, bias, dtype, autocast, channels_last):
    """A bfloat16/float16 model, or a float32 one in a CPU autocast region of that dtype
    (where torch's conv2d casts input, weight and bias, and so does memlean's): the lean
    backward runs, the output is torch's exactly, the gradients have torch's dtypes and are
    no further from float64 autograd (on the values as the convolution saw them) than
    torch's own backward's: twice its error, plus one unit in the last place."""
    x, weight, b = make(n, c, h, w, kernel, bias, torch.float32, seed=4)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    if not autocast:
        x, weight = x.to(dtype), weight.to(dtype)
        b = b.to(dtype) if bias else None
    args = (stride, padding, dilation, c)
    dy = None
    runs = {}
    for name, fn in (("lean", memlean.conv2d), ("torch", F.conv2d)):
        xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
        bs = b.clone().requires_grad_() if bias else None
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            assert _C.lean_conv2d_applies(xs, ws, c)
            y = fn(xs, ws, bs, *args)
        assert ("LeanConvFunction" in y.grad_fn.name()) == (name == "lean")
        assert y.dtype == dtype
        if dy is None:
            dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        y.backward(dy)
        runs[name] = (y, xs.grad, ws.grad, bs.grad if bias else None)
    lean, plain = runs["lean"], runs["torch"]
    assert torch.equal(lean[0], plain[0])
    assert lean[1].stride() == x.stride()
    seen = lambda t: t.to(dtype).to(D).requires_grad_()  # noqa: E731
    x64, w64 = seen(x), seen(weight)
    b64 = seen(b) if bias else None
    F.conv2d(x64, w64, b64, *args).backward(dy.to(D))
    bits = 2 ** -7 if dtype == torch.bfloat16 else 2 ** -10
    for i, r in zip((1, 2, 3), (x64.grad, w64.grad, b64.grad if bias else None)):
        if r is None:
            continue
        assert lean[i].dtype == plain[i].dtype
        ulp = r.abs().max().item() * bits
        assert _error(lean[i], r) <= 2 * _error(plain[i], r) + ulp, (i, _error(lean[i], r),
                                                                    _error(plain[i], r))


@pytest.mark.parametrize("wanted", ["input", "weight", "bias", "input and bias"])
def test_only_the_wanted_gradients(wanted):
    x, weight, b = make(2, 3, 8, 8, (3, 3), True, D)
    xs = x.clone().requires_grad_("input" in wanted)
    ws = weight.clone().requires_grad_(wanted == "weight")
    bs = b.clone().requires_grad_("bias" in wanted)
    memlean.conv2d(xs, ws, bs, 1, 1, 1, 3).sin().sum().backward()
    x64, w64, b64 = (t.clone().requires_grad_() for t in (x, weight, b))
    F.conv2d(x64, w64, b64, 1, 1, 1, 3).sin().sum().backward()
    for t, r in ((xs, x64), (ws, w64), (bs, b64)):
        if t.requires_grad:
            torch.testing.assert_close(t.grad, r.grad, rtol=1e-12, atol=1e-12)
        else:
            assert t.grad is None


def test_double_backward_equals_float64_autograd():
    x, weight, b = make(2, 3, 9, 9, (3, 3), True, D, seed=2)
    assert_double_backward_equal(lambda x, w, b: memlean.conv2d(x, w, b, 2, 1, 1, 3),
                                 lambda x, w, b: F.conv2d(x, w, b, 2, 1, 1, 3), x, weight, b,
                                 lambda y: (y * y.detach().sin()).pow(2).sum(), 1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("stride", [1, 2])
def test_backward_allocates_the_input_gradient_and_per_channel_vectors(stride, channels_last,
                                                                        dtype):
    c = 16
    x0 = torch.randn(8, c, 32, 32, dtype=dtype)
    if channels_last:
        x0 = x0.contiguous(memory_format=torch.channels_last)
    weight = torch.randn(c, 1, 3, 3, dtype=dtype, requires_grad=True)
    bias = torch.zeros(c, dtype=dtype, requires_grad=True)
    peak = backward_bytes(lambda h: memlean.conv2d(h, weight, bias, stride, 1, 1, c), x0)
    # The input gradient; the weight and bias gradients as double then the input's type (at
    # most 12 bytes per weight and bias element), with the allocator's rounding: nothing
    # else (bfloat16's float rows are the kernel's own, not tensors).
    assert x0.nbytes <= peak <= x0.nbytes + 12 * (weight.numel() + c) + 4 * 64, peak


def test_gradient_of_another_layout_is_read_as_it_is():
    x, weight, b = make(2, 4, 6, 6, (3, 3), True, torch.float32)
    xs = x.clone().requires_grad_()
    memlean.conv2d(xs, weight, b, 1, 1, 1, 4).sum().backward()  # an expanded dL/dy
    x2 = x.clone().requires_grad_()
    F.conv2d(x2, weight, b, 1, 1, 1, 4).sum().backward()
    torch.testing.assert_close(xs.grad, x2.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["groups 1", "two per group", "channel multiplier",
                                  "padding same", "no_grad", "no grad needed", "strided",
                                  "float64 in autocast"])
def test_what_it_leaves_to_torch_is_torchs(case):
    x, weight, b = make(2, 4, 8, 8, (3, 3), True, torch.float32, seed=3)
    groups, padding = 4, 1
    if case == "groups 1":
        weight, groups = torch.randn(4, 4, 3, 3), 1
    elif case == "two per group":
        weight, groups = torch.randn(4, 2, 3, 3), 2
    elif case == "channel multiplier":
        weight, b = torch.randn(8, 1, 3, 3), torch.randn(8)
    elif case == "float64 in autocast":  # (torch's conv2d leaves float64 alone there)
        x, weight, b = x.double(), weight.double(), b.double()
    elif case == "padding same":
        padding = "same"
    xs = x if case == "no grad needed" else x.clone().requires_grad_()
    if case == "strided":
        xs = torch.randn(2, 4, 8, 16, requires_grad=True)[..., ::2]
    ctx = torch.no_grad() if case == "no_grad" else torch.enable_grad()
    if case == "float64 in autocast":
        ctx = torch.autocast("cpu", dtype=torch.bfloat16)
    with ctx:
        assert not _C.lean_conv2d_applies(xs, weight, groups) or case in (
            "padding same", "no_grad", "no grad needed")
        y = memlean.conv2d(xs, weight, b, 1, padding, 1, groups)
        r = F.conv2d(xs, weight, b, 1, padding, 1, groups)
    assert y.dtype == r.dtype == (torch.float64 if case == "float64 in autocast"
                                  else torch.float32)
    assert torch.equal(y, r)
    assert type(y.grad_fn) is type(r.grad_fn)  # torch's own node (or none)


@pytest.mark.parametrize("args", [
    dict(stride=0), dict(stride=(1, 2, 3)), dict(padding=-1), dict(dilation=0),
    dict(weight=torch.randn(4, 1, 11, 11)), dict(bias=torch.randn(3)),
])
def test_bad_arguments_get_torchs_error(args):
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    call = dict(weight=torch.randn(4, 1, 3, 3), bias=None, stride=1, padding=1, dilation=1,
                groups=4)
    call.update(args)
    with pytest.raises(RuntimeError) as theirs:
        F.conv2d(x, **call)
    with pytest.raises(RuntimeError) as ours:
        memlean.conv2d(x, **call)
    assert str(ours.value) == str(theirs.value)


class DepthwiseNet(nn.Module):
    def __init__(self, depthwise):
        super().__init__()
        self.pw = nn.Conv2d(3, 8, 1)
        self.dw = depthwise(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(torch.nn.functional.silu(self.dw(self.pw(x))).mean((2, 3)))


def depthwise_convs():
    out = {"nn.Conv2d": lambda c: nn.Conv2d(c, c, 3, 2, 1, groups=c)}
    if available("timm"):
        from timm.layers import create_conv2d

        # timm's "same" padding for a stride-2 convolution: F.pad, then F.conv2d.
        out["timm create_conv2d same"] = lambda c: create_conv2d(c, c, 3, stride=2,
                                                                 padding="same", depthwise=True)
    return out


@pytest.mark.parametrize("conv", list(depthwise_convs()))
@pytest.mark.parametrize("compiled", [None, "aot_eager", "inductor"])
def test_lean_forward_on_modules_eager_and_compiled(conv, compiled):
    plain, lean = twins(lambda: DepthwiseNet(depthwise_convs()[conv]))
    undo, taken = lean_forward(lean.dw)
    untaken = lean_forward(lean.pw)[1]  # not depthwise: torch's
    train_pair(plain, lean, torch.randn(4, 3, 9, 9), compiled)  # gradients equal
    # Eager: every depthwise call ran lean; compiled: none did (torch's, as inductor has it).
    assert taken() == (0 if compiled else 2)
    assert untaken() == 0
    undo()
    assert "forward" not in lean.dw.__dict__


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
