"""The trainer binary end to end: exit codes and messages for bad flags and bad CIFAR-10
folders, a 2-step run of every model at tiny sizes with the JSON report's contents, the
progress display on a pipe and on a terminal, repeatable runs, and the swish variants."""
import json
import math
import os
import pty
import re
import subprocess

import pytest

TINY = {
    "mlp": ["--model=mlp", "--mlp_in=8", "--mlp_hidden=64", "--batch=16"],
    "densenet_bc": ["--model=densenet_bc", "--densenet_depth=10", "--densenet_growth=4",
                    "--image_size=8", "--batch=4"],
    "efficientnet_b0": ["--model=efficientnet_b0", "--efficientnet_width=0.25",
                        "--efficientnet_depth=0.25", "--image_size=32", "--num_classes=10",
                        "--batch=4"],
}
PHASES = ["data", "forw", "loss", "back", "step"]
ISSUE_FLAGS = ["model", "swish", "checkpoint", "batch", "steps", "optimizer", "lr", "threads",
               "device", "data", "seed", "report"]


def binary():
    root = os.path.join(os.environ["TEST_SRCDIR"], os.environ.get("TEST_WORKSPACE", "memlean"))
    return os.path.join(root, "experiments", "trainer", "trainer")


def trainer(*args, timeout=300):
    return subprocess.run([binary(), *args], capture_output=True, text=True, timeout=timeout)


def run_report(tmp_path, *args, name="run.json"):
    path = tmp_path / name
    p = trainer(*args, f"--report={path}")
    assert p.returncode == 0, p.stderr
    with open(path) as f:
        return json.load(f), p


def write_cifar(path, labels, pixel=7):
    with open(path, "wb") as f:
        for label in labels:
            f.write(bytes([label]) + bytes([pixel]) * 3072)


def test_help():
    p = trainer("--help")
    assert p.returncode == 0
    for flag in ISSUE_FLAGS + ["memory_budget"]:
        assert f"--{flag} (default" in p.stdout


@pytest.mark.parametrize("args, message", [
    (["--nope"], "trainer: unknown flag --nope"),
    (["--model=resnet"], "trainer: --model: unknown model 'resnet'"),
    (["--swish=relu"], "trainer: --swish: unknown activation 'relu'"),
    (["--checkpoint=segments:x"], "trainer: --checkpoint: checkpoint 'segments:x': K in segments:K must be a positive integer"),
    (["--batch=-3"], "trainer: --batch: must be >= 1, got -3"),
    (["--steps=many"], "trainer: --steps: 'many' is not a valid integer"),
    (["--optimizer=rmsprop"], "trainer: --optimizer: unknown optimizer 'rmsprop'"),
    (["--device=cuda:0"] , "trainer: --device: "),
    (["--data=mnist"], "trainer: --data: unknown data 'mnist'"),
    (["--report=/nonexistent/dir/r.json"], "trainer: --report: the folder /nonexistent/dir does not exist"),
    (["positional"], "trainer: unexpected argument 'positional'"),
    (TINY["densenet_bc"] + ["--checkpoint=segments:8"], "asks for more segments than the model has stages (7)"),
    (["--memory_budget=lots"], "trainer: --memory_budget: no number, got 'lots'"),
    (["--memory_budget=-1GiB"], "trainer: --memory_budget: a negative budget"),
    (["--memory_budget=1GiB", "--checkpoint=memlean"],
     "trainer: --memory_budget: memlean::fit chooses what to checkpoint itself"),
])
def test_bad_flags_exit_2_with_a_clear_message(args, message):
    if args == ["--device=cuda:0"]:
        import torch
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    p = trainer(*args)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr
    assert "frame #" not in p.stderr and "Traceback" not in p.stderr
    assert p.stdout == ""


def test_cifar10_missing_or_garbled_exit_2(tmp_path):
    cases = []
    cases.append((tmp_path / "missing", "does not exist"))
    (tmp_path / "nofiles").mkdir()
    write_cifar(tmp_path / "nofiles" / "test_batch.bin", [1])
    cases.append((tmp_path / "nofiles", "no data_batch_*.bin in"))
    (tmp_path / "short").mkdir()
    with open(tmp_path / "short" / "data_batch_1.bin", "wb") as f:
        f.write(b"\x01" * 5000)
    cases.append((tmp_path / "short", "5000 bytes is not a whole number of records of 3073 bytes"))
    (tmp_path / "label").mkdir()
    write_cifar(tmp_path / "label" / "data_batch_1.bin", [3, 200])
    cases.append((tmp_path / "label", "record 1 has label 200 (labels are 0 to 9)"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "data_batch_1.bin").write_bytes(b"")
    cases.append((tmp_path / "empty", "it is empty"))
    for folder, message in cases:
        p = trainer("--model=mlp", "--mlp_hidden=8", "--steps=1", f"--data=cifar10:{folder}")
        assert p.returncode == 2, (folder, p.stderr)
        assert p.stderr.startswith("trainer: --data: ") and message in p.stderr, p.stderr


@pytest.mark.parametrize("model", ["mlp", "densenet_bc", "efficientnet_b0"])
def test_cifar10_tiny_folder(tmp_path, model):
    write_cifar(tmp_path / "data_batch_1.bin", [0, 1, 2, 3, 4])
    write_cifar(tmp_path / "data_batch_2.bin", [5, 6, 7], pixel=200)
    args = [a for a in TINY[model] if not a.startswith(("--mlp_in", "--image_size", "--num_classes"))]
    report, _ = run_report(tmp_path, *args, "--steps=2", f"--data=cifar10:{tmp_path}")
    assert report["data"] == "CIFAR-10, 8 images from 2 file(s)"
    assert report["config"]["num_classes"] == 10 and report["config"]["image_size"] == 32
    assert report["config"]["loss"] == "cross_entropy"
    assert len(report["loss"]) == 2


@pytest.mark.parametrize("model", ["mlp", "densenet_bc", "efficientnet_b0"])
def test_two_steps_and_the_report(tmp_path, model):
    report, p = run_report(tmp_path, *TINY[model], "--steps=2", "--seed=3", "--threads=1")
    # Flags as given, and the resolved configuration.
    for flag in ISSUE_FLAGS:
        assert flag in report["flags"], flag
    assert report["flags"]["model"] == model and report["flags"]["seed"] == 3
    assert report["config"]["model"] == model and report["config"]["threads"] == 1
    assert report["config"]["lr"] > 0
    assert report["model"]["parameters"] > 0
    # Loss per step, throughput, peak.
    assert len(report["loss"]) == 2 and all(math.isfinite(x) for x in report["loss"])
    assert report["steps_per_second"] > 0 and report["seconds"] > 0
    assert report["peak_bytes"] == report["memstats"]["peak"] > 0
    # The phase table: 5 phases x 2 steps, equal to memstats' marks.
    assert list(report["phases"]) == PHASES
    marks = report["memstats"]["marks"]
    assert [m["phase"] for m in marks] == PHASES * 2
    for i, phase in enumerate(PHASES):
        row = report["phases"][phase]
        assert row["current"] == [marks[i]["current"], marks[5 + i]["current"]]
        assert row["peak"] == [marks[i]["peak"], marks[5 + i]["peak"]]
        assert len(row["seconds"]) == 2 and all(s >= 0 for s in row["seconds"])
    assert max(max(r["peak"]) for r in report["phases"].values()) == report["peak_bytes"]
    # Categories add up to the total; the last forward's activations are alive at the peak.
    for key in ("categories", "categories_end"):
        c = report[key]
        parts = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "other",
                 "allocator_rounding")
        assert sum(c[k] for k in parts) == c["total"], key
    assert report["categories"]["activations"] > 0
    assert report["categories"]["parameters"] >= 4 * report["model"]["parameters"]
    # stdout: the summary; stderr: plain progress lines (not a terminal here).
    for want in ["memstats cpu: bytes alive at the end of each phase (MiB)", "(peak)",
                 "memory by category after the last forward and loss", "report: "]:
        assert want in p.stdout
    assert "step 1/2  loss " in p.stderr and "step 2/2  loss " in p.stderr
    assert "\r" not in p.stderr


def test_memory_budget(tmp_path):
    """--memory_budget: a budget between the least peak memlean::fit reaches and the eager
    peak (both from first runs) is met, the plan is printed before training, the report holds
    it under "fit", and the loss curve is the eager one."""
    args = TINY["efficientnet_b0"] + ["--steps=2", "--threads=1"]
    eager, _ = run_report(tmp_path, *args, "--memory_budget=1TiB", name="eager.json")
    assert eager["fit"]["checkpointed"] == [] and eager["fit"]["actions"] == []
    top = eager["fit"]["eager_peak_bytes"]
    assert eager["fit"]["peak_bytes"] == top
    p = trainer(*args, "--memory_budget=1B")
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith("trainer: --memory_budget: memlean::fit: no choice of checkpoints "
                               "fits budget_bytes = 1 bytes"), p.stderr
    assert "GiB" in p.stderr and "frame #" not in p.stderr
    least = int(re.search(r"Raise the budget to at least (\d+) bytes", p.stderr).group(1))
    assert 0 < least < top
    budget = (least + top) // 2
    report, p = run_report(tmp_path, *args, f"--memory_budget={budget}", name="fit.json")
    fit = report["fit"]
    assert fit["budget_bytes"] == budget == report["config"]["memory_budget"]
    assert fit["peak_bytes"] <= budget, fit
    assert fit["checkpointed"] and len(fit["actions"]) == len(fit["checkpointed"])
    assert all(a["action"] == "checkpoint" and a["bytes_saved"] > 0 for a in fit["actions"])
    # The plan, printed before training, and the summary's line about it.
    assert p.stdout.startswith("memlean::fit: "), p.stdout
    assert p.stdout.index("  budget ") < p.stdout.index("memlean trainer: ")
    assert f"memory budget {budget:,} bytes" in p.stdout
    # The same training as without checkpoints, in less memory (the trainer's own peak also
    # counts the batch's targets, which fit's step does not).
    assert report["loss"] == pytest.approx(eager["loss"], rel=1e-5)
    assert report["peak_bytes"] < eager["peak_bytes"]
    assert report["peak_bytes"] <= budget + 4096


def test_same_flags_same_loss_curve(tmp_path):
    args = TINY["efficientnet_b0"] + ["--steps=3"]
    a, _ = run_report(tmp_path, *args, name="a.json")
    b, _ = run_report(tmp_path, *args, name="b.json")
    c, _ = run_report(tmp_path, *args, "--seed=1", name="c.json")
    assert a["loss"] == b["loss"]
    assert a["loss"] != c["loss"]


@pytest.mark.parametrize("model", ["mlp", "efficientnet_b0"])
def test_swish_variants_same_loss_curve(tmp_path, model):
    args = TINY[model] + ["--steps=3"]
    if model == "efficientnet_b0":
        args += ["--image_size=64", "--batch=8"]  # enough values per channel for batch norm
    curves = {}
    for v in ("naive", "memory_efficient", "inplace", "silu", "silu_inplace"):
        report, _ = run_report(tmp_path, *args, f"--swish={v}", name=f"{v}.json")
        assert report["config"]["activation"] == v
        curves[v] = report["loss"]
    for v, curve in curves.items():
        assert curve == pytest.approx(curves["naive"], rel=1e-4), v


def test_progress_bar_on_a_terminal():
    master, slave = pty.openpty()
    try:
        p = subprocess.Popen([binary(), *TINY["mlp"], "--steps=3"], stdout=subprocess.PIPE,
                             stderr=slave, text=True)
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO once the child has closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        out, _ = p.communicate(timeout=120)
    finally:
        os.close(master)
    err = b"".join(chunks).decode()
    assert p.returncode == 0
    assert "\r[########................] 1/3  loss " in err
    assert "\r[########################] 3/3  loss " in err
    assert "step 1/3" not in err
    assert "memstats cpu" in out


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
