"""memlean.fit's frontier (issue 23): per model, the training step's peak and time side by side
in one process for: eager as shipped; timm's set_grad_checkpointing() (or every block under
torch.utils.checkpoint for the GPT stack, which timm does not build); torch.compile (inductor)
with torch._functorch.config.activation_memory_budget in {1.0, 0.5, 0.2, 0.0}; and memlean.fit
at budgets from its least peak to the eager peak and at half of per-block checkpointing's
peak where it reaches that (the issue's reach target is read there; and, at its least budget,
the fitted model compiled); and memlean.fit(compile=True), every plan measured compiled, at the peak
torch.compile reaches with activation_memory_budget 0.5, then compiled. With --runs, also
memlean.fit(runs=True) (runs of sibling module calls as candidates, eager only) from its own
least peak to the eager peak. A table and a Pareto figure (peak vs step time, one line per
method). With --autocast bf16 (or fp16), every step runs in an autocast region of its own
(forward, loss, backward and optimizer step: the step memlean.fit measures when called inside
one, which bounds a loop that leaves the region before backward, as PyTorch's docs advise,
from above) and every fit is called inside one.

Peak: the budget's definition (memlean/fitting.py), the unique storages of parameters,
buffers, optimizer state and batch plus the most a step allocates above them, exact on the
CPU (memlean.memstats). Time: the median of a few steps after a warm-up step; with --paired,
each row's steps are followed by eager's (the model as shipped, kept from the first row), and
"vs eager time (paired)" divides by that: this machine's speed drifts 10-20 % between
minutes, and a ratio of neighbouring measurements is what drifts least. Every
torch.compile here is dynamic=False (one batch shape): a fitted model's checkpoints break the
graph inside its stages, so dynamo compiles a stage's forward once per stage, with other
channel counts, and then marks that dimension dynamic, on which inductor fails for
convnext_tiny at batch 8 ('cannot determine truth value of Relational', torch 2.14.1).

    ./bazelw run //experiments:fit_frontier [-- --quick] [--out=DIR] [--device=auto|cpu|cuda]
        [--models efficientnet_b0,gpt] [--budgets 8] [--no-compile] [--runs] [--paired]
        [--autocast bf16|fp16]
"""
import contextlib
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import memlean
from experiments import common

COMPILE_BUDGETS = (1.0, 0.5, 0.2, 0.0)
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
_autocast = None  # the --autocast dtype of this run (run() sets it), or None


def region(device):
    """The autocast region each step and each fit run in (--autocast), or none."""
    if _autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_autocast)

# ---- the GPT-style stack (pre-norm blocks, SwiGLU MLPs, in a ModuleList) ------------------


class SwiGLU(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(d, hidden), nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.mlp = nn.LayerNorm(d), SwiGLU(d, 8 * d // 3)

    def forward(self, x, attn_mask=None):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=attn_mask)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=1024, d=256, layers=6, heads=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.grad_checkpointing = False

    def set_grad_checkpointing(self, enable=True):
        self.grad_checkpointing = enable

    def forward(self, idx):
        t = idx.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
        h = self.emb(idx)
        for b in self.blocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                h = torch.utils.checkpoint.checkpoint(b, h, attn_mask=mask, use_reentrant=False)
            else:
                h = b(h, attn_mask=mask)
        return self.head(self.ln(h))


# ---- models and batches --------------------------------------------------------------------

TIMM = ("efficientnet_b0", "resnet50", "mobilenetv3_large_100", "convnext_tiny",
        "vit_small_patch16_224")
ALL = TIMM + ("gpt",)
# (batch, image size or sequence length): the setting for the first two; the others
# at sizes that keep the full run within 30 minutes on 2 CPU cores.
FULL = {"efficientnet_b0": (32, 224), "resnet50": (32, 224), "mobilenetv3_large_100": (32, 224),
        "convnext_tiny": (8, 224), "vit_small_patch16_224": (8, 224), "gpt": (8, 256)}
QUICK = {"efficientnet_b0": (4, 64), "gpt": (4, 64), "resnet50": (2, 64),
         "mobilenetv3_large_100": (4, 64), "convnext_tiny": (2, 64),
         "vit_small_patch16_224": (2, 224)}


def setup(name, batch, size, device, seed=0):
    """(model, inputs, loss_fn, optimizer): a fresh model (same seed each time), its batch."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    if name == "gpt":
        model = GPT()
        idx = torch.randint(0, 1024, (batch, size + 1), generator=g)
        x, y = idx[:, :-1].contiguous().to(device), idx[:, 1:].contiguous().to(device)

        def loss_fn(out):
            return F.cross_entropy(out.flatten(0, 1), y.flatten())
    else:
        import timm

        kwargs = {"img_size": size} if name.startswith("vit") else {}
        model = timm.create_model(name, pretrained=False, num_classes=1000, **kwargs)
        x = torch.randn(batch, 3, size, size, generator=g).to(device)
        y = torch.randint(0, 1000, (batch,), generator=g).to(device)

        def loss_fn(out):
            return F.cross_entropy(out, y)
    model = model.to(device).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    return model, (x,), loss_fn, opt


def storages(tensors):
    """{storage key: bytes}: each storage once, however many tensors view it."""
    return {memlean.memstats.storage_key(t): t.untyped_storage().nbytes() for t in tensors}


def make_step(model, inputs, loss_fn, opt):
    device = next(model.parameters()).device

    def step():
        with region(device):
            out = model(*inputs)
            loss = loss_fn(out)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return step


def measure(model, inputs, loss_fn, opt, device, repeats):
    """(peak bytes, Seconds) of a training step after a warm-up step."""
    step = make_step(model, inputs, loss_fn, opt)
    step()
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    fixed = sum(storages([t for t in list(model.parameters()) + list(model.buffers()) + state
                          + list(inputs) if t.device == device]).values())
    peak, _ = common.peak_of(step, device)
    return fixed + peak, common.median_seconds(step, repeats, 0, device)


def run_model(name, batch, size, device, repeats, budgets, compile_, progress, runs=False,
              paired=False):
    rows = []
    eager_step = None  # with paired: eager's step, timed after each row's

    def row(method, setting, peak, seconds, eager=None, **extra):
        cells = {}
        if eager_step is not None:
            eager_now = common.median_seconds(eager_step, repeats, 1, device)
            cells = {"eager s (paired)": float(eager_now),
                     "vs eager time (paired)": round(float(seconds) / float(eager_now), 3)}
        rows.append({"model": name, "batch": batch, "size": size, "method": method,
                     "setting": setting, "step peak MiB": common.mib(peak), "peak bytes": peak,
                     **common.time_cells(seconds, device), **cells, **extra})
        progress.step(f"{name} {method} {setting}")

    model, inputs, loss_fn, opt = setup(name, batch, size, device)
    # Twice: the first steps of a process (of a model's sizes) run cold (allocator, caches);
    # at full size they measured 18 % slower than the same eager step later.
    measure(model, inputs, loss_fn, opt, device, repeats)
    eager_peak, eager_s = measure(model, inputs, loss_fn, opt, device, repeats)
    if paired:
        eager_step = make_step(model, inputs, loss_fn, opt)
    row("eager", "as shipped", eager_peak, eager_s)

    model, inputs, loss_fn, opt = setup(name, batch, size, device)
    model.set_grad_checkpointing(True)
    peak, s = measure(model, inputs, loss_fn, opt, device, repeats)
    row("per-block checkpoint", "timm set_grad_checkpointing()" if name != "gpt"
        else "torch.utils.checkpoint per block", peak, s)

    # The reach target is read at half of per-block checkpointing's peak: a budget there
    # too, where fit reaches it (else its progress step is skipped).
    for with_runs in (False, True) if runs else (False,):
        got = fit_rows(name, batch, size, device, repeats, budgets, eager_peak, row,
                       runs=with_runs, half=peak // 2)
        if not with_runs:
            least, probe_s = got[:2]
        if not got[2]:
            progress.step(f"{name} memlean.fit{'(runs=True)' if with_runs else ''} at half of "
                          f"per-block checkpointing's peak: below its least, skipped")
    if compile_:
        compile_peaks = {}
        for b in COMPILE_BUDGETS:
            torch._dynamo.reset()
            model, inputs, loss_fn, opt = setup(name, batch, size, device)
            with torch._functorch.config.patch(activation_memory_budget=b):
                compiled = torch.compile(model, dynamic=False)
                peak, s = measure(compiled, inputs, loss_fn, opt, device, repeats)
            compile_peaks[b] = peak
            row("torch.compile", f"activation_memory_budget {b}", peak, s)
        torch._dynamo.reset()
        model, inputs, loss_fn, opt = setup(name, batch, size, device)
        with region(device):
            memlean.fit(model, inputs, least, loss_fn=loss_fn, optimizer=opt)
        peak, s = measure(torch.compile(model, dynamic=False), inputs, loss_fn, opt, device,
                          repeats)
        row("memlean.fit + torch.compile", f"budget {common.mib(least):.1f} MiB", peak, s,
            budget_bytes=least)
        fit_for_compile(name, batch, size, device, repeats, compile_peaks[0.5], row)
    return rows, least, probe_s


def fit_rows(name, batch, size, device, repeats, budgets, eager_peak, row, runs=False,
             half=None):
    """memlean.fit (runs=True: with runs of sibling calls) at `budgets` budgets from its least
    peak to the eager peak, and at `half` where given and not below the least, a row each;
    returns (least peak, seconds the probe took, whether `half` was fitted)."""
    model, inputs, loss_fn, opt = setup(name, batch, size, device)
    t0 = time.perf_counter()
    try:
        with region(device):
            memlean.fit(model, inputs, 1, loss_fn=loss_fn, optimizer=opt, runs=runs)
        raise AssertionError("a 1-byte budget fit")
    except memlean.FitError as e:
        least = e.least_peak_bytes
    probe_s = time.perf_counter() - t0
    spread = [eager_peak - (eager_peak - least) * i // (budgets - 1) for i in range(budgets)]
    at_half = half is not None and least <= half <= eager_peak
    for budget in sorted(spread + [half] * at_half, reverse=True):
        model, inputs, loss_fn, opt = setup(name, batch, size, device)
        t0 = time.perf_counter()
        with region(device):
            plan = memlean.fit(model, inputs, budget, loss_fn=loss_fn, optimizer=opt, runs=runs)
        fit_s = time.perf_counter() - t0
        peak, s = measure(model, inputs, loss_fn, opt, device, repeats)
        marked = " (half of per-block's peak)" if at_half and budget == half else ""
        row("memlean.fit(runs=True)" if runs else "memlean.fit",
            f"budget {common.mib(budget):.1f} MiB{marked}", peak, s, budget_bytes=budget,
            predicted_bytes=plan.predicted_peak_bytes, fit_s=round(fit_s, 2),
            actions=len(plan.actions))
    return least, probe_s, at_half


def fit_for_compile(name, batch, size, device, repeats, budget, row):
    """memlean.fit(compile=True) at `budget` (torch.compile's peak at activation_memory_budget
    0.5), then the step compiled: every plan fit tries is measured compiled. Below what it
    reaches, it fits at the least compiled peak it names."""
    torch._dynamo.reset()
    model, inputs, loss_fn, opt = setup(name, batch, size, device)
    setting = f"budget {common.mib(budget):.1f} MiB (compile 0.5's peak)"
    t0 = time.perf_counter()
    try:
        with region(device):
            plan = memlean.fit(model, inputs, budget, loss_fn=loss_fn, optimizer=opt,
                               compile=True)
    except memlean.FitError as e:
        budget = e.least_peak_bytes
        setting = f"below its least: at that, {common.mib(budget):.1f} MiB"
        with region(device):
            plan = memlean.fit(model, inputs, budget, loss_fn=loss_fn, optimizer=opt,
                               compile=True)
    fit_s = time.perf_counter() - t0
    torch._dynamo.reset()
    peak, s = measure(torch.compile(model, dynamic=False), inputs, loss_fn, opt, device, repeats)
    row("memlean.fit(compile=True) + torch.compile", setting, peak, s, budget_bytes=budget,
        predicted_bytes=plan.predicted_peak_bytes, fit_s=round(fit_s, 2),
        actions=len(plan.actions))


def run(args):
    global _autocast
    device = args.device
    _autocast = AUTOCAST.get(getattr(args, "autocast", None))
    quick = args.quick
    names = getattr(args, "models", None) or (("efficientnet_b0", "gpt") if quick else ALL)
    sizes = QUICK if quick else FULL
    budgets = getattr(args, "budgets", None) or (4 if quick else 8)
    compile_ = not getattr(args, "no_compile", False) and not quick
    repeats = 1 if quick else 3
    runs = getattr(args, "runs", False)
    paired = getattr(args, "paired", False)
    per_model = 2 + (budgets + 1) * (2 if runs else 1) + (len(COMPILE_BUDGETS) + 2
                                                           if compile_ else 0)
    progress = common.Progress("fit_frontier",
                               [sizes[n][0] * sizes[n][1] for n in names for _ in range(per_model)])
    rows, notes = [], []
    for name in names:
        batch, size = sizes[name]
        got, least, probe_s = run_model(name, batch, size, device, repeats, budgets, compile_,
                                        progress, runs, paired)
        eager = got[0]
        for r in got:
            r["vs eager peak"] = round(r["peak bytes"] / eager["peak bytes"], 3)
            key = "s/step" if "s/step" in r else "ms/step"
            r["vs eager time"] = round(r[key] / eager[key], 3)
        rows += got
        notes.append(f"{name}: least fit peak {common.mib(least):.1f} MiB (probe {probe_s:.1f} s)")
    in_region = (f" Every step ran in a {_autocast} autocast region of its own, every fit "
                 f"inside one." if _autocast is not None else "")
    note = ("Exact CPU bytes (parameters, buffers, optimizer state and batch, plus the most a "
            "step allocates above them); time the median of "
            f"{repeats} step(s) after a warm-up step, all methods in one process. Budgets for "
            "memlean.fit are spread evenly from its least peak to the eager peak, and one at "
            "half of per-block checkpointing's peak where fit reaches it. "
            + "; ".join(notes) + "." + in_region + common.device_note(device, timed=True))
    plot = figure(rows, os.path.join(args.out, "fit_frontier.png"), device)
    return [common.Table("fit_frontier", "memlean.fit: peak and step time beside eager, "
                         "per-block checkpointing and torch.compile", rows, note,
                         [plot] if plot else [])]


def figure(rows, path, device):
    """The Pareto figure: step peak against step time (against the paired ratio to eager's
    time when the rows have it), one colour per method, one line style per model."""
    paired = all("vs eager time (paired)" in r for r in rows)
    x = ("vs eager time (paired)" if paired else "s/step" if device.type != "cuda"
         else "ms/step")
    panel = {}
    for r in rows:
        xs, ys = panel.setdefault((r["method"], r["model"]), ([], []))
        xs.append(float(r[x]))
        ys.append(float(r["step peak MiB"]))
    return common.plot(path, "Training-step peak vs step time, by method",
                       [(x, "step peak MiB", {k: (v[0], v[1]) for k, v in panel.items()})])


def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--models", type=lambda s: s.split(","), default=None,
                   help=f"comma-separated, of {','.join(ALL)}")
    p.add_argument("--budgets", type=int, default=None, help="memlean.fit budgets per model")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    p.add_argument("--runs", action="store_true",
                   help="also memlean.fit(runs=True) at --budgets budgets (eager only)")
    p.add_argument("--paired", action="store_true",
                   help="time eager again after each row; adds 'vs eager time (paired)'")
    p.add_argument("--autocast", choices=sorted(AUTOCAST), default=None,
                   help="each step (forward, loss, backward, optimizer step) and every fit in "
                        "an autocast region of this dtype")
    args = common.parse_args(p, argv)
    if args.models:
        unknown = [m for m in args.models if m not in ALL]
        if unknown:
            p.error(f"--models: unknown {unknown}; choose from {','.join(ALL)}")
    if args.budgets is not None and args.budgets < 2:
        p.error("--budgets: at least 2")
    tables = run(args)
    common.emit(tables, args.out)
    common.write_summary(tables, args.out, "summary_fit_frontier.md")
    return tables


if __name__ == "__main__":
    main()
