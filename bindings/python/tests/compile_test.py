"""memlean's Swish under torch.compile, on the paths users take: graph breaks right before or
after the activation (so its input, or its output, is a graph input), dynamic shapes, both
the aot_eager and inductor backends. Compiled values and gradients must equal eager ones.

Regression: the in-place variant's derivative was lost when its input was a graph input
(AOTAutograd saw the mutation as made under no_grad and copied it back outside autograd).
"""
import pytest
import torch
import torch.nn as nn

import memlean

BREAKS = ("before", "after", "none")


class Block(nn.Module):
    def __init__(self, act, graph_break):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.act = act
        self.out = nn.Linear(16, 3)
        self.graph_break = graph_break

    def forward(self, x):
        h = self.lin(x)
        if self.graph_break == "before":
            torch._dynamo.graph_break()
        h = self.act(h)
        if self.graph_break == "after":
            torch._dynamo.graph_break()
        return self.out(h)


def step(run, model, x):
    """One forward+backward through `run` (the model, or its compiled form)."""
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = run(x)
    out.square().sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_step(compiled, eager):
    (out_c, xg_c, g_c), (out_e, xg_e, g_e) = compiled, eager
    torch.testing.assert_close(out_c, out_e)
    torch.testing.assert_close(xg_c, xg_e)
    assert g_c.keys() == g_e.keys()
    for name in g_e:
        torch.testing.assert_close(g_c[name], g_e[name], msg=lambda m: f"{name}: {m}")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("graph_break", BREAKS)
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("variant", memlean.VARIANTS)
def test_compiled_gradients_equal_eager(variant, backend, dynamic, graph_break):
    torch.manual_seed(0)
    model = Block(memlean.Swish(beta=1.3, variant=variant), graph_break)
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    # Two batch sizes: the second reuses (dynamic) or recompiles (static) the graphs.
    for batch in (8, 5):
        x = torch.randn(batch, 16)
        assert_same_step(step(compiled, model, x), step(model, model, x))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("variant", memlean.VARIANTS)
def test_compiled_function_on_non_leaf_graph_input(variant, backend):
    fn = torch.compile(lambda t: memlean.swish(t, 1.3, variant), backend=backend)
    x0 = torch.randn(64, dtype=torch.float32) * 3
    grads = []
    for f in (lambda t: memlean.swish(t, 1.3, variant), fn):
        leaf = x0.clone().requires_grad_(True)
        y = f(leaf * 1)  # a non-leaf graph input, overwritten by the in-place variant
        (y * torch.arange(64.0)).sum().backward()
        grads.append(leaf.grad)
    x64 = x0.double().requires_grad_(True)
    ((x64 * torch.sigmoid(1.3 * x64)) * torch.arange(64.0, dtype=torch.float64)).sum().backward()
    torch.testing.assert_close(grads[1], grads[0])
    torch.testing.assert_close(grads[1].double(), x64.grad, rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_swish_op_on_graph_input_directly(backend):
    """torch.ops.memlean.swish_ itself, not only through memlean.Swish."""

    def f(t):
        torch.ops.memlean.swish_(t, 0.8)
        return t * 2

    x0 = torch.randn(32)
    grads = []
    for g in (f, torch.compile(f, backend=backend)):
        leaf = x0.clone().requires_grad_(True)
        g(leaf + 0).sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0])
    assert grads[0].abs().sum() > 0
