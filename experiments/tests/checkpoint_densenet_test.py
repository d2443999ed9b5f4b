"""checkpoint_densenet --quick: pytorch-checkpoint's claims at small sizes: checkpointing cuts the
peak, memlean's BatchNorm counts once where the reentrant official one counts twice, every
method computes the same loss, and 2 DDP processes work with memlean's checkpoint."""
import pytest
import torch

from experiments import checkpoint_densenet
from experiments.models.densenet import DenseNetBC


def test_same_loss_less_memory_one_process():
    methods = checkpoint_densenet.METHODS
    r = {m: checkpoint_densenet.measure(m, 8, 40, repeats=1) for m in methods}
    for m in methods:
        assert r[m]["loss"] == pytest.approx(r["naive"]["loss"], rel=1e-5), m
    for m in ("official", "official_nonreentrant", "memlean"):
        assert r[m]["peak"] < 0.8 * r["naive"]["peak"], (m, r[m]["peak"], r["naive"]["peak"])
    assert r["memlean"]["peak"] <= 1.05 * r["official"]["peak"]
    assert r["naive"]["bn_updates"] == 1
    assert r["memlean"]["bn_updates"] == 1
    assert r["official"]["bn_updates"] == 2  # pytorch-checkpoint's reason for cp_BatchNorm2d


def test_two_processes_memlean():
    r = checkpoint_densenet.measure_ddp("memlean", 8, 40, repeats=1, world=2, timeout=600)
    assert "error" not in r, r
    one = checkpoint_densenet.measure("memlean", 8, 40, repeats=1)
    assert r["loss"] > 0 and r["peak"] < one["peak"]  # each process holds half the batch


def test_densenet_bc_100_is_the_seed_model():
    model = DenseNetBC(depth=100)
    n = sum(p.numel() for p in model.parameters())
    assert 0.75e6 < n < 0.8e6, n  # DenseNet-BC-100 (k=12): 0.8M parameters (Huang et al.)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
