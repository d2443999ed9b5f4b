"""`from lean_pair import twins, train_pair`: train a model and its copy whose module(s) run
memlean.lean.lean_forward side by side, eager or compiled, for the lean-backward tests."""
import torch
import torch._dynamo


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
