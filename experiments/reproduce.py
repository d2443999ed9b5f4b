"""memlean's main job: reproduce the tables of the source documents, measured here.

    ./bazelw run //experiments:reproduce [-- --out=DIR] [--quick]

Prints each table (the source's figures beside the measured ones) and writes a markdown
summary and one CSV per table to DIR (default: results/ in the workspace).
"""
import argparse
import csv
import os
import sys

import torch

import memlean


def saved_bytes(fn, x):
    """Bytes of the distinct storages autograd saves for backward while fn(x) runs."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)
    return len(storages), sum(storages.values())


def swish_saved_for_backward(quick):
    """Bytes saved for backward per element, float32: naive x*sigmoid(x) vs memlean."""
    n = 1 << (16 if quick else 22)
    x = torch.randn(n, requires_grad=True)
    rows = []
    for name, fn, source in [
        ("naive x*sigmoid(x)", lambda t: t * torch.sigmoid(t), "x and sigmoid(x) (autograd)"),
        ("memlean.swish", memlean.swish, "x only (seed 000's custom op)"),
    ]:
        count, nbytes = saved_bytes(fn, x)
        rows.append({
            "variant": name,
            "tensors saved": count,
            "bytes saved per element": nbytes / n,
            "source": source,
        })
    note = ("Measured with autograd's saved_tensors_hooks on a float32 tensor of %d elements; "
            "the source (seed 000) states what each version keeps but gives no per-element "
            "figure." % n)
    return "Swish: bytes saved for backward per element (float32)", rows, note


EXPERIMENTS = {
    "swish_saved_for_backward": swish_saved_for_backward,
}


def markdown_table(rows):
    cols = list(rows[0])
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(f"{r[c]:g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    default_out = os.path.join(os.environ.get("BUILD_WORKSPACE_DIRECTORY", os.getcwd()), "results")
    p.add_argument("--out", default=default_out, help="output folder (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="small sizes (what CI runs)")
    p.add_argument("--only", choices=sorted(EXPERIMENTS), action="append", help="run only these")
    args = p.parse_args(argv)

    os.makedirs(args.out, exist_ok=True)
    summary = ["# memlean: source tables reproduced", ""]
    for key in args.only or EXPERIMENTS:
        title, rows, note = EXPERIMENTS[key](args.quick)
        table = markdown_table(rows)
        print(f"\n## {title}\n\n{table}\n\n{note}\n")
        summary += [f"## {title}", "", table, "", note, ""]
        with open(os.path.join(args.out, key + ".csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write("\n".join(summary))
    print(f"wrote {args.out}/summary.md", file=sys.stderr)


if __name__ == "__main__":
    main()
