"""The three Swish variants through memlean: same values, the in-place variant's gradient
bound and autograd semantics, exact saved bytes, and the places PyTorch code runs:
opcheck, torch.compile, TorchScript, ONNX (onnxruntime)."""
import math
import os
import tempfile

import pytest
import torch

import memlean
import memlean.memstats

T_STAR = -1.2784645427610738
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
BOUND = {torch.float32: 2e-4, torch.float64: 1e-8, torch.bfloat16: 3e-2, torch.float16: 3e-2}


def reference_grad(x, beta):
    x64 = x.detach().double().requires_grad_(True)
    (x64 * torch.sigmoid(beta * x64)).sum().backward()
    return x64.grad


@pytest.mark.parametrize("variant", memlean.VARIANTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_variants_agree(variant, dtype):
    x0 = (torch.randn(257, 3, dtype=torch.float64) * 4).to(dtype)
    leaf = x0.clone().requires_grad_(True)
    y = memlean.swish(leaf * 1, 1.3, variant=variant)
    ref = (x0.double() * torch.sigmoid(1.3 * x0.double()))
    tol = 1e-12 if dtype == torch.float64 else 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
    y.sum().backward()
    torch.testing.assert_close(leaf.grad.double(), reference_grad(x0, 1.3), rtol=0, atol=max(BOUND[dtype], tol))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", [1.0, 0.5, -2.0])
def test_inplace_gradient_bound_dense_sweep_and_random(dtype, beta):
    scale = 1 / abs(beta)
    x_star = T_STAR / beta
    g = torch.Generator().manual_seed(0)
    x0 = torch.cat([
        torch.linspace(-110, 110, 1_000_001, dtype=torch.float64) * scale,
        torch.linspace(x_star - 0.05 * scale, x_star + 0.05 * scale, 500_001, dtype=torch.float64),
        torch.randn(500_000, generator=g, dtype=torch.float64) * 3 * scale,
    ]).to(dtype)
    leaf = x0.clone().requires_grad_(True)
    y = memlean.swish_(leaf * 1, beta)
    y.backward(torch.ones_like(y))
    err = (leaf.grad.double() - reference_grad(x0, beta)).abs().max().item()
    assert err <= BOUND[dtype], (dtype, beta, err)


def test_swish_returns_x_itself_and_bumps_its_version():
    x = torch.randn(10)
    v = x._version
    y = memlean.swish_(x)
    assert y is x and x._version == v + 1
    z = torch.randn(10)
    assert memlean.swish(z, variant="inplace") is z


def test_inplace_refuses_a_leaf_that_requires_grad():
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match="x is a leaf tensor that requires grad"):
        memlean.swish_(x)
    with pytest.raises(RuntimeError, match="x is a leaf tensor that requires grad"):
        memlean.Swish(variant="inplace")(x)
    with torch.no_grad():
        memlean.swish_(x)  # fine without grad mode, as for torch's in-place ops


def test_inplace_overwriting_a_saved_tensor_fails_loudly():
    leaf = torch.randn(16, requires_grad=True)
    x = leaf * 2
    sq = x * x  # saves x
    memlean.swish_(x)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (sq.sum() + x.sum()).backward()


def test_inplace_double_backward_is_a_clear_error():
    leaf = torch.randn(5, dtype=torch.float64, requires_grad=True)
    y = memlean.swish_(leaf * 1)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(y.sum(), leaf, create_graph=True)


def test_bad_variant_and_arguments():
    with pytest.raises(ValueError, match="unknown variant 'fast'"):
        memlean.swish(torch.ones(2), variant="fast")
    # An explicit variant wins over timm's inplace=True (act_layer(inplace=True)).
    assert memlean.Swish(variant="naive", inplace=True).variant == "naive"
    assert memlean.Swish(variant="memory_efficient", inplace=True).variant == "memory_efficient"
    with pytest.raises(TypeError, match="inplace must be a bool, got str"):
        memlean.Swish(inplace="no")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        memlean.swish_(3.0)
    assert memlean.Swish(inplace=True).variant == "inplace"
    assert repr(memlean.Swish(2.0, "naive")) == "Swish(beta=2.0, variant='naive')"


def saved_storages(fn):
    """{storage_key: nbytes} of the distinct storages autograd saves while fn() runs."""
    with memlean.memstats.saved_storages() as saved:
        out = fn()
    return saved, out


def test_linear_swish_linear_saved_bytes_exact():
    torch.manual_seed(0)
    batch, d_in, d_h = 64, 32, 1000
    lin1, lin2 = torch.nn.Linear(d_in, d_h), torch.nn.Linear(d_h, 1)
    params = {memlean.memstats.storage_key(p) for p in [*lin1.parameters(), *lin2.parameters()]}
    x = torch.randn(batch, d_in)
    h_bytes, n = batch * d_h * 4, batch * d_h

    activation_bytes, counts = {}, {}
    for variant in memlean.VARIANTS:
        act = memlean.Swish(variant=variant)
        saved, out = saved_storages(lambda: lin2(act(lin1(x))))
        acts = {k: v for k, v in saved.items() if k not in params}
        activation_bytes[variant] = sum(acts.values())
        counts[variant] = sorted(acts.values())
        out.sum().backward()  # the graph is usable
    x_bytes = x.nbytes
    # naive: x, h, sigmoid(h), y; memory_efficient: x, h, y; inplace: x, y (= h), mask.
    assert counts["naive"] == sorted([x_bytes, h_bytes, h_bytes, h_bytes])
    assert counts["memory_efficient"] == sorted([x_bytes, h_bytes, h_bytes])
    assert counts["inplace"] == sorted([x_bytes, h_bytes, math.ceil(n / 8)])
    assert activation_bytes["naive"] - activation_bytes["inplace"] == 2 * h_bytes - math.ceil(n / 8)
    assert activation_bytes["memory_efficient"] - activation_bytes["inplace"] == h_bytes - math.ceil(n / 8)


def test_opcheck_every_swish_op():
    x = torch.randn(7, 5, dtype=torch.float64)
    g = torch.randn(7, 5, dtype=torch.float64)
    ops = torch.ops.memlean
    torch.library.opcheck(ops.swish.default, (x.clone().requires_grad_(True), 1.5))
    torch.library.opcheck(ops.swish.default, (x, 1.0))
    torch.library.opcheck(ops.swish_backward.default, (g, x, 1.5))
    torch.library.opcheck(ops._swish_backward_.default, (g.clone(), x, 1.5))
    torch.library.opcheck(ops.swish_.default, (x.clone(), 0.7))
    torch.library.opcheck(ops._swish_inplace_with_mask.default, (x.clone(), 0.7))
    y = x.clone()
    mask = ops._swish_inplace_with_mask(y, 0.7)
    torch.library.opcheck(ops._swish_inplace_backward.default, (g, y, mask, 0.7))
    torch.library.opcheck(ops._swish_inplace_backward_.default, (g.clone(), y, mask, 0.7))


class Net(torch.nn.Module):
    def __init__(self, variant):
        super().__init__()
        self.lin1 = torch.nn.Linear(8, 16)
        self.act = memlean.Swish(beta=1.2, variant=variant)
        self.lin2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.lin2(self.act(self.lin1(x)))


def run_and_grads(model, x):
    model.zero_grad()
    out = model(x)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("variant,backend", [(v, "aot_eager") for v in memlean.VARIANTS] +
                         [("memory_efficient", "inductor"), ("inplace", "inductor")])
def test_torch_compile_fullgraph_matches_eager(variant, backend):
    torch.manual_seed(0)
    model = Net(variant)
    x = torch.randn(4, 8)
    eager_out, eager_grads = run_and_grads(model, x)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    out, grads = run_and_grads(compiled, x)
    torch.testing.assert_close(out, eager_out)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("variant", memlean.VARIANTS)
def test_torchscript(variant):
    torch.manual_seed(0)
    model = Net(variant)
    scripted = torch.jit.script(model)
    x = torch.randn(4, 8)
    out, grads = run_and_grads(scripted, x)
    eager_out, eager_grads = run_and_grads(model, x)
    torch.testing.assert_close(out, eager_out)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TEST_TMPDIR")) as d:
        path = os.path.join(d, "net.pt")
        scripted.save(path)
        torch.testing.assert_close(torch.jit.load(path)(x), eager_out)


@pytest.mark.parametrize("dynamo", [True, False])
@pytest.mark.parametrize("beta", [1.0, 1.7])
def test_onnx_export_standard_ops_and_onnxruntime(dynamo, beta):
    import onnx  # test dependencies, installed by ./bazelw
    import onnxruntime as ort

    import memlean.onnx  # noqa: F401  (registers the exporters' translations)

    torch.manual_seed(0)
    model = Net("memory_efficient").eval()
    model.act.beta = beta
    x = torch.randn(5, 8)
    with tempfile.TemporaryDirectory(dir=os.environ.get("TEST_TMPDIR")) as d:
        path = os.path.join(d, "net.onnx")
        if dynamo:
            memlean.onnx.export(model, (x,), path)
        else:
            torch.onnx.export(model, (x,), path, dynamo=False)
        proto = onnx.load(path)
        kinds = {n.op_type for n in proto.graph.node}
        assert all(n.domain in ("", "ai.onnx") for n in proto.graph.node), kinds
        assert {"Sigmoid", "Mul"} <= kinds, kinds
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    torch.testing.assert_close(torch.from_numpy(out), model(x).detach(), rtol=1e-5, atol=1e-5)


OPS = ["swish", "swish_backward", "_swish_backward_", "swish_", "_swish_inplace_with_mask",
       "_swish_inplace_backward", "_swish_inplace_backward_"]


def test_cuda_kernels_are_registered_when_built_with_cuda():
    # The library links libtorch_cuda and loads here without a GPU; its CUDA kernels are
    # registered whenever the torch it was built against has CUDA.
    if torch.version.cuda is None:
        pytest.skip("this torch has no CUDA: memlean builds without CUDA kernels")
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"memlean::{op}", "CUDA"), op
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"memlean::{op}", "CPU"), op


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", memlean.VARIANTS)
def test_cuda_matches_float64_reference(dtype, variant):
    beta = 1.3
    x0 = torch.cat([torch.linspace(-60, 60, 200_001, dtype=torch.float64),
                    torch.linspace(T_STAR / beta - 0.05, T_STAR / beta + 0.05, 100_001, dtype=torch.float64),
                    torch.randn(100_003, dtype=torch.float64) * 3]).to(dtype)
    leaf = x0.cuda().requires_grad_(True)
    y = memlean.swish(leaf * 1, beta, variant=variant)
    ref = x0.double() * torch.sigmoid(beta * x0.double())
    tol = 1e-12 if dtype == torch.float64 else 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5
    torch.testing.assert_close(y.detach().cpu().double(), ref, rtol=tol, atol=tol)
    y.backward(torch.ones_like(y))
    err = (leaf.grad.cpu().double() - reference_grad(x0, beta)).abs().max().item()
    assert err <= max(BOUND[dtype], tol), (dtype, variant, err)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _swish_step(x0, w, variant, keep_grad=False):
    """x -> x + 0 -> swish (the variant) -> * w -> sum, backward: the backward's peak above
    its start in bytes (memstats on CPU, torch.cuda on CUDA), x's gradient, and dL/dy if
    keep_grad (a hook holding the gradient that reaches swish's backward). Only mul's and
    swish's backwards allocate: add's hands its gradient on, x.grad takes the one it gets."""
    x = x0.clone().requires_grad_(True)
    y = memlean.swish(x + 0, 1.0, variant=variant)
    held = []
    if keep_grad:
        y.register_hook(held.append)
    loss = (y * w).sum()
    if x0.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loss.backward()
        peak = torch.cuda.max_memory_allocated() - start
    else:
        memlean.memstats.enable()
        with memlean.memstats.track() as t:
            start = t.current
            loss.backward()
            peak = t.peak - start
    return peak, x.grad, held


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("variant", ["inplace", "memory_efficient"])
def test_backward_writes_over_a_gradient_nobody_else_holds(variant, device, dtype, memory_format):
    # The gradient reaching swish's backward is mul's fresh output, held by autograd alone:
    # memlean's backward writes grad_x over it, so the backward peaks at that one gradient,
    # where it held two (dL/dy and dL/dx) when a hook keeps dL/dy (which must then not be
    # overwritten).
    torch.manual_seed(0)
    x0 = (torch.randn(4, 8, 64, 65, dtype=torch.float64) * 3).to(dtype).to(device)
    w = torch.randn(4, 8, 64, 65, dtype=torch.float64).to(dtype).to(device)
    x0, w = (t.contiguous(memory_format=memory_format) for t in (x0, w))
    peak, grad, _ = _swish_step(x0, w, variant)
    peak_held, grad_held, held = _swish_step(x0, w, variant, keep_grad=True)
    # backward()'s gradient of the scalar loss, alive throughout: one element, which CUDA's
    # caching allocator counts as its smallest block, 512 bytes (x0's bytes are a multiple).
    root = 512 if device == "cuda" else x0.element_size()
    assert peak == root + x0.nbytes
    assert peak_held == root + 2 * x0.nbytes
    assert torch.equal(held[0], w)  # the hook's gradient is dL/dy, not overwritten
    assert torch.equal(grad, grad_held)  # the same kernel, in place or not
    assert grad.stride() == x0.stride()
    if dtype == torch.float64:
        ref = x0.clone().requires_grad_(True)
        (ref * torch.sigmoid(ref) * w).sum().backward()
        assert (grad - ref.grad).abs().max().item() <= BOUND[dtype]


def _reference(fn, *xs):
    leaves = [x.detach().double().requires_grad_(True) for x in xs]
    fn(*leaves).backward()
    return [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("case", ["add", "cat", "retain_grad", "autograd.grad", "hook", "chain"])
@pytest.mark.parametrize("variant", ["inplace", "memory_efficient"])
def test_backward_leaves_shared_gradients_alone(variant, case):
    # Where the gradient reaching swish's backward is also another's (add's backward hands one
    # tensor to both inputs; cat's hands views of one; retain_grad, a hook or
    # torch.autograd.grad keep it), writing over it would corrupt the other: every gradient
    # equals float64 autograd's (within the in-place backward's bound).
    torch.manual_seed(0)
    a0, b0, w = torch.randn(1000, dtype=torch.float64), torch.randn(1000, dtype=torch.float64), torch.randn(2000, dtype=torch.float64)

    def silu(t, ours):
        return memlean.swish(t, 1.0, variant=variant) if ours else t * torch.sigmoid(t)

    def f(a, b, ours=True):
        if case == "add":
            return ((silu(a * 2, ours) + silu(b * 3, ours)) * w[:1000]).sum()
        if case == "cat":
            return (torch.cat([silu(a * 2, ours), b * 3]) * w).sum()
        if case == "chain":  # swish twice in a row: each writes over the gradient it gets
            return (silu(silu(a * 2, ours) * 1.5, ours) * w[:1000] + b).sum()
        return (silu(a * 2, ours) * w[:1000]).sum() + b.sum()

    a, b = a0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
    want = _reference(lambda a, b: f(a, b, ours=False), a0, b0)
    if case in ("add", "cat", "chain"):
        f(a, b).backward()
        got = [a.grad, b.grad]
    else:
        y = memlean.swish(a * 2, 1.0, variant=variant)
        loss = (y * w[:1000]).sum() + b.sum()
        held = []
        if case == "retain_grad":
            y.retain_grad()
        elif case == "hook":
            y.register_hook(held.append)
        if case == "autograd.grad":
            gy, ga, gb = torch.autograd.grad(loss, [y, a, b])
            got = [ga, gb]
        else:
            loss.backward()
            got = [a.grad, b.grad]
            gy = y.grad if case == "retain_grad" else held[0]
        assert torch.equal(gy, w[:1000])
    for g, r in zip(got, want):
        assert (g - r).abs().max().item() <= BOUND[torch.float64]


def test_backward_into_checks_its_arguments():
    ops = torch.ops.memlean
    y = torch.randn(6, 4, dtype=torch.float64)
    mask = ops._swish_inplace_with_mask(y, 1.0)
    with pytest.raises(RuntimeError, match="_swish_inplace_backward_: grad must have y's strides"):
        ops._swish_inplace_backward_(torch.randn(4, 6, dtype=torch.float64).t(), y, mask, 1.0)
    with pytest.raises(RuntimeError, match="_swish_inplace_backward_: grad has dtype Float"):
        ops._swish_inplace_backward_(torch.randn(6, 4), y, mask, 1.0)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        ops._swish_inplace_backward_(y, y, mask, 1.0)
    g = torch.randn(6, 4, dtype=torch.float64)
    want = ops._swish_inplace_backward(g, y, mask, 1.0)
    ops._swish_inplace_backward_(g, y, mask, 1.0)
    assert torch.equal(g, want)
    x = torch.randn(6, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="_swish_backward_: grad must have x's strides"):
        ops._swish_backward_(torch.randn(4, 6, dtype=torch.float64).t(), x, 1.0)
    with pytest.raises(RuntimeError, match="_swish_backward_: grad has shape"):
        ops._swish_backward_(torch.randn(6, 5, dtype=torch.float64), x, 1.0)
    with pytest.raises(RuntimeError, match="refer to a single memory location"):
        ops._swish_backward_(x, x, 1.0)
    g = torch.randn(6, 4, dtype=torch.float64)
    want = ops.swish_backward(g, x, 1.5)
    ops._swish_backward_(g, x, 1.5)
    assert torch.equal(g, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_inplace_backward_keeps_nan(device, dtype):
    # A NaN input gives a NaN gradient on every device and dtype (the CUDA double path once
    # turned it into t* and a finite slope: device max() on doubles is fmax, which drops NaN).
    x = torch.tensor([float("nan"), 1.0], dtype=dtype, device=device, requires_grad=True)
    memlean.swish(x * 1, 2.0, "inplace").sum().backward()
    assert torch.isnan(x.grad[0]).item()
    assert torch.isfinite(x.grad[1]).item()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))


def _linear_swish_linear(x0, how, keep_stale=False):
    """x (a leaf) -> nn.Linear -> the in-place Swish (`how`: the module or the function) ->
    nn.Linear -> sum of squares, backward: (the backward's peak above its start in exact CPU
    bytes, x's and the weights' gradients, the first Linear's output h, what Swish returned).
    keep_stale: the loss also adds h itself, used again after Swish overwrote it."""
    torch.manual_seed(0)
    lin1 = torch.nn.Linear(x0.shape[-1], 96).double()
    lin2 = torch.nn.Linear(96, 8).double()
    x = x0.clone().requires_grad_(True)
    h = lin1(x)
    y = (memlean.Swish(variant="inplace")(h) if how == "module"
         else memlean.swish(h, variant="inplace"))
    loss = lin2(y).square().sum() + (h.sum() if keep_stale else 0)
    memlean.memstats.enable()
    with memlean.memstats.track() as t:
        start = t.current
        loss.backward()
        peak = t.peak - start
    return peak, [x.grad, lin1.weight.grad, lin2.weight.grad], h, y


@pytest.mark.parametrize("how", ["module", "function"])
def test_inplace_on_a_view_of_a_whole_tensor_backs_up_as_on_a_tensor(how):
    # nn.Linear's output for a 3-d input is a view of its 2-d matmul result; autograd records
    # an in-place op on it as one on that base (CopySlices), whose backward held two more
    # tensors of its size. memlean's in-place Swish overwrites the base instead and returns a
    # view of it: the backward peaks as for the same batch in 2-d, gradients as float64
    # autograd's, the same memory overwritten.
    x3 = torch.randn(4, 32, 16, dtype=torch.float64)
    peak3, grads3, h, y = _linear_swish_linear(x3, how)
    peak2, grads2, _, _ = _linear_swish_linear(x3.reshape(128, 16), how)
    assert h._base is not None and h.grad_fn is not None  # (the case in question: a view)
    assert y.data_ptr() == h.data_ptr() and torch.equal(y, h)  # h overwritten with y
    assert "CopySlices" not in type(y.grad_fn).__name__
    assert peak3 == peak2, (peak3, peak2)
    torch.manual_seed(0)
    lin1 = torch.nn.Linear(16, 96).double()
    lin2 = torch.nn.Linear(96, 8).double()
    for keep_stale in (False, True):
        _, grads, _, _ = _linear_swish_linear(x3, how, keep_stale)
        x = x3.clone().requires_grad_(True)
        for m in (lin1, lin2):
            m.zero_grad(set_to_none=True)
        ref = torch.nn.functional.silu(lin1(x))
        (lin2(ref).square().sum() + (ref.sum() if keep_stale else 0)).backward()
        for got, want in zip(grads, [x.grad, lin1.weight.grad, lin2.weight.grad]):
            torch.testing.assert_close(got, want, rtol=1e-7, atol=BOUND[torch.float64])
    for got, want in zip(grads3, grads2):
        torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-12, atol=1e-12)
    # A view of part of a tensor is overwritten itself (CopySlices: torch's own bookkeeping).
    part = torch.randn(8, 16, dtype=torch.float64, requires_grad=True) * 1
    view = part[:4]
    assert memlean.swish(view, variant="inplace") is view
