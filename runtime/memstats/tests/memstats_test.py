"""memlean.memstats: exact bytes, nesting peaks, the Swish post's phase table
(docs/sources.md), categories, the cross-check against torch's MemTracker, torch.profiler,
reports and errors (CPU)."""
import contextlib
import csv
import gc
import io
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn as nn

import memlean
import memlean.memstats
from memlean import memstats

MiB = 1 << 20

# Count everything the tests create from here on.
memstats.enable()


@pytest.fixture
def no_gc():
    """A collection in the middle of a test could free (counted) garbage of earlier tests."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def test_enabled_and_module_level_figures():
    assert memstats.enabled()
    memstats.enable()  # idempotent
    with memstats.track() as t:
        x = torch.empty(1000)
        assert memstats.memory_allocated() == t.current
        assert memstats.memory_allocated("cpu") == memstats.memory_allocated(torch.device("cpu"))
        assert memstats.memory_reserved() == memstats.memory_allocated()
        assert memstats.max_memory_allocated() >= t.peak >= t.current
        del x
    assert memlean.memstats is memstats


@pytest.mark.parametrize("n", [1, 3, 1000, 12345, 1 << 20])
def test_float32_tensor_moves_current_by_exactly_4n(n, no_gc):
    with memstats.track() as t:
        base = t.current
        x = torch.empty(n, dtype=torch.float32)
        assert t.current - base == 4 * n
        del x
        assert t.current == base
        assert t.peak - base == 4 * n
        y = torch.zeros(n, 3, dtype=torch.float64)
        v = y[:, 1:].t()  # a view: no storage
        assert t.current - base == 24 * n
        del y, v
        assert t.current == base


def test_nested_trackers_keep_their_own_peaks(no_gc):
    with memstats.track() as outer:
        base = outer.current
        a = torch.empty(1000)  # +4000
        with memstats.track() as inner:
            b = torch.empty(500)  # +2000
            del b
            assert inner.peak - base == 6000
            inner.reset_peak()
            assert inner.peak - base == 4000
            assert outer.peak - base == 6000
            outer.reset_peak()
            assert outer.peak - base == 4000
            c = torch.empty(250)  # +1000
            del c
            assert inner.peak - base == 5000 and outer.peak - base == 5000
        assert not inner.running
        assert inner.peak - base == 5000  # frozen at exit
        d = torch.empty(3000)  # +12000
        del d
        assert outer.peak - base == 16000
        assert inner.peak - base == 5000
        del a
    assert outer.current == base


def test_threads_allocating_at_once_balance_exactly(no_gc):
    with memstats.track() as t:
        base = t.current
        kept = [None] * 8

        def work(k):
            for i in range(300):
                torch.empty((i * 7 + k) % 97 + 1)
            kept[k] = torch.empty(k + 1, dtype=torch.float64)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert t.current - base == 8 * sum(range(1, 9))
        kept.clear()
        assert t.current == base


def test_backward_allocations_are_counted(no_gc):
    n = 10000
    x = torch.randn(n, requires_grad=True)
    y = (x * x).sum()
    with memstats.track() as t:
        base = t.current
        y.backward()
        assert t.current - base == x.grad.nbytes == 4 * n
        assert t.peak - base >= 2 * 4 * n  # grad * x, twice, before the sum


def make_mlp(d, h, c):
    return nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, c))


def expected_table(rows, steps_peaks, unit_bytes):
    """The phase table text as memstats prints it, built here from the predicted numbers."""
    fmt = (lambda v: str(v)) if unit_bytes else (lambda v: f"{v / MiB:.2f}")
    names = list(rows)
    labels = names + ["(peak)"]
    cells = [[fmt(v) for v in rows[n]] for n in names] + [[fmt(v) for v in steps_peaks]]
    nsteps = len(steps_peaks)
    lw = max(len("phase"), *(len(x) for x in labels))
    widths = [max(len(f"step {s + 1}"), *(len(r[s]) for r in cells)) for s in range(nsteps)]
    out = [f"memstats cpu: bytes alive at each mark ({'bytes' if unit_bytes else 'MiB'})"]
    out.append("phase".ljust(lw) + "".join(f"  {f'step {s + 1}'.rjust(widths[s])}" for s in range(nsteps)))
    for label, r in zip(labels, cells):
        out.append(label.ljust(lw) + "".join(f"  {r[s].rjust(widths[s])}" for s in range(nsteps)))
    return "\n".join(out) + "\n"


def test_swish_blog_post_mlp_phase_table(no_gc):
    """The Swish blog post's loop (data, forw, loss, back, step; SGD; gradients persist) on
    a small MLP. Every row is what the shapes predict, to the byte."""
    B, D, H, C = 512, 256, 512, 10
    torch.manual_seed(0)
    with memstats.track() as t:
        base = t.current
        model = make_mlp(D, H, C)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        criterion = nn.CrossEntropyLoss()
        for _ in range(2):
            x = torch.randn(B, D)
            y = torch.randint(0, C, (B,))
            t.mark("data")
            out = model(x)
            t.mark("forw")
            loss = criterion(out, y)
            t.mark("loss")
            loss.backward()
            t.mark("back")
            optimizer.step()
            t.mark("step")

    P = sum(p.nbytes for p in model.parameters())
    assert P == 4 * (D * H + H + H * H + H + H * C + C)
    batch = 4 * B * D + 8 * B  # x (float32) and y (int64)
    hidden = 4 * B * H  # one hidden activation
    logits = 4 * B * C
    # Step 1. Forward keeps both ReLU outputs (saved for backward) and the logits; each
    # Linear's own output dies in the ReLU after it.
    data1 = base + P + batch
    forw1 = data1 + 2 * hidden + logits
    # log_softmax's output, the loss and nll_loss's total_weight (4 bytes each).
    loss1 = forw1 + logits + 4 + 4
    # Gradients (as many bytes as the parameters) appear; what forward saved is freed; x, y,
    # the logits and the loss stay referenced by the loop's variables.
    back1 = data1 + logits + 4 + P
    step1 = back1  # plain SGD: no state, updates in place
    # Step 2. The new batch replaces the old one (the names are rebound), the gradients
    # persist: the data row equals the back row, and the data phase peaked at back + batch.
    data2 = back1 + batch - batch
    forw2 = data2 + 2 * hidden  # the new logits replace the old ones
    loss2 = forw2 + logits + 4  # new log_softmax, loss, total_weight; old loss freed
    back2 = step2 = back1  # gradients accumulate in place

    marks = t.marks
    assert [(m.step, m.name) for m in marks] == [
        (s, n) for s in (1, 2) for n in ("data", "forw", "loss", "back", "step")]
    assert [m.current for m in marks] == [data1, forw1, loss1, back1, step1,
                                          data2, forw2, loss2, back2, step2]
    # The peak of each phase, to the byte: forward peaks while the second ReLU writes its
    # output (ReLU 1's output, Linear 2's output and ReLU 2's output alive at once).
    peaks = [m.peak for m in marks]
    assert peaks[0] == data1
    assert peaks[1] == data1 + 3 * hidden
    assert peaks[2] == loss1
    assert peaks[3] >= loss1 + 4  # backward's temporaries; grads created while saved alive
    assert peaks[4] == step1
    assert peaks[5] == back1 + 4 * B * D  # the new x while the old one was still bound
    assert peaks[6] == data2 + 3 * hidden
    assert peaks[7] == forw2 + logits + 4 + 4  # the old loss until `loss` is rebound
    assert peaks[9] == step2
    # Bytes each phase allocated and kept.
    kept = [m.kept for m in marks]
    assert kept == [P + batch, 2 * hidden + logits, logits + 8, P, 0,
                    batch, 2 * hidden + logits, logits + 8, 0, 0]
    # The peak of the Swish post's table sits right after forward: forw and loss are the
    # largest rows of every step (loss is forw plus the loss's own few bytes).
    for s in (0, 5):
        rows = [m.current for m in marks[s:s + 5]]
        assert max(rows) == rows[2] and rows[2] - rows[1] <= logits + 8
        assert rows[1] > rows[3]

    rows = {n: [marks[i].current, marks[i + 5].current]
            for i, n in enumerate(("data", "forw", "loss", "back", "step"))}
    step_peaks = [max(m.peak for m in marks[:5]), max(m.peak for m in marks[5:])]
    assert t.table(bytes=True) == expected_table(rows, step_peaks, unit_bytes=True)
    assert t.table() == expected_table(rows, step_peaks, unit_bytes=False)
    print(t.table())


def test_categories_sum_to_the_total_and_parameters_are_their_nbytes(no_gc):
    torch.manual_seed(0)
    with memstats.track() as t:
        model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 5))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x, y = torch.randn(16, 32), torch.randint(0, 5, (16,))
        t.mark("data")
        out = model(x)
        t.mark("forward")
        c = t.categories(model, opt)
        param_bytes = sum(p.nbytes for p in model.parameters())
        buffer_bytes = sum(b.nbytes for b in model.buffers())
        assert c.parameters == param_bytes
        assert c.buffers == buffer_bytes
        assert c.gradients == 0 and c.optimizer_state == 0
        # What forward allocated and kept: everything it saved for backward plus its output.
        assert c.activations == t.marks[-1].kept > out.nbytes
        assert c.total == t.current
        assert (c.parameters + c.buffers + c.gradients + c.optimizer_state + c.activations
                + c.other) == c.total
        assert c.untracked == 0 and c.allocator_rounding == 0
        loss = nn.functional.cross_entropy(out, y)
        loss.backward()
        opt.step()
        t.mark("step")
        c = t.categories(model, opt)
        assert c.gradients == param_bytes
        # exp_avg and exp_avg_sq per parameter, and a float32 step counter each.
        n_params = len(list(model.parameters()))
        assert c.optimizer_state == 2 * param_bytes + 4 * n_params
        assert c.activations == out.nbytes  # the logits are still referenced
        assert (c.parameters + c.buffers + c.gradients + c.optimizer_state + c.activations
                + c.other) == c.total == t.current
        assert "optimizer state" in str(c) and "MiB" in str(c)
        assert c.str(bytes=True).splitlines()[-1].split()[-2] == str(c.total)
        assert json.loads(c.json())["optimizer_state"] == c.optimizer_state
        # The phase of another mark: what "data" allocated and kept (the model's own tensors
        # are categorized apart) is the batch.
        assert t.categories(model, opt, forward="data").activations == x.nbytes + y.nbytes


def test_categories_untracked_storages():
    import numpy as np

    arr = np.zeros(100, dtype=np.float32)
    with memstats.track() as t:
        m = nn.Linear(4, 4)
        m.extra = nn.Parameter(torch.from_numpy(arr))  # numpy's memory, not counted
        c = t.categories(m)
        assert c.untracked == arr.nbytes
        assert c.parameters == 4 * (16 + 4)
        # torch.UntypedStorage(n) takes c10's default CPU allocator directly (a torch
        # choice), not the installed one: not counted, reported as untracked.
        before = t.current
        s = torch.UntypedStorage(400)
        assert t.current == before
        m.extra2 = nn.Parameter(torch.empty(0).set_(s, 0, (100,), (1,)))
        assert t.categories(m).untracked == arr.nbytes + 400


def test_cross_check_with_torch_memtracker(no_gc):
    """PyTorch's own MemTracker (a TorchDispatchMode, an independent method) on the same
    CPU step agrees on the parameter, gradient and optimizer-state totals, and the total."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    with memstats.track() as t:
        model = make_mlp(64, 128, 10)
        opt = torch.optim.Adam(model.parameters())
        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        theirs = mt.get_tracker_snapshot("current")[torch.device("cpu")]
        ours = t.categories(model, opt)
    by_name = {str(getattr(k, "value", k)): v for k, v in theirs.items()}
    assert by_name["Parameter"] == ours.parameters > 0
    assert by_name["Gradient"] == ours.gradients > 0
    assert by_name["Optstate"] == ours.optimizer_state > 0
    assert by_name["Buffer"] == ours.buffers == 0


PROFILE_SCRIPT = """
import sys, torch
if sys.argv[1] == "on":
    import memlean.memstats
    memlean.memstats.enable()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                            profile_memory=True) as prof:
    x = torch.empty(1000)
    y = (x + 1).sum()
    del x
print([(e.name, e.cpu_memory_usage) for e in prof.profiler.function_events])
"""


def test_torch_profiler_sees_the_same_memory_events():
    def run(mode):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        r = subprocess.run([sys.executable, "-c", PROFILE_SCRIPT, mode], capture_output=True,
                           text=True, env=env, check=True)
        return r.stdout.strip().splitlines()[-1]

    on, off = run("on"), run("off")
    assert on == off
    assert "('aten::empty', 4000)" in on and "('[memory]', -4000)" in on


def test_marks_reports_csv_json(tmp_path, no_gc):
    with memstats.track() as t:
        base = t.current
        a = torch.empty(MiB // 4)  # 1 MiB
        t.mark("data")
        b = torch.empty(MiB // 2)
        t.mark("forward")
        del b
        t.mark("backward, freed")
        t.mark("data")
        m = memstats.mark("forward")  # the innermost running tracker
    assert m.step == 2 and m.name == "forward" and m.kept == 0
    assert repr(m).startswith("Mark(name='forward', step=2, current=")
    marks = t.marks
    assert [x.kept for x in marks] == [MiB, 2 * MiB, 0, 0, 0]
    assert [x.current - base for x in marks] == [MiB, 3 * MiB, MiB, MiB, MiB]

    text = t.to_csv(tmp_path / "t.csv")
    assert (tmp_path / "t.csv").read_text() == text
    rows = list(csv.DictReader(io.StringIO(text)))
    assert rows[2]["phase"] == "backward, freed"
    assert [int(r["current_bytes"]) - base for r in rows] == [MiB, 3 * MiB, MiB, MiB, MiB]
    assert [int(r["step"]) for r in rows] == [1, 1, 1, 2, 2]
    doc = json.loads(t.to_json(tmp_path / "t.json"))
    assert json.loads((tmp_path / "t.json").read_text()) == doc
    assert doc["device"] == "cpu" and doc["running"] is False
    assert doc["peak"] == t.peak and doc["marks"][1]["kept"] == 2 * MiB
    kept = t.table(bytes=True, value="kept")
    assert kept.splitlines()[0] == (
        "memstats cpu: allocated since the previous mark and still alive (bytes)")
    assert "backward, freed" in t.table() and "(peak)" in str(t)
    assert "step 2" in t.table(value="peak")
    assert repr(t).startswith("Tracker(device='cpu', stopped, current=")
    del a


def test_plot(tmp_path):
    with memstats.track() as t:
        t.mark("data")
        t.mark("forward")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="Tracker.plot\\(\\) needs matplotlib, an optional"):
            t.plot(tmp_path / "m.png")
        return
    path = t.plot(tmp_path / "m.png")
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_errors():
    with pytest.raises(RuntimeError, match=r'mark\("forward"\) with no tracker running'):
        memstats.mark("forward")
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda\\[:index\\]', got 'meta'"):
        memstats.track("meta")
    with pytest.raises(ValueError, match="got 'banana'"):
        memstats.Tracker("banana")
    with pytest.raises(TypeError, match="device must be a str, torch.device or int, got float"):
        memstats.track(1.5)
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="device 'cuda' was asked for, but CUDA is not "
                                               "available"):
            memstats.track("cuda")
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            memstats.memory_allocated(0)
    with memstats.track() as t:
        with pytest.raises(ValueError, match="mark name must not be empty"):
            t.mark("")
        with pytest.raises(ValueError, match="one line of printable text"):
            t.mark("a\nb")
        with pytest.raises(TypeError, match="mark name must be a str, got int"):
            t.mark(3)
        with pytest.raises(ValueError, match="table value must be 'current', 'peak', 'kept' or "
                                             "'reserved', got 'max'"):
            t.table(value="max")
        with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
            t.categories("model")
        with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer or None"):
            t.categories(nn.Linear(2, 2), optimizer=[1])
        with pytest.raises(ValueError, match='forward_mark="nope"\\): this tracker has no mark'):
            t.categories(nn.Linear(2, 2), forward="nope")
    with pytest.raises(RuntimeError, match=r'mark\("x"\) on a stopped tracker'):
        t.mark("x")
    with pytest.raises(RuntimeError, match="reset_peak\\(\\) on a stopped tracker"):
        t.reset_peak()
    t.stop()  # idempotent


def test_storage_key_is_one_per_storage_and_device():
    x = torch.randn(10, 10)
    key = memlean.memstats.storage_key(x)
    assert key == memlean.memstats.storage_key(x[2:].t()) == (x.device, x.untyped_storage().data_ptr())
    assert key != memlean.memstats.storage_key(x.clone())
    saved = memlean.memstats.SavedStorages()
    saved.add(x, x[1], x.t())
    assert saved == {key: x.nbytes} and saved.without(x[3]).nbytes == 0


def test_saved_storages_counts_each_storage_once():
    x = torch.randn(1000, requires_grad=True)
    with memlean.memstats.saved_storages() as saved:
        y = x * torch.sigmoid(x)  # mul saves x and sigmoid(x); sigmoid saves its output
    assert len(saved) == 2 and saved.nbytes == 2 * x.nbytes
    assert saved.without(x).nbytes == x.nbytes
    with memlean.memstats.saved_storages() as none:
        with torch.no_grad():
            x * torch.sigmoid(x)
    assert none == {} and none.nbytes == 0
    y.sum().backward()


def test_saved_storages_keeps_autograds_in_place_check():
    # Autograd skips its version check for tensors saved through saved_tensors_hooks; a step
    # measured under saved_storages still fails where the same step fails without it (a saved
    # output changed in place before backward), rather than computing wrong gradients.
    x = torch.randn(100, requires_grad=True)
    for measured in (False, True):
        with memlean.memstats.saved_storages() if measured else contextlib.nullcontext():
            y = torch.sigmoid(x)  # saves its output
        y.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_saved_storages_keeps_nothing_alive_past_the_graph():
    # A forward recorded and never run backward (a measurement, an exception): dropping its
    # output frees what it saved, also an op's saved output (tanh's), which would otherwise
    # close a cycle through its grad_fn that Python's collector cannot see.
    import weakref

    with memstats.track() as t:
        start = t.current
        w = torch.randn(256, 256, requires_grad=True)
        with memlean.memstats.saved_storages() as saved:
            y = torch.tanh(torch.tanh(w) * 2)
        assert saved.nbytes == 2 * w.nbytes  # the two tanh outputs
        ref = weakref.ref(w)
        del w, y
        gc.collect()
        assert ref() is None
        assert t.current == start


def test_free_mark_goes_to_this_threads_tracker():
    # memstats.mark() marks the innermost tracker of the calling thread, as documented, even
    # when another thread started one later.
    started, marked, seen = threading.Event(), threading.Event(), {}

    def other():
        with memstats.track() as theirs:
            started.set()
            marked.wait(60)
            memstats.mark("theirs")
            seen["names"] = [m.name for m in theirs.marks]

    with memstats.track() as mine:
        thread = threading.Thread(target=other)
        thread.start()
        assert started.wait(60)
        memstats.mark("mine")
        marked.set()
        thread.join(60)
        assert [m.name for m in mine.marks] == ["mine"]
    assert seen["names"] == ["theirs"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_cuda_figures_before_cuda_is_initialised_are_zero():
    # A fresh process: nothing has initialised CUDA's allocator; memstats says 0, as torch does,
    # and initialises nothing (it once raised "Invalid device argument 0: did you call init?").
    code = ("import torch, memlean.memstats as m\n"
            "assert torch.cuda.memory_allocated() == 0\n"
            "assert m.memory_allocated('cuda') == 0 and m.memory_reserved('cuda') == 0\n"
            "assert not torch.cuda.is_initialized()\n"
            "print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_torch_cuda_peak_counter_is_left_alone():
    # Users read torch.cuda.max_memory_allocated(): memstats' scoped peaks must not reset it.
    torch.empty(16 << 20, device="cuda")  # 64 MiB, freed at once
    before = torch.cuda.max_memory_allocated()
    with memstats.track("cuda") as outer:
        base = outer.current
        a = torch.empty(1 << 20, device="cuda")
        with memstats.track("cuda") as inner:
            torch.empty(1 << 18, device="cuda")
            inner.reset_peak()
            inner.mark("m")
            assert inner.peak - base == 4 << 20
        assert outer.peak - base == (4 << 20) + (1 << 20)
        assert torch.cuda.max_memory_allocated() == before
    del a
    assert torch.cuda.max_memory_allocated() == before
    assert memstats.max_memory_allocated("cuda") >= before


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
