"""Shared pieces of the experiment targets: the result table (printed, markdown, CSV),
command-line options (--device among them), memory and time measurement with
memlean.memstats on the CPU (exact bytes) or on CUDA (the caching allocator's bytes),
progress lines, and plots."""
from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import statistics
import sys
import time
from typing import Callable

import torch

import memlean.memstats as memstats
from memlean import _plot

MIB = float(1 << 20)
CPU = torch.device("cpu")
DEVICES = ("auto", "cpu", "cuda")
# On CUDA a step takes milliseconds and its time varies with clocks and other work on the GPU:
# the median of at least this many steps, and their min-max, say how much.
CUDA_MIN_STEPS = 5


@dataclasses.dataclass
class Table:
    """One reproduced table: rows of dicts, the source's figures in their own columns."""

    key: str  # file name stem: results/<key>.csv
    title: str
    rows: list
    note: str = ""  # one line explaining any difference from the source
    plots: list = dataclasses.field(default_factory=list)  # PNG paths written

    @property
    def columns(self):
        cols = []
        for r in self.rows:
            cols += [c for c in r if c not in cols]
        return cols

    def cell(self, value):
        if value is None:
            return ""
        if isinstance(value, float):
            return f"{value:.2f}" if abs(value) >= 0.01 or value == 0 else f"{value:.3g}"
        return str(value)

    def markdown(self) -> str:
        cols = self.columns
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(self.cell(r.get(c)) for c in cols) + " |" for r in self.rows]
        out = [f"### {self.title}", "", *lines, ""]
        if self.note:
            out += [self.note, ""]
        out += [f"![{self.key}]({os.path.basename(p)})" for p in self.plots]
        return "\n".join(out).rstrip() + "\n"

    def text(self) -> str:
        cols = self.columns
        cells = [[self.cell(r.get(c)) for c in cols] for r in self.rows]
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
        fmt = "  ".join("{:<%d}" % w for w in widths)
        lines = [self.title, fmt.format(*cols), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*row) for row in cells]
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)

    def write(self, out_dir: str) -> None:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, self.key + ".csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns)
            w.writeheader()
            for r in self.rows:
                w.writerow({c: r.get(c) for c in self.columns})


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    default_out = os.path.join(os.environ.get("BUILD_WORKSPACE_DIRECTORY", os.getcwd()), "results")
    p.add_argument("--out", default=default_out, help="output folder (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes: seconds instead of minutes (what CI runs)")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where to measure: auto (cuda when torch.cuda.is_available(), else cpu),\n"
                        "cpu (exact bytes of the counting allocator) or cuda (the caching\n"
                        "allocator's bytes, synchronized step times) (default: %(default)s)")
    return p


def parse_args(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """p.parse_args(argv) with args.device resolved to a torch.device. --device=cuda without
    a usable GPU is p.error: one line naming the option, exit status 2."""
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    if args.device == "cuda" and not gpu:
        p.error(f"--device=cuda: no usable CUDA GPU here (torch {torch.__version__}, built for "
                f"CUDA {torch.version.cuda or 'none'}; torch.cuda.is_available() is False); "
                "use --device=cpu or auto")
    args.device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and gpu)
                               else "cpu")
    return args


def emit(tables: list, out_dir: str) -> None:
    """Print each table and write its CSV (plots are written by the experiment)."""
    for t in tables:
        print("\n" + t.text() + "\n", flush=True)
        t.write(out_dir)


def main_for(run: Callable, doc: str, argv=None) -> list:
    """The main() of one experiment target: parse options, run, print, write."""
    args = parse_args(parser(doc), argv)
    tables = run(args)
    emit(tables, args.out)
    write_summary(tables, args.out, "summary_" + tables[0].key.split("__")[0] + ".md")
    return tables


def write_summary(tables: list, out_dir: str, name: str = "summary.md") -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        f.write("# memlean: source tables reproduced\n\n")
        f.write("\n".join(t.markdown() for t in tables))
    print(f"wrote {path}", file=sys.stderr)
    return path


def quiet_gc():
    """Collect garbage left by earlier runs (models in reference cycles are freed only by
    the collector) and keep the collector off inside, so that no earlier tensor is freed in
    the middle of a measurement."""
    return memstats._collector_off(collect=True)


def peak_of(fn: Callable[[], object], device: torch.device = CPU) -> tuple[int, int]:
    """(peak, kept) bytes of `device` storage while fn() runs, from what is alive when fn
    starts: peak = highest bytes alive above the start, kept = bytes still alive above the
    start when fn returns (its result included). CPU: exact bytes of memstats' counting
    allocator. CUDA: memstats' CUDA tracker, i.e. the caching allocator's allocated bytes,
    so peak is what torch.cuda.max_memory_allocated() after reset_peak_memory_stats() at the
    start would give, less the bytes alive at the start."""
    memstats.enable()
    with quiet_gc(), memstats.track(device) as t:
        base = t.current
        t.reset_peak()
        result = fn()
        peak, kept = t.peak - base, t.current - base
    del result
    return peak, kept


class Seconds(float):
    """The median of measured step times, in seconds, carrying every time (`times`), so that
    a table can give the min-max beside it."""

    def __new__(cls, times: list):
        value = super().__new__(cls, statistics.median(times))
        value.times = list(times)
        return value


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1,
                   device: torch.device = CPU) -> Seconds:
    """Median time of `repeats` calls of fn after `warmup` untimed ones. On CUDA, at least
    CUDA_MIN_STEPS calls, each between torch.cuda.synchronize() calls: kernels run
    asynchronously, and a step's time is the time until its last kernel has finished."""
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(repeats, CUDA_MIN_STEPS) if cuda else repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return Seconds(times)


def time_cells(seconds: Seconds, device: torch.device) -> dict:
    """A row's step-time cells: s/step on the CPU; on CUDA ms/step and the min-max of the
    steps (milliseconds: seconds with two decimals would say nothing there)."""
    if device.type != "cuda":
        return {"s/step": seconds}
    return {"ms/step": 1e3 * seconds,
            "ms/step min-max": f"{1e3 * min(seconds.times):.2f}-{1e3 * max(seconds.times):.2f}"}


def warm_up(step: Callable[[], object], device: torch.device) -> None:
    """On CUDA, one untimed, unmeasured step before a table: cuBLAS and cuDNN allocate their
    workspaces (through the caching allocator, kept from then on) at their first call, which
    would otherwise land in the first configuration's figures. Nothing to do on the CPU."""
    if device.type == "cuda":
        step()
        torch.cuda.synchronize(device)


def device_note(device: torch.device, tracked: bool = True, timed: bool = False) -> str:
    """What a table's note adds on CUDA: the GPU, torch and CUDA versions, and how memory
    (when `tracked`: measured with a tracker) and time (when `timed`) were measured. Empty
    on the CPU, where each note says exact CPU bytes already."""
    if device.type != "cuda":
        return ""
    note = (f" Measured on {torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}.")
    if tracked:
        note += (" Memory: memlean.memstats' CUDA tracker, the caching allocator's allocated "
                 "bytes above the start of each measured span (torch.cuda.max_memory_allocated's "
                 "semantics); cuBLAS/cuDNN workspaces warmed up by one untimed, unmeasured step "
                 "before the table.")
    if timed:
        note += (f" Times: median and min-max of at least {CUDA_MIN_STEPS} steps after a "
                 "warm-up step, torch.cuda.synchronize() before and after each.")
    return note


def about(seconds: float) -> str:
    """A duration as people estimate it: 'about 12 min' (seconds below 90 s)."""
    return f"about {round(seconds / 60)} min" if seconds >= 90 else f"about {round(seconds)} s"


class Progress:
    """Progress lines on stderr for an experiment that runs for minutes: one per
    configuration measured, with the time left; after the first configuration, an estimate
    of the rest (its time x the work left). Work is in units the experiment picks
    (e.g. samples x steps), so that a configuration of twice the batch counts twice."""

    def __init__(self, name: str, works: list):
        self.name, self.works, self.done = name, list(works), 0
        self.t0 = time.perf_counter()

    def step(self, label: str) -> None:
        """One configuration (the next in `works`) measured, or skipped."""
        self.done += 1
        elapsed = time.perf_counter() - self.t0
        work_done = sum(self.works[:self.done])
        left = elapsed / work_done * sum(self.works[self.done:]) if work_done else 0.0
        n = len(self.works)
        if self.done == n:
            print(f"  {self.name} {n}/{n} {label}: {elapsed:.0f} s in all", file=sys.stderr,
                  flush=True)
            return
        if self.done == 1:
            print(f"{self.name}: the first configuration took {elapsed:.1f} s; the "
                  f"{n - 1} others will take {about(left)}", file=sys.stderr, flush=True)
        print(f"  {self.name} {self.done}/{n} {label}: {elapsed:.0f} s so far, {about(left)} left",
              file=sys.stderr, flush=True)


def plot(path: str, title: str, panels: list, xticks: list | None = None,
         log: bool = False) -> str | None:
    """memlean's panel plot (memlean._plot.panels: its docstring says what panels are) to a
    PNG at `path`; without matplotlib (optional), a line on stderr and None."""
    try:
        return _plot.panels(path, title, panels, xticks=xticks, log=log)
    except ImportError as e:
        print(f"{e}: {path} not drawn", file=sys.stderr)
        return None


def mib(nbytes: float) -> float:
    return nbytes / MIB
