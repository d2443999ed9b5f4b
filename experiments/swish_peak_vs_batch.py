"""The Swish blog post's figure (docs/sources.md): peak memory of one training step of the
reference MLP against the batch size (64 ... 512), for naive, memory-efficient and in-place
Swish and torch's SiLU; the reduction at batch 512 beside the source's "almost 20% less"; a
PNG line plot.

    ./bazelw run //experiments:swish_peak_vs_batch [-- --quick] [--out=DIR] [--device=auto|cpu|cuda]
"""
import os

import torch
import torch.nn.functional as F

import memlean.memstats as memstats
from experiments import common
from experiments.models.mlp import Mlp

ACTIVATIONS = ("naive", "memory_efficient", "inplace", "silu")

SOURCE_CLAIM = "almost 20% less (custom op vs naive) at batch 512"


def step_memory(act: str, hidden: int, batch: int, seed: int = 0,
                device: torch.device = common.CPU) -> dict:
    """Bytes of one full training step (model, data, forward, backward, SGD step): alive
    right after forward (where the Swish post read memory_allocated) and the step's true peak.
    Model and data are drawn on the CPU from the seed and moved to `device`."""
    memstats.enable()
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    with common.quiet_gc(), memstats.track(device) as t:
        base = t.current
        t.reset_peak()
        model = Mlp(128, hidden, 1, activation=act).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(batch, 128, generator=g).to(device)
        y = torch.randn(batch, 1, generator=g).to(device)
        out = model(x)
        after_forward = t.current - base
        F.mse_loss(out, y).backward()
        opt.step()
        peak = t.peak - base
    return {"after forward": after_forward, "step peak": peak}


def run(args):
    hidden = 1 << (14 if args.quick else 20)
    batches = [64, 128, 256, 512]
    device = args.device
    common.warm_up(lambda: step_memory(ACTIVATIONS[0], hidden, batches[0], device=device), device)
    progress = common.Progress("swish_peak_vs_batch", [b for _ in ACTIVATIONS for b in batches])
    m = {}
    for a in ACTIVATIONS:
        m[a] = []
        for b in batches:
            m[a].append(step_memory(a, hidden, b, device=device))
            progress.step(f"{a}, batch {b}")
    rows = []
    for metric in ("after forward", "step peak"):
        for i, b in enumerate(batches):
            row = {"batch": b, "measure": metric}
            for a in ACTIVATIONS:
                row[f"{a} MiB"] = common.mib(m[a][i][metric])
            for a in ("memory_efficient", "inplace"):
                row[f"{a} vs naive"] = f"{100 * (1 - m[a][i][metric] / m['naive'][i][metric]):.1f}% less"
            rows.append(row)
    fwd = 1 - m["memory_efficient"][-1]["after forward"] / m["naive"][-1]["after forward"]
    peak = 1 - m["memory_efficient"][-1]["step peak"] / m["naive"][-1]["step peak"]
    inpl = 1 - m["inplace"][-1]["step peak"] / m["naive"][-1]["step peak"]
    what = "Exact CPU bytes" if device.type == "cpu" else "CUDA allocated bytes"
    note = (
        f"{what}, hidden={hidden}. At batch 512 the memory-efficient Swish is "
        f"{100 * fwd:.1f}% below naive right after forward and {100 * peak:.1f}% below at the "
        f"step's true peak (in-place: {100 * inpl:.1f}%); source: {SOURCE_CLAIM}. The true peak "
        "of this MLP is inside backward, in the second Linear's backward (its saved input, "
        "Swish's output, and the gradient it makes), where memory-efficient and torch's SiLU "
        "also keep Swish's input and in-place only its 1-bit mask: one activation less. "
        "Swish's own backward no longer sets it: memlean's write the input gradient over the "
        "incoming one (torch's silu_backward makes a third tensor there). Right after forward "
        "in-place keeps one activation fewer."
        + common.device_note(device)
    )
    # One colour per activation, one line style per measure. torch's SiLU after forward is
    # memory_efficient's line exactly (both keep only the input): left out, not drawn over it.
    series = {(a, measure): (batches, [common.mib(r[measure]) for r in m[a]])
              for measure in ("step peak", "after forward") for a in ACTIVATIONS
              if (a, measure) != ("silu", "after forward")}
    plot = common.plot(os.path.join(args.out, "swish_peak_vs_batch.png"),
                       "Memory of a training step (reference MLP)",
                       [("batch size", "MiB", series)], xticks=batches)
    return [common.Table("swish_peak_vs_batch", "The Swish blog post: memory vs batch size (MiB)",
                         rows, note, [plot] if plot else [])]


def main(argv=None):
    return common.main_for(run, __doc__, argv)


if __name__ == "__main__":
    main()
