"""`from lean_pair import ...`: for the lean-backward tests, the bytes a backward allocates,
double-backward gradients compared, and a model and its copy whose module(s) run
memlean.lean.lean_forward trained side by side, eager or compiled."""
import torch
import torch._dynamo

import memlean


def backward_bytes(fn, x0, owned=False):
    """Bytes the backward of out = fn(h) allocates above its start (memstats, exact on CPU), h
    a leaf copy of x0. owned: dL/dy comes from y * 2 (autograd alone holds it), else it is
    the caller's tensor."""
    h = x0.clone().requires_grad_()
    y = fn(h)
    out = y * 2 if owned else y
    dy = torch.ones_like(out)
    with memlean.memstats.track() as t:
        start = t.current
        out.backward(dy)
        peak = t.peak - start
    assert h.grad is not None
    return peak


def assert_double_backward_equal(lean, reference, x, w, b, first_loss, tol):
    """Gradients of gradients (create_graph=True) of y = lean(x, w, b) and of the reference,
    from the first loss first_loss(y) on to |dx|^2 + sum(dw^3), equal within tol (a gradient
    the reference does not have is absent or zero)."""
    grads = {}
    for name, fn in (("lean", lean), ("reference", reference)):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w, b))
        gx, gw = torch.autograd.grad(first_loss(fn(xs, ws, bs)), (xs, ws), create_graph=True)
        grads[name] = torch.autograd.grad(gx.pow(2).sum() + gw.pow(3).sum(), (xs, ws, bs),
                                          allow_unused=True)
    for a, r in zip(grads["lean"], grads["reference"]):
        if r is None:
            assert a is None or torch.count_nonzero(a) == 0
        else:
            torch.testing.assert_close(a, r, rtol=tol, atol=tol)


def twins(make):
    """Two models from make() with the same parameters and buffers: (plain, lean)."""
    torch.manual_seed(0)
    plain, lean = make(), make()
    lean.load_state_dict(plain.state_dict())
    return plain, lean


def train_pair(plain, lean, x, compiled=None, steps=2):
    """`steps` training steps (loss: the output's squares summed) of `plain` and `lean` on x,
    both eager (compiled None) or both through torch.compile(backend=compiled,
    fullgraph=True): a lean forward that broke the graph fails here. Then asserts their
    parameter gradients equal to float tolerance; dynamo's caches are reset around a compiled
    pair."""
    if compiled:
        torch._dynamo.reset()
        run_plain = torch.compile(plain, backend=compiled, fullgraph=True)
        run_lean = torch.compile(lean, backend=compiled, fullgraph=True)
    else:
        run_plain, run_lean = plain, lean
    try:
        for _ in range(steps):
            run_plain(x).square().sum().backward()
            run_lean(x).square().sum().backward()
    finally:
        if compiled:
            torch._dynamo.reset()
    for (n, a), b in zip(plain.named_parameters(), lean.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{n}: {m}")
