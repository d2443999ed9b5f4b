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
--autocast bf16 runs every step (fit's and the measured ones) in a bfloat16 autocast region;
--compile fits with compile=True and measures the fitted model compiled (inductor,
dynamic=False), as it will train (minutes per model). --budgets N fits at N budgets from the
least to the eager peak (default 2: the least and halfway). --grad-checkpointing turns on
timm's own set_grad_checkpointing() first (torch.utils.checkpoint regions fit plans around).

--device cuda runs on the GPU (autocast on CUDA) and measures each fitted step with torch's
own counters (fit_test.cuda_step: `torch.cuda.max_memory_allocated()` above what the process
keeps, as FitCudaTest does), which then must be at or under the budget and within
max(2 %, 1 MiB) of fit's measured peak; each cell adds torch's figure less fit's, and the row
the fitted step's time against the unfitted one's (CUDA events, median of 5).

A model that cannot train at the size itself (its own forward or backward fails) is listed as
skipped; a fit that fails or breaks its budget as FAIL. Exit status 1 if any FAIL. fit's own
RuntimeWarnings (a step it worked around: slicing or the in-place swap given up) end the row
as WARNED, with the first one's first line."""
import argparse
import contextlib
import copy
import sys
import time
import warnings

import torch
import torch.nn as nn


def cuda_step_time(model, x, loss_fn, opt, region, steps=5):
    """The median of `steps` training steps' times on CUDA, in seconds (CUDA events)."""
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with region():
            loss_fn(model(x)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


def sweep_one(name, size, batch, runs=False, channels_last=False, autocast=None,
              compile=False, device="cpu", budgets=2, grad_checkpointing=False):
    import timm

    import memlean
    from fit_test import cuda_process_bytes, cuda_step, step_peak

    cuda = device == "cuda"
    if budgets < 2:
        raise ValueError(f"--budgets must be 2 or more, not {budgets}")
    if cuda and compile:
        raise ValueError("--compile is measured on the CPU only")

    def region():
        return (torch.autocast(device, dtype=autocast) if autocast is not None
                else contextlib.nullcontext())

    torch.manual_seed(0)
    try:
        try:
            model = timm.create_model(name, num_classes=10, img_size=size)
        except TypeError:  # (no img_size: a CNN)
            model = timm.create_model(name, num_classes=10)
        model.train()
        if grad_checkpointing:
            model.set_grad_checkpointing(True)
        x = torch.randn(batch, 3, size, size)
        y = torch.randint(0, 10, (batch,))
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
            x = x.contiguous(memory_format=torch.channels_last)
        if cuda:
            # What the process keeps on the device once such steps ran (cuBLAS's
            # workspaces), made by a twin before the model is there (its loss reads no
            # labels: nothing of it stays), and the labels, which the loss reads and fit does
            # not count (fit counts what it is given: a loss's labels are the caller's, 512
            # bytes at batch 32: docs/fit.md): torch's counts less these are the step's.
            def make():
                twin = copy.deepcopy(model).to(device)
                return (twin, x.to(device), lambda out: out.float().square().mean(),
                        torch.optim.SGD(twin.parameters(), lr=0.01, momentum=0.9))
            cuda_process_bytes(make, region)
            y = y.to(device)
            base = torch.cuda.memory_allocated()
            model, x = model.to(device), x.to(device)
        with region():
            nn.functional.cross_entropy(model(x), y).backward()
        model.zero_grad(set_to_none=True)
    except Exception as e:  # the model itself at this size
        return f"{name}: skipped ({type(e).__name__}: {str(e)[:100]})", True

    def loss_fn(out):
        return nn.functional.cross_entropy(out.float(), y)

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if cuda:
        unfitted_time = cuda_step_time(model, x, loss_fn, opt, region)
    started = time.perf_counter()
    warned = []  # fit's RuntimeWarnings (a step that failed and was worked around)

    def fit(budget):
        with region(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                return memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt,
                                   runs=runs, compile=compile)
            finally:
                warned.extend(str(w.message).split("\n")[0][:200] for w in caught
                              if issubclass(w.category, RuntimeWarning)
                              and str(w.message).startswith("memlean"))

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
    # Two: the least and halfway; more: from the eager peak down to the least, where the
    # measured peak must never rise as the budget falls.
    points = ((least, max(least, (least + eager) // 2)) if budgets == 2 else
              [eager - (eager - least) * i // (budgets - 1) for i in range(budgets)])
    cells, ok, previous = [], True, None
    for budget in points:
        plan = fit(budget)
        if budgets > 2 and previous is not None and plan.peak_bytes > previous:
            print(f"  {name} budget {budget:,}: the peak rose as the budget fell")
            ok = False
        previous = plan.peak_bytes
        if cuda:
            cuda_step(model, x, loss_fn, opt, region)  # (the momentum buffers, once)
            before, peak = cuda_step(model, x, loss_fn, opt, region)
            measured = peak - base
            kept = (measured <= budget and before - base == plan.fixed_bytes
                    and abs(measured - plan.peak_bytes) <= max(plan.peak_bytes // 50, 1 << 20))
            fitted_time = cuda_step_time(model, x, loss_fn, opt, region)
        else:
            stepped = torch.compile(model, dynamic=False) if compile else model
            for _ in range(2 if compile or not opt.state else 1):  # (compiled: the first compiles)
                with region():  # (each step in a region of its own: autocast's cast cache)
                    measured = step_peak(stepped, (x,), loss_fn, opt)
            if compile:
                torch._dynamo.reset()
            kept = measured <= budget and measured == plan.peak_bytes
        plan.undo()
        if not kept:
            print(f"  {name} budget {budget:,}: measured {measured:,}, fit's {plan.peak_bytes:,}"
                  + (f", resident {before - base:,} against fit's {plan.fixed_bytes:,}"
                     if cuda else ""))
        ok &= kept
        error = (plan.predicted_peak_bytes - measured) / measured
        cell = f"{budget:,}: {'kept' if kept else 'FAIL'} {error:+.4f}"
        if cuda:
            cell += (f" torch-fit {measured - plan.peak_bytes:+,} "
                     f"step {fitted_time / unfitted_time:.2f}x")
        cells.append(cell)
    timing = f"; eager step {unfitted_time * 1e3:.1f} ms" if cuda else ""
    notes = (f"; WARNED {len(warned)}x: {warned[0]}" if warned else "")
    return (f"{name}: least {least:,} ({least / eager:.3f} of eager {eager:,}); budgets "
            f"{'; '.join(cells)}; {time.perf_counter() - started:.1f} s{timing}{notes}"), ok


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", required=True, help="comma-separated timm model names")
    parser.add_argument("--size", type=int, default=64, help="image side (default 64)")
    parser.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", action="store_true", help="fit with runs=True")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--autocast", choices=["bf16"], help="a bfloat16 autocast region")
    parser.add_argument("--compile", action="store_true", help="fit(compile=True), measured compiled")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--budgets", type=int, default=2,
                        help="budgets from the least to the eager peak (default 2)")
    parser.add_argument("--grad-checkpointing", action="store_true",
                        help="timm's set_grad_checkpointing() before fit")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    failed = 0
    for name in args.models.split(","):
        try:
            line, ok = sweep_one(name.strip(), args.size, args.batch, args.runs,
                                 args.channels_last,
                                 torch.bfloat16 if args.autocast == "bf16" else None,
                                 args.compile, args.device, args.budgets,
                                 args.grad_checkpointing)
        except Exception as e:
            line, ok = f"{name}: FAIL ({type(e).__name__}: {str(e)[:300]})", False
        failed += not ok
        print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
