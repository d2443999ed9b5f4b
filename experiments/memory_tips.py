"""The memory-tips article's tips (docs/sources.md), each measured on one reference CNN: peak
bytes of a training step (or of inference, where the tip is about inference) before and
after the tip, with memlean.memstats (exact CPU bytes, or CUDA's allocated bytes); the
source's claim; and a verdict that says plainly when a tip does not save training memory.

    ./bazelw run //experiments:memory_tips [-- --quick] [--out=DIR] [--device=auto|cpu|cuda]
"""
import gc

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import memlean
from experiments import common


class Config:
    def __init__(self, quick, device=common.CPU):
        self.batch = 8 if quick else 64
        self.size = 32 if quick else 64
        self.width = 16 if quick else 32
        self.device = device


def conv_bn_relu(cin, cout, stride=1, inplace=False):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=inplace))


class RefCNN(nn.Module):
    """conv-BN-ReLU stem, five residual conv blocks, a head. Options switch single tips."""

    def __init__(self, cfg, inplace=False, head="gap", stride=1, names=False, ckpt=False):
        super().__init__()
        w = cfg.width
        self.stem = conv_bn_relu(3, w, stride, inplace)
        self.blocks = nn.ModuleList(conv_bn_relu(w, w, 1, inplace) for _ in range(5))
        side = cfg.size // stride
        self.head = nn.Linear(w, 10) if head == "gap" else nn.Linear(w * side * side, 10)
        self.gap, self.names, self.ckpt = head == "gap", names, ckpt

    def forward(self, x):
        x = self.stem(x)
        if self.names:  # tip 2's "before": every block output under its own name
            x1 = self.blocks[0](x) + x
            x2 = self.blocks[1](x1) + x1
            x3 = self.blocks[2](x2) + x2
            x4 = self.blocks[3](x3) + x3
            x5 = self.blocks[4](x4) + x4
            x = x5
        else:
            for b in self.blocks:
                x = (checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)) + x
        x = x.mean((2, 3)) if self.gap else x.flatten(1)
        return self.head(x)


class DelCNN(RefCNN):
    """Tip 15's code: the block input kept in input_, added after each block, then deleted."""

    def __init__(self, cfg, delete):
        super().__init__(cfg)
        self.delete = delete

    def forward(self, x):
        x = self.stem(x)
        input_ = x
        for b in self.blocks[:4]:
            x = F.relu_(b(x) + input_)
        if self.delete:
            del input_
        x = self.blocks[4](x)
        return self.head(x.mean((2, 3)))


def data(cfg, batch=None, seed=0):
    """A batch drawn on the CPU from the seed (the same numbers on every device), on cfg.device."""
    g = torch.Generator().manual_seed(seed)
    b = batch or cfg.batch
    x = torch.randn(b, 3, cfg.size, cfg.size, generator=g)
    return x.to(cfg.device), torch.randint(0, 10, (b,), generator=g).to(cfg.device)


def train_step(make_model, cfg, opt="sgd", steps=1, batch=None, micro=1, split=1, autocast=False,
               loss_item=True, collect=False, empty_cache=False):
    """A closure running `steps` training steps from scratch (model and optimizer included)."""

    def run():
        torch.manual_seed(0)
        model = make_model().to(cfg.device)
        o = (torch.optim.Adam if opt == "adam" else torch.optim.SGD)(model.parameters(), lr=1e-3)
        total = 0.0
        for s in range(steps):
            x, y = data(cfg, batch, seed=s)
            o.zero_grad(set_to_none=True)
            if collect:
                gc.collect()
            if split > 1:  # tip 5: losses of the parts added, one backward
                loss = sum(F.cross_entropy(model(xs), ys)
                           for xs, ys in zip(x.chunk(split), y.chunk(split)))
                loss.backward()
            else:
                for xs, ys in zip(x.chunk(micro), y.chunk(micro)):  # tip 11: one backward each
                    with torch.autocast(cfg.device.type, dtype=torch.bfloat16, enabled=autocast):
                        loss = F.cross_entropy(model(xs), ys) / micro
                    loss.backward()
            o.step()
            if empty_cache and cfg.device.type == "cuda":  # tip 13; the CPU has no cache
                torch.cuda.empty_cache()
            total = total + (loss.item() if loss_item else loss)  # tip 7
        return total

    return run


def inference(make_model, cfg, no_grad):
    def run():
        torch.manual_seed(0)
        model = make_model().to(cfg.device)
        x, _ = data(cfg)
        if no_grad:
            model.eval()
            with torch.no_grad():
                return model(x)
        return model(x)

    return run


def tips(cfg):
    """(tip, the source's claim, what runs before, what runs after)."""
    ref = lambda **kw: (lambda: RefCNN(cfg, **kw))  # noqa: E731
    half = cfg.batch // 2
    return [
        ("1 in-place ops (ReLU(inplace=True))", "saves memory: no new memory for the result",
         train_step(ref(), cfg), train_step(ref(inplace=True), cfg)),
        ("2 avoid intermediate variables (training)", "the latter saves nearly 90% of the memory",
         train_step(ref(names=True), cfg), train_step(ref(), cfg)),
        ("2 avoid intermediate variables (inference, no_grad)", "the latter saves nearly 90% of the memory",
         inference(ref(names=True), cfg, True), inference(ref(), cfg, True)),
        ("3 global average pooling instead of FC", "saves the FC layer's parameters",
         train_step(ref(head="fc"), cfg), train_step(ref(), cfg)),
        ("4 smaller batch size (half)", "reducing batch_size reduces memory",
         train_step(ref(), cfg), train_step(ref(), cfg, batch=half)),
        ("5 split the batch (losses added, one backward)", "splitting the batch saves memory",
         train_step(ref(), cfg), train_step(ref(), cfg, split=2)),
        ("7 accumulate the loss with .item()", "frees the batch loss' GPU memory",
         train_step(ref(), cfg, steps=3, loss_item=False), train_step(ref(), cfg, steps=3)),
        ("8 reduced precision (autocast bfloat16)", "greatly reduces the memory usage",
         train_step(ref(), cfg), train_step(ref(), cfg, autocast=True)),
        ("9 checkpointing (each residual block)", "trades time for memory",
         train_step(ref(), cfg), train_step(ref(ckpt=True), cfg)),
        ("10 gc.collect()", "reclaims memory garbage",
         train_step(ref(), cfg, steps=2), train_step(ref(), cfg, steps=2, collect=True)),
        ("11 gradient accumulation (4 micro-batches)", "simulates a larger batch in less memory",
         train_step(ref(), cfg), train_step(ref(), cfg, micro=4)),
        ("12 no_grad + eval for inference", "saves the memory of gradients",
         inference(ref(), cfg, False), inference(ref(), cfg, True)),
        ("13 empty_cache()", "releases video memory (CUDA only)",
         train_step(ref(), cfg), train_step(ref(), cfg, empty_cache=True)),
        ("14 downsampling (stride-2 stem)", "smaller feature maps save memory",
         train_step(ref(), cfg), train_step(ref(stride=2), cfg)),
        ("15 del of a variable", "deletes the variable",
         train_step(lambda: DelCNN(cfg, False), cfg), train_step(lambda: DelCNN(cfg, True), cfg)),
        ("16 SGD instead of Adam", "SGD has a smaller memory footprint than Adam",
         train_step(ref(), cfg, opt="adam", steps=2), train_step(ref(), cfg, steps=2)),
    ]


def verdict(name, before, after):
    saved = 1 - after / before if before else 0.0
    if "empty_cache" in name:
        return "no effect on allocated bytes: it only returns CUDA's cached, unused blocks"
    if abs(saved) < 0.005:
        why = {
            "1 in-place": "autograd keeps ReLU's output either way; in-place only spares the "
                          "BatchNorm output, which is freed right after ReLU anyway",
            "2 avoid intermediate variables (training)":
                "autograd keeps every block output for backward, named or not",
            "5 split the batch": "both halves' graphs are alive at the one backward",
            "7 accumulate": "backward already freed each step's saved tensors",
            "10 gc.collect": "CPython frees tensors by reference counting; gc only breaks cycles",
            "15 del": "the tensor stays referenced by the autograd graph",
            "16 SGD": "Adam's two state tensors per parameter are tiny beside this CNN's "
                      "activations (it matters for parameter-heavy models)",
        }
        reason = next((r for k, r in why.items() if name.startswith(k)), "")
        return "does not save training memory" + (f": {reason}" if reason else "")
    return f"saves {100 * saved:.1f}%" if saved > 0 else f"costs {100 * -saved:.1f}% more"


def run(args):
    cfg = Config(args.quick, args.device)
    rows = []
    measured = tips(cfg)
    common.warm_up(measured[0][2], cfg.device)
    for name, claim, before, after in measured:
        b, _ = common.peak_of(before, cfg.device)
        a, _ = common.peak_of(after, cfg.device)
        rows.append({"tip": name, "source claim": claim, "before MiB": common.mib(b),
                     "after MiB": common.mib(a), "verdict": verdict(name, b, a)})
    note = (f"One reference CNN (conv-BN-ReLU stem, 5 residual conv-BN-ReLU blocks, width "
            f"{cfg.width}, {cfg.size}x{cfg.size} inputs, batch {cfg.batch}), peak of a training "
            "step from scratch (model, optimizer, data) unless the tip is about inference; ")
    if cfg.device.type == "cpu":
        note += ("exact CPU bytes. On a GPU the same tensors are allocated; only tip 13 is "
                 "CUDA-only.")
    else:
        note += ("CUDA allocated bytes; tip 13 calls torch.cuda.empty_cache() after the step."
                 + common.device_note(cfg.device))
    return [common.Table("memory_tips", "The memory-tips article: memory-saving tips, measured",
                         rows, note)]


def main(argv=None):
    return common.main_for(run, __doc__, argv)


if __name__ == "__main__":
    main()
