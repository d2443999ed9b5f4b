"""memlean's main job: every table of the source documents, measured here, beside the
source's figures. Writes DIR/summary.md, one CSV per table and the plots.

    ./bazelw run //experiments:reproduce [-- --out=DIR] [--quick] [--only NAME ...]
"""
import importlib
import sys
import time

from experiments import common

EXPERIMENTS = [
    "swish_saved_bytes",
    "swish_phases",
    "swish_peak_vs_batch",
    "memory_tips",
    "efficientnet_swish",
    "checkpoint_densenet",
]


def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--only", choices=EXPERIMENTS, action="append", help="run only these")
    args = p.parse_args(argv)
    tables = []
    for name in args.only or EXPERIMENTS:
        t0 = time.perf_counter()
        print(f"== {name}", file=sys.stderr, flush=True)
        new = importlib.import_module("experiments." + name).run(args)
        common.emit(new, args.out)
        tables += new
        print(f"== {name}: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    common.write_summary(tables, args.out)
    return tables


if __name__ == "__main__":
    main()
