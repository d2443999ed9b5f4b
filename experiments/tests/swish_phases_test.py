"""swish_phases --quick: the Swish blog post's table, byte for byte from the shapes."""
import argparse

import pytest
import torch

from experiments import swish_phases

HIDDEN, BATCH = 1 << 14, 128


@pytest.mark.parametrize("variant,kept", [("naive", 3), ("memory_efficient", 2), ("inplace", 1)])
def test_phases_follow_the_shapes(variant, kept):
    m, params = swish_phases.measure(variant, HIDDEN, BATCH)
    act = BATCH * HIDDEN * 4
    mask = BATCH * HIDDEN // 8 if variant == "inplace" else 0
    data = BATCH * 128 * 4 + BATCH * 4
    assert params == (128 * HIDDEN + HIDDEN + HIDDEN + 1) * 4
    # Step 1: gradients do not exist yet; they persist into step 2 (zeroed in place).
    assert m[1, "data"] == params + data
    assert m[1, "forw"] == params + data + kept * act + mask + BATCH * 4  # + the output
    assert m[2, "data"] == params + params + data  # parameters and their gradients
    assert m[2, "forw"] - m[2, "data"] == m[1, "forw"] - m[1, "data"]
    assert m[1, "back"] < m[1, "forw"]  # the saved activations are freed by backward
    assert m[2, "step"] == m[2, "back"]


def test_table_rows():
    args = argparse.Namespace(quick=True, out=None, device=torch.device("cpu"))
    (table,) = swish_phases.run(args)
    assert [(r["step"], r["phase"]) for r in table.rows] == [
        (s, p) for s in (1, 2) for p in swish_phases.PHASES]


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
