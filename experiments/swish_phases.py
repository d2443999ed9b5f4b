"""The Swish blog post's table (docs/sources.md): memory after data / forw / loss / back /
step of two SGD steps of the reference MLP (Linear(128 -> 2^20) -> Swish ->
Linear(2^20 -> 1), batch 128), for naive, memory-efficient and in-place Swish, measured with
memlean.memstats (exact CPU bytes, or the CUDA caching allocator's allocated bytes, what the
Swish post read with torch.cuda.memory_allocated).

    ./bazelw run //experiments:swish_phases [-- --quick] [--out=DIR] [--device=auto|cpu|cuda]
"""
import torch
import torch.nn.functional as F

import memlean.memstats as memstats
from experiments import common
from experiments.models.mlp import Mlp

PHASES = ("data", "forw", "loss", "back", "step")
# torch.cuda.memory_allocated() / 2^20 in the Swish post, batch 128, first and second step.
SOURCE = {1: (524, 1552, 1552, 1044, 1044), 2: (1044, 2072, 2072, 1044, 1044)}
VARIANTS = ("naive", "memory_efficient", "inplace")


def measure(variant: str, hidden: int, batch: int, steps: int = 2, seed: int = 0,
            grads_to_none: bool = False, device: torch.device = common.CPU):
    """{(step, phase): bytes alive} for one variant, counting from an empty process state.
    grads_to_none: zero_grad(set_to_none=True) (today's default, and the C++ trainer's)
    instead of 2019's in-place zeroing. The model and data are drawn on the CPU from the
    seed and moved to `device` (on the CPU, .to() is the tensor itself), so every device
    trains the same numbers."""
    memstats.enable()
    torch.manual_seed(seed)
    with common.quiet_gc(), memstats.track(device) as t:
        base = t.current
        model = Mlp(128, hidden, 1, activation=variant).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(seed)
        out = {}
        for step in range(1, steps + 1):
            # Gradients persist between steps, zeroed in place, as in 2019's zero_grad().
            opt.zero_grad(set_to_none=grads_to_none)
            x = torch.randn(batch, 128, generator=g).to(device)
            y = torch.randn(batch, 1, generator=g).to(device)
            out[step, "data"] = t.current - base
            pred = model(x)
            out[step, "forw"] = t.current - base
            loss = F.mse_loss(pred, y)
            out[step, "loss"] = t.current - base
            loss.backward()
            del pred, loss  # as the C++ trainer does: only the batch outlives backward
            out[step, "back"] = t.current - base
            opt.step()
            out[step, "step"] = t.current - base
            del x, y
        params = sum(p.nbytes for p in model.parameters())
    return out, params


def run(args):
    hidden = 1 << (14 if args.quick else 20)
    batch = 128
    device = args.device
    common.warm_up(lambda: measure(VARIANTS[0], hidden, batch, steps=1, device=device), device)
    results = {v: measure(v, hidden, batch, device=device) for v in VARIANTS}
    rows = []
    for step in (1, 2):
        for i, phase in enumerate(PHASES):
            row = {"step": step, "phase": phase}
            if not args.quick:
                row["source MB"] = SOURCE[step][i]
            for v in VARIANTS:
                row[f"{v} MiB"] = common.mib(results[v][0][step, phase])
            rows.append(row)
    params = results["naive"][1]
    where = ("on the CPU with memlean.memstats (exact bytes)" if device.type == "cpu" else
             "on the GPU (torch.cuda.memory_allocated, as in the Swish blog post)")
    note = (
        f"Measured {where}, hidden={hidden}, batch={batch}; "
        f"parameters {common.mib(params):.2f} MiB. The Swish blog post's network code is not in "
        "the source; its figures (torch.cuda.memory_allocated on a GPU) match the "
        "memory-efficient column: forw = data + 2 activations of batch x hidden floats (the "
        "Linear output and the Swish output); naive keeps a third (sigmoid), in-place one fewer "
        "(plus a 1-bit mask)."
        + common.device_note(device)
    )
    if args.quick:
        note = "Quick mode (CI): " + note
    return [common.Table("swish_phases", "The Swish blog post: memory per training phase (MiB)",
                         rows, note)]


def main(argv=None):
    return common.main_for(run, __doc__, argv)


if __name__ == "__main__":
    main()
