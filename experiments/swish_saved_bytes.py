"""Bytes saved for backward per element by each Swish variant, float32, measured with
autograd's saved_tensors_hooks (the Swish blog post, docs/sources.md, states what each
version keeps).

    ./bazelw run //experiments:swish_saved_bytes [-- --device=auto|cpu|cuda]
"""
import torch

import memlean
import memlean.memstats as memstats
from experiments import common

VARIANTS = {
    "naive x*sigmoid(x)": (lambda t: t * torch.sigmoid(t), "x and sigmoid(x) (autograd)"),
    "memlean memory_efficient": (memlean.swish, "x only (the Swish post's custom op)"),
    "memlean inplace": (memlean.swish_, "not described in the source"),
}


def saved(fn, x):
    """(count, bytes) of the distinct storages saved while fn(x) runs, its output excluded
    (the output is alive anyway: the next layer holds it)."""
    with memstats.saved_storages() as saved:
        y = fn(x)
    kept = saved.without(y)
    return len(kept), kept.nbytes


def run(args):
    n = 1 << (16 if args.quick else 22)
    leaf = torch.randn(n, device=args.device, requires_grad=True)
    rows = []
    for name, (fn, source) in VARIANTS.items():
        count, nbytes = saved(fn, leaf * 1)
        rows.append({"variant": name, "tensors kept": count,
                     "bytes kept per element": nbytes / n, "source": source})
    note = (f"Measured on a float32 tensor of {n} elements; the in-place variant's input is its "
            "output, so it keeps only its 1-bit mask beyond it."
            + common.device_note(args.device, tracked=False))
    return [common.Table("swish_saved_bytes", "Swish: bytes kept for backward per element (float32)",
                         rows, note)]


def main(argv=None):
    return common.main_for(run, __doc__, argv)


if __name__ == "__main__":
    main()
