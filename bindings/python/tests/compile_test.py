"""memlean's Swish under torch.compile, on the paths users take: graph breaks right before or
after the activation (so its input, or its output, is a graph input), dynamic shapes, both
the aot_eager and inductor backends, through memlean.Swish and through the operators
themselves. Compiled values and gradients must equal eager ones.

Regression: the in-place variant's derivative was lost when its input was a graph input
(AOTAutograd saw the mutation as made under no_grad and copied it back outside autograd).

Compiled, memlean.Swish's memory-efficient and in-place variants are torch's own silu
(memlean/swish.py, _compiled), so inductor treats them as it treats nn.SiLU; the operators
called directly (memlean.swish_, torch.ops.memlean.*) stay memlean's.
"""
import pytest
import torch
import torch.nn as nn

import memlean


class Op(nn.Module):
    """The operators themselves, as a user calling torch.ops.memlean.* would."""

    def __init__(self, beta, variant):
        super().__init__()
        self.beta, self.variant = beta, variant

    def forward(self, x):
        if self.variant == "inplace":
            torch.ops.memlean.swish_(x, self.beta)
            return x
        return torch.ops.memlean.swish(x, self.beta)

BREAKS = ("before", "after", "none")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("graph_break", BREAKS)
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("variant,path", [(v, "module") for v in memlean.VARIANTS] +
                         [("memory_efficient", "op"), ("inplace", "op")])
def test_compiled_gradients_equal_eager(variant, path, backend, dynamic, graph_break, device):
    torch.manual_seed(0)
    act = memlean.Swish(beta=1.3, variant=variant) if path == "module" else Op(1.3, variant)
    model = Block(act, graph_break).to(device)
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    # Two batch sizes: the second reuses (dynamic) or recompiles (static) the graphs.
    for batch in (8, 5):
        x = torch.randn(batch, 16, device=device)
        assert_same_step(step(compiled, model, x), step(model, model, x))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("variant", memlean.VARIANTS)
def test_compiled_function_on_non_leaf_graph_input(variant, backend, device):
    fn = torch.compile(lambda t: memlean.swish(t, 1.3, variant), backend=backend)
    x0 = torch.randn(64, dtype=torch.float32, device=device) * 3
    grads = []
    for f in (lambda t: memlean.swish(t, 1.3, variant), fn):
        leaf = x0.clone().requires_grad_(True)
        y = f(leaf * 1)  # a non-leaf graph input, overwritten by the in-place variant
        (y * torch.arange(64.0, device=device)).sum().backward()
        grads.append(leaf.grad)
    x64 = x0.double().requires_grad_(True)
    ((x64 * torch.sigmoid(1.3 * x64))
     * torch.arange(64.0, dtype=torch.float64, device=device)).sum().backward()
    torch.testing.assert_close(grads[1], grads[0])
    torch.testing.assert_close(grads[1].double(), x64.grad, rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_swish_op_on_graph_input_directly(backend, device):
    """torch.ops.memlean.swish_ itself, not only through memlean.Swish."""

    def f(t):
        torch.ops.memlean.swish_(t, 0.8)
        return t * 2

    x0 = torch.randn(32, device=device)
    grads = []
    for g in (f, torch.compile(f, backend=backend)):
        leaf = x0.clone().requires_grad_(True)
        g(leaf + 0).sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[1], grads[0])
    assert grads[0].abs().sum() > 0


def traced_graph(act):
    """The ops torch.compile captures for a conv-BN-act block (dynamo's graph)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([(n.op, str(n.target)) for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    torch._dynamo.reset()
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), act, nn.Conv2d(8, 4, 1), act)
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(2, 3, 8, 8))
    assert len(graphs) == 1
    return graphs[0]


def test_compiled_swish_module_is_torchs_silu():
    # Compiled, the memory-efficient variant is what nn.SiLU is (F.silu; x * sigmoid(beta * x)
    # for another beta), so inductor fuses it with BatchNorm and recomputes it in backward as
    # it does torch's own: never worse than nn.SiLU. The operator itself would be opaque.
    silu = traced_graph(nn.SiLU())
    assert traced_graph(memlean.Swish()) == silu
    assert traced_graph(memlean.Swish(variant="memory_efficient", inplace=True)) == silu
    # The in-place module too: compiled, it computes out of place (the compiler decides what
    # to keep; the one-bit op would be opaque to it).
    assert traced_graph(memlean.Swish(inplace=True)) == silu
    assert ("call_function", "memlean.swish_") in traced_graph(Op(1.0, "inplace"))
    assert ("call_function", "memlean.swish") in traced_graph(Op(1.0, "memory_efficient"))
    beta = traced_graph(memlean.Swish(beta=1.5))
    assert not any("memlean" in t for _, t in beta), beta
    assert any("sigmoid" in t for _, t in beta), beta


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
