"""Starting gloo ranks on this machine for a test: the launcher of the DDP and FSDP tests,
and the harness of those that train a model under several wrappings and compare every
rank's gradients and BatchNorm statistics with one process's."""
import datetime
import os
import sys
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# How long a rank waits for the others (store, process group) before it gives up.
TIMEOUT = datetime.timedelta(seconds=60)


def run_ranks(worker, args, *, world, deadline_s, what="ranks"):
    """Runs worker(rank, port, *args) in `world` spawned processes, which meet through a
    TCPStore on 127.0.0.1:port. Waits at most deadline_s (failing the test past it), and
    kills whatever is still running when it returns or raises."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    ctx = mp.start_processes(_run_and_leave, args=(worker, store.port, *args), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the {what} did not finish within {deadline_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def _run_and_leave(rank, worker, port, *args):
    """A rank: worker(rank, port, *args), then out of the process at once. Its results are
    saved by then; the interpreter's own exit (static destructors beside c10d and gloo
    threads) once aborted a rank whose work was done ("terminate called without an active
    exception", SIGABRT, CI 2026-11-24, checkpoint_fsdp_test; not reproduced in 12 runs).
    A worker that raises still fails the rank (the exception propagates first)."""
    worker(rank, port, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train_on_ranks(train, configs, *, world, deadline_s):
    """{config: [result of each rank]}: every rank (gloo, one thread each, a CPU device mesh
    of `world`) runs result = train(config, mesh, rank) for each config in turn; a config
    that raises on a rank gives {"error": its traceback} there (both ranks fail alike; the
    test of that config reports it). `train` must be a module-level function (the ranks are
    spawned)."""
    with tempfile.TemporaryDirectory(dir=os.environ.get("TEST_TMPDIR")) as outdir:
        run_ranks(_train_configs, (outdir, train, list(configs), world), world=world,
                  deadline_s=deadline_s)
        return {c: [torch.load(os.path.join(outdir, f"{c}_rank{r}.pt")) for r in range(world)]
                for c in configs}


def _train_configs(rank, port, outdir, train, configs, world):
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only (the test sandbox has no network)
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        mesh = init_device_mesh("cpu", (world,))
        for config in configs:
            try:
                result = train(config, mesh, rank)
            except Exception:
                result = {"error": traceback.format_exc()}
            torch.save(result, os.path.join(outdir, f"{config}_rank{rank}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def wrap(model, how, mesh):
    """The model as a rank trains it: DistributedDataParallel ("ddp"), else FSDP2's
    fully_shard on each of model.blocks and on the root."""
    if how == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train_steps(model, wrapped, x, y, *, steps, lr):
    """A rank's result: `steps` SGD steps of cross-entropy through `wrapped` (which trains
    `model`), each step's gradients and the final buffers as full tensors."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(wrapped(x), y).backward()
        grads.append({k: full_tensor(p.grad) for k, p in model.named_parameters()})
        opt.step()
    return {"grads": grads, "buffers": {k: full_tensor(b) for k, b in model.named_buffers()}}


def train_one_process(model, tracker, parts, *, steps, lr):
    """The reference the ranks are held to: `model` trained in one process on every part
    (the average of the parts' cross-entropies: what DDP and FSDP average), each step's
    gradients; and the buffers of rank 0's, from `tracker` (a second copy of the model), fed
    the parameters and part 0 in train mode before each step."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    grads = []
    for _ in range(steps):
        tracker.load_state_dict({**tracker.state_dict(), **dict(model.named_parameters())})
        with torch.no_grad():
            tracker(parts[0][0])
        opt.zero_grad(set_to_none=True)
        loss = sum(torch.nn.functional.cross_entropy(model(x), y) for x, y in parts) / len(parts)
        loss.backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        opt.step()
    return grads, dict(tracker.named_buffers())


def full_tensor(t):
    """A DTensor's full value (FSDP2's sharded parameters and gradients), else a copy."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def assert_like_one_process(rank_results, grads, buffers, steps, batchnorms):
    """Every rank's result {"grads": [per step {name: gradient}], "buffers": {name: tensor}}
    against one process's: the gradients of each step to 1e-10, and rank 0's buffers (each
    of the `batchnorms` BatchNorms counted once per training forward)."""
    for rank, result in enumerate(rank_results):
        assert "error" not in result, f"rank {rank}:\n{result.get('error')}"
        for step, (got, expected) in enumerate(zip(result["grads"], grads)):
            assert got.keys() == expected.keys()
            for k, g in got.items():
                torch.testing.assert_close(g, expected[k], rtol=1e-10, atol=1e-12,
                                           msg=lambda m: f"rank {rank}, step {step}, {k}: {m}")
    got = rank_results[0]["buffers"]
    counts = [v.item() for k, v in got.items() if k.endswith("num_batches_tracked")]
    assert counts == [steps] * batchnorms  # once per training forward, recomputed or not
    assert got.keys() == buffers.keys()
    for k, v in got.items():
        torch.testing.assert_close(v, buffers[k], rtol=1e-9, atol=1e-12, msg=lambda m: f"{k}: {m}")
