"""ONNX export of every Swish variant with both exporters: standard Sigmoid and Mul nodes,
onnxruntime equal to eager, and never a dropped activation (the in-place operator
memlean::swish_ returns nothing, which the TorchScript exporter used to delete silently)."""
import os
import tempfile

import onnx  # test dependencies, installed by ./bazelw
import onnxruntime as ort
import pytest
import torch

import memlean
import memlean.onnx

EXPORTERS = ["memlean.onnx.export", "torch.onnx.export dynamo", "torch.onnx.export torchscript"]


def export(model, x, exporter, path):
    if exporter == "memlean.onnx.export":
        memlean.onnx.export(model, (x,), path)
    elif exporter == "torch.onnx.export dynamo":
        torch.onnx.export(model, (x,), path, dynamo=True,
                          custom_translation_table=memlean.onnx.translation_table())
    else:
        torch.onnx.export(model, (x,), path, dynamo=False)


def export_and_run(model, x, exporter):
    """Exports model(x), returns (op types of the ONNX graph, onnxruntime's output)."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("TEST_TMPDIR")) as d:
        path = os.path.join(d, "model.onnx")
        export(model, x.clone(), exporter, path)
        proto = onnx.load(path)
        onnx.checker.check_model(proto)
        assert all(n.domain in ("", "ai.onnx") for n in proto.graph.node), \
            [(n.domain, n.op_type) for n in proto.graph.node]
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    return [n.op_type for n in proto.graph.node], torch.from_numpy(out)


def eager(model, x):
    with torch.no_grad():
        return model(x.clone())  # the in-place variant may overwrite what it is given


def assert_exports_swish(model, x, exporter):
    ops, out = export_and_run(model, x, exporter)
    assert "Sigmoid" in ops and "Mul" in ops, ops
    torch.testing.assert_close(out, eager(model, x), rtol=1e-5, atol=1e-5)
    # The activation matters here: without it the output is far off.
    assert (out - eager(NoActivation(model), x)).abs().max() > 1e-2


class Net(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)
        self.act = act
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.act(self.lin(x)))


class NoActivation(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net.out(self.net.lin(x))


# Each dynamo export takes seconds: beta 1 (its own code path) with one exporter each.
@pytest.mark.parametrize("exporter,beta", [
    ("memlean.onnx.export", -1.7),
    ("torch.onnx.export dynamo", 1.0),
    ("torch.onnx.export torchscript", -1.7),
    ("torch.onnx.export torchscript", 1.0),
])
@pytest.mark.parametrize("variant", memlean.VARIANTS)
def test_every_variant_exports_as_sigmoid_and_mul(variant, exporter, beta):
    model = Net(memlean.Swish(beta, variant=variant)).eval()
    assert_exports_swish(model, torch.randn(5, 8) * 3, exporter)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_timm_style_inplace_module(exporter):
    # The reproduction: timm's act_layer(inplace=True) in an nn.Sequential.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), memlean.Swish(inplace=True),
                                torch.nn.Linear(8, 3)).eval()
    x = torch.randn(4, 8)
    ops, out = export_and_run(model, x, exporter)
    assert "Sigmoid" in ops and "Mul" in ops, ops
    torch.testing.assert_close(out, eager(model, x), rtol=1e-5, atol=1e-5)


class InplaceByMutation(Net):
    """Relies on the mutation alone (the return value is ignored), as in-place code may."""

    def __init__(self, how):
        super().__init__(None)
        self.how = how

    def forward(self, x):
        h = self.lin(x)
        if self.how == "memlean.swish_":
            memlean.swish_(h, 1.3)
        elif self.how == "memlean.swish":
            memlean.swish(h, 1.3, variant="inplace")
        else:
            torch.ops.memlean.swish_(h, 1.3)
        return self.out(h)


@pytest.mark.parametrize("how,exporter", [
    ("memlean.swish_", "torch.onnx.export dynamo"),
    ("memlean.swish_", "torch.onnx.export torchscript"),
    ("memlean.swish", "torch.onnx.export dynamo"),
    ("memlean.swish", "torch.onnx.export torchscript"),
    ("torch.ops.memlean.swish_", "memlean.onnx.export"),
    ("torch.ops.memlean.swish_", "torch.onnx.export dynamo"),
    ("torch.ops.memlean.swish_", "torch.onnx.export torchscript"),
])
def test_inplace_mutation_is_exported(how, exporter):
    model = InplaceByMutation(how).eval()
    x = torch.randn(5, 8) * 3
    if how == "torch.ops.memlean.swish_" and exporter == "torch.onnx.export dynamo":
        # The raw operator under plain torch.onnx.export(dynamo=True): refused, never dropped.
        with pytest.raises(Exception, match=r"memlean\.swish_"):
            export_and_run(model, x, exporter)
        return
    assert_exports_swish(model, x, exporter)


def test_inplace_on_the_model_input():
    # The activation overwrites the graph input itself: eager mutates x, ONNX returns y.
    model = torch.nn.Sequential(memlean.Swish(0.8, inplace=True)).eval()
    x = torch.randn(6, 5) * 3
    for exporter in EXPORTERS:
        ops, out = export_and_run(model, x, exporter)
        assert "Sigmoid" in ops and "Mul" in ops, (exporter, ops)
        torch.testing.assert_close(out, x * torch.sigmoid(0.8 * x), rtol=1e-5, atol=1e-5)


def test_jit_trace_outside_onnx_keeps_the_inplace_operator():
    # Only ONNX export swaps the operator: a plain torch.jit.trace still records memlean::swish_
    # (saving one bit per element) and gives eager's values and gradients.
    model = InplaceByMutation("torch.ops.memlean.swish_")
    x = torch.randn(5, 8) * 3
    traced = torch.jit.trace(model, (x,))
    kinds = [n.kind() for n in traced.inlined_graph.nodes()]
    assert "memlean::swish_" in kinds and "memlean::swish" not in kinds, kinds
    traced(x).square().sum().backward()
    traced_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    torch.testing.assert_close(traced(x), model(x))
    for a, p in zip(traced_grads, model.parameters()):
        torch.testing.assert_close(a, p.grad)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
