"""Builds and runs examples/bazel_consumer, a workspace of its own that depends on memlean
(`@memlean//ops/swish`, `//ops/checkpoint`, `//runtime/memstats`) through the README's
lines: local_repository + memlean_dependencies(). Offline, with a Bazel of its own (batch
mode, its own output root), CUDA kernels built where nvcc exists; Bazel's disk cache is
shared with memlean's builds, so only a cold cache compiles memlean's libraries again.

Runs outside the sandbox (tags = ["local"]): it starts Bazel on the source tree.
"""
import glob
import os
import pathlib
import pwd
import shutil
import subprocess
import sys
import tempfile

import pytest


def source_root():
    # The runfile is a symlink into the source tree.
    here = pathlib.Path(os.environ.get("TEST_SRCDIR", "."), "memlean", "README.md")
    if not here.exists():
        here = pathlib.Path(__file__).resolve().parents[1] / "README.md"
    return pathlib.Path(os.path.realpath(here)).parent


def test_consumer_workspace_builds_and_runs():
    root = source_root()
    consumer = root / "examples" / "bazel_consumer"
    assert (consumer / "WORKSPACE").exists(), consumer
    bazel = shutil.which("bazel") or "/usr/bin/bazel"
    home = pwd.getpwuid(os.getuid()).pw_dir
    nvcc = pathlib.Path(os.environ.get("CUDA_HOME") or "/usr/local/cuda", "bin", "nvcc")
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "MEMLEAN_PYTHON": sys.executable,  # the interpreter whose torch memlean builds against
        "TMPDIR": os.environ.get("TEST_TMPDIR", tempfile.gettempdir()),
    }
    with tempfile.TemporaryDirectory(dir=os.environ.get("TEST_TMPDIR")) as tmp:
        def bazel_run(target):
            cmd = [
                bazel, "--batch", f"--output_user_root={tmp}/bazel",
                "run", target,
                "--symlink_prefix=/",  # leave no bazel-* links in the source tree
                f"--disk_cache={home}/.cache/memlean/bazel-disk",
                "--incompatible_strict_action_env",
                "--strategy=CppCompile=local", "--strategy=CppLink=local",
                "--curses=no", "--color=no", "--noshow_progress",
            ]
            res = subprocess.run(cmd, cwd=consumer, env=env, capture_output=True, text=True,
                                 timeout=1500)
            log = f"$ {' '.join(cmd)}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr[-20000:]}"
            assert res.returncode == 0, log
            assert "Downloading" not in res.stderr, log
            return res.stdout, log

        out, log = bazel_run("//:train")
        assert "loss " in out and "\nok\n" in out, log
        for phase in ("data", "forward", "backward", "step", "(peak)"):
            assert phase in out, log
        # All public libraries linked, one called: links in the default link order.
        out, log = bazel_run("//:link_only")
        assert "linked: swish(1) = 0.731059" in out, log
        # (Not a recursive glob: the output root links to the torch and Python trees.)
        objects = glob.glob(f"{tmp}/bazel/*/execroot/bazel_consumer/bazel-out/*/bin/"
                            "external/memlean/ops/swish/*.pic.o")
        if nvcc.exists():
            # The CUDA kernels were compiled by nvcc inside the external repository.
            assert objects, "nvcc exists but no CUDA object was built\n" + log
        else:
            assert not objects


def test_readme_shows_the_consumer_workspace_lines():
    # The README's WORKSPACE/BUILD block is what examples/bazel_consumer does (the block
    # itself cannot run: its path is a placeholder).
    root = source_root()
    readme = (root / "README.md").read_text()
    start = readme.index("## Use it from another Bazel workspace")
    block = readme[readme.index("```starlark", start):]
    block = block[:block.index("```", len("```starlark"))]
    consumer = root / "examples" / "bazel_consumer"
    workspace = (consumer / "WORKSPACE").read_text()
    build = (consumer / "BUILD").read_text()
    checked = 0
    for line in block.splitlines():
        code = line.split("#")[0].strip()
        if code.startswith(("load(", "memlean_dependencies(", "register_toolchains(")):
            assert code in workspace, f"README line {code!r} is not in {consumer}/WORKSPACE"
            checked += 1
        for dep in ("@memlean//ops/swish", "@memlean//ops/checkpoint", "@memlean//runtime/memstats"):
            if dep in code:
                assert f'"{dep}"' in build, f"{dep} (README) is not a dep in {consumer}/BUILD"
                checked += 1
    assert checked >= 6, block


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
