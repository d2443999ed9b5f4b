"""The reproduce target's quick mode: its table says what the source claims."""
import csv
import os
import tempfile

import reproduce


def test_quick_run_writes_the_swish_table():
    with tempfile.TemporaryDirectory(dir=os.environ.get("TEST_TMPDIR")) as out:
        reproduce.main(["--quick", "--out", out])
        with open(os.path.join(out, "swish_saved_for_backward.csv")) as f:
            rows = {r["variant"]: r for r in csv.DictReader(f)}
        assert os.path.exists(os.path.join(out, "summary.md"))
    # float32: the naive composition keeps x and sigmoid(x), memlean keeps x.
    assert float(rows["naive x*sigmoid(x)"]["bytes saved per element"]) == 8.0
    assert int(rows["naive x*sigmoid(x)"]["tensors saved"]) == 2
    assert float(rows["memlean.swish"]["bytes saved per element"]) == 4.0
    assert int(rows["memlean.swish"]["tensors saved"]) == 1


if __name__ == "__main__":
    import pytest
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
