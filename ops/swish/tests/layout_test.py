"""Swish keeps the input's layout: outputs and gradients have the strides at::empty_like gives
(the input's own for any dense layout: channels_last, channels_last_3d, a dense transpose),
values equal the float64 reference, a dense input is worked on with no copy (exact CPU bytes),
and torch.compile agrees with eager on the strides (the Meta kernels promise the same layout
as the real ones). On CUDA too when a GPU is present."""
import pytest
import torch

import memlean
import memlean.memstats as memstats

D = torch.float64
BETA = 1.3


def layouts(device):
    """name -> a fresh input in that layout (values from one seed)."""
    def make(shape, fix):
        g = torch.Generator().manual_seed(0)
        return lambda: fix(torch.randn(*shape, generator=g, dtype=D) * 4).to(device)
    return {
        "contiguous": make((2, 3, 4, 5), lambda t: t),
        "channels_last": make((2, 3, 4, 5), lambda t: t.contiguous(memory_format=torch.channels_last)),
        "channels_last_3d": make((2, 3, 2, 4, 3),
                                 lambda t: t.contiguous(memory_format=torch.channels_last_3d)),
        "dense transpose": make((7, 5), lambda t: t.t()),
        "dense permutation": make((3, 4, 5), lambda t: t.permute(2, 0, 1)),
        "strided slice (not dense)": make((4, 10), lambda t: t[:, ::2]),
    }


def devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference(x):
    x64 = x.detach().double().cpu().requires_grad_(True)
    y = x64 * torch.sigmoid(BETA * x64)
    return y, x64


def expected_strides(x):
    return torch.empty_like(x).stride()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("layout", list(layouts("cpu")))
@pytest.mark.parametrize("variant", ["naive", "memory_efficient", "inplace"])
def test_output_and_gradient_keep_the_layout(device, layout, variant):
    x = layouts(device)[layout]()
    leaf = x.detach().clone(memory_format=torch.preserve_format).requires_grad_(True)
    h = leaf * 1  # a non-leaf (the in-place variant needs one), in leaf's layout if dense
    if x.is_contiguous() or layout != "strided slice (not dense)":
        assert h.stride() == x.stride()
    strides = h.stride() if variant == "inplace" else expected_strides(h)
    y = memlean.swish(h, BETA, variant)
    want, x64 = reference(x)
    assert y.stride() == strides
    torch.testing.assert_close(y.cpu(), want)
    # A gradient that arrives contiguous, whatever y's layout.
    g = torch.linspace(-1, 1, y.numel(), dtype=D).view(y.shape).to(device)
    y.backward(g)
    want.backward(g.cpu())
    torch.testing.assert_close(leaf.grad.cpu(), x64.grad)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("layout", list(layouts("cpu")))
@pytest.mark.parametrize("grad_layout", ["same as x", "contiguous"])
def test_backward_ops_return_grads_in_x_layout(device, layout, grad_layout):
    x = layouts(device)[layout]()
    g = torch.randn(x.shape, dtype=D, generator=torch.Generator().manual_seed(1)).to(device)
    if grad_layout == "same as x":
        g = torch.empty_like(x).copy_(g)
    want, x64 = reference(x)
    want.backward(g.cpu())

    grad_x = torch.ops.memlean.swish_backward(g, x, BETA)
    assert grad_x.stride() == expected_strides(x)
    torch.testing.assert_close(grad_x.cpu(), x64.grad)

    y, strides = x, x.stride()  # x is not used again: the in-place variant may overwrite it
    mask = torch.ops.memlean._swish_inplace_with_mask(y, BETA)
    assert y.stride() == strides
    torch.testing.assert_close(y.cpu(), want.detach())
    grad_x = torch.ops.memlean._swish_inplace_backward(g, y, mask, BETA)
    assert grad_x.stride() == expected_strides(y)
    torch.testing.assert_close(grad_x.cpu(), x64.grad, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("layout", ["channels_last", "channels_last_3d", "dense transpose"])
def test_dense_layouts_are_not_copied(layout):
    # Exact CPU bytes: the in-place variant allocates its mask only, the others their output.
    x = layouts("cpu")[layout]()
    memstats.enable()
    with memstats.track() as t:
        base = t.current
        torch.ops.memlean.swish_(x, BETA)
        assert t.peak - base == 0
        t.reset_peak()
        mask = torch.ops.memlean._swish_inplace_with_mask(x, BETA)
        assert t.peak - base == mask.nbytes == (x.numel() + 7) // 8
        del mask
        t.reset_peak()
        g = torch.empty_like(x).fill_(1)
        base = t.current
        y = torch.ops.memlean.swish(x, BETA)
        grad_x = torch.ops.memlean.swish_backward(g, x, BETA)
        assert t.peak - base == y.nbytes + grad_x.nbytes == 2 * x.numel() * 8


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("variant", ["naive", "memory_efficient", "inplace"])
def test_compiled_channels_last_matches_eager(backend, variant):
    torch._dynamo.reset()
    x = layouts("cpu")["channels_last"]().float()

    def f(t):
        return memlean.swish(t * 1, BETA, variant) * 2

    eager_in = x.clone(memory_format=torch.preserve_format).requires_grad_(True)
    compiled_in = x.clone(memory_format=torch.preserve_format).requires_grad_(True)
    want = f(eager_in)
    got = torch.compile(f, backend=backend)(compiled_in)
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want)
    want.backward(torch.ones_like(want))
    got.backward(torch.ones_like(got))
    torch.testing.assert_close(compiled_in.grad, eager_in.grad)
    assert compiled_in.grad.stride() == eager_in.grad.stride()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
