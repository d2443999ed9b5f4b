"""swish_saved_bytes --quick: what each variant keeps, exactly."""
import argparse

import pytest
import torch

from experiments import swish_saved_bytes


def test_kept_bytes():
    (table,) = swish_saved_bytes.run(argparse.Namespace(quick=True, device=torch.device("cpu")))
    got = {r["variant"]: (r["tensors kept"], r["bytes kept per element"]) for r in table.rows}
    assert got == {"naive x*sigmoid(x)": (2, 8.0), "memlean memory_efficient": (1, 4.0),
                   "memlean inplace": (1, 0.125)}


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
