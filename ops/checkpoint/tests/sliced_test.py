"""memlean.sliced_chain (bindings/python/memlean/sliced.py): a chain of channelwise modules,
optionally headed by an ungrouped convolution, computed and recomputed slice by slice of
channels, keeping only its input for backward.

Asserted: its output, running statistics (num_batches_tracked counted once) and gradients
equal the modules run in turn, against float64 autograd of a copy, for chains with and
without the head (1x1, 3x3 and strided), contiguous and channels_last, 1 to all-channels
slices, an input with and without grad, BatchNorm with
momentum=None, without running statistics and in eval mode, biases, torch's, memlean's
(in-place) and timm's activations and timm's BatchNormAct2d; the bytes it keeps after its
forward, exactly (memstats, CPU): its output and nothing else, where the modules in turn keep
their wide inner tensors; its backward's peak a fraction of theirs, and with a 1x1 head no
gradient of the whole input made per slice; where it does not apply
(bfloat16, autocast) it is the modules in turn; bad input named; double backward refused.

memlean.sliced_mlp (an MLP, Linear, elementwise activations, Linear, computed and recomputed
slice by slice of its hidden features): output and gradients equal the modules in turn
(float64 autograd of a copy) for GELU (exact and tanh), SiLU, ReLU and no activation, with
and without biases, 2-d to 4-d inputs, 1 to all-features slices, frozen parameters; the bytes
it keeps after its forward exactly its output; its peak under half of theirs; where it does
not apply it is the modules in turn; bad input named; double backward refused.
"""
import contextlib
import copy

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import memlean
from memlean import memstats
from optional_deps import available, require


def chain(head=True, cin=5, c=12, stride=2, act=nn.SiLU, bias=False, momentum=0.1,
          track=True, head_conv=dict(kernel_size=1)):
    mods = [nn.Conv2d(cin, c, bias=bias, **head_conv)] if head else []
    mods += [nn.BatchNorm2d(c, momentum=momentum, track_running_stats=track), act(),
             nn.Conv2d(c, c, 3, stride, 1, groups=c, bias=bias),
             nn.BatchNorm2d(c, momentum=momentum, track_running_stats=track), act()]
    for m in mods:
        if isinstance(m, nn.BatchNorm2d):  # weights away from 1 and 0
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.5, 0.5)
    return nn.ModuleList(mods)


def in_turn(x, modules):
    for m in modules:
        x = m(x)
    return x


class Wrapped(torch.Tensor):
    """A tensor subclass: the sliced chains and MLPs leave it to the modules in turn."""


def max_error(t, ref):
    return (t.double() - ref).abs().max().item()


def compare(modules, x, slices, dtype=torch.float32, train=True, tol=1e-5, x_grad=True):
    """sliced_chain on `modules` (in dtype) against a float64 copy run in turn: output,
    gradients of the input (x_grad) and every parameter, buffers after."""
    torch.manual_seed(1)
    mine, ref = copy.deepcopy(modules).to(dtype), copy.deepcopy(modules).double()
    mine.train(train)
    ref.train(train)
    xs = x.to(dtype).clone().requires_grad_(x_grad)
    x64 = x.double().clone().requires_grad_(x_grad)
    y = memlean.sliced_chain(xs, list(mine), slices=slices)
    y64 = in_turn(x64, ref)
    assert y.dtype == dtype and y.shape == y64.shape
    layout = (torch.channels_last if x.is_contiguous(memory_format=torch.channels_last)
              and not x.is_contiguous() else torch.contiguous_format)
    assert y.is_contiguous(memory_format=layout)
    g = torch.randn_like(y64)
    (y.double() * g).sum().backward()
    (y64 * g).sum().backward()
    torch.testing.assert_close(y.double(), y64, rtol=tol, atol=tol)
    if x_grad:
        torch.testing.assert_close(xs.grad.double(), x64.grad, rtol=tol, atol=tol)
    else:
        assert xs.grad is None
    for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=tol, atol=tol, msg=name)
    for (name, b), r in zip(mine.named_buffers(), ref.buffers()):
        if b.dtype == torch.long:
            assert torch.equal(b, r), name  # num_batches_tracked: once per forward
        else:
            torch.testing.assert_close(b.double(), r, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("head", [True, False])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("slices", [1, 5, 12])
def test_equals_the_modules_in_turn(head, layout, slices):
    torch.manual_seed(0)
    x = torch.randn(4, 5 if head else 12, 10, 9)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    compare(chain(head), x, slices, torch.float64, tol=1e-10)
    compare(chain(head), x, slices, torch.float32, tol=1e-4)


@pytest.mark.parametrize("case", ["bias", "momentum None", "no running stats", "eval",
                                  "relu6", "hardswish", "memlean inplace swish", "stride 1",
                                  "3x3 head", "strided 1x1 head", "input without grad"])
def test_module_variants(case):
    # (A 1x1 head adds its input gradient into one tensor slice by slice; a 3x3 or strided
    # head makes it whole per slice: both paths.)
    torch.manual_seed(0)
    options = {"bias": dict(bias=True), "momentum None": dict(momentum=None),
               "no running stats": dict(track=False), "relu6": dict(act=nn.ReLU6),
               "hardswish": dict(act=nn.Hardswish), "stride 1": dict(stride=1),
               "memlean inplace swish": dict(act=lambda: memlean.Swish(variant="inplace")),
               "3x3 head": dict(head_conv=dict(kernel_size=3, padding=1), bias=True),
               "strided 1x1 head": dict(head_conv=dict(kernel_size=1, stride=2)),
               "eval": {}, "input without grad": {}}[case]
    modules = chain(**options)
    if case == "eval":  # statistics from a training forward first
        in_turn(torch.randn(8, 5, 6, 6), modules)
    for layout in (torch.contiguous_format, torch.channels_last):
        compare(modules, torch.randn(3, 5, 8, 8).contiguous(memory_format=layout), 4,
                torch.float64, train=case != "eval", tol=1e-10,
                x_grad=case != "input without grad")


@pytest.mark.parametrize("case", ["after a 1x1 head", "after a 1x1 head, through Identity",
                                  "after a 3x3 head", "first, on the input"])
def test_an_activation_writing_its_input_overwrites_no_tensor_of_the_chain(case):
    # An in-place activation right after a 1x1 head (or after an Identity following it) once
    # overwrote the head's output slice whose gradient the backward takes: input gradients
    # silently wrong (timm's efficientvit_b0 through memlean.fit, 2026-11-27). First in a
    # chain, on a batch of one in one slice, it could overwrite the chain's input. Now such
    # an activation takes a copy: the input untouched, everything as float64 autograd's.
    torch.manual_seed(0)
    act = nn.Hardswish(inplace=True)
    mods, shape = {
        "after a 1x1 head": ([nn.Conv2d(5, 12, 1), act, nn.Conv2d(12, 12, 3, 1, 1, groups=12),
                              nn.BatchNorm2d(12)], (3, 5, 8, 8)),
        "after a 1x1 head, through Identity": ([nn.Conv2d(5, 12, 1), nn.Identity(), act],
                                               (3, 5, 8, 8)),
        "after a 3x3 head": ([nn.Conv2d(5, 12, 3, padding=1), act, nn.BatchNorm2d(12)],
                             (3, 5, 8, 8)),
        "first, on the input": ([nn.ReLU(inplace=True), nn.Conv2d(12, 12, 3, 1, 1, groups=12),
                                 nn.BatchNorm2d(12)], (1, 12, 8, 8)),
    }[case]
    modules = nn.ModuleList(mods)
    x0 = torch.randn(shape, dtype=torch.float64)
    for slices in (1, 4):
        mine, ref = copy.deepcopy(modules).double(), copy.deepcopy(modules).double()
        xs, x64 = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        y = memlean.sliced_chain(xs, list(mine), slices=slices)
        assert torch.equal(xs.detach(), x0), case  # the input untouched
        y64 = in_turn(x64 * 1, ref)  # (a copy: torch refuses an in-place op on a leaf)
        g = torch.randn_like(y64)
        y.backward(g)
        y64.backward(g)
        torch.testing.assert_close(y, y64, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(xs.grad, x64.grad, rtol=1e-10, atol=1e-10)
        for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10, msg=name)


def test_timm_batchnorm_act():
    if not available("timm"):
        pytest.skip("timm: this environment is made without it")
    from timm.layers import BatchNormAct2d

    torch.manual_seed(0)
    modules = nn.ModuleList([nn.Conv2d(4, 8, 1, bias=False), BatchNormAct2d(8, act_layer=nn.SiLU),
                             nn.Conv2d(8, 8, 5, 2, 2, groups=8, bias=False),
                             BatchNormAct2d(8, act_layer=nn.ReLU), nn.Identity()])
    compare(modules, torch.randn(2, 4, 11, 11), 3, torch.float64, tol=1e-10)
    # Dropout inside timm's BatchNormAct2d: not channelwise-safe in slices, refused.
    dropped = nn.ModuleList([nn.Conv2d(4, 8, 1), BatchNormAct2d(8, drop_layer=nn.Dropout)])
    with pytest.raises(ValueError, match="modules must be"):
        memlean.sliced_chain(torch.randn(2, 4, 5, 5), list(dropped))


def kept_and_peaks(sliced, modules, x, slices=8, in_turn=in_turn):
    """({"sliced", "in turn"}: the bytes each keeps after its forward, {...: the forward's and
    the backward's peak above the start}), exact CPU bytes; asserts the sliced one keeps its
    output alone."""
    kept, peaks = {}, {}
    for name in ("sliced", "in turn"):
        with memstats.track() as t:
            start = t.current
            y = (sliced(x, list(modules), slices=slices) if name == "sliced"
                 else in_turn(x, modules))
            kept[name] = t.current - start
            assert kept[name] >= y.untyped_storage().nbytes()
            if name == "sliced":
                assert kept[name] == y.untyped_storage().nbytes()
            y.backward(torch.ones_like(y))
            peaks[name] = t.peak - start
            del y
    return kept, peaks


def test_keeps_only_its_input_and_peaks_lower():
    # Exact CPU bytes: after the forward the sliced chain holds its output and nothing else
    # (its input is the caller's); the modules in turn hold their wide inner tensors too.
    # Forward and backward together peak at less than half of theirs.
    torch.manual_seed(0)
    modules = chain(cin=8, c=48, stride=1)
    x = torch.randn(8, 8, 32, 32, requires_grad=True)
    kept, peaks = kept_and_peaks(memlean.sliced_chain, modules, x)
    wide = 8 * 48 * 32 * 32 * 4
    assert kept["in turn"] >= kept["sliced"] + 3 * wide  # conv, BN and act outputs at least
    assert peaks["sliced"] < peaks["in turn"] / 2, peaks


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_a_1x1_head_makes_no_whole_input_gradient_per_slice(layout, monkeypatch):
    # Exact CPU bytes: the backward adds each slice's part of a 1x1 head's input gradient into
    # one tensor. Made whole per slice and added (what it does for other heads, forced here),
    # that gradient (the input's bytes) lives beside the sum while the slice's own tensors
    # (an eighth of that here: 16 slices of a 2x expansion) do not: the backward peaks at
    # least half an input's bytes higher, with equal gradients.
    torch.manual_seed(0)
    modules = chain(cin=64, c=128, stride=2)
    x = torch.randn(8, 64, 16, 16).contiguous(memory_format=layout).requires_grad_()
    peaks, grads = {}, {}
    for name in ("accumulated", "whole per slice"):
        if name == "whole per slice":
            monkeypatch.setattr(memlean.sliced, "pointwise", lambda module: False)
        y = memlean.sliced_chain(x, list(modules), slices=16)
        g = torch.ones_like(y)
        with memstats.track() as t:
            start = t.current
            y.backward(g)
            peaks[name] = t.peak - start
        grads[name] = x.grad
        x.grad = None
        del y
    torch.testing.assert_close(grads["accumulated"], grads["whole per slice"])
    assert peaks["whole per slice"] - peaks["accumulated"] >= x.numel() * 4 // 2, peaks


class ConvolutionDtypes(TorchDispatchMode):
    """The dtypes of the inputs of the forward convolutions run while it is on (below
    autocast: the dtypes autocast gave them)."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.convolution.default:
            self.seen.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


def chain_ran(y) -> bool:
    """Whether y came out of sliced_chain's Function (not the modules in turn)."""
    return y.grad_fn is not None and type(y.grad_fn).__name__ == "_SlicedChainBackward"


def test_where_it_does_not_apply_it_is_the_modules_in_turn():
    torch.manual_seed(0)
    modules, twin = chain(), chain()
    twin.load_state_dict(modules.state_dict())
    x = torch.randn(2, 5, 8, 8).as_subclass(Wrapped)
    y = memlean.sliced_chain(x, list(modules))
    assert not chain_ran(y)
    torch.testing.assert_close(y, in_turn(x, twin))
    assert chain_ran(memlean.sliced_chain(torch.randn(2, 5, 8, 8, requires_grad=True),
                                          list(modules)))


@pytest.mark.parametrize("head", [True, False])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("params,region", [
    (torch.bfloat16, None),  # a model in that dtype
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16),  # a CPU autocast region
])
def test_chain_in_reduced_precision_and_autocast_is_as_the_modules_in_turn(head, layout, params,
                                                                           region):
    # bfloat16 models, and float32 models in a CPU autocast region: the sliced chain runs (its
    # Function), its recompute in the forward's autocast state; its output, every gradient and
    # the running statistics in the dtypes the modules in turn give them, no further from
    # float64 autograd (on the same rounded weights and input) than theirs: within twice
    # their error (or 1e-3 of the largest value).
    # 16 slices of 64 channels: a head's input gradient, a sum of 16 parts, adds up in
    # float32 (summed in bfloat16, its error here was up to 2.4 times the modules').
    torch.manual_seed(0)
    modules = chain(head, cin=24, c=64, bias=True)
    mine = copy.deepcopy(modules).to(params)
    turn, ref = copy.deepcopy(mine), copy.deepcopy(mine).double()
    x0 = torch.randn(4, 24 if head else 64, 10, 9).to(params)
    if layout == "channels_last":
        x0 = x0.contiguous(memory_format=torch.channels_last)
    xs, xt = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    x64 = x0.double().requires_grad_()
    ctx = (torch.autocast("cpu", dtype=region) if region is not None
           else contextlib.nullcontext())
    with ctx:
        y, yt = memlean.sliced_chain(xs, list(mine), slices=16), in_turn(xt, turn)
    y64 = in_turn(x64, ref)
    assert chain_ran(y)
    assert y.dtype == yt.dtype and y.shape == y64.shape
    g = torch.randn(y64.shape, dtype=torch.float64)
    with ConvolutionDtypes() as recompute:
        y.backward(g.to(y.dtype))
    assert recompute.seen == {region or params}  # (its convolutions as the forward's)
    yt.backward(g.to(yt.dtype))
    y64.backward(g)
    pairs = [("output", y, yt, y64), ("x", xs.grad, xt.grad, x64.grad)] + [
        (name, p.grad, q.grad, r.grad) for (name, p), q, r in
        zip(mine.named_parameters(), turn.parameters(), ref.parameters())] + [
        (name, b, c, r) for (name, b), c, r in
        zip(mine.named_buffers(), turn.buffers(), ref.buffers()) if b.is_floating_point()]
    for name, got, theirs, want in pairs:
        assert got.dtype == theirs.dtype, name
        s = want.abs().max().item()
        assert max_error(got, want) <= 2 * max_error(theirs, want) + 1e-3 * s, name


def test_bad_input_is_named():
    modules = chain()
    x = torch.randn(2, 5, 8, 8)
    with pytest.raises(ValueError, match="modules must be"):
        memlean.sliced_chain(x, [nn.Conv2d(5, 6, 1), nn.Linear(6, 6)])
    with pytest.raises(ValueError, match="modules must be"):
        memlean.sliced_chain(x, [nn.Conv2d(5, 6, 1), nn.BatchNorm2d(7)])  # channels differ
    with pytest.raises(ValueError, match="modules must be"):
        memlean.sliced_chain(x, [nn.SiLU(), nn.ReLU()])  # nothing to slice by
    with pytest.raises(ValueError, match="modules must be"):
        memlean.sliced_chain(x, [nn.BatchNorm2d(5), nn.Conv2d(5, 5, 1)])  # head not first
    with pytest.raises(ValueError, match="slices must be an int in 1..12, got 13"):
        memlean.sliced_chain(x, list(modules), slices=13)
    with pytest.raises(ValueError, match="slices must be"):
        memlean.sliced_chain(x, list(modules), slices=0)
    with pytest.raises(ValueError, match="slices must be"):  # also where it runs in turn
        memlean.sliced_chain(x.bfloat16(), list(modules), slices=2.0)
    with pytest.raises(ValueError, match="x has 6 channels, the chain takes 5"):
        memlean.sliced_chain(torch.randn(2, 6, 8, 8), list(modules))
    with pytest.raises(TypeError, match="x must be a tensor"):
        memlean.sliced_chain([1.0], list(modules))


def test_modules_that_are_not_the_classes_own_are_refused():
    # A subclass with its own forward, an instance forward, a hook: sliced_chain would not run
    # what the module runs, so it refuses them.
    class Doubled(nn.SiLU):
        def forward(self, x):
            return 2 * x

    x = torch.randn(2, 5, 8, 8)
    patched = nn.BatchNorm2d(12)
    patched.forward = lambda t: t
    hooked = nn.BatchNorm2d(12)
    hooked.register_forward_hook(lambda *a: None)
    for odd in (Doubled(), patched, hooked):
        with pytest.raises(ValueError, match="modules must be"):
            memlean.sliced_chain(x, [nn.Conv2d(5, 12, 1), nn.BatchNorm2d(12), odd])


def test_eval_backward_uses_the_statistics_its_forward_used():
    # A BatchNorm in eval mode normalises with the running statistics; a training forward
    # between this forward and its backward changes them, and the backward's recompute
    # still uses the ones the forward used.
    torch.manual_seed(0)
    modules = chain().double()
    in_turn(torch.randn(8, 5, 6, 6, dtype=torch.double), modules)
    modules.eval()
    reference = copy.deepcopy(modules)
    x = torch.randn(3, 5, 8, 8, dtype=torch.double)
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = memlean.sliced_chain(xs, list(modules), slices=3)
    modules.train()
    in_turn(torch.randn(8, 5, 6, 6, dtype=torch.double), modules)
    modules.eval()
    y.sum().backward()
    in_turn(xr, reference).sum().backward()
    torch.testing.assert_close(xs.grad, xr.grad, rtol=1e-10, atol=1e-12)


def test_double_backward_is_refused():
    modules = chain()
    x = torch.randn(2, 5, 8, 8, requires_grad=True)
    y = memlean.sliced_chain(x, list(modules), slices=2)
    (gx,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gx.sum().backward()


# ---- memlean.sliced_mlp: Linear, elementwise activations, Linear, sliced over the hidden ----


def mlp(d=6, hidden=20, out=None, act=nn.GELU, bias=True, extras=True):
    """timm's Mlp as a list: fc1, act, drop1 (p=0), norm (Identity), fc2, drop2 (p=0)."""
    mods = [nn.Linear(d, hidden, bias=bias), act()]
    mods += [nn.Dropout(0.0), nn.Identity()] if extras else []
    mods += [nn.Linear(hidden, out or d, bias=bias)]
    mods += [nn.Dropout(0.0)] if extras else []
    return nn.ModuleList(mods)


@pytest.mark.parametrize("slices", [1, 3, 20])
@pytest.mark.parametrize("act,bias,shape", [
    (nn.GELU, True, (3, 7, 6)),
    (lambda: nn.GELU(approximate="tanh"), False, (4, 6)),
    (nn.SiLU, True, (2, 3, 5, 6)),  # (ConvNeXt's MLP: channels last)
    (nn.ReLU, True, (5, 6)),
    (nn.Identity, True, (3, 4, 6)),  # (no activation at all)
    (lambda: nn.ReLU(inplace=True), True, (4, 6)),  # activations that write their input:
    (lambda: memlean.Swish(variant="inplace"), True, (2, 4, 6)),  # (fit's swap, before slicing)
])
def test_mlp_equals_the_modules_in_turn(act, bias, shape, slices):
    # Against float64 autograd of a copy run in turn: the output and the gradients of the
    # input and every parameter, in float64 (to 1e-12) and float32 (to 1e-5); without an
    # input gradient too. The caller writes the output in place (as `y += x` does): it is no
    # view made inside the Function, which autograd would refuse.
    torch.manual_seed(0)
    modules = mlp(act=act, bias=bias, out=5)
    x = torch.randn(shape)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        for x_grad in (True, False):
            mine, ref = copy.deepcopy(modules).to(dtype), copy.deepcopy(modules).double()
            xs = x.to(dtype).clone().requires_grad_(x_grad)
            x64 = x.double().clone().requires_grad_(x_grad)
            y = memlean.sliced_mlp(xs, list(mine), slices=slices).mul_(1.5)
            y64 = in_turn(x64, ref) * 1.5
            assert y.dtype == dtype and y.shape == y64.shape
            torch.testing.assert_close(y.double(), y64, rtol=tol, atol=tol)
            g = torch.randn(y64.shape, dtype=torch.float64)
            y.backward(g.to(dtype))
            y64.backward(g)
            if x_grad:
                torch.testing.assert_close(xs.grad.double(), x64.grad, rtol=tol, atol=tol)
            for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad.double(), q.grad, rtol=tol, atol=tol,
                                           msg=name)


def test_mlp_frozen_parameters_get_no_gradient():
    torch.manual_seed(0)
    modules = mlp()
    ref = copy.deepcopy(modules)
    for m in (modules, ref):
        m[0].weight.requires_grad_(False)
        m[4].bias.requires_grad_(False)
    x = torch.randn(4, 6, requires_grad=True)
    memlean.sliced_mlp(x, list(modules), slices=4).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    in_turn(x_ref, ref).sum().backward()
    assert modules[0].weight.grad is None and modules[4].bias.grad is None
    torch.testing.assert_close(x.grad, x_ref.grad)
    torch.testing.assert_close(modules[4].weight.grad, ref[4].weight.grad)


def test_mlp_keeps_only_its_input_and_peaks_lower():
    # Exact CPU bytes: after the forward the sliced MLP holds its output and nothing else (its
    # input is the caller's); the modules in turn hold the hidden tensors too (fc1's output,
    # which GELU saves, and GELU's, which fc2 saves). Forward and backward together peak at
    # less than half of theirs.
    torch.manual_seed(0)
    modules = mlp(d=64, hidden=256)
    x = torch.randn(8, 128, 64, requires_grad=True)
    kept, peaks = kept_and_peaks(memlean.sliced_mlp, modules, x)
    hidden = 8 * 128 * 256 * 4
    assert kept["in turn"] >= kept["sliced"] + 2 * hidden
    assert peaks["sliced"] < peaks["in turn"] / 2, peaks


def sliced_ran(y) -> bool:
    """Whether y came out of memlean::sliced_mlp's Function (not the modules in turn)."""
    return y.grad_fn is not None and "SlicedMlpFunction" in y.grad_fn.name()


def test_mlp_where_it_does_not_apply_it_is_the_modules_in_turn():
    torch.manual_seed(0)
    modules = mlp()
    x = torch.randn(3, 6)
    for other in (x.as_subclass(Wrapped), x.to(torch.int64)):
        y = memlean.sliced_mlp(other, list(modules)) if other.is_floating_point() else None
        if y is None:  # (an integer input: nn.Linear's own error, as in turn)
            with pytest.raises(RuntimeError) as mine:
                memlean.sliced_mlp(other, list(modules))
            with pytest.raises(RuntimeError) as theirs:
                in_turn(other, modules)
            assert str(mine.value) == str(theirs.value)
            continue
        assert not sliced_ran(y)
        torch.testing.assert_close(y, in_turn(other, modules))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert sliced_ran(memlean.sliced_mlp(x, list(modules)))


@pytest.mark.parametrize("kind", ["plain", "gated", "packed"])
@pytest.mark.parametrize("params,region", [
    (torch.bfloat16, None), (torch.float16, None),  # a model in that dtype
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16),  # a CPU autocast region
])
def test_mlp_in_reduced_precision_and_autocast_is_as_the_modules_in_turn(kind, params, region):
    # bfloat16 and float16 models, and float32 models in a CPU autocast region: the sliced MLP
    # runs (its Function, not the modules in turn), its output and every gradient in the dtype
    # the modules in turn give, no further from float64 autograd (on the same rounded weights
    # and input) than theirs: within twice their error (its partial sums add up in float32).
    torch.manual_seed(0)
    act = nn.GELU()
    if kind == "plain":
        lins = nn.ModuleList([nn.Linear(32, 128), nn.Linear(128, 24)])

        def sliced(x, ls):
            return memlean.sliced_mlp(x, [ls[0], act, ls[1]], slices=4)

        def formula(x, ls):
            return ls[1](act(ls[0](x)))
    elif kind == "gated":
        lins = gated(32, 128, 24)

        def sliced(x, ls):
            return memlean.sliced_gated_mlp(x, ls[0], act, ls[1], ls[2], slices=4)

        def formula(x, ls):
            return gated_in_turn(x, ls, act)
    else:
        lins = nn.ModuleList([nn.Linear(32, 256), nn.Linear(128, 24)])

        def sliced(x, ls):
            return memlean.sliced_gated_mlp(x, ls[0], act, None, ls[1], slices=4)

        def formula(x, ls):
            return packed_in_turn(x, ls, act, True)
    mine = copy.deepcopy(lins).to(params)
    turn, ref = copy.deepcopy(mine), copy.deepcopy(mine).double()  # (the rounded weights)
    x0 = torch.randn(4, 8, 32).to(params)
    xs, xt = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    x64 = x0.double().requires_grad_()
    ctx = (torch.autocast("cpu", dtype=region) if region is not None
           else contextlib.nullcontext())
    with ctx:
        y, yt = sliced(xs, mine), formula(xt, turn)
    y64 = formula(x64, ref)
    assert sliced_ran(y)
    assert y.dtype == yt.dtype == (region or params) and y.shape == y64.shape
    scale = y64.abs().max().item()
    assert max_error(y, y64) <= 2 * max_error(yt, y64) + 1e-4 * scale
    g = torch.randn(y64.shape, dtype=torch.float64)
    y.backward(g.to(y.dtype))
    yt.backward(g.to(yt.dtype))
    y64.backward(g)
    pairs = [("x", xs.grad, xt.grad, x64.grad)] + [
        (name, p.grad, q.grad, r.grad) for (name, p), q, r in
        zip(mine.named_parameters(), turn.parameters(), ref.parameters())]
    for name, got, theirs, want in pairs:
        assert got.dtype == theirs.dtype == params, name
        s = want.abs().max().item()
        assert max_error(got, want) <= 2 * max_error(theirs, want) + 1e-4 * s, name


def test_mlp_in_autocast_keeps_its_output_and_the_casts_alone():
    # Exact CPU bytes in a bfloat16 autocast region: after the forward the sliced MLP holds its
    # output, the bfloat16 copy of its input and autocast's bfloat16 copies of the weights
    # (which the modules in turn hold too), not the two hidden tensors; the step peaks at least
    # one hidden tensor lower (not a ratio of the peaks: what torch's bfloat16 matrix products
    # allocate differs by CPU, 0.56 of theirs with avx512_bf16, 0.64 with AVX2 only).
    torch.manual_seed(0)
    modules = mlp(d=64, hidden=256)
    x = torch.randn(8, 128, 64, requires_grad=True)
    params = sum(p.numel() for p in modules.parameters())
    kept, peaks = {}, {}
    for name in ("sliced", "in turn"):
        with memstats.track() as t:
            start = t.current
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = (memlean.sliced_mlp(x, list(modules), slices=8) if name == "sliced"
                     else in_turn(x, modules))
                kept[name] = t.current - start
            assert y.dtype == torch.bfloat16
            if name == "sliced":
                assert kept[name] == y.untyped_storage().nbytes() + 2 * x.numel() + 2 * params
            y.backward(torch.ones_like(y))
            del y
            peaks[name] = t.peak - start
        x.grad = None
        for p in modules.parameters():
            p.grad = None
    hidden = 8 * 128 * 256 * 2
    assert kept["in turn"] >= kept["sliced"] + 2 * hidden, kept
    assert peaks["sliced"] + hidden <= peaks["in turn"], peaks


def test_mlp_bad_input_is_named():
    x = torch.randn(3, 6)
    with pytest.raises(ValueError, match="modules must be"):
        memlean.sliced_mlp(x, [nn.GELU(), nn.Linear(6, 6)])  # no first Linear
    with pytest.raises(ValueError, match="modules must be"):
        memlean.sliced_mlp(x, [nn.Linear(6, 12), nn.GELU(), nn.Linear(10, 6)])  # 12 != 10
    with pytest.raises(ValueError, match="modules must be"):
        memlean.sliced_mlp(x, [nn.Linear(6, 12), nn.Dropout(0.1), nn.Linear(12, 6)])  # p > 0
    with pytest.raises(ValueError, match="modules must be"):
        memlean.sliced_mlp(x, [nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 12),
                               nn.Linear(12, 6)])  # two Linears after the first
    with pytest.raises(ValueError, match="modules must be"):
        memlean.sliced_mlp(x, [nn.Linear(6, 12), nn.LayerNorm(12), nn.Linear(12, 6)])
    hooked = mlp()
    hooked[1].register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="modules must be"):
        memlean.sliced_mlp(x, list(hooked))
    with pytest.raises(ValueError, match="slices must be an int in 1..20, got 21"):
        memlean.sliced_mlp(x, list(mlp()), slices=21)
    with pytest.raises(ValueError, match="slices must be"):
        memlean.sliced_mlp(x, list(mlp()), slices=True)
    with pytest.raises(ValueError, match="x has 5 features in its last dimension, the MLP "
                                         "takes 6"):
        memlean.sliced_mlp(torch.randn(3, 5), list(mlp()))
    with pytest.raises(TypeError, match="x must be a tensor"):
        memlean.sliced_mlp([1.0], list(mlp()))


def test_mlp_double_backward_is_refused():
    x = torch.randn(3, 6, requires_grad=True)
    y = memlean.sliced_mlp(x, list(mlp()), slices=2)
    (g,) = torch.autograd.grad(y.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()


# ---- transformers' MLP modules: Conv1D (GPT-2's c_fc, c_proj) and its activations ----------

# transformers' elementwise activation modules by name (transformers.activations), each
# sliced as the modules in turn compute it.
TRANSFORMERS_ACTIVATIONS = ["SiLUActivation", "GELUActivation", "NewGELUActivation",
                            "GELUTanh", "FastGELUActivation", "QuickGELUActivation",
                            "AccurateGELUActivation", "ReLUSquaredActivation",
                            "MishActivation", "LaplaceActivation", "LinearActivation"]


def transformers_module(name, *args):
    transformers = require("transformers")
    if name == "Conv1D":
        return transformers.pytorch_utils.Conv1D(*args)
    return getattr(transformers.activations, name)(*args)


def gpt2_mlp(d=6, hidden=20, out=5, act="NewGELUActivation"):
    """GPT-2's MLP as a list: c_fc, act, c_proj (transformers' Conv1D: weight [in, out])."""
    torch.manual_seed(0)
    mods = nn.ModuleList([transformers_module("Conv1D", hidden, d), transformers_module(act),
                          transformers_module("Conv1D", out, hidden)])
    for m in (mods[0], mods[2]):
        nn.init.normal_(m.bias)  # (Conv1D's are zeros)
    return mods


@pytest.mark.parametrize("slices", [1, 3, 20])
@pytest.mark.parametrize("linear", ["Conv1D", "Linear"])
@pytest.mark.parametrize("act", TRANSFORMERS_ACTIVATIONS)
def test_transformers_mlp_equals_the_modules_in_turn(act, linear, slices):
    # GPT-2's Conv1D (its weight transposed: the sliced MLP takes a view, autograd hands the
    # gradient back through it, of the weight's own layout) and every elementwise activation
    # of transformers, against float64 autograd of a copy run in turn (as for nn.Linear).
    modules = gpt2_mlp(act=act)
    if linear == "Linear":
        modules[0], modules[2] = nn.Linear(6, 20), nn.Linear(20, 5)
    x = torch.randn(3, 7, 6)
    matches_float64(modules, x, lambda xs, mine: memlean.sliced_mlp(xs, list(mine),
                                                                    slices=slices),
                    in_turn)
    y = memlean.sliced_mlp(x.requires_grad_(), list(modules), slices=slices)
    assert sliced_ran(y)  # (not the modules in turn)
    y.sum().backward()
    for m in (modules[0], modules[2]):
        assert m.weight.grad.stride() == m.weight.stride()


def test_transformers_gated_mlp_of_conv1ds_equals_the_formula():
    lins = nn.ModuleList([transformers_module("Conv1D", 20, 6),
                          transformers_module("Conv1D", 20, 6),
                          transformers_module("Conv1D", 5, 20)])
    act = transformers_module("SiLUActivation")
    matches_float64(lins, torch.randn(3, 4, 6), lambda xs, mine: memlean.sliced_gated_mlp(
        xs, mine[0], act, mine[1], mine[2], slices=3),
        lambda x64, ref: gated_in_turn(x64, ref, act))


def test_transformers_modules_that_are_not_the_classes_own_are_refused():
    x = torch.randn(3, 6)
    for patch in ("hook", "instance forward", "subclass"):
        modules = gpt2_mlp()
        if patch == "hook":
            modules[0].register_forward_hook(lambda *a: None)
        elif patch == "instance forward":
            modules[1].forward = lambda h: h * 2
        else:
            class NewGELUActivation(type(modules[1])):  # (a forward of its own, elsewhere)
                def forward(self, h):
                    return h * 2
            modules[1] = NewGELUActivation()
        with pytest.raises(ValueError, match="modules must be"):
            memlean.sliced_mlp(x, list(modules))
    with pytest.raises(ValueError, match="modules must be"):  # c_proj takes 20, not 12
        memlean.sliced_mlp(x, [transformers_module("Conv1D", 20, 6), nn.GELU(),
                               transformers_module("Conv1D", 6, 12)])
    with pytest.raises(ValueError, match="x has 5 features in its last dimension, the MLP "
                                         "takes 6"):
        memlean.sliced_mlp(torch.randn(3, 5), list(gpt2_mlp()))
    # (XIELUActivation has parameters: not elementwise in the sense slicing needs)
    xielu = transformers_module("XIELUActivation")
    with pytest.raises(ValueError, match="modules must be"):
        memlean.sliced_mlp(x, [nn.Linear(6, 20), xielu, nn.Linear(20, 6)])


# ---- memlean.sliced_gated_mlp: down(act(gate(x)) * up(x)), sliced over the hidden ----------


def gated(d=6, hidden=20, out=5, bias=True):
    return nn.ModuleList([nn.Linear(d, hidden, bias=bias), nn.Linear(d, hidden, bias=bias),
                          nn.Linear(hidden, out, bias=bias)])


def gated_in_turn(x, lins, act):
    return lins[2](act(lins[0](x)) * lins[1](x))


def matches_float64(lins, x, sliced, formula):
    """sliced(x, lins) (float64 to 1e-12, float32 to 1e-5), its output written in place by
    the caller (as `y += x` does), equals formula(x, lins) in float64 autograd: the output
    and the gradients of x and of every parameter."""
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        mine, ref = copy.deepcopy(lins).to(dtype), copy.deepcopy(lins).double()
        xs = x.to(dtype).clone().requires_grad_()
        x64 = x.double().clone().requires_grad_()
        y = sliced(xs, mine).mul_(1.5)
        y64 = formula(x64, ref) * 1.5
        torch.testing.assert_close(y.double(), y64, rtol=tol, atol=tol)
        g = torch.randn(y64.shape, dtype=torch.float64)
        y.backward(g.to(dtype))
        y64.backward(g)
        torch.testing.assert_close(xs.grad.double(), x64.grad, rtol=tol, atol=tol)
        for (name, p), q in zip(mine.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.double(), q.grad, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("slices", [1, 3, 20])
@pytest.mark.parametrize("act,bias,shape", [
    (nn.SiLU, True, (3, 7, 6)),
    (nn.GELU, False, (4, 6)),
    (lambda: memlean.Swish(variant="inplace"), True, (2, 3, 6)),  # (fit's swap)
])
def test_gated_mlp_equals_the_formula(act, bias, shape, slices):
    # Against float64 autograd of a copy computing down(act(gate(x)) * up(x)): the output and
    # the gradients of the input and every parameter, in float64 (1e-12) and float32 (1e-5);
    # the output written in place by the caller, as for sliced_mlp.
    torch.manual_seed(0)
    lins, x = gated(bias=bias), torch.randn(shape)
    matches_float64(lins, x, lambda xs, mine: memlean.sliced_gated_mlp(
        xs, mine[0], act(), mine[1], mine[2], slices=slices),
        lambda x64, ref: gated_in_turn(x64, ref, act()))


def test_gated_mlp_keeps_only_its_input_and_peaks_lower():
    # Exact CPU bytes: after the forward it holds its output alone; the formula in turn holds
    # four hidden tensors more (gate's output, the activation's, up's, their product).
    torch.manual_seed(0)
    lins = gated(d=64, hidden=256, out=64)
    x = torch.randn(8, 128, 64, requires_grad=True)
    kept, peaks = kept_and_peaks(
        lambda x, mods, slices: memlean.sliced_gated_mlp(x, mods[0], nn.SiLU(), mods[1],
                                                         mods[2], slices=slices),
        lins, x, in_turn=lambda x, mods: gated_in_turn(x, mods, nn.SiLU()))
    hidden = 8 * 128 * 256 * 4
    assert kept["in turn"] >= kept["sliced"] + 4 * hidden
    assert peaks["sliced"] < peaks["in turn"] / 2, peaks


def test_gated_mlp_where_it_does_not_apply_and_bad_input():
    torch.manual_seed(0)
    lins, x = gated(), torch.randn(3, 6)
    y = memlean.sliced_gated_mlp(x.as_subclass(Wrapped), lins[0], nn.SiLU(), lins[1], lins[2])
    assert not sliced_ran(y)
    torch.testing.assert_close(y, gated_in_turn(x.as_subclass(Wrapped), lins, nn.SiLU()))
    with pytest.raises(ValueError, match="gate, up and down must be nn.Linear"):
        memlean.sliced_gated_mlp(x, lins[0], nn.SiLU(), nn.Linear(6, 19), lins[2])
    with pytest.raises(ValueError, match="gate, up and down must be nn.Linear"):
        memlean.sliced_gated_mlp(x, lins[0], nn.LayerNorm(20), lins[1], lins[2])
    with pytest.raises(ValueError, match="slices must be an int in 1..20, got 0"):
        memlean.sliced_gated_mlp(x, lins[0], nn.SiLU(), lins[1], lins[2], slices=0)
    with pytest.raises(ValueError, match="x has 5 features"):
        memlean.sliced_gated_mlp(torch.randn(3, 5), lins[0], nn.SiLU(), lins[1], lins[2])
    with pytest.raises(TypeError, match="x must be a tensor"):
        memlean.sliced_gated_mlp(None, lins[0], nn.SiLU(), lins[1], lins[2])
    xg = torch.randn(3, 6, requires_grad=True)
    y = memlean.sliced_gated_mlp(xg, lins[0], nn.SiLU(), lins[1], lins[2], slices=2)
    (g,) = torch.autograd.grad(y.square().sum(), xg, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        g.sum().backward()


# Packed: one Linear makes gate and up (timm's GluMlp, SwiGLUPacked: EVA-02, DINOv2 giant).


def packed_in_turn(x, lins, act, gate_first):
    first, second = lins[0](x).chunk(2, dim=-1)
    g, u = (first, second) if gate_first else (second, first)
    return lins[1](act(g) * u)


@pytest.mark.parametrize("slices", [1, 3, 10])
@pytest.mark.parametrize("gate_first", [True, False])
@pytest.mark.parametrize("act,bias,shape", [
    (nn.SiLU, True, (3, 7, 6)),
    (nn.Sigmoid, False, (4, 6)),  # (GluMlp's default)
    (lambda: memlean.Swish(variant="inplace"), True, (2, 3, 6)),
])
def test_packed_gated_mlp_equals_the_formula(act, bias, shape, gate_first, slices):
    # Against float64 autograd of `g, u = fc1(x).chunk(2, -1); fc2(act(g) * u)` (or u first):
    # the output and the gradients of the input and both weights and biases, float64 (1e-12)
    # and float32 (1e-5); fc1's one gradient holds both halves' rows. (The in-place Swish: its
    # formula with nn.SiLU, autograd refusing an in-place op on a chunk.)
    torch.manual_seed(0)
    lins = nn.ModuleList([nn.Linear(6, 20, bias=bias), nn.Linear(10, 5, bias=bias)])
    x = torch.randn(shape)
    ref_act = act() if not isinstance(act(), memlean.Swish) else nn.SiLU()
    matches_float64(lins, x, lambda xs, mine: memlean.sliced_gated_mlp(
        xs, mine[0], act(), None, mine[1], slices=slices, gate_first=gate_first),
        lambda x64, ref: packed_in_turn(x64, ref, ref_act, gate_first))


def test_packed_gated_mlp_frozen_parameters_and_bytes():
    # A frozen packed weight gets no gradient, the others theirs; after the forward the
    # sliced MLP holds its output alone (the formula: fc1's output, the activation's and the
    # product, 2 + 1 + 1 hidden tensors), and it peaks under half of the formula.
    torch.manual_seed(0)
    lins = nn.ModuleList([nn.Linear(6, 20), nn.Linear(10, 5)])
    ref = copy.deepcopy(lins)
    for m in (lins, ref):
        m[0].weight.requires_grad_(False)
    x = torch.randn(4, 6, requires_grad=True)
    memlean.sliced_gated_mlp(x, lins[0], nn.SiLU(), None, lins[1], slices=3).sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    packed_in_turn(x_ref, ref, nn.SiLU(), True).sum().backward()
    assert lins[0].weight.grad is None
    for a, b in ((x.grad, x_ref.grad), (lins[0].bias.grad, ref[0].bias.grad),
                 (lins[1].weight.grad, ref[1].weight.grad)):
        torch.testing.assert_close(a, b)
    lins = nn.ModuleList([nn.Linear(64, 512), nn.Linear(256, 64)])
    x = torch.randn(8, 128, 64, requires_grad=True)
    kept, peaks = kept_and_peaks(
        lambda x, mods, slices: memlean.sliced_gated_mlp(x, mods[0], nn.SiLU(), None, mods[1],
                                                         slices=slices),
        lins, x, in_turn=lambda x, mods: packed_in_turn(x, mods, nn.SiLU(), True))
    hidden = 8 * 128 * 256 * 4
    assert kept["in turn"] >= kept["sliced"] + 4 * hidden
    assert peaks["sliced"] < peaks["in turn"] / 2, peaks


def test_packed_gated_mlp_where_it_does_not_apply_and_bad_input():
    torch.manual_seed(0)
    lins, x = nn.ModuleList([nn.Linear(6, 20), nn.Linear(10, 5)]), torch.randn(3, 6)
    for gate_first in (True, False):
        y = memlean.sliced_gated_mlp(x.as_subclass(Wrapped), lins[0], nn.SiLU(), None, lins[1],
                                     gate_first=gate_first)
        assert not sliced_ran(y)
        torch.testing.assert_close(
            y, packed_in_turn(x.as_subclass(Wrapped), lins, nn.SiLU(), gate_first))
    with pytest.raises(ValueError, match="or up None and gate with twice down's input"):
        memlean.sliced_gated_mlp(x, lins[0], nn.SiLU(), None, nn.Linear(20, 5))
    with pytest.raises(TypeError, match="gate_first must be a bool, got str"):
        memlean.sliced_gated_mlp(x, lins[0], nn.SiLU(), None, lins[1], gate_first="last")
    with pytest.raises(ValueError, match="slices must be an int in 1..10, got 11"):
        memlean.sliced_gated_mlp(x, lins[0], nn.SiLU(), None, lins[1], slices=11)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
