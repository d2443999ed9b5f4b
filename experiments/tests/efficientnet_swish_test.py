"""efficientnet_swish --quick: the direction of the claims on EfficientNet-B0, its plot, and
the CUDA table's bf16 autocast / channels_last steps as far as the CPU runs them."""
import argparse
import os

import pytest
import torch

import memlean
from experiments import common, efficientnet_swish


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("out"))
    (table,) = efficientnet_swish.run(argparse.Namespace(quick=True, out=out,
                                                         device=torch.device("cpu")))
    return table


@pytest.fixture(scope="module")
def rows(table):
    return {(r["batch"], r["activation"]): r["step peak MiB"] for r in table.rows}


def test_memory_efficient_variants_peak_below_naive(rows):
    for b in (2, 4):
        naive = rows[b, "naive"]
        assert rows[b, "memlean memory_efficient"] < naive
        assert rows[b, "memlean inplace"] < rows[b, "memlean memory_efficient"]
        # timm's SwishMe keeps what memlean's memory-efficient variant keeps.
        assert rows[b, "timm SwishMe"] == pytest.approx(rows[b, "memlean memory_efficient"], rel=0.01)


def test_plot_of_peak_and_time_beside_the_table(table):
    pytest.importorskip("matplotlib")
    (plot,) = table.plots
    assert os.path.getsize(plot) > 0 and os.path.basename(plot) in table.markdown()


@pytest.mark.parametrize("config", efficientnet_swish.CONFIGS)
def test_cuda_configs_run_a_step_on_the_cpu(config):
    # The CUDA table's precisions and memory formats, one step each, measured as on CUDA.
    # The claim is memlean's: in-place Swish never peaks above nn.SiLU in the same
    # configuration. The absolute figures are oneDNN's (its channels_last convolutions peak
    # at 35-49 MB here on an AVX512 CPU with either activation, above fp32 contiguous), so
    # both are measured in the same warm state: each warmed up, then measured alternately.
    steps = {name: efficientnet_swish.step(act, 2, 64, config=config)
             for name, act in (("silu", torch.nn.SiLU),
                               ("inplace", efficientnet_swish.memlean_act("inplace")))}
    for fn in steps.values():
        fn()
    peaks = {name: [] for name in steps}
    for _ in range(2):
        for name, fn in steps.items():
            peaks[name].append(common.peak_of(fn)[0])
    assert 0 < min(peaks["inplace"]) <= min(peaks["silu"]), (config, peaks)


def test_memlean_activation_plugs_into_timm():
    import torch

    act = efficientnet_swish.memlean_act("inplace")
    model = efficientnet_swish.make_model(act, num_classes=10)
    n = sum(p.numel() for p in model.parameters())
    acts = [m for m in model.modules() if isinstance(m, memlean.Swish)]
    assert acts and all(m.variant == "inplace" for m in acts)
    out = model(torch.randn(2, 3, 32, 32))
    out.sum().backward()
    assert out.shape == (2, 10) and n > 4_000_000


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
