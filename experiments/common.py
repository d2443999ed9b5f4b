"""Shared pieces of the experiment targets: the result table (printed, markdown, CSV),
command-line options, exact CPU memory measurement with memlean.memstats, and plots."""
from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import gc
import os
import statistics
import sys
import time
from typing import Callable

import memlean.memstats as memstats

MIB = float(1 << 20)


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
    return p


def emit(tables: list, out_dir: str) -> None:
    """Print each table and write its CSV (plots are written by the experiment)."""
    for t in tables:
        print("\n" + t.text() + "\n", flush=True)
        t.write(out_dir)


def main_for(run: Callable, doc: str, argv=None) -> list:
    """The main() of one experiment target: parse options, run, print, write."""
    args = parser(doc).parse_args(argv)
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


@contextlib.contextmanager
def quiet_gc():
    """Collect garbage left by earlier runs (models in reference cycles are freed only by
    the collector) and keep the collector off inside, so that no earlier tensor is freed in
    the middle of a measurement."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def peak_of(fn: Callable[[], object]) -> tuple[int, int]:
    """(peak, kept) bytes of CPU storage while fn() runs, counted exactly by memstats from
    what is alive when fn starts: peak = highest bytes alive above the start, kept = bytes
    still alive above the start when fn returns (its result included)."""
    memstats.enable()
    with quiet_gc(), memstats.track() as t:
        base = t.current
        t.reset_peak()
        result = fn()
        peak, kept = t.peak - base, t.current - base
    del result
    return peak, kept


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def line_plot(path: str, title: str, xlabel: str, ylabel: str, series: dict, xs: list) -> str | None:
    """A PNG line plot (matplotlib, optional): series = {label: [y per x]}."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: {path} not drawn (pip install matplotlib)",
              file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, ys in series.items():
        ax.plot(xs, ys, "o-", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_xticks(xs)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
    return path


def mib(nbytes: float) -> float:
    return nbytes / MIB
