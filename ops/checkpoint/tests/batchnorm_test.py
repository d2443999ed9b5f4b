"""BatchNorm once per training step under memlean's checkpoint, for every torch BatchNorm
(any torch.nn.modules.batchnorm._BatchNorm): BatchNorm1d/2d/3d, SyncBatchNorm, and
subclasses such as timm's BatchNormAct2d / SyncBatchNormAct and one with a buffer of its own.
Whatever form the checkpoint takes (an nn.Module, a plain function with params=,
CheckpointFunction.apply, checkpoint_sequential, nested checkpoints), after one step each
BatchNorm has num_batches_tracked == 1, and its statistics and every gradient equal those of
the same model run without a checkpoint (the reference; float64, and float32 for timm's
efficientnet_b0)."""
import copy
import functools
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

import memlean
from optional_deps import available, require

if available("timm"):  # ./bazelw installs it; left out only with MEMLEAN_WITHOUT=timm
    import timm
    from timm.layers import BatchNormAct2d
    from timm.layers.norm_act import SyncBatchNormAct, convert_sync_batchnorm

D = torch.float64


class CountingBatchNorm1d(nn.BatchNorm1d):
    """A subclass with a buffer of its own, counting its train-mode forwards."""

    def __init__(self, n):
        super().__init__(n)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            self.calls.add_(1)
        return super().forward(x)


def chains():
    """name -> (make the chain, its input). Each ends in an Identity, so that
    checkpoint_sequential(segments=[0, n - 1]) checkpoints every BatchNorm in it."""
    cases = {
        "BatchNorm1d and a subclass with its own buffer": (
            lambda: nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8),
                                  CountingBatchNorm1d(8), nn.Identity()),
            (6, 5)),
        "BatchNorm3d": (
            lambda: nn.Sequential(nn.Conv3d(2, 3, 1), nn.BatchNorm3d(3, momentum=0.3), nn.Tanh(), nn.Identity()),
            (3, 2, 3, 3, 2)),
        "SyncBatchNorm (no process group)": (
            lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.SyncBatchNorm(4), nn.Conv2d(4, 4, 1),
                                  nn.Identity()),
            (4, 3, 3, 3)),
    }
    if available("timm"):
        cases["timm BatchNormAct2d (act, dropout, momentum None)"] = (
            lambda: nn.Sequential(
                nn.Conv2d(3, 6, 3, padding=1),
                BatchNormAct2d(6, act_layer=nn.SiLU, drop_layer=functools.partial(nn.Dropout, 0.3)),
                nn.Conv2d(6, 4, 1),
                BatchNormAct2d(4, act_layer=memlean.Swish, momentum=None),
                nn.Identity()),
            (4, 3, 5, 5))
        cases["SyncBatchNorm and timm's SyncBatchNormAct (no process group)"] = (
            lambda: nn.Sequential(nn.Conv2d(3, 4, 1), nn.SyncBatchNorm(4), nn.Conv2d(4, 4, 1),
                                  convert_sync_batchnorm(BatchNormAct2d(4, act_layer=nn.ReLU)),
                                  nn.Identity()),
            (4, 3, 3, 3))
    return cases


def run_function(model, x):
    return memlean.checkpoint(lambda t: model(t), x, params=list(model.parameters()))


MODES = {
    "plain function, params=": run_function,
    "nn.Module": lambda model, x: memlean.checkpoint(model, x),
    "CheckpointFunction.apply": lambda model, x: memlean.CheckpointFunction.apply(
        lambda t: model(t), 1, x, *model.parameters()),
    "checkpoint_sequential": lambda model, x: memlean.checkpoint_sequential(model, [0, len(model) - 1], x),
    "nested checkpoints": lambda model, x: memlean.checkpoint(
        lambda t: memlean.checkpoint(model, t), x, params=list(model.parameters())),
}


def batchnorms(model):
    return [m for m in model.modules() if isinstance(m, _BatchNorm)]


def step(model, x, forward):
    """One training step's forward and backward with the RNG seeded; returns the gradients
    of x and of the parameters."""
    x = x.detach().requires_grad_(True)
    torch.manual_seed(7)
    y = forward(model, x)
    (y * torch.linspace(-1, 2, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    return [x.grad] + [p.grad for p in model.parameters()]


def assert_same(got, want, what):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=lambda m: f"{what} {i}: {m}")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("chain", list(chains()))
def test_every_batchnorm_is_updated_once_with_the_plain_gradients(chain, mode):
    make, shape = chains()[chain]
    torch.manual_seed(0)
    plain = make().to(D).train()
    ckpt = copy.deepcopy(plain)
    x = torch.randn(*shape, dtype=D)
    want = step(plain, x, lambda m, t: m(t))
    got = step(ckpt, x, MODES[mode])
    for bn in batchnorms(ckpt):
        assert bn.num_batches_tracked.item() == 1, (type(bn).__name__, bn.num_batches_tracked.item())
    assert_same(list(ckpt.buffers()), list(plain.buffers()), "buffer")
    assert_same(got, want, "gradient")
    # What the subclasses add is kept: the activations and dropout run (the gradients say
    # so), and the subclass's own buffer counted one call.
    for bn in batchnorms(ckpt):
        if isinstance(bn, CountingBatchNorm1d):
            assert bn.calls.item() == 1
        if available("timm") and isinstance(bn, SyncBatchNormAct):
            assert isinstance(bn.act, nn.ReLU)


def test_statistics_of_another_thread_are_left_alone():
    # A recompute keeps the statistics of the BatchNorms it runs on its own thread only: a
    # model training on another thread meanwhile keeps its update.
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to(D)
    other = nn.BatchNorm1d(4).to(D)

    def function(t):
        if memlean.is_recomputing():
            worker = threading.Thread(target=lambda: other(torch.randn(5, 4, dtype=D)))
            worker.start()
            worker.join()
        return model(t)

    x = torch.randn(6, 4, dtype=D, requires_grad=True)
    memlean.checkpoint(function, x, params=list(model.parameters())).sum().backward()
    assert model[1].num_batches_tracked.item() == 1
    assert other.num_batches_tracked.item() == 1 and not torch.equal(other.running_mean, torch.zeros(4, dtype=D))


def test_eval_mode_batchnorm_in_a_function_is_unaffected():
    require("timm")
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(2, 3, 1), BatchNormAct2d(3, act_layer=nn.ReLU)).to(D)
    model(torch.randn(4, 2, 3, 3, dtype=D))
    model.eval()
    before = [b.clone() for b in model.buffers()]
    x = torch.randn(4, 2, 3, 3, dtype=D, requires_grad=True)
    y = run_function(model, x)
    y.pow(2).sum().backward()
    assert_same(list(model.buffers()), before, "buffer")
    g = x.grad
    x.grad = None
    model(x).pow(2).sum().backward()
    torch.testing.assert_close(g, x.grad, rtol=1e-12, atol=1e-12)


def test_convert_keeps_subclasses_and_they_count_once():
    require("timm")
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), BatchNormAct2d(4, act_layer=nn.SiLU),
                          nn.Flatten(), nn.Linear(4 * 9, 6), nn.BatchNorm1d(6), nn.SyncBatchNorm(6))
    converted = memlean.BatchNorm2d.convert(model)
    assert type(converted[1]) is memlean.BatchNorm2d
    # The others are left as they are, with what they add (timm's activation).
    assert type(converted[2]) is BatchNormAct2d and isinstance(converted[2].act, nn.SiLU)
    assert type(converted[5]) is nn.BatchNorm1d and type(converted[6]) is nn.SyncBatchNorm
    x = torch.randn(5, 3, 3, 3, requires_grad=True)
    run_function(converted, x).sum().backward()
    assert [bn.num_batches_tracked.item() for bn in batchnorms(converted)] == [1, 1, 1, 1]


# ---- timm's efficientnet_b0: 49 BatchNorms, all BatchNormAct2d ----------------------------


def efficientnet_forward(model, x, mode):
    x = model.bn1(model.conv_stem(x))
    if mode == "plain":
        x = model.blocks(x)
    elif mode == "function":
        x = memlean.checkpoint(lambda t: model.blocks(t), x, params=list(model.blocks.parameters()))
    elif mode == "each block":
        for block in model.blocks:
            x = memlean.checkpoint(block, x)
    elif mode == "checkpoint_sequential":
        x = memlean.checkpoint_sequential(model.blocks, 3, x)
    return model.forward_head(model.bn2(model.conv_head(x)))


@pytest.fixture(scope="module")
def efficientnet():
    require("timm")
    torch.manual_seed(0)
    # float32: float64 convolutions take seconds per step on CPU; the comparison is still
    # exact, the checkpointed step computes what the plain one does.
    model = timm.create_model("efficientnet_b0", pretrained=False, num_classes=3).train()
    assert sum(type(m) is BatchNormAct2d for m in model.modules()) == 49
    x = torch.randn(2, 3, 32, 32)
    plain = copy.deepcopy(model)
    F.cross_entropy(efficientnet_forward(plain, x, "plain"), torch.tensor([0, 2])).backward()
    return model, x, plain


@pytest.mark.parametrize("mode", ["function", "each block", "checkpoint_sequential"])
def test_efficientnet_b0_batchnorms_count_once(efficientnet, mode):
    model, x, plain = efficientnet
    model = copy.deepcopy(model)
    F.cross_entropy(efficientnet_forward(model, x, mode), torch.tensor([0, 2])).backward()
    assert [bn.num_batches_tracked.item() for bn in batchnorms(model)] == [1] * 49
    for (n, a), b in zip(model.named_buffers(), plain.buffers()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m: f"{n}: {m}")
    for (n, a), b in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
