"""Seed 003's table: DenseNet-BC-100 (k=12) on CIFAR-sized input, bottlenecks run naive,
with torch.utils.checkpoint (reentrant, as the seed measured; non-reentrant, as recommended
today) and with memlean's checkpoint; 1 and 2 processes (DDP over gloo, each process half
the batch, as DataParallel split it); peak memory per process (exact CPU bytes) and
seconds per step (median after a warm-up step).

    ./bazelw run //experiments:checkpoint_densenet [-- --quick] [--out=DIR] [--batches 4 256]
"""
import json
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import memlean.memstats as memstats
from experiments import common
from experiments.models.densenet import DenseNetBC

# The table's methods and the twin's checkpoint modes (seed 003's names on the left).
METHODS = {"naive": "none", "official": "torch_reentrant", "official_nonreentrant": "torch",
           "memlean": "memlean"}

# Seed 003 (TITAN X Pascal, PyTorch 1.0): (method, GPUs, batch) -> (memory GB, seconds).
SOURCE = {
    ("naive", 1, 256): (9.93, 0.42), ("naive", 2, 4): (0.65, 0.10),
    ("naive", 2, 256): (5.25, 0.27), ("naive", 2, 512): (9.93, 0.50),
    ("official", 1, 256): (5.38, 0.52), ("official", 1, 512): (10.1, 1.00),
    ("official", 2, 4): (0.62, 1.40), ("official", 2, 256): (2.98, 1.41),
    ("official", 2, 512): (5.39, 1.53),
    ("memlean", 1, 256): (5.37, 0.50), ("memlean", 1, 512): (10.1, 0.97),
    ("memlean", 2, 4): (0.62, 0.13), ("memlean", 2, 256): (2.97, 0.31),
    ("memlean", 2, 512): (5.37, 0.58),
}


def measure(method, batch, depth, repeats, rank=0, world=1):
    """Peak bytes and median seconds of a training step of this process (its share of the
    batch), and BatchNorm's num_batches_tracked after the step (1 = updated once)."""
    torch.manual_seed(0)
    memstats.enable()
    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(batch, 3, 32, 32, generator=g)
    y_all = torch.randint(0, 10, (batch,), generator=g)
    share = batch // world
    x, y = x_all[rank * share:(rank + 1) * share], y_all[rank * share:(rank + 1) * share]
    model = DenseNetBC(depth=depth, checkpoint=METHODS[method])
    first_bn = model.features.denseblock1.denselayer1.norm1
    net = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    loss = step()  # warm-up; also the BatchNorm count of one step
    updates = int(first_bn.num_batches_tracked)
    peak, _ = common.peak_of(step)
    seconds = common.median_seconds(step, repeats, warmup=0)
    return {"peak": peak, "seconds": seconds, "bn_updates": updates, "loss": loss}


def _worker(rank, world, port, method, batch, depth, repeats, out_dir):
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result = {}
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=__import__("datetime").timedelta(seconds=300))
        result = measure(method, batch, depth, repeats, rank, world)
    except Exception as e:  # reported in the table, not a crash of the whole run
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}",
                  "trace": traceback.format_exc()}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_ddp(method, batch, depth, repeats, world=2, timeout=1800):
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_worker, args=(world, free_port(), method, batch, depth, repeats, d),
                                 nprocs=world, join=False, start_method="spawn")
        ctx.join(timeout)  # bounded: a stuck rank does not hang the experiment
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        results = []
        for r in range(world):
            path = os.path.join(d, f"rank{r}.json")
            results.append(json.load(open(path)) if os.path.exists(path) else {"error": "no result (timeout)"})
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {"error": errors[0]}
    return {"peak": max(r["peak"] for r in results), "seconds": max(r["seconds"] for r in results),
            "bn_updates": results[0]["bn_updates"], "loss": results[0]["loss"]}


def available_bytes():
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return info.get("MemAvailable", 0)


def estimate(points, per_process_batch):
    """Peak bytes at a per-process batch, from measured (batch, peak) points: the line
    through the last two, or proportional to the one."""
    if not points:
        return None
    (b1, p1), (b2, p2) = (points[-2], points[-1]) if len(points) > 1 else ((0, 0), points[-1])
    return p2 + (p2 - p1) / (b2 - b1) * (per_process_batch - b2)


def run(args):
    quick = args.quick
    depth = 40 if quick else 100
    batches = getattr(args, "batches", None) or ([4, 8] if quick else [4, 256, 512])
    repeats = 1 if quick else 3
    rows, measured = [], {}
    for world in (1, 2):
        for batch in batches:
            for method in METHODS:
                row = {"method": method, "processes": world, "batch": batch}
                if (method, world, batch) in SOURCE:
                    row["source GB"], row["source s"] = SOURCE[method, world, batch]
                points = measured.setdefault((method, world), [])
                est = estimate(points, batch / world)
                budget = 0.8 * available_bytes() / world
                if est is not None and est > budget:
                    row["note"] = (f"skipped: needs about {est / 2**30:.1f} GiB per process, "
                                   f"{budget / 2**30:.1f} GiB available per process")
                    rows.append(row)
                    continue
                r = measure(method, batch, depth, repeats) if world == 1 else \
                    measure_ddp(method, batch, depth, repeats, world)
                if "error" in r:
                    row["note"] = "fails: " + r["error"]
                else:
                    row.update({"peak GiB/process": r["peak"] / 2**30, "s/step": r["seconds"],
                                "BN updates/step": r["bn_updates"], "loss": round(r["loss"], 5)})
                    points.append((batch / world, r["peak"]))
                rows.append(row)
    note = (f"DenseNet-BC-{depth} (k=12), 32x32 inputs, SGD with momentum, on this machine's 2 CPU "
            "cores (2 processes: 1 thread each, DDP over gloo) instead of TITAN X GPUs; memory is "
            "exact CPU bytes (no cuDNN workspace or CUDA context). 'BN updates/step' is the first "
            "bottleneck BatchNorm's num_batches_tracked after one step: torch's checkpoint (both "
            "forms) recomputes the BatchNorm in train mode and counts the step twice; memlean's "
            "checkpoint with memlean.BatchNorm2d counts it once.")
    return [common.Table("checkpoint_densenet", "Seed 003: DenseNet-BC checkpointing, 1 and 2 processes",
                         rows, note)]


def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--batches", type=int, nargs="+", help="batch sizes (default: 4 256 512)")
    args = p.parse_args(argv)
    tables = run(args)
    common.emit(tables, args.out)
    common.write_summary(tables, args.out, "summary_checkpoint_densenet.md")
    return tables


if __name__ == "__main__":
    main()
