"""The same table from C++ and from Python: the Swish blog post's phase table
(docs/sources.md) of the reference MLP, measured by the C++ trainer (LibTorch,
memlean::memstats) and by //experiments:swish_phases (Python, memlean.memstats), agrees to
the byte for every Swish variant."""
import json
import os
import subprocess
import tempfile

import pytest

from experiments import swish_phases

HIDDEN, BATCH = 1 << 14, 128
PHASES = ("data", "forw", "loss", "back", "step")


def trainer():
    path = os.path.join(os.environ.get("TEST_SRCDIR", ""), "memlean", "experiments", "trainer",
                        "trainer")
    assert os.path.exists(path), path
    return path


@pytest.mark.parametrize("variant", swish_phases.VARIANTS)
def test_cpp_trainer_and_python_agree_to_the_byte(variant):
    with tempfile.TemporaryDirectory(dir=os.environ.get("TEST_TMPDIR")) as d:
        report = os.path.join(d, "report.json")
        subprocess.run([trainer(), "--model=mlp", f"--mlp_hidden={HIDDEN}", f"--batch={BATCH}",
                        "--steps=2", f"--swish={variant}", "--optimizer=sgd", "--momentum=0",
                        "--threads=1", "--progress=none", f"--report={report}"],
                       check=True, capture_output=True, timeout=300)
        cpp = json.load(open(report))["phases"]
    py, _ = swish_phases.measure(variant, HIDDEN, BATCH, grads_to_none=True)
    for step in (1, 2):
        for phase in PHASES:
            assert cpp[phase]["current"][step - 1] == py[step, phase], (variant, step, phase)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
