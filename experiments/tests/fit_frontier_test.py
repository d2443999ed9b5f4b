"""fit_frontier --quick --runs --paired: memlean.fit's rows, with and without runs, keep their
budgets (exact CPU bytes, measured by the experiment apart from fit; one of them half of per-block
checkpointing's peak where fit reaches it), their peaks never rise as
the budget falls, fit's least peak is below eager's and below per-block checkpointing's for
EfficientNet-B0 (with runs at or below it without), every row has its paired eager time, and
the figure is drawn beside the table. With --autocast bf16 (EfficientNet-B0 alone), the same
promises in a bfloat16 autocast region."""
import argparse
import os

import pytest
import torch

from experiments import fit_frontier


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("out"))
    (table,) = fit_frontier.run(argparse.Namespace(quick=True, out=out, device=torch.device("cpu"),
                                                   models=None, budgets=None, no_compile=True,
                                                   runs=True, paired=True))
    return table


@pytest.fixture(scope="module")
def table_bf16(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("out_bf16"))
    (table,) = fit_frontier.run(argparse.Namespace(
        quick=True, out=out, device=torch.device("cpu"), models=["efficientnet_b0"], budgets=3,
        no_compile=True, runs=False, paired=False, autocast="bf16"))
    return table


def rows_of(table, model, method):
    return [r for r in table.rows if r["model"] == model and r["method"] == method]


@pytest.mark.parametrize("method", ["memlean.fit", "memlean.fit(runs=True)"])
@pytest.mark.parametrize("model", ["efficientnet_b0", "gpt"])
def test_budgets_kept_and_peaks_fall_with_them(table, model, method):
    fits = rows_of(table, model, method)
    # 4 budgets spread from the least to the eager peak, and one at half of per-block
    # checkpointing's peak where fit reaches that (the reach target is read there).
    (per_block,) = rows_of(table, model, "per-block checkpoint")
    half = per_block["peak bytes"] // 2
    reached = fits[-1]["budget_bytes"] <= half
    assert len(fits) == 4 + reached, fits
    assert [r["budget_bytes"] for r in fits if "half of per-block" in r["setting"]] == (
        [half] if reached else [])
    for r in fits:
        assert r["peak bytes"] <= r["budget_bytes"], r
    budgets = [r["budget_bytes"] for r in fits]
    assert budgets == sorted(budgets, reverse=True)
    peaks = [r["peak bytes"] for r in fits]
    assert peaks == sorted(peaks, reverse=True), peaks
    (eager,) = rows_of(table, model, "eager")
    assert fits[0]["peak bytes"] == eager["peak bytes"]  # the eager peak as budget: no change
    assert fits[-1]["peak bytes"] < eager["peak bytes"]


def test_in_a_bf16_autocast_region_budgets_kept_and_peaks_fall_with_them(table, table_bf16):
    fits = rows_of(table_bf16, "efficientnet_b0", "memlean.fit")
    assert len(fits) == 3
    for r in fits:
        assert r["peak bytes"] <= r["budget_bytes"], r
    peaks = [r["peak bytes"] for r in fits]
    assert peaks == sorted(peaks, reverse=True), peaks
    (eager,) = rows_of(table_bf16, "efficientnet_b0", "eager")
    assert fits[0]["peak bytes"] == eager["peak bytes"]
    assert fits[-1]["peak bytes"] < eager["peak bytes"]
    # In bfloat16 the step's activations take fewer bytes than in float32.
    (eager32,) = rows_of(table, "efficientnet_b0", "eager")
    assert eager["peak bytes"] < eager32["peak bytes"]
    assert "torch.bfloat16 autocast region of its own" in table_bf16.note


def test_least_fit_peak_below_per_block_checkpointing_on_efficientnet(table):
    (timm_ckpt,) = rows_of(table, "efficientnet_b0", "per-block checkpoint")
    least = rows_of(table, "efficientnet_b0", "memlean.fit")[-1]
    assert least["peak bytes"] < timm_ckpt["peak bytes"]
    least_with_runs = rows_of(table, "efficientnet_b0", "memlean.fit(runs=True)")[-1]
    assert least_with_runs["peak bytes"] <= least["peak bytes"]


def test_every_row_timed_beside_eager(table):
    for r in table.rows:
        assert r["eager s (paired)"] > 0, r
        assert r["vs eager time (paired)"] == round(r["s/step"] / r["eager s (paired)"], 3), r


def test_figure_beside_the_table(table):
    pytest.importorskip("matplotlib")
    (plot,) = table.plots
    assert os.path.getsize(plot) > 0 and os.path.basename(plot) in table.markdown()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
