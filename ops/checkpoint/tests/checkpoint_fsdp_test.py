"""memlean checkpointing under FSDP2 (torch.distributed.fsdp.fully_shard) and DDP: two
processes (gloo on 127.0.0.1) train a small residual CNN for two steps, with fully_shard on
each block and on the root, and memlean's checkpoint used three ways:

- "module": the model's forward calls memlean.checkpoint(block, h) on each FSDP block (the
  FSDP hooks run inside the checkpoint; its recompute gathers the parameters again);
- "sequential": memlean.checkpoint_sequential over the FSDP blocks (a segment of two);
- "inside": each block's forward checkpoints its conv + BatchNorm in pytorch-checkpoint's
  call form (docs/sources.md): CheckpointFunction.apply with the block's parameters,
  unsharded at that time;

and "ddp": DistributedDataParallel with memlean.checkpoint(block, h). The blocks' BatchNorms
are torch's nn.BatchNorm2d and memlean.BatchNorm2d. Each step's gradients (the full tensors
of FSDP's sharded gradients) equal those of one process running the same model without
checkpoints or sharding, and every BatchNorm counted each training forward once, with rank
0's running statistics those of its half batch.

Without SyncBatchNorm each rank normalizes with its own half batch's statistics, so the
single-process reference averages the losses of the two halves, the gradient FSDP's
reduce-scatter and DDP's all-reduce average across the ranks. The test ends in bounded time
even if a rank fails or hangs (short timeouts, a deadline, and what is left is killed; see
checkpoint_ddp_test.py, which tests that).
"""

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
DEADLINE_S = 150
CONFIGS = ["module", "sequential", "inside", "ddp"]
N_BN = 3


class Block(nn.Module):
    def __init__(self, c, norm, inside):
        super().__init__()
        self.inside = inside
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.norm = norm(c)

    def forward(self, x):
        def conv_norm(t):
            return self.norm(self.conv(t))

        if self.inside:
            params = tuple(self.conv.parameters()) + tuple(self.norm.parameters())
            h = memlean.CheckpointFunction.apply(conv_norm, 1, x, *params)
        else:
            h = conv_norm(x)
        return x + F.relu(h)


class Net(nn.Module):
    def __init__(self, how):
        super().__init__()
        torch.manual_seed(0)
        self.how = how
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        norms = [nn.BatchNorm2d, memlean.BatchNorm2d, nn.BatchNorm2d]
        self.blocks = nn.ModuleList(Block(6, n, inside=how == "inside") for n in norms)
        self.head = nn.Linear(6, 5)
        self.to(D)

    def forward(self, x):
        h = self.stem(x)
        if self.how == "sequential":
            h = memlean.checkpoint_sequential(list(self.blocks), [0, 2], h)
        else:
            for block in self.blocks:
                h = memlean.checkpoint(block, h) if self.how in ("module", "ddp") else block(h)
        return self.head(h.mean((2, 3)))


def halves():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 3, 6, 6, generator=g, dtype=D)
    y = torch.randint(0, 5, (BATCH,), generator=g)
    n = BATCH // WORLD
    return [(x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]) for r in range(WORLD)]


def _train(how, mesh, rank):
    x, y = halves()[rank]
    model = Net(how)
    return train_steps(model, wrap(model, how, mesh), x, y, steps=STEPS, lr=LR)


def reference():
    """One process, no checkpoint, no sharding: each step's gradients of the average of the
    halves' losses, and rank 0's BatchNorm statistics (half 0 only)."""
    model, tracker = Net("none"), Net("none")
    return train_one_process(model, tracker, halves(), steps=STEPS, lr=LR)


@pytest.fixture(scope="module")
def results():
    return train_on_ranks(_train, CONFIGS, world=WORLD, deadline_s=DEADLINE_S)


@pytest.mark.parametrize("how", CONFIGS)
def test_gradients_and_batchnorm_equal_an_unsharded_single_process(results, how):
    grads, buffers = reference()
    assert_like_one_process(results[how], grads, buffers, STEPS, N_BN)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
