"""Builds a fresh venv (seeing the running torch's site-packages), installs memlean's wheel
into it and runs forward + backward from a folder outside the repository."""
import glob
import os
import subprocess
import sys
import tempfile
import zipfile

import torch

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

USE = """
import os, sys, torch, memlean
assert os.getcwd() == sys.argv[1], os.getcwd()
assert memlean.__file__.startswith(sys.argv[2]), memlean.__file__
x = torch.linspace(-5, 5, 1001, dtype=torch.float64, requires_grad=True)
y = memlean.Swish(beta=1.3)(x)
y.sum().backward()
x64 = x.detach().clone().requires_grad_(True)
(x64 * torch.sigmoid(1.3 * x64)).sum().backward()
torch.testing.assert_close(y, x64 * torch.sigmoid(1.3 * x64))
torch.testing.assert_close(x.grad, x64.grad)
# The rest of the package works from the wheel too: in-place Swish, checkpoint, memstats.
import memlean.memstats as memstats
h = (x.detach() * 1).requires_grad_(True)
memlean.checkpoint(lambda v: memlean.swish_(v * 2), h).sum().backward()
t = 2 * x.detach()
s = torch.sigmoid(t)
torch.testing.assert_close(h.grad, 2 * s * (1 + t * (1 - s)))
memstats.enable()
with memstats.track() as tracker:
    before = tracker.current
    z = torch.empty(1000, dtype=torch.float32)
    assert tracker.current - before == 4000, tracker.current - before
print("OK", memlean.__version__, memlean.__file__)
"""


def test_wheel_installs_and_runs_outside_the_repository():
    (wheel,) = glob.glob(os.path.join(HERE, "memlean-*.whl"))
    name = os.path.basename(wheel)
    tag = "cp%d%d" % sys.version_info[:2]
    assert name.endswith(f"-{tag}-{tag}-linux_x86_64.whl"), name

    with zipfile.ZipFile(wheel) as z:
        files = set(z.namelist())
        meta = z.read(next(f for f in files if f.endswith(".dist-info/METADATA"))).decode()
        build_info = {}
        exec(z.read("memlean/_build_info.py").decode(), build_info)
    # The name says which torch it runs with (the local label of its version), the torch the
    # package itself was built against.
    assert build_info["TORCH_VERSION"] == torch.__version__, build_info
    label = "torch" + torch.__version__.replace("+", ".")
    assert name.startswith(f"memlean-{build_info['VERSION']}+{label}-"), name
    assert f"Version: {build_info['VERSION']}+{label}\n" in meta, meta
    assert {"memlean/__init__.py", "memlean/_C.so", "memlean/_build_info.py"} <= files, files
    assert f"Requires-Dist: torch=={torch.__version__.split('+')[0]}" in meta, meta

    with tempfile.TemporaryDirectory(dir=os.environ.get("TEST_TMPDIR")) as tmp:
        venv = os.path.join(tmp, "venv")
        # No pip inside the venv: ensurepip's old setuptools would shadow the one torch needs.
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
        py = os.path.join(venv, "bin", "python")
        site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        # The venv sees the site-packages of the torch this test runs with (a venv's
        # --system-site-packages are its base interpreter's, which may hold another torch).
        with open(os.path.join(site, "torch_site.pth"), "w") as f:
            f.write(os.path.dirname(os.path.dirname(torch.__file__)) + "\n")
        # Without --no-deps: pip must find the pinned torch already installed.
        subprocess.run([sys.executable, "-m", "pip", "--python", py, "install", "--no-index", "-q", wheel],
                       check=True)
        work = os.path.join(tmp, "elsewhere")
        os.makedirs(work)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        out = subprocess.run([py, "-c", USE, work, site], cwd=work, env=env, check=True,
                             capture_output=True, text=True)
        assert out.stdout.startswith("OK"), out


if __name__ == "__main__":
    import pytest
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
