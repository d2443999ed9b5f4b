"""memlean's main job: every table of the source documents, measured here, beside the
source's figures. Writes DIR/summary.md, one CSV per table and the plots. Tells on stderr
which experiment runs ("[3/6] memory_tips ..."), and for the long ones a line per
configuration measured and, after the first, how long the rest will take.

    ./bazelw run //experiments:reproduce [-- --out=DIR] [--quick] [--only NAME ...]
                                         [--device=auto|cpu|cuda]
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
    "fit_frontier",
]


def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--only", choices=EXPERIMENTS, action="append", help="run only these")
    args = common.parse_args(p, argv)
    tables = []
    names = args.only or EXPERIMENTS
    print(f"reproduce: {len(names)} experiments on {args.device}", file=sys.stderr, flush=True)
    for i, name in enumerate(names, 1):
        t0 = time.perf_counter()
        print(f"[{i}/{len(names)}] {name} ...", file=sys.stderr, flush=True)
        new = importlib.import_module("experiments." + name).run(args)
        common.emit(new, args.out)
        tables += new
        print(f"[{i}/{len(names)}] {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr,
              flush=True)
    common.write_summary(tables, args.out)
    return tables


if __name__ == "__main__":
    main()
