"""Where fit's predicted peak and its measured one part, checkpoint by checkpoint: for one timm
model, fit's recorded problem (the step it plans on, after the Swish swap), the planner's
least-peak plan predicted and measured, then each of that plan's checkpoints alone, predicted
and measured, largest difference first. Not a test: a probe for the predictions that lie
above the measured peaks on CUDA (docs/fit.md, "On an H200, 2026-11-29"), which needs a GPU
to run where it matters; it runs on the CPU too (where they agree).

    PYTHONPATH=<built package>:testing:ops/fit/tests python3 tools/fit_prediction_probe.py \\
        --model ghostnet_100 --size 128 --batch 32 --runs --channels-last --autocast bf16 \\
        --device cuda
"""
import argparse
import contextlib
import sys
import warnings

import torch
import torch.nn as nn


class _Done(Exception):
    pass


def probe(name, size, batch, device, runs, channels_last, autocast, top):
    import timm

    import memlean
    from memlean import _C, fitting

    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=10).train()
    x = torch.randn(batch, 3, size, size)
    y = torch.randint(0, 10, (batch,))
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    model, x, y = model.to(device), x.to(device), y.to(device)

    def region():
        return (torch.autocast(device, dtype=autocast) if autocast is not None
                else contextlib.nullcontext())

    def loss_fn(out):
        return nn.functional.cross_entropy(out.float(), y)

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    lines = []

    def spy(self, problem, empty_peak, seen=None):
        paths = fitting._paths(model)

        def named(j):
            module = problem.calls[j].module
            if isinstance(module, fitting._Nest):
                module = module.outer
            return (module.path(paths) if isinstance(module, fitting._Run)
                    else paths.get(id(module), "?"))

        def pair(chosen):
            predicted = _C.fit.predicted_peak(problem.base, problem.atoms, problem.candidates,
                                              list(chosen), **problem.options)
            measured = fitting._measure_plan(self.step, problem.calls, list(chosen),
                                             self.compile_options, self.untraced)
            return predicted, measured

        least = _C.fit.least_peak_plan(problem.base, problem.atoms, problem.candidates,
                                       **problem.options)[1]
        predicted, measured = pair(least)
        lines.append(f"{name}: the least-peak plan, {len(least)} checkpoints: predicted "
                     f"{predicted:,}, measured {measured:,} ({(predicted - measured) / measured:+.4f})")
        rows = []
        for j in least:
            predicted, measured = pair([j])
            rows.append((predicted - measured, named(j), predicted, measured))
        rows.sort(key=lambda r: -abs(r[0]))
        for diff, path, predicted, measured in rows[:top]:
            lines.append(f"  {path}: alone predicted {predicted:,}, measured {measured:,} "
                         f"({diff:+,})")
        raise _Done

    real = fitting._Fitting.search
    fitting._Fitting.search = spy
    try:
        with region():
            memlean.fit(model, x, 1, loss_fn=loss_fn, optimizer=opt, runs=runs)
    except _Done:
        pass
    finally:
        fitting._Fitting.search = real
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a timm model name")
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--runs", action="store_true", help="fit with runs=True")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--autocast", choices=["bf16"], help="a bfloat16 autocast region")
    parser.add_argument("--top", type=int, default=12, help="checkpoints listed (default 12)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    for line in probe(args.model, args.size, args.batch, args.device, args.runs,
                      args.channels_last, torch.bfloat16 if args.autocast else None, args.top):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
