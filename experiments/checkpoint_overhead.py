"""Per-call overhead of a checkpoint, side by side in one process: a chain of small Linear
layers, each its own segment, trained a step at a time (forward + backward) with no
checkpoint, memlean.checkpoint, torch.utils.checkpoint in both forms, and a minimal
autograd.Function checkpoint with none of the safety (the floor of that design). The overhead per
call is (step time - plain step time) / layers: with layers this small, it is what the
checkpoint itself costs (autograd Function, RNG state, argument checks, bookkeeping, the
nested backward), not the recompute.

    ./bazelw run //experiments:checkpoint_overhead [-- --layers 48 --repeats 50 --threads 1]
"""
import argparse

import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_checkpoint

import memlean
from experiments import common

class _Minimal(torch.autograd.Function):
    """The floor of a checkpoint built as a Python autograd.Function, for reference: saves
    the input, recomputes in backward and takes the gradients with torch.autograd.grad,
    and nothing else (no RNG or autocast state, no checks, no BatchNorm
    or buffer handling): what memlean.checkpoint would cost without its safety."""

    @staticmethod
    def forward(ctx, layer, h, *params):
        ctx.layer = layer
        ctx.save_for_backward(h, *params)
        return layer(h)

    @staticmethod
    def backward(ctx, grad):
        h, *params = ctx.saved_tensors
        detached = h.detach().requires_grad_(h.requires_grad)
        with torch.enable_grad():
            out = ctx.layer(detached)
        targets = [t for t in [detached, *params] if t.requires_grad]
        got = iter(torch.autograd.grad([out], targets, [grad], allow_unused=True))
        return (None, *[next(got) if t.requires_grad else None for t in [detached, *params]])


METHODS = {
    "plain call": lambda layer, h: layer(h),
    "memlean.checkpoint": lambda layer, h: memlean.checkpoint(layer, h),
    "torch non-reentrant": lambda layer, h: torch_checkpoint.checkpoint(layer, h,
                                                                       use_reentrant=False),
    "torch reentrant": lambda layer, h: torch_checkpoint.checkpoint(layer, h, use_reentrant=True),
    "minimal Function": lambda layer, h: _Minimal.apply(layer, h, *layer.parameters()),
}


def step_seconds(call, layers, x, repeats):
    """Median time of a forward + backward through `layers`, each run through `call`, after
    5 warm-up steps."""
    def step():
        h = x
        for layer in layers:
            h = call(layer, h)
        h.sum().backward()

    return common.median_seconds(step, repeats, warmup=5)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=48, help="segments in the chain (default: %(default)s)")
    p.add_argument("--width", type=int, default=16, help="features per layer (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=50, help="timed steps per method (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(args.width, args.width) for _ in range(args.layers))
    x = torch.randn(4, args.width, requires_grad=True)
    seconds = {name: step_seconds(call, layers, x, args.repeats) for name, call in METHODS.items()}
    plain = seconds["plain call"]
    reference = seconds["torch non-reentrant"] - plain
    print(f"{args.layers} Linear({args.width}, {args.width}) segments, batch 4, "
          f"{args.threads} thread(s), median of {args.repeats} steps (torch {torch.__version__})")
    print(f"{'method':22s} {'ms/step':>9s} {'us/call overhead':>17s} {'vs torch non-reentrant':>23s}")
    for name, s in seconds.items():
        over = (s - plain) / args.layers * 1e6
        ratio = "" if name == "plain call" else f"{(s - plain) / reference:.2f}x"
        print(f"{name:22s} {s * 1e3:9.3f} {over:17.1f} {ratio:>23s}")


if __name__ == "__main__":
    main()
