"""memlean checkpointing under DistributedDataParallel: two processes (gloo on 127.0.0.1)
train a small DenseNet-like model whose bottlenecks are checkpointed in pytorch-checkpoint's
call form (CheckpointFunction.apply; docs/sources.md) and whose transition is checkpointed as
a module, with memlean.BatchNorm2d everywhere. After two steps the parameters equal those of
one process running the same (un-checkpointed) model on the full batch, with
find_unused_parameters off and on, and every BatchNorm has counted each training forward once.

Without SyncBatchNorm each DDP rank normalizes with its own half batch's statistics, so the
single-process reference computes the loss of each half separately and averages them:
exactly the gradient DDP averages across the ranks.

The test ends in bounded time even if a rank fails or hangs: the ranks use short
collective/store timeouts, the parent joins them with a deadline and kills what is left.
"""
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import memlean
from ranks import TIMEOUT, run_ranks

D = torch.float64
WORLD = 2
BATCH = 8  # global; each rank takes half
STEPS = 2
LR = 0.1
DEADLINE_S = 240


class DenseLayer(nn.Module):
    """pytorch-checkpoint's efficient DenseNet layer: its bottleneck bn_function is
    checkpointed."""

    def __init__(self, cin, growth, efficient):
        super().__init__()
        self.efficient = efficient
        self.norm1 = memlean.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, 2 * growth, 1, bias=False)
        self.norm2 = memlean.BatchNorm2d(2 * growth)
        self.conv2 = nn.Conv2d(2 * growth, growth, 3, padding=1, bias=False)

    def forward(self, *prev_features):
        def bn_function(*inputs):
            return self.conv1(F.relu(self.norm1(torch.cat(inputs, 1))))

        if self.efficient:
            args = prev_features + tuple(self.norm1.parameters()) + tuple(self.conv1.parameters())
            bottleneck = memlean.CheckpointFunction.apply(bn_function, len(prev_features), *args)
        else:
            bottleneck = bn_function(*prev_features)
        return self.conv2(F.relu(self.norm2(bottleneck)))


class Net(nn.Module):
    def __init__(self, efficient, unused):
        super().__init__()
        torch.manual_seed(0)
        self.efficient = efficient
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.layers = nn.ModuleList(DenseLayer(8 + 4 * i, 4, efficient) for i in range(3))
        self.transition = nn.Sequential(memlean.BatchNorm2d(20), nn.ReLU(), nn.Conv2d(20, 10, 1, bias=False),
                                        nn.AvgPool2d(2))
        self.norm = memlean.BatchNorm2d(10)
        self.head = nn.Linear(10, 5)
        # A parameter the forward never uses: DDP needs find_unused_parameters=True.
        self.unused = nn.Linear(3, 3) if unused else None
        self.to(D)

    def forward(self, x):
        features = (self.stem(x),)
        for layer in self.layers:
            features = features + (layer(*features),)
        h = torch.cat(features, 1)
        h = memlean.checkpoint(self.transition, h) if self.efficient else self.transition(h)
        h = F.adaptive_avg_pool2d(F.relu(self.norm(h)), 1).flatten(1)
        return self.head(h)


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 3, 8, 8, generator=g, dtype=D), torch.randint(0, 5, (BATCH,), generator=g)


def halves():
    x, y = data()
    n = BATCH // WORLD
    return [(x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]) for r in range(WORLD)]


CONFIGS = {"find_unused_off": dict(unused=False, find_unused=False),
           "find_unused_on": dict(unused=True, find_unused=True)}


def _worker(rank, port, outdir, mode):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only (the test sandbox has no network)
    torch.set_num_threads(1)
    if mode == "fail" and rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=TIMEOUT)
    try:
        if mode == "fail":
            dist.barrier()  # waits for rank 1, which never comes
        x, y = halves()[rank]
        for name, cfg in CONFIGS.items():
            model = nn.parallel.DistributedDataParallel(
                Net(efficient=True, unused=cfg["unused"]), find_unused_parameters=cfg["find_unused"])
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            for _ in range(STEPS):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                opt.step()
            torch.save({"params": {k: v.detach().clone() for k, v in model.module.named_parameters()},
                        "buffers": {k: v.clone() for k, v in model.module.named_buffers()}},
                       os.path.join(outdir, f"{name}_rank{rank}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def reference(unused):
    """One process, the same model without checkpoints: the average of the halves' losses."""
    model = Net(efficient=False, unused=unused)
    tracker = Net(efficient=False, unused=unused)  # rank 0's statistics: half 0 only
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    parts = halves()
    for _ in range(STEPS):
        tracker.load_state_dict({**tracker.state_dict(), **dict(model.named_parameters())})
        with torch.no_grad():
            tracker(parts[0][0])
        opt.zero_grad(set_to_none=True)
        loss = sum(F.cross_entropy(model(x), y) for x, y in parts) / WORLD
        loss.backward()
        opt.step()
    return model, tracker


@pytest.fixture(scope="module")
def ddp_results():
    with tempfile.TemporaryDirectory(dir=os.environ.get("TEST_TMPDIR")) as outdir:
        run_ranks(_worker, (outdir, "train"), world=WORLD, deadline_s=DEADLINE_S, what="DDP ranks")
        yield {name: [torch.load(os.path.join(outdir, f"{name}_rank{r}.pt")) for r in range(WORLD)]
               for name in CONFIGS}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ddp_parameters_equal_a_single_process_on_the_full_batch(ddp_results, name):
    model, tracker = reference(CONFIGS[name]["unused"])
    expected = dict(model.named_parameters())
    for rank, result in enumerate(ddp_results[name]):
        assert result["params"].keys() == expected.keys()
        for k, v in result["params"].items():
            torch.testing.assert_close(v, expected[k].detach(), rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"rank {rank}, {k}: {m}")
        if CONFIGS[name]["unused"]:
            # Unused: no gradient, unchanged, and the same on both ranks.
            torch.testing.assert_close(result["params"]["unused.weight"], Net(False, True).unused.weight)
    # Every BatchNorm counted each of the STEPS training forwards once, recomputed or not,
    # and rank 0's statistics are those of its half batch.
    buffers = ddp_results[name][0]["buffers"]
    counts = [v.item() for k, v in buffers.items() if k.endswith("num_batches_tracked")]
    assert counts == [STEPS] * 8
    expected_buffers = dict(tracker.named_buffers())
    for k, v in buffers.items():
        torch.testing.assert_close(v, expected_buffers[k], rtol=1e-9, atol=1e-12, msg=lambda m: f"{k}: {m}")


def test_a_failing_rank_ends_the_run_in_bounded_time():
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TEST_TMPDIR")) as outdir:
        with pytest.raises(mp.ProcessRaisedException, match="rank 1 fails on purpose"):
            run_ranks(_worker, (outdir, "fail"), world=WORLD, deadline_s=DEADLINE_S, what="DDP ranks")
    assert time.monotonic() - start < DEADLINE_S


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
