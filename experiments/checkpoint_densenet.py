"""pytorch-checkpoint's table (docs/sources.md): DenseNet-BC-100 (k=12) on CIFAR-sized input,
bottlenecks run naive, with torch.utils.checkpoint (reentrant, as pytorch-checkpoint
measured; non-reentrant, as recommended today) and with memlean's checkpoint; 1 and 2
processes (DDP over gloo, each process half the batch, as DataParallel split it); peak memory
per process (exact CPU bytes, or CUDA's allocated bytes) and seconds per step (median after a
warm-up step); a PNG of peak against step time. On CUDA, 2 processes take one GPU each (DDP
over NCCL).

    ./bazelw run //experiments:checkpoint_densenet [-- --quick] [--out=DIR] [--batches 4 256]
                                                   [--device=auto|cpu|cuda]
"""
import gc
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

# The table's methods and the twin's checkpoint modes (pytorch-checkpoint's names on the left).
METHODS = {"naive": "none", "official": "torch_reentrant", "official_nonreentrant": "torch",
           "memlean": "memlean"}

# pytorch-checkpoint's figures (TITAN X Pascal, PyTorch 1.0):
# (method, GPUs, batch) -> (memory GB, seconds).
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


def measure(method, batch, depth, repeats, rank=0, world=1, device=common.CPU):
    """Peak bytes and median seconds of a training step of this process (its share of the
    batch) on `device`, and BatchNorm's num_batches_tracked after the step (1 = updated
    once). Model and data are drawn on the CPU from the seed, the same on every device."""
    torch.manual_seed(0)
    memstats.enable()
    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(batch, 3, 32, 32, generator=g)
    y_all = torch.randint(0, 10, (batch,), generator=g)
    share = batch // world
    x = x_all[rank * share:(rank + 1) * share].to(device)
    y = y_all[rank * share:(rank + 1) * share].to(device)
    model = DenseNetBC(depth=depth, checkpoint=METHODS[method]).to(device)
    first_bn = model.features.denseblock1.denselayer1.norm1
    if world == 1:
        net = model
    elif device.type == "cuda":
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    loss = step()  # warm-up; also the BatchNorm count of one step
    updates = int(first_bn.num_batches_tracked)
    peak, _ = common.peak_of(step, device)
    seconds = common.median_seconds(step, repeats, warmup=0, device=device)
    return {"peak": peak, "seconds": seconds, "bn_updates": updates, "loss": loss}


def measure_here(method, batch, depth, repeats, device):
    """measure() in this process; running out of memory makes the row's note, and the run
    goes on with the next configuration."""
    try:
        return measure(method, batch, depth, repeats, device=device)
    except torch.OutOfMemoryError as e:
        error = f"OutOfMemoryError: {str(e).splitlines()[0][:160]}"
    gc.collect()  # what the failed step left, before the next configuration
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"error": error}


def _worker(rank, world, port, method, batch, depth, repeats, out_dir, device_type="cpu"):
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result = {}
    try:
        device = torch.device(device_type, rank) if device_type == "cuda" else common.CPU
        if device_type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank,
                                world_size=world,
                                timeout=__import__("datetime").timedelta(seconds=300))
        result = measure(method, batch, depth, repeats, rank, world, device)
        result["seconds"] = result["seconds"].times  # JSON keeps a float subclass's value only
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


def measure_ddp(method, batch, depth, repeats, world=2, timeout=1800, device_type="cpu"):
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_worker, args=(world, free_port(), method, batch, depth, repeats,
                                                d, device_type),
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
    return {"peak": max(r["peak"] for r in results),
            "seconds": max((common.Seconds(r["seconds"]) for r in results), key=float),
            "bn_updates": results[0]["bn_updates"], "loss": results[0]["loss"]}


def available_bytes(device=common.CPU):
    """Bytes a measurement may use: the memory available on the machine (its processes
    share it), or on CUDA the device's total memory (each process has a GPU of its own)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
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
    quick, device = args.quick, args.device
    cuda = device.type == "cuda"
    depth = 40 if quick else 100
    batches = getattr(args, "batches", None) or (
        [4, 8] if quick else [64, 128, 256, 512, 1024] if cuda else [4, 256, 512])
    repeats = 1 if quick else 3
    # On CUDA each process needs a GPU of its own.
    gpus = torch.cuda.device_count() if cuda else 0
    worlds = {1: True, 2: not cuda or gpus >= 2}
    configs = [(world, batch, method)
               for world in worlds for batch in batches for method in METHODS]
    # Work: samples x steps, none where nothing runs.
    works = [batch * (2 + repeats) * worlds[world] for world, batch, _ in configs]
    progress = common.Progress("checkpoint_densenet", works)
    rows, measured, drawn = [], {}, {}
    for world, batch, method in configs:
        label = f"{method}, {world} process{'es' if world > 1 else ''}, batch {batch}"
        row = {"method": method, "processes": world, "batch": batch}
        if (method, world, batch) in SOURCE:
            gb, source_s = SOURCE[method, world, batch]
            row["source GB"] = gb
            row.update({"source ms": 1e3 * source_s} if cuda else {"source s": source_s})
        points = measured.setdefault((method, world), [])
        est = estimate(points, batch / world)
        budget = 0.8 * available_bytes() / world if not cuda else 0.9 * available_bytes(device)
        if not worlds[world]:
            row["note"] = (f"not measured: {world} processes need {world} GPUs, this machine "
                           f"has {gpus}")
        elif est is not None and est > budget:
            row["note"] = (f"skipped: needs about {est / 2**30:.1f} GiB per process, "
                           f"{budget / 2**30:.1f} GiB available per process")
        else:
            r = measure_here(method, batch, depth, repeats, device) if world == 1 else \
                measure_ddp(method, batch, depth, repeats, world, device_type=device.type)
            if "error" in r:
                row["note"] = "fails: " + r["error"]
            else:
                row.update({"peak GiB/process": r["peak"] / 2**30,
                            **common.time_cells(r["seconds"], device),
                            "BN updates/step": r["bn_updates"], "loss": round(r["loss"], 5)})
                points.append((batch / world, r["peak"]))
                drawn.setdefault((method, world), []).append((r["seconds"], r["peak"], batch))
        rows.append(row)
        progress.step(label)
    if cuda:
        where = (f"on {torch.cuda.get_device_name(device)} GPUs (2 processes: one GPU each, DDP "
                 "over NCCL) instead of TITAN X GPUs; memory is CUDA allocated bytes per process, "
                 "cuDNN workspaces included, not the CUDA context (which pytorch-checkpoint's "
                 "figures hold)")
        if not worlds[2]:
            where += f"; the 2-process rows need 2 GPUs and this machine has {gpus}"
    else:
        where = ("on this machine's 2 CPU cores (2 processes: 1 thread each, DDP over gloo) "
                 "instead of TITAN X GPUs; memory is exact CPU bytes (no cuDNN workspace or "
                 "CUDA context)")
    note = (f"DenseNet-BC-{depth} (k=12), 32x32 inputs, SGD with momentum, {where}. 'BN "
            "updates/step' is the first bottleneck BatchNorm's num_batches_tracked after one "
            "step: torch's checkpoint (both forms) recomputes the BatchNorm in train mode and "
            "counts the step twice; memlean's checkpoint with memlean.BatchNorm2d counts it once."
            + common.device_note(device, timed=True))
    # One colour per method, one line style per process count; each point is a batch size.
    unit, scale = ("ms", 1e3) if cuda else ("s", 1.0)
    plot = common.plot(
        os.path.join(args.out, "checkpoint_densenet.png"),
        f"DenseNet-BC-{depth}: peak memory against step time",
        [(f"{unit} per step", "peak GiB per process",
          {(method, f"{world} process{'es' if world > 1 else ''}"):
           ([scale * p[0] for p in ps], [p[1] / 2**30 for p in ps], [p[2] for p in ps])
           for (method, world), ps in drawn.items()})],
        log=True)
    return [common.Table("checkpoint_densenet",
                         "pytorch-checkpoint: DenseNet-BC checkpointing, 1 and 2 processes",
                         rows, note, [plot] if plot else [])]


def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--batches", type=int, nargs="+", help="batch sizes (default: 4 256 512)")
    args = common.parse_args(p, argv)
    tables = run(args)
    common.emit(tables, args.out)
    common.write_summary(tables, args.out, "summary_checkpoint_densenet.md")
    return tables


if __name__ == "__main__":
    main()
