"""A model fitted by memlean.fit, then wrapped for data parallelism, trains as one process
does: two processes (gloo on 127.0.0.1) fit the same model to the same budget (one that
needs checkpoints and swaps its SiLUs, and gives its BatchNorms and depthwise convolutions
memlean's lean backwards), then wrap it in DistributedDataParallel or shard it
with FSDP2 (fully_shard on each block and the root), and train two steps on half the batch
each. Every step's gradients equal those of one process training the same fitted model on
the whole batch, and BatchNorm counts each training forward once. The same again with the
model fitted at its least peak, where fit recomputes channelwise chains slice by slice of
channels (memlean.sliced_chain) beside its checkpoints, and with a token net fitted at its
least peak, where fit slices its MLPs (a plain and a packed gated one) over their hidden
features, and with the model fitted at its least peak with runs=True, where fit checkpoints
runs of sibling modules nested three deep (a run of the root's stem and first two blocks,
around a run of two blocks, around a run inside the first block; under FSDP2, runs
spanning fully_shard units: a clear error, since fully_shard's hooks on a run's modules would
not run around their forwards). "ddp+mlp_applied", "ddp+sliced_applied" and "ddp+runs_applied":
rank 0 fits, broadcasts the plan's
JSON, and the other rank applies it with memlean.apply_plan (no search there): the same plan,
trained as one process does. "ddp+sliced_sent": rank 0 fits and sends the fitted model itself
(dist.broadcast_object_list pickles it); the other rank trains the model it loads, fitted as
rank 0's (the same modules wrapped).

fit is called before wrapping (docs/fit.md): it measures and changes the plain module.
Without SyncBatchNorm each rank normalizes with its own half's statistics, so the reference
averages the losses of the two halves: exactly the gradient DDP and FSDP average.

The test ends in bounded time even if a rank fails or hangs (ranks.py).
"""

from unittest import mock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memlean
from ranks import (assert_like_one_process, train_on_ranks, train_one_process, train_steps,
                   wrap)

D = torch.float64
WORLD = 2
BATCH = 8  # global; each rank takes half
STEPS = 2
LR = 0.1
DEADLINE_S = 300
# "+sliced": fitted at its least peak, which channel-sliced recompute reaches (each block's
# bn1..act2 chain and the stem recomputed slice by slice of channels). "+mlp": a token net
# fitted at its least peak, which slicing its MLPs over their hidden features reaches
# (memlean::sliced_mlp, C++, run with the Python activations: a plain and a packed gated one).
# "+runs": fitted at its least peak with runs=True (runs nested in runs); under FSDP2, with
# fully_shard on blocks its runs span, a clear error (docs/fit.md).
CONFIGS = ["ddp", "fsdp", "ddp+sliced", "fsdp+sliced", "ddp+mlp", "fsdp+mlp", "ddp+runs",
           "fsdp+runs", "ddp+sliced_applied", "ddp+mlp_applied", "ddp+runs_applied",
           "ddp+sliced_sent"]


class Block(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.conv1, self.bn1, self.act1 = nn.Conv2d(w, w, 3, padding=1), nn.BatchNorm2d(w), nn.SiLU()
        # conv2 depthwise: fit gives it memlean's lean convolution backward.
        self.conv2 = nn.Conv2d(w, w, 3, padding=1, groups=w)
        self.bn2, self.act2 = nn.BatchNorm2d(w), nn.SiLU()

    def forward(self, x):
        return x + self.act2(self.bn2(self.conv2(self.act1(self.bn1(self.conv1(x))))))


class Expanding(nn.Module):
    """An inverted residual block (timm's modules as siblings): its conv_pw..act2 chain is what
    fit slices by channels."""

    def __init__(self, w):
        super().__init__()
        e = 4 * w
        self.conv_pw, self.bn1, self.act1 = nn.Conv2d(w, e, 1), nn.BatchNorm2d(e), nn.SiLU()
        self.conv_dw = nn.Conv2d(e, e, 3, padding=1, groups=e)
        self.bn2, self.act2 = nn.BatchNorm2d(e), nn.SiLU()
        self.conv_pwl, self.bn3 = nn.Conv2d(e, w, 1), nn.BatchNorm2d(w)

    def forward(self, x):
        h = self.act2(self.bn2(self.conv_dw(self.act1(self.bn1(self.conv_pw(x))))))
        return x + self.bn3(self.conv_pwl(h))


class Net(nn.Module):
    def __init__(self, w=6, blocks=4, block=Block):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, padding=1), nn.BatchNorm2d(w), nn.SiLU())
        self.blocks = nn.ModuleList(block(w) for _ in range(blocks))
        self.head = nn.Linear(w, 5)
        self.to(D)

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h.mean((2, 3)))


N_BN = 1 + 2 * 4  # (Expanding blocks: 1 + 3 * 4)


class Mlp(nn.Module):
    """timm's Mlp: fc1, act, fc2 as children."""

    def __init__(self, w):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class PackedSwiGLU(nn.Module):
    """A gated MLP whose one Linear makes gate and up."""

    def __init__(self, w):
        super().__init__()
        self.w12, self.w3 = nn.Linear(w, 8 * w), nn.Linear(4 * w, w)

    def forward(self, x):
        g, u = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(g) * u)


class TokenBlock(nn.Module):
    def __init__(self, w, i):
        super().__init__()
        self.norm = nn.LayerNorm(w)
        self.mlp = Mlp(w) if i % 2 == 0 else PackedSwiGLU(w)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class TokenNet(nn.Module):
    """A BatchNorm stem, then its pixels as tokens through MLP blocks."""

    def __init__(self, w=6, blocks=4):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, padding=1), nn.BatchNorm2d(w))
        self.blocks = nn.ModuleList(TokenBlock(w, i) for i in range(blocks))
        self.head = nn.Linear(w, 5)
        self.to(D)

    def forward(self, x):
        h = self.stem(x).flatten(2).transpose(1, 2)
        for b in self.blocks:
            h = b(h)
        return self.head(h.mean(1))


def halves():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 3, 12, 12, generator=g, dtype=D)
    y = torch.randint(0, 5, (BATCH,), generator=g)
    n = BATCH // WORLD
    return [(x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]) for r in range(WORLD)]


def _setup(what):
    """The model for `what` ("", "sliced", "mlp" or "runs"; fit's sizes lowered to these
    small nets), half 0 of the batch, its loss, SGD."""
    from memlean import fitting, sliced as slicing

    sliced, mlp = what == "sliced", what == "mlp"
    fitting._SLICE_MIN_BYTES = 0 if sliced or mlp else 1 << 20
    slicing.SLICE_BYTES = 16 << 10 if sliced or mlp else 1 << 20  # (several slices of these)
    model = TokenNet() if mlp else Net(block=Expanding) if sliced else Net()
    x, y = halves()[0]
    loss_fn = lambda out: F.cross_entropy(out, y)  # noqa: E731
    return model, x, loss_fn, torch.optim.SGD(model.parameters(), lr=LR)


def applied(what, rank):
    """fitted() on rank 0; on the others the same model with rank 0's plan applied
    (memlean.apply_plan of the JSON rank 0 broadcast): the same actions (their recompute
    times each rank's own)."""
    import json

    import torch.distributed as dist

    model, box = None, [None]
    if rank == 0:
        model, plan = fitted(what)
        box = [plan.to_json()]
    dist.broadcast_object_list(box, src=0)
    if rank == 0:
        return model
    model, x, loss_fn, opt = _setup(what)
    plan = memlean.apply_plan(model, x, box[0], loss_fn=loss_fn, optimizer=opt)
    assert [(a.path, a.action, a.bytes_saved) for a in plan.actions] == [
        (a["path"], a["action"], a["bytes_saved"]) for a in json.loads(box[0])["actions"]]
    return model


def sent(what, rank):
    """fitted() on rank 0, sent whole to the others (dist.broadcast_object_list pickles it,
    fit's wrappers made again where it loads): the same fitted model on every rank."""
    import torch.distributed as dist

    box = [None]
    if rank == 0:
        model = fitted(what)[0]
        box = [(model, wrapped(model))]
    dist.broadcast_object_list(box, src=0)
    model, paths = box[0]
    assert paths and wrapped(model) == paths, (wrapped(model), paths)
    return model


def wrapped(model):
    """The paths of the modules whose forward fit wrapped."""
    return [n for n, m in model.named_modules() if "forward" in m.__dict__]


def fitted(what=""):
    """The model, fitted on half a batch to the budget halfway between the least peak fit
    reaches and the eager peak: a plan with checkpoints, swapped SiLUs and the lean BatchNorm
    and depthwise-convolution backwards, the same in every process (memory does not depend
    on the values). "sliced": a net of Expanding blocks at its least peak, with channel-sliced
    recompute (its chains are far under the 1 MiB fit slices from and a slice's 1 MiB: both
    lowered); "mlp": a TokenNet at its least peak, its MLPs sliced (the same sizes lowered);
    "runs": the plain net at its least peak with runs=True, runs nested in runs."""
    model, x, loss_fn, opt = _setup(what)
    runs = what == "runs"
    try:
        memlean.fit(model, x, 1, loss_fn=loss_fn, optimizer=opt, runs=runs)
        raise AssertionError("a budget of 1 byte fitted")
    except memlean.FitError as e:
        least = e.least_peak_bytes
    eager = memlean.fit(model, x, 2**50, loss_fn=loss_fn, optimizer=opt,
                        runs=runs).eager_peak_bytes
    plan = memlean.fit(model, x, least if what else (least + eager) // 2,
                       loss_fn=loss_fn, optimizer=opt, runs=runs)
    actions = {a.action for a in plan.actions}
    if what == "mlp":
        sliced_mlps = sorted(a.path for a in plan.actions if a.action == "sliced mlp")
        assert sliced_mlps == [f"blocks.{i}.mlp{'.(fc1..fc2)' if i % 2 == 0 else ''}"
                               for i in range(4)], str(plan)
        return model, plan
    assert {"checkpoint", "lean batchnorm", "lean depthwise conv"} <= actions, str(plan)
    assert ("sliced recompute" in actions) == (what == "sliced"), str(plan)
    if runs:  # a run of sibling modules inside a run inside a run
        assert max(a.depth for a in plan.actions) >= 2, str(plan)
        assert any(a.depth and "(" in a.path for a in plan.actions), str(plan)
    assert actions & {"inplace swish", "memory_efficient swish"}, str(plan)
    return model, plan


def _train(config, mesh, rank):
    x, y = halves()[rank]
    how, what, apply = _parse(config)
    make = {"applied": applied, "sent": sent}.get(apply)
    model = make(what, rank) if make else fitted(what)[0]
    return train_steps(model, wrap(model, how, mesh), x, y, steps=STEPS, lr=LR)


def _parse(config):
    """("ddp" or "fsdp", the model's kind, how the other ranks get the plan) of a config."""
    how, _, what = config.partition("+")
    what, _, apply = what.partition("_")
    return how, what, apply


def reference(what):
    """One process, the same fitted model: each step's gradients of the average of the
    halves' losses, and rank 0's BatchNorm statistics (half 0's forward only). fit's sizes
    (_setup lowers them) are put back after: this process runs other tests too (the zoo's
    fits, in one pytest process, then sliced chains they should not)."""
    from memlean import fitting, sliced as slicing

    with mock.patch.object(fitting, "_SLICE_MIN_BYTES", fitting._SLICE_MIN_BYTES), \
            mock.patch.object(slicing, "SLICE_BYTES", slicing.SLICE_BYTES):
        model, tracker = fitted(what)[0], fitted(what)[0]
        return train_one_process(model, tracker, halves(), steps=STEPS, lr=LR)


@pytest.fixture(scope="module")
def results():
    return train_on_ranks(_train, CONFIGS, world=WORLD, deadline_s=DEADLINE_S)


@pytest.mark.parametrize("config", CONFIGS)
def test_a_fitted_model_trains_under_ddp_and_fsdp2_as_one_process(results, config):
    how, what, _ = _parse(config)
    if how == "fsdp" and what == "runs":
        # fully_shard on blocks that a run of the plan spans adds hooks fit's run would not
        # run around their modules' forwards: a clear error on every rank, naming the run.
        for rank, result in enumerate(results[config]):
            assert "has hooks since fit planned it" in result.get("error", ""), (rank, result)
            assert "fully_shard the run's parent" in result["error"], result["error"]
        return
    grads, buffers = reference(what)
    assert_like_one_process(results[config], grads, buffers, STEPS,
                            {"mlp": 1, "sliced": 1 + 3 * 4}.get(what, N_BN))


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
