"""//experiments:reproduce --quick runs every experiment and writes the summary and CSVs."""
import csv
import os
import tempfile

import pytest

from experiments import reproduce


def test_quick_run_writes_every_table():
    with tempfile.TemporaryDirectory(dir=os.environ.get("TEST_TMPDIR")) as out:
        tables = reproduce.main(["--quick", "--out", out, "--only", "swish_saved_bytes"])
        assert [t.key for t in tables] == ["swish_saved_bytes"]
        with open(os.path.join(out, "swish_saved_bytes.csv")) as f:
            rows = {r["variant"]: r for r in csv.DictReader(f)}
        summary = open(os.path.join(out, "summary.md")).read()
    assert "Swish: bytes kept for backward per element" in summary
    # float32: naive keeps x and sigmoid(x), memory-efficient x, in-place 1 bit.
    assert float(rows["naive x*sigmoid(x)"]["bytes kept per element"]) == 8.0
    assert float(rows["memlean memory_efficient"]["bytes kept per element"]) == 4.0
    assert float(rows["memlean inplace"]["bytes kept per element"]) == 0.125


def test_every_experiment_is_listed_with_a_target():
    here = os.path.dirname(os.path.abspath(reproduce.__file__))
    build = open(os.path.join(here, "BUILD")).read()
    for name in reproduce.EXPERIMENTS:
        assert f'"{name}"' in build, name


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
