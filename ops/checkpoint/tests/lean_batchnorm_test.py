"""memlean.batch_norm (ops/checkpoint/lean_batchnorm.h): torch's batch-norm forward with a
backward that allocates at most the input gradient, written over the incoming gradient when
autograd alone holds it.

Asserted: its output and running statistics equal F.batch_norm's exactly; its gradients (and
double-backward gradients) equal float64 autograd's of the batch-norm formula, for contiguous
and channels_last inputs, 2-d to 5-d, with and without affine parameters and running
statistics; in bfloat16 and float16 (a reduced-precision model, a float32 weight beside a
reduced input, a CPU autocast region) its gradients are no further from float64 autograd's
than torch's own; the bytes its backward allocates, exactly (memstats, CPU): no tensor of the
input's size when it may overwrite the incoming gradient, one when it may not, in float32 and
bfloat16; what it leaves to torch (eval, no_grad, non-dense layouts) is F.batch_norm itself; bad arguments
are named; lean_forward on torch's and timm's BatchNorm modules, eager and compiled (aot_eager
and inductor, fullgraph: no graph break).
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


def reference(x, weight, bias, eps):
    """Training-mode batch norm from float64 autograd ops (no ATen batch-norm kernel)."""
    dims = [d for d in range(x.dim()) if d != 1]
    shape = [1, x.size(1)] + [1] * (x.dim() - 2)
    mean = x.mean(dims, keepdim=True)
    var = (x - mean).pow(2).mean(dims, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps)
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    return y


CASES = [
    # (shape, channels_last, affine, running stats)
    ((6, 5), False, True, True),
    ((4, 3, 10), False, True, True),
    ((4, 6, 5, 7), False, True, True),
    ((4, 6, 5, 7), True, True, True),
    ((4, 6, 5, 7), True, False, False),
    ((3, 4, 3, 2, 5), False, False, True),
    ((2, 3, 2049, 1), False, True, True),  # a plane longer than one partial-sum block
    ((130, 3, 1, 1), True, True, False),  # more rows than one partial-sum block
    ((70, 5, 1, 1), False, True, True),  # contiguous, one element per sample: rows
]


def make(shape, channels_last, affine, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=dtype) * 3 + 1
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    c = shape[1]
    w = torch.rand(c, generator=g, dtype=dtype) + 0.5 if affine else None
    b = torch.randn(c, generator=g, dtype=dtype) if affine else None
    dy = torch.randn(shape, generator=g, dtype=dtype)
    return x, w, b, dy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape,channels_last,affine,stats", CASES)
def test_forward_and_statistics_are_torchs_gradients_float64s(shape, channels_last, affine,
                                                             stats, dtype):
    x, w, b, dy = make(shape, channels_last, affine, dtype)
    assert _C.lean_batch_norm_applies(x)
    c = shape[1]
    runs = {}
    for name, fn in (("lean", memlean.batch_norm), ("torch", F.batch_norm)):
        xs = x.clone().requires_grad_()
        ws = w.clone().requires_grad_() if affine else None
        bs = b.clone().requires_grad_() if affine else None
        rm = torch.zeros(c, dtype=dtype) if stats else None
        rv = torch.ones(c, dtype=dtype) if stats else None
        y = fn(xs, rm, rv, ws, bs, True, 0.3, 1e-3)
        y.backward(dy)
        runs[name] = (y, rm, rv, xs.grad, ws.grad if affine else None,
                      bs.grad if affine else None)
    lean, plain = runs["lean"], runs["torch"]
    assert torch.equal(lean[0], plain[0])  # the same forward kernel
    if stats:
        assert torch.equal(lean[1], plain[1]) and torch.equal(lean[2], plain[2])
    assert lean[3].stride() == x.stride()
    # Gradients against float64 autograd of the formula.
    x64 = x.detach().to(D).requires_grad_()
    w64 = w.detach().to(D).requires_grad_() if affine else None
    b64 = b.detach().to(D).requires_grad_() if affine else None
    reference(x64, w64, b64, 1e-3).backward(dy.to(D))
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lean[3].to(D), x64.grad, **tol)
    if affine:
        torch.testing.assert_close(lean[4].to(D), w64.grad, **tol)
        torch.testing.assert_close(lean[5].to(D), b64.grad, **tol)


def _error(a, r):
    return (a.to(D) - r).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weights", ["float32", "input's", "autocast"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_reduced_precision_no_further_from_float64_than_torchs(dtype, weights, channels_last):
    """A bfloat16/float16 input: with weights of its type (a reduced-precision model), with
    float32 weights (what a BatchNorm meets in a CPU autocast region: its convolution's
    reduced output, the module's float32 parameters), and so inside such a region (autocast
    leaves batch_norm alone). The lean backward runs (its node), the forward and running statistics
    are torch's exactly, the gradients have torch's dtypes and are no further from float64
    autograd of the formula (on the same rounded values) than torch's own backward's."""
    shape = (4, 6, 9, 7)
    x, w, b, dy = make(shape, channels_last, True, torch.float32, seed=4)
    x, dy = x.to(dtype), dy.to(dtype)
    if weights == "input's":
        w, b = w.to(dtype), b.to(dtype)
    runs = {}
    for name, fn in (("lean", memlean.batch_norm), ("torch", F.batch_norm)):
        xs = x.clone().requires_grad_()
        ws, bs = w.clone().requires_grad_(), b.clone().requires_grad_()
        rm, rv = torch.zeros(6, dtype=w.dtype), torch.ones(6, dtype=w.dtype)
        if weights == "autocast":
            with torch.autocast("cpu", dtype=dtype):
                lean = _C.lean_batch_norm_applies(xs)
                y = fn(xs, rm, rv, ws, bs, True, 0.3, 1e-3)
        else:
            lean = _C.lean_batch_norm_applies(xs)
            y = fn(xs, rm, rv, ws, bs, True, 0.3, 1e-3)
        assert lean
        assert ("LeanBatchNormFunction" in y.grad_fn.name()) == (name == "lean")
        y.backward(dy)
        runs[name] = (y, rm, rv, xs.grad, ws.grad, bs.grad)
    lean, plain = runs["lean"], runs["torch"]
    for a, t in zip(lean[:3], plain[:3]):
        assert torch.equal(a, t)  # the same forward kernel
    assert lean[3].stride() == x.stride()
    x64 = x.detach().to(D).requires_grad_()
    w64, b64 = (t.detach().to(D).requires_grad_() for t in (w, b))
    reference(x64, w64, b64, 1e-3).backward(dy.to(D))
    for i, r in zip((3, 4, 5), (x64.grad, w64.grad, b64.grad)):
        assert lean[i].dtype == plain[i].dtype
        # (bfloat16 keeps 8 bits: 2x torch's error, and one unit in the last place at
        # worst, where torch's rounding happened to land exactly)
        ulp = r.abs().max().item() * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)
        assert _error(lean[i], r) <= 2 * _error(plain[i], r) + ulp, (i, _error(lean[i], r),
                                                                    _error(plain[i], r))


@pytest.mark.parametrize("channels_last", [False, True])
def test_double_backward_equals_float64_autograd(channels_last):
    x, w, b, _ = make((3, 4, 5, 3), channels_last, True, D, seed=1)
    assert_double_backward_equal(lambda x, w, b: memlean.batch_norm(x, None, None, w, b, True),
                                 lambda x, w, b: reference(x, w, b, 1e-5), x, w, b,
                                 lambda y: (y * y.detach().sin()).sum(), 1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_backward_allocates_no_tensor_of_the_inputs_size_when_it_owns_the_gradient(
        channels_last, dtype):
    x0 = torch.randn(8, 4, 32, 32, dtype=dtype)  # (float32 weights: autocast's mix)
    if channels_last:
        x0 = x0.contiguous(memory_format=torch.channels_last)
    c, nbytes = 4, x0.nbytes
    w, b = torch.ones(c, requires_grad=True), torch.zeros(c, requires_grad=True)
    lean = lambda h: memlean.batch_norm(h, None, None, w, b, True)  # noqa: E731
    plain = lambda h: F.batch_norm(h, None, None, w, b, True)  # noqa: E731
    # Per-channel vectors (a few doubles per channel) are all the lean backward adds to the
    # incoming gradient (owned: overwritten into h.grad) or to the one input gradient.
    per_channel = 64 * c * 8
    owned = backward_bytes(lean, x0, owned=True)
    assert nbytes <= owned < nbytes + per_channel  # y * 2's gradient, then nothing
    held = backward_bytes(lean, x0, owned=False)
    assert nbytes <= held < nbytes + per_channel  # the input gradient only
    # torch's own backward allocates its input gradient beside the incoming one.
    assert backward_bytes(plain, x0, owned=True) >= owned + nbytes


def test_gradient_kept_elsewhere_is_not_overwritten():
    x, w, b, _ = make((4, 3, 6, 6), False, True, torch.float32, seed=2)
    h = x.clone().requires_grad_()
    y = memlean.batch_norm(h, None, None, w, b, True)
    z = y * 2
    kept = []
    y.register_hook(lambda g: kept.append(g) or None)
    z.backward(torch.ones_like(z))
    assert torch.equal(kept[0], torch.full_like(x, 2.0))  # the hook's tensor is intact
    h2 = x.clone().requires_grad_()
    F.batch_norm(h2, None, None, w, b, True).mul(2).backward(torch.ones_like(z))
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["eval", "no_grad", "strided", "no grad needed"])
def test_what_it_leaves_to_torch_is_torchs(case):
    x, w, b, _ = make((4, 3, 6, 6), False, True, torch.float32, seed=3)
    training = case != "eval"
    rm, rv = torch.randn(3), torch.rand(3) + 0.5
    args = lambda: (rm.clone(), rv.clone(), w, b, training, 0.1, 1e-5)  # noqa: E731
    ctx = torch.no_grad() if case == "no_grad" else torch.enable_grad()
    xs = x if case == "no grad needed" else x.clone().requires_grad_()
    if case == "strided":
        xs = xs[:, :, ::2]
        assert not _C.lean_batch_norm_applies(xs)
    with ctx:
        y = memlean.batch_norm(xs, *args())
        r = F.batch_norm(xs, *args())
    assert torch.equal(y, r)
    assert type(y.grad_fn) is type(r.grad_fn)  # torch's own node (or none)


def test_bad_arguments_are_named():
    x = torch.randn(4, 3, 5, 5, requires_grad=True)
    with pytest.raises(RuntimeError, match="weight must have one element per channel"):
        memlean.batch_norm(x, None, None, torch.ones(4), None, True)
    with pytest.raises(RuntimeError, match="running_var must have one element per channel"):
        memlean.batch_norm(x, torch.zeros(3), torch.ones(2), None, None, True)
    with pytest.raises(RuntimeError, match="input must be a tensor of shape"):
        _C.lean_batch_norm(torch.randn(5, requires_grad=True), None, None, None, None, 0.1,
                           1e-5)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        memlean.batch_norm(torch.randn(1, 3, requires_grad=True), None, None, None, None, True)


class ConvNet(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = norm(8)
        self.act = nn.SiLU()
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.act(self.bn(self.conv(x))).mean((2, 3)))


def norms():
    out = {"nn.BatchNorm2d": nn.BatchNorm2d, "memlean.BatchNorm2d": memlean.BatchNorm2d}
    if available("timm"):
        from timm.layers import BatchNormAct2d

        out["timm BatchNormAct2d"] = lambda c: BatchNormAct2d(c, act_layer=nn.SiLU)
    return out


@pytest.mark.parametrize("norm", list(norms()))
@pytest.mark.parametrize("compiled", [None, "aot_eager", "inductor"])
def test_lean_forward_on_modules_eager_and_compiled(norm, compiled):
    plain, lean = twins(lambda: ConvNet(norms()[norm]))
    undo, taken = lean_forward(lean.bn)
    x = torch.randn(4, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    train_pair(plain, lean, x, compiled)  # gradients equal
    # Eager: every BatchNorm call ran lean; compiled: none did (torch's, fused by inductor).
    assert taken() == (0 if compiled else 2)
    for (n, a), b in zip(plain.named_buffers(), lean.buffers()):
        assert torch.equal(a, b), n  # running statistics: the same forward kernel
    undo()
    assert "forward" not in lean.bn.__dict__


def test_lean_forward_counts_only_the_calls_that_ran_lean():
    bn = nn.BatchNorm2d(3)
    undo, taken = lean_forward(bn)
    x = torch.randn(4, 3, 5, 5, requires_grad=True)
    bn(x[:, :, ::2])  # torch's (a strided input)
    bn.eval()
    bn(x)  # torch's (eval)
    assert taken() == 0
    bn.train()
    assert "LeanBatchNormFunction" in bn(x).grad_fn.name()
    assert taken() == 1
    undo()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
