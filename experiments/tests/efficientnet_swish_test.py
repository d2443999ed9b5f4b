"""efficientnet_swish --quick: the direction of the claims on EfficientNet-B0."""
import pytest

import memlean
from experiments import efficientnet_swish


@pytest.fixture(scope="module")
def rows():
    (table,) = efficientnet_swish.run(type("A", (), {"quick": True})())
    return {(r["batch"], r["activation"]): r["step peak MiB"] for r in table.rows}


def test_memory_efficient_variants_peak_below_naive(rows):
    for b in (2, 4):
        naive = rows[b, "naive"]
        assert rows[b, "memlean memory_efficient"] < naive
        assert rows[b, "memlean inplace"] < rows[b, "memlean memory_efficient"]
        # timm's SwishMe keeps what memlean's memory-efficient variant keeps.
        assert rows[b, "timm SwishMe"] == pytest.approx(rows[b, "memlean memory_efficient"], rel=0.01)


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
