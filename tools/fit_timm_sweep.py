"""memlean.fit across timm architectures: for each model, the least peak (a FitError of a
1-byte budget), then fit at that least and halfway to the eager peak, each fitted step
measured again apart from fit (fit_test.step_peak: memstats, exact on the CPU). A row per
model: the least against eager's peak, and per budget whether it was kept, whether the
measured peak equals the plan's, and the prediction's error ((predicted - measured) /
measured). Not a test (minutes, and the models are timm's to change): a probe for models no
test covers.

    PYTHONPATH=<built package>:testing:ops/fit/tests \\
        python3 tools/fit_timm_sweep.py --models resnet18,hrnet_w18_small --size 128 --batch 8

--runs fits with runs=True; --channels-last puts the model and batch in channels_last;
--autocast bf16 runs every step (fit's and the measured ones) in a CPU bfloat16 autocast region;
--compile fits with compile=True and measures the fitted model compiled (inductor,
dynamic=False), as it will train (minutes per model).

A model that cannot train at the size itself (its own forward or backward fails) is listed as
skipped; a fit that fails or breaks its budget as FAIL. Exit status 1 if any FAIL."""
import argparse
import contextlib
import sys
import time
import warnings

import torch
import torch.nn as nn


def sweep_one(name, size, batch, runs=False, channels_last=False, autocast=None,
              compile=False):
    import timm

    import memlean
    from fit_test import step_peak

    def region():
        return (torch.autocast("cpu", dtype=autocast) if autocast is not None
                else contextlib.nullcontext())

    torch.manual_seed(0)
    try:
        try:
            model = timm.create_model(name, num_classes=10, img_size=size)
        except TypeError:  # (no img_size: a CNN)
            model = timm.create_model(name, num_classes=10)
        model.train()
        x = torch.randn(batch, 3, size, size)
        y = torch.randint(0, 10, (batch,))
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
            x = x.contiguous(memory_format=torch.channels_last)
        with region():
            nn.functional.cross_entropy(model(x), y).backward()
        model.zero_grad(set_to_none=True)
    except Exception as e:  # the model itself at this size
        return f"{name}: skipped ({type(e).__name__}: {str(e)[:100]})", True

    def loss_fn(out):
        return nn.functional.cross_entropy(out.float(), y)

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    started = time.perf_counter()
    def fit(budget):
        with region():
            return memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt, runs=runs,
                               compile=compile)

    try:
        fit(1)
        return f"{name}: FAIL (no FitError for a 1-byte budget)", False
    except memlean.FitError as e:
        least = e.least_peak_bytes
    unfitted = fit(2**50)
    # (compiled, the step as it is peaks where fit(compile=True) measures it, not at the eager
    # step's peak, which may be below the least: ViT-Ti at 64² compiled 71,901,600 bytes,
    # 71,016,736 eager)
    eager = unfitted.peak_bytes if compile else unfitted.eager_peak_bytes
    cells, ok = [], True
    for budget in (least, max(least, (least + eager) // 2)):
        plan = fit(budget)
        stepped = torch.compile(model, dynamic=False) if compile else model
        for _ in range(2 if compile or not opt.state else 1):  # (compiled: the first compiles)
            with region():  # (each step in a region of its own: autocast's cast cache)
                measured = step_peak(stepped, (x,), loss_fn, opt)
        if compile:
            torch._dynamo.reset()
        plan.undo()
        kept = measured <= budget and measured == plan.peak_bytes
        if not kept:
            print(f"  {name} budget {budget:,}: measured {measured:,}, fit's {plan.peak_bytes:,}")
        ok &= kept
        error = (plan.predicted_peak_bytes - measured) / measured
        cells.append(f"{'kept' if kept else 'FAIL'} {error:+.4f}")
    return (f"{name}: least {least:,} ({least / eager:.3f} of eager {eager:,}); at the least "
            f"{cells[0]}, halfway {cells[1]}; {time.perf_counter() - started:.1f} s"), ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", required=True, help="comma-separated timm model names")
    parser.add_argument("--size", type=int, default=64, help="image side (default 64)")
    parser.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", action="store_true", help="fit with runs=True")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--autocast", choices=["bf16"], help="a CPU bfloat16 autocast region")
    parser.add_argument("--compile", action="store_true", help="fit(compile=True), measured compiled")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    failed = 0
    for name in args.models.split(","):
        try:
            line, ok = sweep_one(name.strip(), args.size, args.batch, args.runs,
                                 args.channels_last,
                                 torch.bfloat16 if args.autocast == "bf16" else None,
                                 args.compile)
        except Exception as e:
            line, ok = f"{name}: FAIL ({type(e).__name__}: {str(e)[:300]})", False
        failed += not ok
        print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
