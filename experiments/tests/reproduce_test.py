"""//experiments:reproduce --quick runs every experiment and writes the summary and CSVs;
every experiment takes --device, and --device=cuda without a GPU is a clear error."""
import csv
import importlib
import os
import tempfile

import pytest
import torch

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


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: --device=cuda is valid")
@pytest.mark.parametrize("name", reproduce.EXPERIMENTS + ["reproduce"])
def test_device_cuda_without_a_gpu_is_a_clear_error(name, capsys):
    module = importlib.import_module("experiments." + name)
    with pytest.raises(SystemExit) as e:
        module.main(["--device=cuda", "--quick"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: --device=cuda: no usable CUDA GPU here" in err, err
    assert "torch.cuda.is_available() is False" in err, err


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
