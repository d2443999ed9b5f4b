"""memlean.memstats: exact tensor memory accounting, scoped peaks, phases and categories.

    import memlean.memstats as memstats

    memstats.enable()                       # before building the model: count its parameters
    model, opt = ..., ...
    with memstats.track(device="cpu") as t:
        for x, y in batches:
            t.mark("data")
            loss = F.cross_entropy(model(x), y)
            t.mark("forward")               # t.categories(model, opt) here: activations kept
            loss.backward()
            t.mark("backward")
            opt.step()
            t.mark("step")
    print(t.table())                        # rows = marks, columns = steps, MiB
    print(t.peak, t.categories(model, opt))

CPU: a counting allocator wraps torch's CPU allocator (installed by enable() or the first
tracker) and counts every storage it allocates, to the byte, on any thread; storages that
existed before are not counted, nor their frees. CUDA: the caching allocator's figures
(torch.cuda.memory_allocated and friends). Trackers nest: each has its own peak, and
reset_peak() on one leaves the others alone. Names follow torch.cuda's where they overlap.
No tracker changes any torch counter: torch.cuda.max_memory_allocated() reads the same with
or without them (on CUDA, memstats keeps its own peaks from the allocator's trace).

Known limitations (docs/memstats.md says more):

- CPU: storages allocated before the counting allocator was installed are not counted,
  nor are their frees; nor are storages made with torch.UntypedStorage(n) (c10's default
  allocator), pinned host memory (CUDA's host allocator), Static Runtime's CPU caching
  allocator, or shared-memory tensors from DataLoader workers. categories() shows such
  tensors of the model and optimizer as `untracked`.
- CUDA: the cudaMallocAsync backend cannot be observed (CUDA trackers raise); `kept` is
  None and activations are 0 on CUDA.
- The counting allocator, once installed, stays for the life of the process.
"""
from __future__ import annotations

import contextlib
import gc
import math
import os
from typing import Iterable

import torch

from memlean import _C, _plot

_M = _C.memstats

Mark = _M.Mark
Categories = _M.Categories

__all__ = [
    "Categories",
    "Mark",
    "Tracker",
    "enable",
    "enabled",
    "mark",
    "max_memory_allocated",
    "memory_allocated",
    "memory_reserved",
    "saved_storages",
    "storage_key",
    "track",
]


def _device(device) -> str:
    """'cpu' / 'cuda' / 'cuda:1' / torch.device / a CUDA index → the string C++ parses."""
    if isinstance(device, bool):
        raise TypeError("memlean.memstats: device must be a str, torch.device or int, got bool")
    if isinstance(device, int):
        device = f"cuda:{device}"
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str):
        raise TypeError(
            f"memlean.memstats: device must be a str, torch.device or int, got "
            f"{type(device).__name__}"
        )
    return device


def _name(name) -> str:
    if not isinstance(name, str):
        raise TypeError(f"memlean.memstats: mark name must be a str, got {type(name).__name__}")
    return name


def enable() -> None:
    """Install the counting CPU allocator now (idempotent).

    .. note::
        Storages allocated earlier are not counted, nor their frees: call it before
        creating the model whose memory you want to see. The first CPU tracker calls it too.
    """
    _M.enable()


def enabled() -> bool:
    """Return whether the counting CPU allocator is installed."""
    return _M.enabled()


def memory_allocated(device="cpu") -> int:
    """Return the bytes of tensor storage alive on a device.

    Args:
        device (str, torch.device or int, optional): ``"cpu"`` (default), ``"cuda"``,
            ``"cuda:1"``, a ``torch.device``, or a CUDA device index.

    Returns:
        int: on the CPU, the bytes of the storages allocated since :func:`enable` and still
        alive; on CUDA, ``torch.cuda.memory_allocated(device)``.

    Raises:
        TypeError: ``device`` of another type. ValueError or RuntimeError: a device that
        is not ``cpu`` or ``cuda[:index]``, out of range, or CUDA without a GPU.
    """
    return _M.memory_allocated(_device(device))


def max_memory_allocated(device="cpu") -> int:
    """Return the largest :func:`memory_allocated` of a device so far in this process.

    Args:
        device (str, torch.device or int, optional): as for :func:`memory_allocated`.

    .. note::
        Trackers never lower it (their own peaks are theirs: see :attr:`Tracker.peak`), and
        on CUDA it is torch's counter, which memstats never resets.
    """
    return _M.max_memory_allocated(_device(device))


def memory_reserved(device="cpu") -> int:
    """Return the bytes the device's allocator holds.

    Args:
        device (str, torch.device or int, optional): as for :func:`memory_allocated`.

    Returns:
        int: on CUDA, the caching allocator's reserved bytes; on the CPU, which has no
        cache, :func:`memory_allocated`.
    """
    return _M.memory_reserved(_device(device))


def mark(name: str) -> Mark:
    """Mark the innermost running tracker of this thread, for code that has no handle on it.

    Args:
        name (str): the phase that ends here (see :meth:`Tracker.mark`).

    Returns:
        Mark: what the tracker recorded.

    Raises:
        TypeError: a name that is not a str. RuntimeError: no tracker is running.
    """
    return _M.mark(_name(name))


def _tensors(obj) -> Iterable[torch.Tensor]:
    """The tensors inside an optimizer state value (tensors, lists, tuples, dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


class Tracker:
    """A scoped view of one device's memory, with its own peak and marks.

    It starts when created and stops at :meth:`stop` or at the end of its ``with`` block;
    after that its figures stay readable, frozen. Trackers nest: each keeps its own peak,
    and :meth:`reset_peak` on one leaves the others (and torch's counters) alone.

    Args:
        device (str, torch.device or int, optional): the device it watches, as for
            :func:`memory_allocated`. Default: ``"cpu"`` (installs the counting allocator).

    Example::

        with memlean.memstats.track("cpu") as t:
            y = model(x)
            t.mark("forward")
        print(t.peak, t.table())
    """

    def __init__(self, device="cpu"):
        self._t = _M.Tracker(_device(device))

    def __enter__(self) -> "Tracker":
        if not self._t.running:
            raise RuntimeError(
                "memlean.memstats: `with` on a stopped Tracker: it stopped at stop() or at the "
                "end of its `with` block and tracks nothing any more (its figures stay readable). "
                "Start a new one: `with memlean.memstats.track(device) as t:`"
            )
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return (
            f"Tracker(device='{self._t.device}', {state}, current={self.current}, "
            f"peak={self.peak}, marks={len(self.marks)})"
        )

    def __str__(self) -> str:
        return self.table()

    @property
    def device(self) -> torch.device:
        """The device it watches."""
        return torch.device(self._t.device)

    @property
    def running(self) -> bool:
        """False once stopped."""
        return self._t.running

    @property
    def current(self) -> int:
        """Bytes alive on the device now (after stop(): when it stopped)."""
        return self._t.current

    @property
    def peak(self) -> int:
        """The largest `current` since the tracker started or since its reset_peak()."""
        return self._t.peak

    @property
    def reserved(self) -> int:
        """The device's :func:`memory_reserved` now (after stop(): when it stopped)."""
        return self._t.reserved

    @property
    def marks(self) -> list:
        """The Mark of every mark() so far: name, step, current, peak (since the previous
        mark), kept (bytes allocated since the previous mark still alive; None on CUDA),
        reserved, seconds."""
        return self._t.marks()

    def reset_peak(self) -> None:
        """Start this tracker's peak again from :attr:`current` (no other tracker's peak,
        and no torch counter, changes)."""
        self._t.reset_peak()

    def mark(self, name: str) -> Mark:
        """End the phase that began at the previous mark and record it as `name`. A name
        seen already in the current step starts a new step (column)."""
        return self._t.mark(_name(name))

    def stop(self) -> None:
        """Stop tracking; the figures stay readable. Stopping twice is harmless."""
        self._t.stop()

    def table(self, bytes: bool = False, value: str = "current") -> str:
        """Return the phase table of the Swish blog post (docs/sources.md): one row per
        mark name, one column per step.

        Args:
            bytes (bool, optional): exact bytes instead of MiB with two decimals.
            value (str, optional): ``"current"`` (bytes alive at the mark, with a
                ``(peak)`` row; default), ``"peak"`` (peak since the previous mark),
                ``"kept"`` (bytes allocated since the previous mark still alive; CPU only)
                or ``"reserved"``.

        Raises:
            TypeError: arguments of other types. ValueError: another ``value``.
        """
        if not isinstance(bytes, bool):
            raise TypeError(f"memlean.memstats: bytes must be a bool, got {type(bytes).__name__}")
        if not isinstance(value, str):
            raise TypeError(f"memlean.memstats: value must be a str, got {type(value).__name__}")
        return self._t.table(bytes, value)

    def to_csv(self, path=None) -> str:
        """One row per mark (step,phase,current_bytes,peak_bytes,kept_bytes,reserved_bytes,
        seconds); written to `path` when given. Returns the text."""
        return _write(path, self._t.csv())

    def to_json(self, path=None) -> str:
        """The tracker and its marks as JSON; written to `path` when given."""
        return _write(path, self._t.json())

    def categories(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                   forward: str | None = None) -> Categories:
        """Split the device's live bytes into parameters, buffers, gradients, optimizer state,
        activations and other; they sum to `total` to the byte. Activations are the bytes
        allocated during the latest mark named `forward` (default: "forward" or "forw") that
        are still alive, other than the model's and optimizer's tensors. `untracked` counts
        the model's and optimizer's bytes outside the total (allocated before enable())."""
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"memlean.memstats: model must be a torch.nn.Module, got {type(model).__name__}"
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"memlean.memstats: optimizer must be a torch.optim.Optimizer or None, got "
                f"{type(optimizer).__name__}"
            )
        if forward is not None and not isinstance(forward, str):
            raise TypeError(
                f"memlean.memstats: forward must be a mark name or None, got "
                f"{type(forward).__name__}"
            )
        params = list(model.parameters())
        buffers = list(model.buffers())
        grads = [p.grad for p in params if p.grad is not None]
        state = []
        if optimizer is not None:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        grads.append(p.grad)
            for s in optimizer.state.values():
                state.extend(_tensors(s))
        return self._t.categories(params, buffers, grads, state, forward or "")

    def plot(self, path, title: str | None = None) -> str:
        """Draw bytes alive at each mark and the peak of each phase to a PNG at `path`
        (needs matplotlib, an optional dependency). Returns the path. Many marks or long
        names stay readable: the labels turn vertical ("step: name"), names over 24
        characters are shortened in the middle, the figure widens with the number of marks
        (up to 60 inches; beyond that only every k-th mark is labelled)."""
        plt = _plot.pyplot("memlean.memstats: Tracker.plot()", " or use to_csv()/to_json()")
        marks = self.marks
        if not marks:
            raise RuntimeError("memlean.memstats: plot(): the tracker has no marks")
        mib = float(1 << 20)
        n = len(marks)
        xs = list(range(n))
        names = [_shorten(m.name, _PLOT_NAME_CHARS) for m in marks]
        # Few short names: "name\nstep" under each mark. Otherwise vertical "step: name"
        # labels, names of over _PLOT_NAME_CHARS characters shortened in the middle, the
        # figure widened to give each its room, and (beyond what fits _PLOT_MAX_INCHES)
        # only every k-th mark labelled.
        longest = max(len(name) for name in names)
        vertical = n > 12 or longest > 10
        if vertical:
            every = max(1, math.ceil(n * _PLOT_INCHES_PER_LABEL / (_PLOT_MAX_INCHES - 1.5)))
            width = max(6.0, min(_PLOT_MAX_INCHES, math.ceil(n / every) * _PLOT_INCHES_PER_LABEL + 1.5))
            height = 4.0 + 0.075 * longest
        else:
            longest = max(longest, len(str(marks[-1].step)))
            every, width, height = 1, max(6.0, n * (0.075 * longest + 0.2) + 1.5), 4.0
        fig, ax = plt.subplots(figsize=(width, height))
        ax.plot(xs, [m.current / mib for m in marks], "o-", label="alive at the mark")
        ax.plot(xs, [m.peak / mib for m in marks], "v--", label="peak since the previous mark")
        for i in range(1, len(marks)):
            if marks[i].step != marks[i - 1].step:
                ax.axvline(i - 0.5, color="0.8", linewidth=1)
        ticks = xs[::every]
        ax.set_xticks(ticks)
        if vertical:
            ax.set_xticklabels([f"{marks[i].step}: {names[i]}" for i in ticks], fontsize=8, rotation=90)
            ax.set_xlabel("step: mark")
        else:
            ax.set_xticklabels([f"{names[i]}\n{marks[i].step}" for i in ticks], fontsize=8)
        ax.set_xlim(-0.5, n - 0.5)
        ax.set_ylabel("MiB")
        ax.set_title(title or f"memory on {self._t.device}")
        ax.legend(loc="best")
        fig.tight_layout()
        return _plot.save(fig, path)


_PLOT_NAME_CHARS = 24  # longer mark names are shortened in the middle on the plot
_PLOT_INCHES_PER_LABEL = 0.2  # vertical 8-point labels are ~0.12 inch wide
_PLOT_MAX_INCHES = 60.0


def _shorten(name: str, limit: int) -> str:
    """`name`, or its start and end around an ellipsis (marks often differ at the end)."""
    if len(name) <= limit:
        return name
    tail = (limit - 1) // 2
    return name[:limit - 1 - tail] + "\u2026" + name[-tail:]


def track(device="cpu") -> Tracker:
    """Start a :class:`Tracker` on ``device``: ``with memlean.memstats.track() as t: ...``."""
    return Tracker(device)


def _write(path, text: str) -> str:
    if path is not None:
        with open(os.fspath(path), "w", encoding="utf-8") as f:
            f.write(text)
    return text


@contextlib.contextmanager
def _collector_off(collect: bool = True):
    """Python's cyclic garbage collector off inside (and, with `collect`, run first), so
    that no garbage of earlier code (models in reference cycles are freed only by the
    collector) is freed in the middle of a measurement, which would lower a peak measured
    from the start. Reference counting still frees what dies inside. memlean.fit's
    measured steps and the experiments' measurements use it."""
    if collect:
        gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def storage_key(tensor: torch.Tensor):
    """The key of a tensor's storage: (device, data_ptr), the same for every view of it."""
    return (tensor.device, tensor.untyped_storage().data_ptr())


class SavedStorages(dict):
    """{storage_key: nbytes} of the distinct storages autograd saved for backward."""

    @property
    def nbytes(self) -> int:
        return sum(self.values())

    def add(self, *tensors: torch.Tensor) -> None:
        """Counts the storages of `tensors` too (e.g. an op's output, which a caller keeps)."""
        for t in tensors:
            self[storage_key(t)] = t.untyped_storage().nbytes()

    def without(self, *tensors: torch.Tensor) -> "SavedStorages":
        """The same, less the storages of `tensors` (e.g. an op's output, alive anyway)."""
        drop = {storage_key(t) for t in tensors}
        return SavedStorages({k: v for k, v in self.items() if k not in drop})


@contextlib.contextmanager
def saved_storages():
    """Record the storages autograd saves for backward inside the block (each counted once,
    however many saved tensors view it; keyed by storage_key):

        with memlean.memstats.saved_storages() as saved:
            y = model(x)
        print(len(saved), saved.nbytes, saved.without(y).nbytes)

    The one way memlean's Python side counts saved bytes (the experiments and tests use
    it; memlean.measure_layer_costs counts every allocation that stays alive instead, with
    the C++ measurement)."""
    saved = SavedStorages()

    def pack(t):
        saved.add(t)
        # Detached: a saved output returned as itself would make a cycle through its grad_fn
        # that Python's collector cannot see (pytorch#115255): a graph never run backward
        # would then keep its tensors, and the model's parameters, alive for good. (It shares
        # t's version counter.)
        return t.detach(), t._version

    def unpack(packed):
        t, version = packed
        _check_saved_version(t, version)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield saved


def _check_saved_version(t, version):
    """Autograd's check that a saved tensor was not modified in place before its backward,
    which autograd skips for a tensor saved through saved_tensors_hooks (it cannot see
    through them): the hooks of memlean's measurements (saved_storages, memlean.fit's
    recorded steps) call it at unpack, so a step with an in-place error fails under them as
    it does without (the same message)."""
    if t._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{t.type()} {list(t.shape)}] is at version {t._version}; "
            f"expected version {version} instead (checked by memlean's saved-tensor hooks)")
