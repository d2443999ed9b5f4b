"""Swish implementations side by side, float32 on the CPU: forward+backward time and the
bytes autograd keeps for backward beyond the op's own output (which the next layer holds
anyway). Peers: torch's F.silu, the naive composition, timm's
SwishMe (its memory-efficient autograd.Function), and memlean's variants.

    ./bazelw run //experiments:swish_peers [-- --sizes 1048576 16777216 --repeats 7]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import memlean
import memlean.memstats as memstats


def peers():
    out = {
        "torch F.silu": lambda x: F.silu(x),
        "naive x*sigmoid(x)": lambda x: x * torch.sigmoid(x),
        "memlean memory_efficient": lambda x: memlean.swish(x),
        "memlean inplace": lambda x: memlean.swish_(x),
    }
    try:
        from timm.layers.activations_me import swish_me
        out["timm SwishMe"] = lambda x: swish_me(x)
    except ImportError:
        print("timm is not installed: its SwishMe is left out (./bazelw installs timm==1.0.29)")
    return out


def saved_bytes(fn, x):
    with memstats.saved_storages() as saved:
        y = fn(x)
    # The output is alive anyway (the next layer holds it): count what is kept beyond it.
    return saved.without(y).nbytes


def step_seconds(fn, leaf, grad, repeats):
    times = []
    for _ in range(repeats + 1):
        x = leaf.clone()  # a non-leaf input, as an activation is (in-place needs one)
        t0 = time.perf_counter()
        fn(x).backward(grad)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 24])
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, float32, forward+backward")
    print(f"{'elements':>10}  {'implementation':<26} {'ms':>9} {'vs F.silu':>10} {'kept bytes/elem':>16}")
    for n in args.sizes:
        leaf = (torch.randn(n) * 3).requires_grad_(True)
        grad = torch.randn(n)
        rows = []
        for name, fn in peers().items():
            ms = step_seconds(fn, leaf, grad, args.repeats) * 1e3
            rows.append((name, ms, saved_bytes(fn, leaf.clone()) / n))
        base = next(ms for name, ms, _ in rows if name == "torch F.silu")
        for name, ms, per in rows:
            print(f"{n:>10}  {name:<26} {ms:>9.2f} {base / ms:>9.2f}x {per:>16.3f}")


if __name__ == "__main__":
    main()
