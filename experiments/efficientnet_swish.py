"""The claims around seed 000 on EfficientNet-B0: the training-step peak of timm's
efficientnet_b0 with each of memlean's Swish variants as its activation, beside timm's own
SwishMe (memory-efficient autograd.Function) and torch's nn.SiLU (timm's default), at
several batch sizes; exact CPU bytes, and the step time.

    ./bazelw run //experiments:efficientnet_swish [-- --quick] [--out=DIR]
"""
import functools

import torch
import torch.nn.functional as F

import memlean
from experiments import common

CLAIMS = ('"up to 30%" less (the issue seed 000 cites), "almost 20% less" at batch 512 '
          "(seed 000, an MLP), 15-20% (timm's memory-efficient activations)")


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


def step(act_layer, batch, size, seed=0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = make_model(act_layer).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, 3, size, size, generator=g)
    y = torch.randint(0, 1000, (batch,), generator=g)

    def run():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return run


def run(args):
    batches, size, repeats = ([2, 4], 64, 1) if args.quick else ([8, 16, 32], 224, 3)
    acts = activations()
    step(acts["naive"], batches[0], size)()  # first-use costs of the process (thread pools, ...)
    rows = []
    for b in batches:
        base = None
        for name, act in acts.items():
            fn = step(act, b, size)
            fn()  # warm-up: gradients and allocator state as in every later step
            peak, _ = common.peak_of(fn)
            seconds = common.median_seconds(fn, repeats, warmup=0)
            base = base or peak
            rows.append({"batch": b, "activation": name, "step peak MiB": common.mib(peak),
                         "vs naive": f"{100 * (1 - peak / base):.1f}% less",
                         "s/step": seconds})
    naive_peak = rows[-len(acts)]["step peak MiB"]
    best = {r["activation"]: r["step peak MiB"] for r in rows[-len(acts):]}
    note = (f"timm 1.0.29 efficientnet_b0 (5.29M parameters), {size}x{size} inputs, SGD, exact "
            f"CPU bytes of a training step after a warm-up step; source claims: {CLAIMS}. At "
            f"batch {batches[-1]}: memory-efficient {100 * (1 - best['memlean memory_efficient'] / naive_peak):.1f}%, "
            f"in-place {100 * (1 - best['memlean inplace'] / naive_peak):.1f}%, timm SwishMe "
            f"{100 * (1 - best['timm SwishMe'] / naive_peak):.1f}% below naive.")
    return [common.Table("efficientnet_swish", "EfficientNet-B0: training-step peak by Swish variant",
                         rows, note)]


def main(argv=None):
    return common.main_for(run, __doc__, argv)


if __name__ == "__main__":
    main()
