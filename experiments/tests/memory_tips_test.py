"""memory_tips --quick: each tip's direction, and the tips that save nothing in training."""
import argparse

import pytest
import torch

from experiments import memory_tips


@pytest.fixture(scope="module")
def rows():
    (table,) = memory_tips.run(argparse.Namespace(quick=True, device=torch.device("cpu")))
    return {r["tip"].split(" ")[0] + ":" + r["tip"]: r for r in table.rows}


def find(rows, prefix):
    (row,) = [r for k, r in rows.items() if r["tip"].startswith(prefix)]
    return row


@pytest.mark.parametrize("prefix", [
    "2 avoid intermediate variables (inference", "3 global", "4 smaller", "8 reduced",
    "9 checkpointing", "11 gradient", "12 no_grad", "14 downsampling"])
def test_tips_that_save(rows, prefix):
    r = find(rows, prefix)
    assert r["after MiB"] < 0.95 * r["before MiB"], r
    assert r["verdict"].startswith("saves"), r


@pytest.mark.parametrize("prefix", [
    "1 in-place", "2 avoid intermediate variables (training)", "10 gc", "13 empty", "15 del"])
def test_tips_that_do_not_save_training_memory(rows, prefix):
    r = find(rows, prefix)
    assert abs(r["after MiB"] - r["before MiB"]) <= 0.005 * r["before MiB"], r
    assert "saves" not in r["verdict"], r


def test_small_effects_point_the_right_way(rows):
    # Adam keeps two state tensors per parameter: tiny beside this CNN's activations.
    sgd = find(rows, "16 SGD")
    assert sgd["after MiB"] < sgd["before MiB"], sgd
    # Adding the halves' losses: both graphs live until the one backward, yet the gradient
    # buffers of backward come half-sized: never more memory.
    split = find(rows, "5 split")
    assert split["after MiB"] <= split["before MiB"], split


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
