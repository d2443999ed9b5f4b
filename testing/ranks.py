"""Starting gloo ranks on this machine for a test: the launcher of the DDP and FSDP tests."""
import datetime
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

# How long a rank waits for the others (store, process group) before it gives up.
TIMEOUT = datetime.timedelta(seconds=60)


def run_ranks(worker, args, *, world, deadline_s, what="ranks"):
    """Runs worker(rank, port, *args) in `world` spawned processes, which meet through a
    TCPStore on 127.0.0.1:port. Waits at most deadline_s (failing the test past it), and
    kills whatever is still running when it returns or raises."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    ctx = mp.start_processes(worker, args=(store.port, *args), nprocs=world, join=False,
                             start_method="spawn")
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
