"""memlean.Swish as timm's act_layer: timm builds its activations with act_layer(inplace=True),
so memlean.Swish lets an explicit variant win over inplace=. Each variant in timm's
efficientnet_b0 trains a step with the gradients of the same model with nn.SiLU (timm's
default for it) and the same weights, to float32 tolerance. (float32: the model is small but
deep, and float64 convolutions on CPU take seconds a step; swish_test.py and
swish_variants_test.py hold the variants to float64 references.)"""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memlean
from optional_deps import require

D = torch.float32
ACT_LAYERS = {
    "plain memlean.Swish": (memlean.Swish, "inplace"),  # timm's inplace=True selects it
    "naive": (functools.partial(memlean.Swish, variant="naive"), "naive"),
    "memory_efficient": (functools.partial(memlean.Swish, variant="memory_efficient"), "memory_efficient"),
    "inplace": (functools.partial(memlean.Swish, variant="inplace"), "inplace"),
}


def make(act_layer):
    torch.manual_seed(0)
    timm = require("timm")  # ./bazelw installs it
    return timm.create_model("efficientnet_b0", pretrained=False, num_classes=3,
                             act_layer=act_layer).to(D).train()


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 3, 64, 64, generator=g, dtype=D), torch.tensor([0, 2])


def assert_grads_close(got, want):
    """Each gradient within 1e-3 of its own largest magnitude plus 1e-5 of the model's largest
    gradient: float32 rounding through ~80 layers with BatchNorm, where some gradients (e.g.
    a bias before a BatchNorm) are rounding noise. Measured here: the variants stay below
    0.07 of this bound; Swish with beta=1.001 instead of 1 exceeds it 80-fold, a backward off
    by 1% 300-fold."""
    top = max(w.abs().max().item() for w in want.values())
    for n, w in want.items():
        err = (got[n] - w).abs().max().item()
        bound = 1e-3 * w.abs().max().item() + 1e-5 * top
        assert err <= bound, f"{n}: max error {err:.3g} > {bound:.3g}"


@pytest.fixture(scope="module")
def reference():
    """The nn.SiLU model: its weights, and its loss, gradients and buffers after one batch."""
    model = make(nn.SiLU)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = batch()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return state, loss.detach(), grads, buffers


@pytest.mark.parametrize("name", list(ACT_LAYERS))
def test_efficientnet_b0_trains_with_silus_gradients(name, reference):
    act_layer, variant = ACT_LAYERS[name]
    state, ref_loss, ref_grads, ref_buffers = reference
    model = make(act_layer)
    acts = [m for m in model.modules() if isinstance(m, memlean.Swish)]
    # Every activation is memlean's, of the variant asked for (none left as nn.SiLU).
    assert len(acts) > 40 and {a.variant for a in acts} == {variant}
    assert not any(isinstance(m, nn.SiLU) for m in model.modules())
    model.load_state_dict(state)

    x, y = batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close({n: p.grad for n, p in model.named_parameters()}, ref_grads)
    for n, b in model.named_buffers():
        torch.testing.assert_close(b, ref_buffers[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    opt.step()
    opt.zero_grad()
    # The step trained: a second step on the same batch has a lower, finite loss.
    loss2 = F.cross_entropy(model(x), y)
    assert torch.isfinite(loss2) and loss2 < loss


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
