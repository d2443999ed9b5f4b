"""The claims around the Swish blog post (docs/sources.md) on EfficientNet-B0: the
training-step peak of timm's efficientnet_b0 with each of memlean's Swish variants as its
activation, beside timm's own SwishMe (memory-efficient autograd.Function) and torch's
nn.SiLU (timm's default), at several batch sizes; exact CPU bytes (or CUDA's allocated bytes:
then also in bf16 autocast and channels_last), the step time, and a PNG of both.

    ./bazelw run //experiments:efficientnet_swish [-- --quick] [--out=DIR] [--device=auto|cpu|cuda]
"""
import functools
import os

import torch
import torch.nn.functional as F

import memlean
from experiments import common

CLAIMS = ('"up to 30%" less (the issue the Swish blog post cites), "almost 20% less" at '
          "batch 512 (the Swish blog post, an MLP), 15-20% (timm's memory-efficient "
          "activations)")


def memlean_act(variant):
    """timm's act_layer for a memlean variant: timm calls act_layer(inplace=True), and an
    explicit variant wins over inplace=."""
    return functools.partial(memlean.Swish, variant=variant)


def activations():
    import timm.layers.activations_me as me  # timm is on local disk; ./bazelw installs it

    return {
        "naive": memlean_act("naive"),
        "memlean memory_efficient": memlean_act("memory_efficient"),
        "memlean inplace": memlean_act("inplace"),
        "timm SwishMe": me.SwishMe,
        "torch nn.SiLU (timm default)": torch.nn.SiLU,
    }


def make_model(act_layer, num_classes=1000):
    import timm

    return timm.create_model("efficientnet_b0", pretrained=False, act_layer=act_layer,
                             num_classes=num_classes)


# On CUDA, the settings EfficientNet-B0 is trained in: (precision, memory format).
CONFIGS = (("fp32", "contiguous"), ("fp32", "channels_last"),
           ("bf16 autocast", "contiguous"), ("bf16 autocast", "channels_last"))


def step(act_layer, batch, size, seed=0, device=common.CPU, config=CONFIGS[0]):
    """A closure running one training step of a fresh model on `device`, in `config`'s
    precision and memory format; model and data drawn on the CPU from the seed."""
    precision, memory_format = config
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = make_model(act_layer).train().to(device)
    x = torch.randn(batch, 3, size, size, generator=g).to(device)
    y = torch.randint(0, 1000, (batch,), generator=g).to(device)
    if memory_format == "channels_last":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    bf16 = precision.startswith("bf16")

    def run():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        del loss  # freed here, before the optimizer step, as a temporary would be
        opt.step()

    return run


def run(args):
    device = args.device
    cuda = device.type == "cuda"
    if args.quick:
        batches, size, repeats = [2, 4], 64, 1
    elif cuda:
        batches, size, repeats = [128, 256], 224, common.CUDA_MIN_STEPS
    else:
        batches, size, repeats = [8, 16, 32], 224, 3
    # The CPU table stays fp32 and contiguous: there the bf16 and channels_last rows would
    # measure oneDNN's convolutions, not the activation.
    configs = CONFIGS if cuda else CONFIGS[:1]
    acts = activations()
    # First-use costs of the process (thread pools, ...); on CUDA also the cuBLAS/cuDNN
    # workspaces, allocated once and kept.
    step(acts["naive"], batches[0], size, device=device)()
    progress = common.Progress("efficientnet_swish",
                               [b * (2 + repeats) for b in batches for _ in configs for _ in acts])
    rows, peaks, seconds = [], {}, {}
    for b in batches:
        for config in configs:
            for name, act in acts.items():
                fn = step(act, b, size, device=device, config=config)
                fn()  # warm-up: gradients and allocator state as in every later step
                peak, _ = common.peak_of(fn, device)
                peaks[b, config, name] = peak
                seconds[b, config, name] = common.median_seconds(fn, repeats, 0, device)
                base = peaks[b, config, "naive"]
                row = {"batch": b}
                if cuda:
                    row.update({"precision": config[0], "memory format": config[1]})
                row.update({"activation": name, "step peak MiB": common.mib(peak),
                            "vs naive": f"{100 * (1 - peak / base):.1f}% less",
                            **common.time_cells(seconds[b, config, name], device)})
                rows.append(row)
                progress.step(f"batch {b}, {', '.join(config)}, {name}")
    last = {name: peaks[batches[-1], configs[0], name] for name in acts}
    setting = (", fp32 and bf16 autocast, contiguous and channels_last, CUDA allocated bytes"
               if cuda else ", exact CPU bytes")
    note = (f"timm 1.0.29 efficientnet_b0 (5.29M parameters), {size}x{size} inputs, SGD{setting} "
            f"of a training step after a warm-up step; source claims: {CLAIMS}. At "
            f"batch {batches[-1]}{' (fp32, contiguous)' if cuda else ''}: memory-efficient "
            f"{100 * (1 - last['memlean memory_efficient'] / last['naive']):.1f}%, "
            f"in-place {100 * (1 - last['memlean inplace'] / last['naive']):.1f}%, timm SwishMe "
            f"{100 * (1 - last['timm SwishMe'] / last['naive']):.1f}% below naive."
            + common.device_note(device, timed=True))
    # One colour per activation; one line style per precision and memory format (CUDA).
    unit, scale = ("ms/step", 1e3) if cuda else ("s/step", 1.0)
    plot = common.plot(
        os.path.join(args.out, "efficientnet_swish.png"),
        f"EfficientNet-B0 training step by activation ({size}x{size})",
        [("batch size", "step peak MiB",
          {(name, ", ".join(c)): (batches, [common.mib(peaks[b, c, name]) for b in batches])
           for c in configs for name in acts}),
         ("batch size", unit,
          {(name, ", ".join(c)): (batches, [scale * seconds[b, c, name] for b in batches])
           for c in configs for name in acts})],
        xticks=batches)
    return [common.Table("efficientnet_swish", "EfficientNet-B0: training-step peak by Swish variant",
                         rows, note, [plot] if plot else [])]


def main(argv=None):
    return common.main_for(run, __doc__, argv)


if __name__ == "__main__":
    main()
