"""memlean.fit: the budget is a promise (exact bytes on the CPU, measured here independently
of fit's own figures), the fitted step trains as the eager one (gradients, BatchNorm
statistics, dropout masks), the Swish swap is safe, fit leaves the training state as it found
it, undo() and state_dict() work, and bad input is named."""
import contextlib
import copy
import gc
import json
import pickle
import unittest
from dataclasses import replace
import warnings
from unittest import mock

import torch
import torch.nn as nn
import torch.nn.functional as F

import memlean

# ---- models --------------------------------------------------------------------------------


class ConvBlock(nn.Module):
    """A residual block whose second activation's input is not read again (in place is safe)."""

    def __init__(self, w):
        super().__init__()
        self.conv1, self.bn1, self.act1 = nn.Conv2d(w, w, 3, padding=1), nn.BatchNorm2d(w), nn.SiLU()
        self.conv2, self.bn2, self.act2 = nn.Conv2d(w, w, 3, padding=1), nn.BatchNorm2d(w), nn.SiLU()

    def forward(self, x):
        h = self.act1(self.bn1(self.conv1(x)))
        return x + self.act2(self.bn2(self.conv2(h)))


class ReuseBlock(nn.Module):
    """Its activation's input is read after the activation: in place would be wrong."""

    def __init__(self, w):
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(w, w, 3, padding=1), nn.BatchNorm2d(w), nn.SiLU()

    def forward(self, x):
        h = self.bn(self.conv(x))
        return self.act(h) + h


class Table(nn.Module):
    """x + table.sum(0): a layer holding a buffer it only reads, whose forward makes a
    temporary it does not save."""

    def __init__(self, width):
        super().__init__()
        self.register_buffer("table", torch.rand(2, width))

    def forward(self, x):
        return x + self.table.sum(0)


class ConvNet(nn.Module):
    def __init__(self, w=8, blocks=4, act=nn.SiLU):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, padding=1), nn.BatchNorm2d(w), act())
        self.blocks = nn.ModuleList([ConvBlock(w) for _ in range(blocks)] + [ReuseBlock(w)])
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.3),
                                  nn.Linear(w, 10))

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class FusedResidual(nn.Module):
    """torchvision's FusedMBConv with expand ratio 1 (EfficientNetV2): convolution, BatchNorm,
    SiLU(inplace=True), and the residual added in place onto the SiLU's output."""

    def __init__(self, w):
        super().__init__()
        self.conv = nn.Conv2d(w, w, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(w)
        self.act = nn.SiLU(inplace=True)

    def forward(self, x):
        out = self.act(self.bn(self.conv(x)))
        out += x
        return out


class LaterWrites(nn.Module):
    """SiLUs whose output a later op writes in place (fused.act: the residual's `out += x`;
    mid.1: a ReLU(inplace=True)) beside SiLUs whose output nothing writes (stem.2, last.1)."""

    def __init__(self, w=8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, padding=1), nn.BatchNorm2d(w), nn.SiLU())
        self.fused = FusedResidual(w)
        self.mid = nn.Sequential(nn.Conv2d(w, w, 3, padding=1), nn.SiLU(), nn.ReLU(inplace=True))
        self.last = nn.Sequential(nn.Conv2d(w, w, 3, padding=1), nn.SiLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(w, 10))

    def forward(self, x):
        return self.head(self.last(self.mid(self.fused(self.stem(x)))))


class SwiGLU(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.w2(self.act(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block called with a keyword argument (attn_mask=)."""

    def __init__(self, d, heads=2):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.mlp, self.drop = nn.LayerNorm(d), SwiGLU(d), nn.Dropout(0.1)

    def forward(self, x, attn_mask=None):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=attn_mask)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=50, d=32, layers=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
        h = self.emb(idx)
        for b in self.blocks:
            h = b(h, attn_mask=mask)
        return self.head(self.ln(h))


class ViTBlock(nn.Module):
    """A ViT's pre-norm block: attention, then an MLP (Linear 4x, GELU, Dropout(0), Linear)
    that memlean.sliced_mlp can slice over its hidden features."""

    def __init__(self, d, heads=2):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(0.0),
                                 nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2))
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TokenLM(nn.Module):
    """ViT blocks over embedded tokens, a vocabulary head on every token: the step peaks
    inside backward, at the head's logits and their gradient."""

    def __init__(self, vocab=256, d=64, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[ViTBlock(d) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        return self.head(self.ln(self.blocks(self.embed(idx))))


class GatedVariant(nn.Module):
    """A SwiGLU-shaped module (w1, act, w3, w2) whose forward is `how`: "swiglu"
    w2(act(w1(x)) * w3(x)); "up first" w2(w3(x) * act(w1(x))); "functional"
    w2(F.silu(w1(x)) * w3(x)); "functional gelu", "functional tanh gelu" (GeGLU: F.gelu, exact
    or approximate="tanh"); the others are not a gated MLP: "add" (+ for *), "scaled" (the
    product halved), "detached" (no gradient through the activation), "residual" (x added to
    the output), "functional mish" (F.mish: not one of fit's functional activations).
    "gate in region": "swiglu" with w1 called inside a torch.utils.checkpoint region of its
    own (a gated MLP still: its slices replace the whole forward, region and all)."""

    def __init__(self, d, hidden, how):
        super().__init__()
        self.how = how
        self.w1, self.w3, self.w2 = nn.Linear(d, hidden), nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.act = nn.SiLU()

    def forward(self, x):
        if self.how == "gate in region":
            g = torch.utils.checkpoint.checkpoint(self.w1, x, use_reentrant=False)
            return self.w2(self.act(g) * self.w3(x))
        if self.how == "up first":
            return self.w2(self.w3(x) * self.act(self.w1(x)))
        if self.how == "functional":
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        if self.how == "functional gelu":
            return self.w2(F.gelu(self.w1(x)) * self.w3(x))
        if self.how == "functional tanh gelu":
            return self.w2(F.gelu(self.w1(x), approximate="tanh") * self.w3(x))
        if self.how == "functional mish":
            return self.w2(F.mish(self.w1(x)) * self.w3(x))
        a = self.act(self.w1(x))
        if self.how == "add":
            return self.w2(a + self.w3(x))
        if self.how == "scaled":
            return self.w2(a * self.w3(x) * 0.5)
        if self.how == "detached":
            return self.w2(a.detach() * self.w3(x))
        out = self.w2(a * self.w3(x))
        return out + x if self.how == "residual" else out


class PackedVariant(nn.Module):
    """A gated MLP whose one Linear w12 makes gate and up (xformers' and many Llama ports'
    packed SwiGLU), its forward `how`: "chunk" `a, b = w12(x).chunk(2, -1); w3(F.silu(a) * b)`;
    "split" the same with torch.split; "slices" with h[..., :n] and h[..., n:]; "gate last"
    `w3(a * F.silu(b))`; not a gated MLP: "same half" `w3(F.silu(a) * a)`, "interleaved"
    h[..., ::2] and h[..., 1::2], "add" (+ for *), "scaled" (the product doubled)."""

    def __init__(self, d, hidden, how):
        super().__init__()
        self.how = how
        self.w12, self.w3 = nn.Linear(d, 2 * hidden), nn.Linear(hidden, d)

    def forward(self, x):
        h = self.w12(x)
        n = h.shape[-1] // 2
        if self.how == "split":
            a, b = torch.split(h, n, dim=-1)
        elif self.how == "slices":
            a, b = h[..., :n], h[..., n:]
        elif self.how == "interleaved":
            a, b = h[..., ::2], h[..., 1::2]
        else:
            a, b = h.chunk(2, dim=-1)
        if self.how == "gate last":
            return self.w3(a * F.silu(b))
        if self.how == "same half":
            return self.w3(F.silu(a) * a)
        if self.how == "add":
            return self.w3(F.silu(a) + b)
        if self.how == "scaled":
            return self.w3(F.silu(a) * b * 2)
        return self.w3(F.silu(a) * b)


def mlps_of(modules, finder):
    """fitting.`finder`'s MLPs (_gated_mlps, _split_mlps; any size) in one recorded step of
    nn.Sequential(modules) on a batch of 4 rows of 8 features."""
    from memlean import fitting

    model = nn.Sequential(*modules)
    model.train()
    step = fitting._Step(model, (torch.randn(4, 8),), lambda y: y.sum(), None,
                         torch.device("cpu"))
    recorded = step.run(record=True, dataflow=True).recorder
    with mock.patch.object(fitting, "_SLICE_MIN_BYTES", 0):
        return getattr(fitting, finder)(recorded, recorded)


def gated_mlps_of(modules):
    """fit's gated MLPs (_gated_mlps) in a step of nn.Sequential(modules): mlps_of."""
    return mlps_of(modules, "_gated_mlps")


class SplitIntermediate(nn.Module):
    """act(dense(x)), as transformers' BertIntermediate; "scaled": halved after."""

    def __init__(self, d, hidden, how):
        super().__init__()
        self.how = how
        self.dense, self.act = nn.Linear(d, hidden), nn.GELU()

    def forward(self, x):
        h = self.act(self.dense(x))
        return h * 0.5 if self.how == "scaled" else h


class SplitOutput(nn.Module):
    """norm(dense(h) + x), as transformers' BertOutput; "reread": h's first features added
    after dense."""

    def __init__(self, d, hidden, how):
        super().__init__()
        self.how = how
        self.dense, self.norm = nn.Linear(hidden, d), nn.LayerNorm(d)

    def forward(self, h, x):
        y = self.dense(h)
        if self.how == "reread":
            y = y + h[..., :y.shape[-1]]
        return self.norm(y + x)


class SplitLayer(nn.Module):
    """A layer whose MLP is split between two modules as in transformers' encoders: "split"
    output(intermediate(x), x), which fit slices as one MLP; not so: "scaled" (the
    intermediate's forward does more than its children), "reread" (the output reads the hidden
    again), "op between" (the hidden doubled before the output takes it), "handed twice" (a
    second module takes the hidden), "hooked" (a forward hook on the output's dense), "region"
    (the intermediate called inside a torch.utils.checkpoint region, the output after it:
    timm's set_grad_checkpointing's last block and the head)."""

    def __init__(self, d, hidden, how="split"):
        super().__init__()
        self.how = how
        self.intermediate = SplitIntermediate(d, hidden, how)
        self.output = SplitOutput(d, hidden, how)
        self.probe = nn.Linear(hidden, 1)
        if how == "hooked":
            self.output.dense.register_forward_hook(lambda m, i, o: None)

    def forward(self, x):
        if self.how == "region":
            h = torch.utils.checkpoint.checkpoint(self.intermediate, x, use_reentrant=False)
        else:
            h = self.intermediate(x)
        if self.how == "op between":
            h = h * 2.0
        y = self.output(h, x)
        if self.how == "handed twice":
            y = y + self.probe(h)
        return y


class ViT(nn.Module):
    def __init__(self, patch=48, d=64, layers=3, classes=10):
        super().__init__()
        self.embed = nn.Linear(patch, d)
        self.blocks = nn.Sequential(*[ViTBlock(d) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.ln(self.blocks(self.embed(x))).mean(1))


class Observed(nn.Module):
    """A layer whose forward reads a buffer it updates (a QAT observer's running scale): a
    checkpoint of it keeps the buffer's value from the forward's start until its backward."""

    def __init__(self, d, n):
        super().__init__()
        self.lin, self.act = nn.Linear(d, d), nn.SiLU()
        self.register_buffer("scale", torch.ones(n))

    def forward(self, x):
        with torch.no_grad():
            self.scale.mul_(1.001)
        return self.act(self.lin(x)) * self.scale[0]


class DataScaled(nn.Module):
    """Observed, its buffer updated through .data (as older code does): the buffer's version
    counter does not move (a checkpoint sees the change by value only, since 2026-11-27)."""

    def __init__(self, d, n):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d), nn.GELU())
        self.register_buffer("scale", torch.ones(n))

    def forward(self, x):
        self.scale.data.mul_(1.5)
        return (self.body(x) * self.scale[0]).square()  # (square saves its input: a block
        # checkpoint frees more than its body's)


class KeyValueCache:
    """A key-value cache as transformers' DynamicCache is one: update() appends the keys and
    values it is given and returns all it holds (a recompute of a layer that calls it would
    append them again and attend over twice the keys)."""

    def __init__(self):
        self.keys = {}

    def update(self, layer, k, v):
        if layer in self.keys:
            k = torch.cat([self.keys[layer][0], k], 1)
            v = torch.cat([self.keys[layer][1], v], 1)
        self.keys[layer] = (k, v)
        return k, v


class CachedAttention(nn.Module):
    def __init__(self, d, layer):
        super().__init__()
        self.qkv, self.out, self.layer = nn.Linear(d, 3 * d), nn.Linear(d, d), layer

    def forward(self, x, cache=None):
        q, k, v = self.qkv(x).chunk(3, -1)
        if cache is not None:
            k, v = cache.update(self.layer, k, v)
        return self.out(torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, -1) @ v)


class CachedBlock(nn.Module):
    def __init__(self, d, layer):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CachedAttention(d, layer)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, cache=None):
        x = x + self.attn(self.norm1(x), cache=cache)
        return x + self.mlp(self.norm2(x))


class CachedLM(nn.Module):
    """A decoder whose forward makes a key-value cache and hands it to every block, as
    transformers' models do in training with use_cache=True (their default without gradient
    checkpointing)."""

    def __init__(self, d=32, depth=3, use_cache=True):
        super().__init__()
        self.blocks = nn.ModuleList(CachedBlock(d, i) for i in range(depth))
        self.head = nn.Linear(d, 16)
        self.use_cache = use_cache

    def forward(self, x):
        cache = KeyValueCache() if self.use_cache else None
        for block in self.blocks:
            x = block(x, cache=cache)
        return self.head(x)


class MBConv(nn.Module):
    """An inverted residual block (EfficientNet's): its wide middle makes backward's own
    working memory (activation gradients, temporaries) a large part of a checkpointed step's
    peak, largest in the early, high-resolution blocks."""

    def __init__(self, w_in, w_out, stride=1, expand=6):
        super().__init__()
        e = w_in * expand
        self.residual = stride == 1 and w_in == w_out
        self.pw = nn.Sequential(nn.Conv2d(w_in, e, 1, bias=False), nn.BatchNorm2d(e), nn.SiLU())
        self.dw = nn.Sequential(nn.Conv2d(e, e, 3, stride=stride, padding=1, groups=e, bias=False),
                                nn.BatchNorm2d(e), nn.SiLU())
        self.pwl = nn.Sequential(nn.Conv2d(e, w_out, 1, bias=False), nn.BatchNorm2d(w_out))

    def forward(self, x):
        y = self.pwl(self.dw(self.pw(x)))
        return x + y if self.residual else y


class DenseLayer(nn.Module):
    """DenseNet-BC's layer: BN-ReLU-1x1 conv-BN-ReLU-3x3 conv over the concatenation of the
    list of its block's earlier feature maps (which no op saves)."""

    def __init__(self, channels, growth):
        super().__init__()
        self.body = nn.Sequential(nn.BatchNorm2d(channels), nn.ReLU(),
                                  nn.Conv2d(channels, 4 * growth, 1, bias=False),
                                  nn.BatchNorm2d(4 * growth), nn.ReLU(),
                                  nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False))

    def forward(self, features):
        return self.body(torch.cat(features, 1))


class DenseNet(nn.Module):
    """A stem and one dense block of 5 layers (each reading every earlier map), then a head."""

    def __init__(self, growth=8, stem=16, layers=5):
        super().__init__()
        self.stem = nn.Conv2d(3, stem, 3, padding=1, bias=False)
        self.layers = nn.ModuleList(DenseLayer(stem + i * growth, growth) for i in range(layers))
        width = stem + layers * growth
        self.head = nn.Sequential(nn.BatchNorm2d(width), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(width, 10))

    def forward(self, x):
        features = [self.stem(x)]
        for layer in self.layers:
            features.append(layer(features))
        return self.head(torch.cat(features, 1))


class Scored(nn.Module):
    """Attention-like: returns (output, weights) as transformers' attention modules do; the
    weights (batch x tokens x tokens) are saved by the product with the values."""

    def __init__(self, width):
        super().__init__()
        self.q = nn.Linear(width, width)
        self.v = nn.Linear(width, width)

    def forward(self, x):
        weights = torch.softmax(self.q(x) @ x.transpose(-1, -2), -1)
        return weights @ self.v(x), weights


class ReluBranch(nn.Module):
    """A convolution and a ReLU, which saves its output: the block's output, saved inside it."""

    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.conv(x))


class BranchSum(nn.Module):
    """HRNet's incre_modules in small: a ReluBranch whose output an add alone reads."""

    def __init__(self, channels):
        super().__init__()
        self.branch = ReluBranch(channels)
        self.down = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return self.branch(x) + self.down(x)


class ScoredLayer(nn.Module):
    """A layer that drops its attention's weights, as transformers' decoder layers do."""

    def __init__(self, width):
        super().__init__()
        self.attn = Scored(width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU())

    def forward(self, x):
        y, _ = self.attn(x)
        return x + self.mlp(y)


class NeXtBlock(nn.Module):
    """ConvNeXt's block: a 7x7 depthwise convolution, then channels-last LayerNorm and a 4x
    MLP (GELU), added to its input."""

    def __init__(self, d):
        super().__init__()
        self.dw = nn.Conv2d(d, d, 7, padding=3, groups=d)
        self.norm = nn.LayerNorm(d)
        self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.norm(self.dw(x).permute(0, 2, 3, 1))
        return x + self.fc2(self.act(self.fc1(h))).permute(0, 3, 1, 2)


class NeXtNet(nn.Module):
    def __init__(self, d=16, blocks=3, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, d, 4, stride=4)
        self.blocks = nn.Sequential(*[NeXtBlock(d) for _ in range(blocks)])
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class MBNet(nn.Module):
    """EfficientNet's shape, small: resolution halving while width grows."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
                                  nn.SiLU())
        self.blocks = nn.Sequential(MBConv(16, 16), MBConv(16, 24, 2), MBConv(24, 24),
                                    MBConv(24, 40, 2), MBConv(40, 40), MBConv(40, 80, 2))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(80, 10))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


class FlatMBConv(nn.Module):
    """timm's inverted residual block: its modules siblings, called one after the other."""

    def __init__(self, w_in, w_out, stride=1, expand=6, act=nn.SiLU):
        super().__init__()
        e = w_in * expand
        self.residual = stride == 1 and w_in == w_out
        self.conv_pw, self.bn1, self.act1 = nn.Conv2d(w_in, e, 1, bias=False), nn.BatchNorm2d(e), act()
        self.conv_dw = nn.Conv2d(e, e, 3, stride=stride, padding=1, groups=e, bias=False)
        self.bn2, self.act2 = nn.BatchNorm2d(e), act()
        self.conv_pwl, self.bn3 = nn.Conv2d(e, w_out, 1, bias=False), nn.BatchNorm2d(w_out)

    def forward(self, x):
        y = self.act2(self.bn2(self.conv_dw(self.act1(self.bn1(self.conv_pw(x))))))
        y = self.bn3(self.conv_pwl(y))
        return x + y if self.residual else y


class StridedMBNet(nn.Module):
    """Two inverted residual blocks of 4x expansion at full resolution, the first strided:
    its expanded chain, behind a 1x1 head, sets the least peak."""

    def __init__(self, width=8):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.blocks = nn.Sequential(FlatMBConv(width, width, 2, expand=4),
                                    FlatMBConv(width, width, expand=4))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


class FlatMBNet(nn.Module):
    def __init__(self, act=nn.SiLU):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),
                                  act())
        self.blocks = nn.Sequential(FlatMBConv(16, 24, 2, act=act), FlatMBConv(24, 24, act=act),
                                    FlatMBConv(24, 40, 2, act=act), FlatMBConv(40, 40, act=act))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(40, 10))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


class Bottleneck(nn.Module):
    """A ResNet bottleneck as timm's: 1x1 down, 3x3, 1x1 up (4x), BatchNorms, ReLUs in place,
    the residual added before the last ReLU."""

    def __init__(self, channels):
        super().__init__()
        inner = channels // 4
        self.conv1, self.bn1 = nn.Conv2d(channels, inner, 1, bias=False), nn.BatchNorm2d(inner)
        self.act1 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(inner, inner, 3, padding=1, bias=False)
        self.bn2, self.act2 = nn.BatchNorm2d(inner), nn.ReLU(inplace=True)
        self.conv3, self.bn3 = nn.Conv2d(inner, channels, 1, bias=False), nn.BatchNorm2d(channels)
        self.act3 = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.act2(self.bn2(self.conv2(self.act1(self.bn1(self.conv1(x))))))
        return self.act3(self.bn3(self.conv3(h)) + x)


class BottleneckNet(nn.Module):
    def __init__(self, channels=64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(channels), nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(*[Bottleneck(channels) for _ in range(3)])
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


# ---- an independent measurement of one step ------------------------------------------------


def storages(tensors):
    found = {}
    for t in tensors:
        if t.is_sparse:  # its indices and values hold it (SGD's momentum of a sparse gradient)
            tensors.extend([t._indices(), t._values()])
            continue
        s = t.untyped_storage()
        found[s.data_ptr()] = s.nbytes()
    return found


def step_peak(model, inputs, loss_fn, opt, keep_grads=False, extra=()):
    """The budget's definition, measured here: the unique storages of parameters, buffers,
    optimizer state and batch, plus the most the step allocates above them (memstats, exact on
    the CPU). keep_grads: the loop's zero_grad(set_to_none=False): the step begins with the
    gradients allocated (zeros the first time), counted as the parameters are. extra: other
    parameters the optimizer trains (counted too)."""
    for p in list(model.parameters()) + list(extra):
        if not keep_grads:
            p.grad = None
        elif p.grad is None and p.requires_grad:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in list(model.parameters()) + list(extra) if p.grad is not None]
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)] if opt else []
    batch = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
    fixed = sum(storages(list(model.parameters()) + list(model.buffers()) + state + batch
                         + grads + list(extra)).values())
    gc.disable()  # earlier garbage freed inside the step would lower its peak
    with memlean.memstats.track("cpu") as t:
        start = t.current
        # (inputs: positional arguments, or a dict of keyword ones)
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        # the output and the loss live to the step's end, as in a loop
        loss = loss_fn(out)
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=not keep_grads)
        del out, loss
    gc.enable()
    return fixed + t.peak - start


def snapshot(model, opt):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {k: (p.grad.clone() if p.grad is not None else None) for k, p in model.named_parameters()},
            copy.deepcopy(opt.state_dict()) if opt is not None else None,
            torch.get_rng_state())


def assert_same_state(test, a, b):
    sd_a, grads_a, opt_a, rng_a = a
    sd_b, grads_b, opt_b, rng_b = b
    test.assertEqual(sd_a.keys(), sd_b.keys())
    for k in sd_a:
        test.assertTrue(torch.equal(sd_a[k], sd_b[k]), k)
    for k in grads_a:
        if grads_a[k] is None:
            test.assertIsNone(grads_b[k], k)
        else:
            test.assertTrue(torch.equal(grads_a[k], grads_b[k]), k)
    test.assertTrue(torch.equal(rng_a, rng_b))
    if opt_a is not None:
        test.assertEqual(opt_a["state"].keys(), opt_b["state"].keys())
        for i in opt_a["state"]:
            for k, v in opt_a["state"][i].items():
                test.assertTrue(torch.equal(v, opt_b["state"][i][k]), (i, k))
        test.assertEqual(opt_a["param_groups"], opt_b["param_groups"])


def cross_entropy_of(y):
    return lambda out: F.cross_entropy(out, y)


def classified(model, size, batch=8):
    """(model, a batch of size x size images, cross-entropy of random labels, SGD with
    momentum): the CNN tests' training step, seeded."""
    torch.manual_seed(0)
    model = model()
    x = torch.randn(batch, 3, size, size)
    loss_fn = cross_entropy_of(torch.randint(0, 10, (batch,)))
    return model, x, loss_fn, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def vit_step():
    """(the tests' ViT, a batch of 8 sequences of 128 patches, cross-entropy of random labels,
    SGD with momentum): the sliced-MLP tests' training step, seeded."""
    torch.manual_seed(0)
    model, x = ViT(), torch.randn(8, 128, 48)
    loss_fn = cross_entropy_of(torch.randint(0, 10, (8,)))
    return model, x, loss_fn, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def lm_loss_of(targets):
    return lambda out: F.cross_entropy(out.flatten(0, 1), targets.flatten())


def changes(plan):
    """(path, action, bytes saved) of each of a plan's actions: what apply_plan repeats (the
    recompute times are measured where it runs)."""
    return [(a.path, a.action, a.bytes_saved) for a in plan.actions]


def wrapped_forwards(model):
    """The paths of the modules whose forward an instance attribute stands over (fit's
    wrappers): none once a plan is undone or a fit raised."""
    return [n for n, m in model.named_modules() if "forward" in m.__dict__]


def plain_checkpoints():
    """A context in which fit plans without compound candidates (no checkpoint nested in
    another): fitting._with_compounds made the identity."""
    from memlean import fitting

    return mock.patch.object(fitting, "_with_compounds", lambda problem: problem)


def recorded_problem(model, x, loss_fn, opt, runs=False, nest=False):
    """fit's first measurements, as fit makes them: (the training state saved, the step, a
    recorded step after one that made the optimizer's state, the planner's problem from it,
    with runs of sibling modules if `runs`, with compound candidates if `nest`). The caller
    restores the state (saved.restore())."""
    from memlean import fitting

    inputs, loss_fn, device = fitting._check(model, x, loss_fn, opt)
    saved = fitting._Saved(model, opt, device)
    step = fitting._Step(model, inputs, loss_fn, opt, device)
    step.run()
    current = step.run(record=True, dataflow=True)
    found = fitting._runs(current.recorder, current.recorder, model) if runs else ()
    uses = fitting._uses(current.recorder)
    return saved, step, current, fitting._problem(current, model, found, uses=uses, nest=nest)


def recorded_sliced(step, chains):
    """`step` (recorded_problem's) run and recorded with `chains` sliced: fit's wrappers on
    for it, off again after."""
    from memlean import fitting

    wraps = [fitting._wrap(c) for c in chains]
    try:
        return step.run(record=True)
    finally:
        for w in reversed(wraps):
            w()


def train_side_by_side(model, opt, twin, opt_twin, x, loss_fn, region=contextlib.nullcontext):
    """Three training steps of model and twin side by side, each step's forward from the same
    RNG state (dropout masks), the last without its optimizer step (its gradients kept); each
    forward and loss inside a region() of its own (an autocast region)."""
    for step in range(3):
        for m, o in ((model, opt), (twin, opt_twin)):
            torch.manual_seed(100 + step)
            with region():
                loss = loss_fn(m(x))
            loss.backward()
            if step < 2:
                o.step()
                o.zero_grad()


def train_alike(model, opt, twin, opt_twin, x, loss_fn, rtol, atol,
                region=contextlib.nullcontext):
    """train_side_by_side; then their gradients, parameters and buffers (BatchNorm
    statistics, num_batches_tracked) equal within rtol and atol."""
    train_side_by_side(model, opt, twin, opt_twin, x, loss_fn, region)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=rtol, atol=atol, msg=name)
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=name)
    for (name, b), c in zip(model.named_buffers(), twin.buffers()):
        torch.testing.assert_close(b, c, rtol=rtol, atol=atol, msg=name)


def least_and_eager(test, model, x, loss_fn, opt, fit_region=contextlib.nullcontext,
                    **options):
    """(The least peak a FitError names, the eager peak of a plan that changes nothing),
    each fit inside fit_region()."""
    with test.assertRaises(memlean.FitError) as caught, fit_region():
        memlean.fit(model, x, 1, loss_fn=loss_fn, optimizer=opt, **options)
    with fit_region():
        plan = memlean.fit(model, x, 2**50, loss_fn=loss_fn, optimizer=opt, **options)
    test.assertEqual(plan.actions, [])
    return caught.exception.least_peak_bytes, plan.eager_peak_bytes


def relu_twins_float64(cls, x):
    """cls(act=nn.ReLU) in float64 (seed 1) and a deep copy, `x` in float64, and an SGD with
    momentum for each: a model to fit and its unfitted twin, to train alike."""
    torch.manual_seed(1)
    model = cls(act=nn.ReLU).double()
    twin = copy.deepcopy(model)
    return (model, twin, x.double(), torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9))


def check_no_checkpoint_holds_a_data_change(test, device, batch=256):
    """fit at its least peak on 4 blocks that change a buffer through .data (DataScaled),
    float64 on `device`, a batch of `batch` rows: only what lies inside the blocks is
    checkpointed, fit puts the buffers back, and 2 backward passes equal the unfitted twin's
    (buffers changed once per forward, not again)."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(*[DataScaled(64, 4) for _ in range(4)],
                             nn.Linear(64, 10)).to(device, torch.double)

    model, twin = make(), make()
    x = torch.randn(batch, 64, dtype=torch.double, device=device)
    loss_fn = cross_entropy_of(torch.randint(0, 10, (batch,), device=device))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    least, eager = least_and_eager(test, model, x, loss_fn, opt)
    test.assertLess(least, eager)
    plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
    checkpointed = [a.path for a in plan.actions if a.action == "checkpoint"]
    test.assertTrue(checkpointed, str(plan))
    inside = tuple(f"{i}." for i in range(4))
    test.assertTrue(all(p.startswith(inside) for p in checkpointed), str(plan))
    for b, b2 in zip(model.buffers(), twin.buffers()):
        test.assertTrue(torch.equal(b, b2))  # fit's steps put the buffers back
    for _ in range(2):
        loss_fn(model(x)).backward()
        loss_fn(twin(x)).backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    for b, b2 in zip(model.buffers(), twin.buffers()):
        test.assertTrue(torch.equal(b, b2))  # changed once per forward, not again
    plan.undo()


def swish_swaps_and_two_steps(test, model, x, loss_fn):
    """The Swish swaps of a plan below the eager peak, after two training steps of the
    model beside an unfitted twin (autograd's version check must not fire) with gradients
    as the twin's, within the in-place backward's float64 bound (docs/swish.md)."""
    twin = copy.deepcopy(model)
    eager = memlean.fit(model, x, 2**50, loss_fn=loss_fn).eager_peak_bytes
    plan = memlean.fit(model, x, eager - 1, loss_fn=loss_fn)
    test.assertLess(plan.peak_bytes, eager)
    for _ in range(2):
        loss_fn(model(x)).backward()
        loss_fn(twin(x)).backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9, msg=name)
    plan.undo()
    return {a.path: a.action for a in plan.actions if a.action.endswith("swish")}


def check_no_in_place_swish_where_written(test, device, batch=4, size=16):
    """LaterWrites, float64 on `device`, batch x 3 x size x size: stem.2 and last.1 become
    in-place Swishes, fused.act (a residual added onto its output) and mid.1 (a
    ReLU(inplace=True) after it) do not, and two steps train as the twin."""
    torch.manual_seed(0)
    model = LaterWrites().to(device, torch.double)
    x = torch.randn(batch, 3, size, size, dtype=torch.double, device=device)
    swaps = swish_swaps_and_two_steps(
        test, model, x, cross_entropy_of(torch.randint(0, 10, (batch,), device=device)))
    test.assertEqual(swaps.get("stem.2"), "inplace swish", swaps)
    test.assertEqual(swaps.get("last.1"), "inplace swish", swaps)
    test.assertNotEqual(swaps.get("fused.act"), "inplace swish", swaps)
    test.assertNotEqual(swaps.get("mid.1"), "inplace swish", swaps)


class FitTest(unittest.TestCase):
    def setUp(self):
        torch.manual_seed(0)

    def conv_setup(self, dtype=torch.float32, batch=8, size=24):
        model = ConvNet().to(dtype)
        x = torch.randn(batch, 3, size, size, dtype=dtype)
        y = torch.randint(0, 10, (batch,))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, x, cross_entropy_of(y), opt

    def flat_setup(self):
        """FlatMBNet, a batch, its loss, SGD, and the least peak fit reaches without channel
        slicing (checkpoints alone)."""
        from memlean import fitting

        model, x, loss_fn, opt = classified(FlatMBNet, 32)
        with mock.patch.object(fitting, "_slices", lambda *a: []):
            least, _ = self.least_and_eager(model, x, loss_fn, opt)
        return model, x, loss_fn, opt, least

    def least_and_eager(self, model, x, loss_fn, opt, fit_region=contextlib.nullcontext,
                        **options):
        return least_and_eager(self, model, x, loss_fn, opt, fit_region, **options)

    def check_budgets(self, model, inputs, loss_fn, opt, count=8, fit_region=contextlib.nullcontext,
                      step_region=contextlib.nullcontext, **options):
        """For `count` budgets from the least reachable peak to the eager one: the step, measured
        here, peaks at or under the budget, equal to fit's own figure; the peak never rises as
        the budget falls. fit runs inside fit_region(), each step measured here inside a
        step_region() of its own. Returns (least, eager, the plans' actions)."""
        least, eager = self.least_and_eager(model, inputs, loss_fn, opt, fit_region, **options)
        actions = []
        self.assertLess(least, eager)
        previous = None
        for i in range(count):
            budget = eager - (eager - least) * i // (count - 1)
            with fit_region():
                plan = memlean.fit(model, inputs, budget, loss_fn=loss_fn, optimizer=opt,
                                   **options)
            actions += plan.actions
            # A warm step gives the optimizer its state, as fit measured with.
            if opt is not None and not opt.state:
                with step_region():
                    step_peak(model, inputs, loss_fn, opt)
            with step_region():
                measured = step_peak(model, inputs, loss_fn, opt)
            self.assertLessEqual(measured, budget, f"budget {budget}: {plan}")
            self.assertEqual(measured, plan.peak_bytes, str(plan))
            # The printed plan says when it checkpoints runs (eager steps only), and only then.
            # (every sliced action is eager-only: a gated MLP's path is its module's)
            runs = sum(a.action in ("sliced recompute", "sliced mlp")
                       or (a.action == "checkpoint" and a.path.endswith(")"))
                       for a in plan.actions)
            self.assertEqual("in eager steps only" in str(plan), runs > 0, str(plan))
            if runs:
                self.assertIn(f"{runs} of them run(s) of sibling modules", str(plan))
            self.assertEqual(json.loads(plan.to_json())["eager_only_runs"], runs)
            self.assertEqual(plan.eager_peak_bytes, eager)
            if previous is not None:
                self.assertLessEqual(plan.peak_bytes, previous, "the peak rose as the budget fell")
            previous = plan.peak_bytes
            plan.undo()
        return least, eager, actions

    def test_budget_is_a_promise_conv(self):
        model, x, loss_fn, opt = self.conv_setup()
        least, eager, _ = self.check_budgets(model, (x,), loss_fn, opt)
        self.assertLess(least, 0.75 * eager)

    def test_budget_is_a_promise_transformer_with_keyword_arguments(self):
        model = GPT()
        idx = torch.randint(0, 50, (4, 48))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        least, eager, _ = self.check_budgets(model, (idx,), lm_loss_of(torch.roll(idx, -1, 1)), opt)
        self.assertLess(least, 0.8 * eager)

    def test_budget_is_a_promise_with_keyword_inputs_and_a_dict_output(self):
        # A model called as Hugging Face's are: keyword arguments only (example_inputs a dict)
        # and a dict returned (loss_fn reads its "logits"): budgets kept in exact bytes, the
        # batch's tensors (a mask among them) counted; the default loss sums the dict's
        # floating-point values.
        class KeywordGPT(GPT):
            def forward(self, *, input_ids, attention_mask):
                h = self.emb(input_ids) * attention_mask.unsqueeze(-1)
                t = input_ids.shape[1]
                causal = torch.ones(t, t, dtype=torch.bool).tril()
                for b in self.blocks:
                    h = b(h, attn_mask=causal)
                return {"logits": self.head(self.ln(h)), "steps": 1}

        torch.manual_seed(0)
        model = KeywordGPT()
        idx = torch.randint(0, 50, (4, 48))
        batch = {"input_ids": idx, "attention_mask": torch.ones(4, 48)}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        lm = lm_loss_of(torch.roll(idx, -1, 1))
        least, eager, _ = self.check_budgets(model, batch, lambda out: lm(out["logits"]), opt,
                                             count=4)
        self.assertLess(least, 0.8 * eager)
        plan = memlean.fit(model, batch, 2**50, optimizer=opt)  # default loss
        self.assertEqual(plan.actions, [])
        with self.assertRaisesRegex(TypeError, "keys must be str"):
            memlean.fit(model, {0: idx}, 2**50)

    def test_budget_is_a_promise_with_runs_of_sibling_modules(self):
        # fit(runs=True): budgets kept as without, plans that checkpoint runs, and a least
        # peak below the one without runs (the runs inside MBConv blocks skip their wide
        # middle's saved tensors without recomputing the whole block). Channel slicing off
        # (below the least checkpoints reach it takes the same blocks lower, runs or not:
        # test_sliced_recompute_below_what_checkpoints_reach).
        from memlean import fitting

        no_slices = mock.patch.object(fitting, "_slices", lambda *a: [])
        no_slices.start()
        self.addCleanup(no_slices.stop)
        model, x, loss_fn, opt = classified(MBNet, 32)
        least, eager, actions = self.check_budgets(model, (x,), loss_fn, opt, runs=True)
        self.assertTrue(any("(" in a.path for a in actions), [a.path for a in actions])
        # Every depthwise convolution of every plan got the lean backward (CPU eager steps).
        depthwise = sorted(n for n, m in model.named_modules()
                           if isinstance(m, nn.Conv2d) and m.groups > 1)
        self.assertEqual(len(depthwise), 6)
        self.assertEqual(sorted({a.path for a in actions if a.action == "lean depthwise conv"}),
                         depthwise)
        plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt, runs=True)
        self.assertIn("6 depthwise Conv2d(s) with the lean backward", str(plan))
        plan.undo()
        self.assertEqual(wrapped_forwards(model), [])
        without, _ = self.least_and_eager(model, x, loss_fn, opt)
        self.assertLess(least, without)
        with self.assertRaisesRegex(TypeError, "runs must be a bool"):
            memlean.fit(model, x, 2**50, loss_fn=loss_fn, optimizer=opt, runs=1)

    def test_keep_grads_measures_the_loop_that_keeps_gradients_allocated(self):
        # A loop zeroing with set_to_none=False (or accumulating gradients) begins each step
        # with every gradient alive. fit(keep_grads=True) measures that step: at 3 budgets
        # that loop's step, measured here, peaks at or under the budget, equal to
        # plan.peak_bytes, and the fixed bytes count the gradients. A plan made for the
        # default loop is exceeded by that loop's step (gradients alive that the default
        # step has not made yet where it peaks).
        model, x, loss_fn, opt = self.conv_setup()
        step_peak(model, (x,), loss_fn, opt)  # mid-training: the optimizer has its state
        model.blocks[0].conv1.weight.grad = torch.ones_like(model.blocks[0].conv1.weight)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        with self.assertRaises(memlean.FitError) as caught:
            memlean.fit(model, x, 1, loss_fn=loss_fn, optimizer=opt, keep_grads=True)
        least = caught.exception.least_peak_bytes
        plain = memlean.fit(model, x, 2**50, loss_fn=loss_fn, optimizer=opt, keep_grads=True)
        self.assertEqual(plain.actions, [])
        # fit put the caller's gradient back
        self.assertTrue(torch.equal(model.blocks[0].conv1.weight.grad,
                                    torch.ones_like(model.blocks[0].conv1.weight)))
        for p in model.parameters():
            p.grad = None
        default = memlean.fit(model, x, 2**50, loss_fn=loss_fn, optimizer=opt)
        self.assertEqual(plain.fixed_bytes, default.fixed_bytes + params)
        self.assertGreater(plain.eager_peak_bytes, default.eager_peak_bytes)
        for i in range(3):
            budget = least + (plain.eager_peak_bytes - least) * i // 3
            plan = memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt,
                               keep_grads=True)
            if not opt.state:  # a warm step: the optimizer's state, as fit measured with
                step_peak(model, (x,), loss_fn, opt, keep_grads=True)
            measured = step_peak(model, (x,), loss_fn, opt, keep_grads=True)
            self.assertLessEqual(measured, budget, str(plan))
            self.assertEqual(measured, plan.peak_bytes, str(plan))
            self.assertIsNotNone(model.stem[0].weight.grad)  # the loop's, not fit's
            plan.undo()
            for p in model.parameters():
                p.grad = None
        plan = memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt)
        self.assertGreater(step_peak(model, (x,), loss_fn, opt, keep_grads=True),
                           plan.peak_bytes)
        self.assertEqual(step_peak(model, (x,), loss_fn, opt), plan.peak_bytes)
        plan.undo()
        with self.assertRaisesRegex(TypeError, "keep_grads must be a bool"):
            memlean.fit(model, x, 2**50, loss_fn=loss_fn, optimizer=opt, keep_grads=None)

    def test_parameters_the_optimizer_trains_outside_the_model(self):
        # A learnable parameter of the loss (1 MiB), trained by the same optimizer: the step's
        # memory counts it (and its gradient and momentum), budgets are kept by the step
        # measured here with it counted, and fit puts it back as it found it.
        model, x, _, _ = self.conv_setup()
        y = torch.randint(0, 10, (8,))
        scale = nn.Parameter(torch.ones(256, 1024))

        def loss_fn(out):
            return F.cross_entropy(out * scale.mean(), y)

        opt = torch.optim.SGD(list(model.parameters()) + [scale], lr=0.5, momentum=0.9)
        step_peak(model, (x,), loss_fn, opt, extra=[scale])  # mid-training
        before = scale.detach().clone()
        plain = memlean.fit(model, x, 2**50, loss_fn=loss_fn, optimizer=opt)
        self.assertGreaterEqual(plain.fixed_bytes, 2 * scale.nbytes)  # it and its momentum
        with self.assertRaises(memlean.FitError) as caught:
            memlean.fit(model, x, 1, loss_fn=loss_fn, optimizer=opt)
        least = caught.exception.least_peak_bytes
        for budget in (least, (least + plain.eager_peak_bytes) // 2):
            plan = memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt)
            self.assertTrue(torch.equal(scale, before))
            self.assertIsNone(scale.grad)
            measured = step_peak(model, (x,), loss_fn, opt, extra=[scale])
            self.assertLessEqual(measured, budget, str(plan))
            self.assertEqual(measured, plan.peak_bytes, str(plan))
            plan.undo()
            with torch.no_grad():
                scale.copy_(before)

    def test_budget_is_a_promise_on_the_paths_users_take(self):
        # channels_last weights and batch; a bf16 autocast step (fit called inside an autocast
        # region in which a forward already ran, so autocast holds bf16 copies of the weights
        # to the region's end, and each step measured here in a region of its own, as a loop
        # enters one per step: fit measures its steps so); memlean.Swish as the activation (as
        # timm's act_layer=memlean.Swish builds it). Each: budgets kept, in exact bytes, and
        # the plan swaps Swish modules, memlean's own included.
        for path in ["channels_last", "autocast bf16", "memlean.Swish"]:
            with self.subTest(path=path):
                torch.manual_seed(0)
                model = ConvNet(act=memlean.Swish if path == "memlean.Swish" else nn.SiLU)
                x = torch.randn(8, 3, 24, 24)
                loss_fn = cross_entropy_of(torch.randint(0, 10, (8,)))
                if path == "channels_last":
                    model = model.to(memory_format=torch.channels_last)
                    x = x.contiguous(memory_format=torch.channels_last)
                opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                bf16 = path == "autocast bf16"

                def step_region():
                    return (torch.autocast("cpu", dtype=torch.bfloat16) if bf16
                            else contextlib.nullcontext())

                @contextlib.contextmanager
                def fit_region():
                    with step_region():
                        with torch.no_grad():
                            model(x)  # autocast keeps its weight copies to the region's end
                        yield

                self.check_budgets(model, (x,), loss_fn, opt, count=4, fit_region=fit_region,
                                   step_region=step_region)
                with step_region():
                    plan = memlean.fit(model, (x,), 2**50 - 1, loss_fn=loss_fn, optimizer=opt)
                    self.assertEqual(plan.actions, [])  # eager fits: nothing changed
                    least = memlean.fit(model, (x,), plan.eager_peak_bytes - 1, loss_fn=loss_fn,
                                        optimizer=opt)
                swapped = [a.path for a in least.actions if "swish" in a.action]
                self.assertIn("stem.2", swapped, str(least))
                least.undo()

    def check_plans_predicted(self, model, inputs, loss_fn, opt, runs=False):
        """Measures a recorded step of `model`, then the planner's plans (its least-peak plan
        and those of 3 budgets up to the eager peak: each predicted within 64 bytes of its
        measured peak) and 8 random disjoint choices of candidates (each predicted at or
        above its measured peak, within 2 %). The candidates' times are their atom counts,
        so the plans do not depend on the machine's speed. Returns the problem and the
        random choices' number of runs of sibling modules."""
        import random

        from memlean import _C, fitting

        saved, step, current, problem = recorded_problem(model, inputs, loss_fn, opt, runs)
        is_run = [isinstance(c.module, fitting._Run) for c in problem.calls]
        candidates = [(b, e, freed, float(e - b), extra, held)
                      for b, e, freed, _, extra, held in problem.candidates]

        def predicted(chosen):
            return _C.fit.predicted_peak(problem.base, problem.atoms, candidates, list(chosen),
                                         **problem.options)

        self.assertEqual(predicted(()), current.forward_backward_peak)
        least = _C.fit.least_peak_plan(problem.base, problem.atoms, candidates,
                                       **problem.options)
        plans = {tuple(least[1])}
        for i in range(1, 4):
            target = least[2] + (current.peak - least[2]) * i // 4
            plans.add(tuple(_C.fit.plan(problem.base, problem.atoms, candidates, target,
                                        **problem.options)[1]))
        self.assertGreaterEqual(len(plans), 3)
        for chosen in plans:
            measured = fitting._measure_plan(step, problem.calls, chosen)
            self.assertLessEqual(abs(predicted(chosen) - measured), 64, chosen)
        rng = random.Random(0)
        random_runs = 0
        for _ in range(8):
            chosen, used = [], set()
            for i in rng.sample(range(len(candidates)), len(candidates)):
                atoms = set(range(candidates[i][0], candidates[i][1]))
                if rng.random() < 0.3 and not atoms & used:
                    chosen.append(i)
                    used |= atoms
            chosen.sort(key=lambda i: candidates[i][0])
            measured = fitting._measure_plan(step, problem.calls, tuple(chosen))
            prediction = predicted(chosen)
            self.assertGreaterEqual(prediction, measured, chosen)
            self.assertLessEqual(prediction, measured + measured // 50, chosen)
            random_runs += sum(is_run[i] for i in chosen)
        saved.restore()
        return current, problem, sum(is_run), random_runs

    def test_the_planners_plans_are_predicted_within_bytes(self):
        # On an EfficientNet-shaped net (the modules' times replaced by fixed ones, so the
        # plans do not depend on the machine's speed), the plans of the least peak and of
        # budgets between it and eager's are predicted to within a few bytes (the issue asks
        # for max(2 %, 1 MiB)): the planner counts backward's working memory atom by atom and,
        # at each recompute, the gradients backward brings and what the forward held above
        # what it left; memlean.checkpoint frees the recomputed output and the incoming
        # gradient as soon as they are used. Any other disjoint choice of modules and runs of
        # sibling modules is predicted at or above its measured peak, within 2 %. (Exact but
        # for a few bytes: until recomputes counted the gradients backward brings, one plan
        # here peaked 8 bytes, a scalar, above its prediction of 81,101,016.)
        model, x, loss_fn, opt = classified(MBNet, 64)
        _, _, runs, random_runs = self.check_plans_predicted(model, x, loss_fn, opt, runs=True)
        self.assertGreater(runs, 10)
        self.assertGreater(random_runs, 0)

    def assert_fit_predicted(self, model, x, loss_fn, opt, eager_peak):
        """fit's own plans, at its least and halfway to the eager peak: within the budget,
        predicted within 64 bytes of the peak fit measured."""
        with self.assertRaises(memlean.FitError) as caught:
            memlean.fit(model, x, 1, loss_fn=loss_fn, optimizer=opt)
        least = caught.exception.least_peak_bytes
        for budget in (least, (least + eager_peak) // 2):
            plan = memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt)
            self.assertLessEqual(plan.peak_bytes, budget)
            self.assertLessEqual(abs(plan.predicted_peak_bytes - plan.peak_bytes), 64, str(plan))
            plan.undo()

    def test_inputs_that_several_checkpoints_keep_are_counted_once(self):
        # Each dense layer's input is the list of its block's earlier maps, which no op saves:
        # a checkpoint of the layer keeps every map of it, and two checkpointed layers keep the
        # same maps, which live once. The planner counts them once (shared inputs): every
        # choice of dense layers is predicted within 64 bytes, where counted per layer the
        # predictions of choices of two or more layers lay a map or more above the measured
        # peak (DenseNet-121's least: 6 % above).
        model, x, loss_fn, opt = classified(DenseNet, 32)
        from memlean import _C, fitting

        saved, step, current, problem = recorded_problem(model, x, loss_fn, opt)
        layers = [i for i, c in enumerate(problem.calls) if isinstance(c.module, DenseLayer)]
        self.assertEqual(len(layers), 5)
        # The stem's map is kept by all 5, the first layer's by the 4 after it, ...
        self.assertEqual(sorted(len(ks) for _, ks in problem.shared), [2, 3, 4, 5])
        per_layer = dict(problem.options, shared_inputs=[])
        over = 0
        for chosen in [layers[:1], layers[1:3], layers[::2], layers[1:], layers]:
            measured = fitting._measure_plan(step, problem.calls, tuple(chosen))
            predicted = _C.fit.predicted_peak(problem.base, problem.atoms, problem.candidates,
                                              chosen, **problem.options)
            self.assertLessEqual(abs(predicted - measured), 64, chosen)
            counted_per_layer = _C.fit.predicted_peak(problem.base, problem.atoms,
                                                      problem.candidates, chosen, **per_layer)
            over += counted_per_layer > measured + 64
        saved.restore()
        self.assertEqual(over, 4)  # every choice of two layers or more
        self.assert_fit_predicted(model, x, loss_fn, opt, current.peak)

    def test_outputs_nothing_uses_after_a_checkpoint_are_not_kept(self):
        # An attention module returning (output, weights), whose layer drops the weights (as
        # transformers' layers do): the weights are saved inside it, but nothing reads them
        # after it, so a checkpoint of it keeps them not. Each candidate alone is predicted
        # within 64 bytes; counted as kept (as until 2026-11-28) the first attentions'
        # predictions lay their weights above the measured peak (GPT-J, BLOOM and ELECTRA:
        # 2 MiB per attention, up to 12 % at a plan, and GPT-J's least 16 % higher). The last
        # attention's backward sets the step's peak, with its input's gradient apart from
        # the residual's (the checkpoint hands it on whole): predicted that much (131,072
        # bytes, 1.8 %) low until counted. fit's plans: within 64 bytes.
        torch.manual_seed(0)
        model = nn.Sequential(*[ScoredLayer(32) for _ in range(3)], nn.Flatten(),
                              nn.Linear(32 * 256, 4))
        x, y = torch.randn(4, 256, 32), torch.randn(4, 4)

        def loss_fn(out):
            return F.mse_loss(out, y)

        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        from memlean import _C, fitting

        saved, step, current, problem = recorded_problem(model, x, loss_fn, opt)
        attentions = [i for i, c in enumerate(problem.calls) if isinstance(c.module, Scored)]
        self.assertEqual(len(attentions), 3)
        weights = 4 * 256 * 256 * 4
        # The weights counted as kept: every saved tensor taken to outlive its module.
        with mock.patch.object(fitting, "_outlives",
                               lambda rec: dict.fromkeys(rec.saved, len(rec.atom_bytes))):
            kept_too = fitting._problem(current, model)
        for i, call in enumerate(problem.calls):
            measured = fitting._measure_plan(step, problem.calls, (i,))
            predicted = _C.fit.predicted_peak(problem.base, problem.atoms, problem.candidates,
                                              [i], **problem.options)
            self.assertLessEqual(abs(predicted - measured), 64, call.module)
            if i in attentions[:2]:
                self.assertEqual(kept_too.candidates[i][2] + weights, problem.candidates[i][2])
                self.assertGreater(_C.fit.predicted_peak(
                    kept_too.base, kept_too.atoms, kept_too.candidates, [i],
                    **kept_too.options), measured + weights // 2)
        saved.restore()
        self.assert_fit_predicted(model, x, loss_fn, opt, current.peak)

    def test_bfloat16_checkpoint_defers_its_weight_gradients(self):
        # Under bfloat16 autocast a checkpoint's recompute reuses the weight copies autocast
        # cached in the forward, whose casts' backward autograd runs last: through the
        # checkpoint's backward each weight's gradient waits in bfloat16 where the step
        # without it had accumulated it in float32 (the planner's atom_deferred_bytes, from
        # the recorder's autocast copies). timm's rexnet_100 (64², batch 4): its longest run
        # of feature blocks alone, predicted within 0.1 % of its measured peak (counted as
        # float32, the prediction was 1.4 MB, 2.4 %, high: 2026-11-29).
        import optional_deps

        if not optional_deps.available("timm"):
            self.skipTest("timm: this environment is made without it (MEMLEAN_WITHOUT)")
        import timm

        from memlean import _C, fitting

        torch.manual_seed(0)
        model = timm.create_model("rexnet_100", num_classes=10).train()
        x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 10, (4,))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        paths = fitting._paths(model)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            saved, step, current, problem = recorded_problem(
                model, x, lambda out: F.cross_entropy(out.float(), y), opt, runs=True)
            runs = [i for i, c in enumerate(problem.calls)
                    if isinstance(c.module, fitting._Run) and c.module.path(paths).startswith(
                        "features.(0..")]
            longest = max(runs, key=lambda i: problem.candidates[i][1])
            self.assertEqual(problem.calls[longest].module.path(paths), "features.(0..15)")
            b, e = problem.candidates[longest][:2]
            deferred = sum(problem.deferred[b + 1:e])
            self.assertGreater(deferred, 1 << 20)
            measured = fitting._measure_plan(step, problem.calls, (longest,))
            saved.restore()
        predicted = _C.fit.predicted_peak(problem.base, problem.atoms, problem.candidates,
                                          [longest], **problem.options)
        as_float32 = dict(problem.options, atom_deferred_bytes=[])
        self.assertLessEqual(abs(predicted - measured), measured // 1000)
        self.assertGreater(_C.fit.predicted_peak(problem.base, problem.atoms,
                                                 problem.candidates, [longest], **as_float32),
                           measured + (1 << 20))

    def test_bfloat16_weights_cast_inside_torch_checkpoint_regions_are_deferred_too(self):
        # timm's set_grad_checkpointing() runs each stage inside torch.utils.checkpoint's
        # saved-tensors region, where the recorder's own hook sees nothing saved: the weight
        # copies autocast casts there (nn.Linear, convolutions) are counted at the call that
        # casts them (_Recorder._foreign_casts). ConvNeXt-atto (96², batch 4, bfloat16): a
        # checkpoint of its stages predicted within 0.1 % of its measured peak; counted as
        # float32, more than 1 MiB high (5.1 % here; fitted with runs, channels_last, its
        # least was predicted 4.8 % high and named 3 % higher, fastvit_t8 6.2 %: 2026-11-30).
        import optional_deps

        if not optional_deps.available("timm"):
            self.skipTest("timm: this environment is made without it (MEMLEAN_WITHOUT)")
        import timm

        from memlean import _C, fitting

        torch.manual_seed(0)
        model = timm.create_model("convnext_atto", num_classes=10).train()
        model.set_grad_checkpointing(True)
        x, y = torch.randn(4, 3, 96, 96), torch.randint(0, 10, (4,))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        stages = fitting._paths(model)
        stages = next(m for m, path in stages.items() if path == "stages")

        def predicted_and_measured():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                saved, step, current, problem = recorded_problem(
                    model, x, lambda out: F.cross_entropy(out.float(), y), opt)
                i = next(i for i, c in enumerate(problem.calls) if id(c.module) == stages)
                measured = fitting._measure_plan(step, problem.calls, (i,))
                saved.restore()
            return _C.fit.predicted_peak(problem.base, problem.atoms, problem.candidates, [i],
                                         **problem.options), measured

        predicted, measured = predicted_and_measured()
        self.assertLessEqual(abs(predicted - measured), measured // 1000)
        with mock.patch.object(fitting._Recorder, "_foreign_casts", lambda *args: None):
            as_float32, measured_again = predicted_and_measured()
        self.assertEqual(measured_again, measured)
        self.assertGreater(as_float32, measured + (1 << 20))

    def test_an_output_only_an_add_reads_is_not_kept_by_its_checkpoint(self):
        # A block whose output its last module saves (a ReLU) and nothing after it saves or
        # takes as a module's input (an add reads it, saving nothing: HRNet's incre_modules):
        # checkpointed, the block's output is freed in forward once the add has run, so the
        # checkpoint keeps none of it. Each candidate alone is predicted to the byte; counted
        # as kept (until 2026-11-29), each block alone was predicted its output's bytes high
        # (HRNet-W18-small's least +2.1 %).
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), BranchSum(8), BranchSum(8),
                              nn.Flatten(), nn.Linear(8 * 16 * 16, 4))
        x, y = torch.randn(4, 3, 16, 16), torch.randn(4, 4)

        def loss_fn(out):
            return F.mse_loss(out, y)

        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        from memlean import _C, fitting

        saved, step, current, problem = recorded_problem(model, x, loss_fn, opt)
        with mock.patch.object(fitting, "_outlives",
                               lambda rec: dict.fromkeys(rec.saved, len(rec.atom_bytes))):
            kept_too = fitting._problem(current, model, uses=fitting._uses(current.recorder))
        branches = [i for i, c in enumerate(problem.calls) if isinstance(c.module, ReluBranch)]
        self.assertEqual(len(branches), 2)
        output = 4 * 8 * 16 * 16 * 4
        for i in branches:
            self.assertEqual(kept_too.candidates[i][2] + output, problem.candidates[i][2])
        plans = [[i] for i in range(len(problem.calls))] + [branches]
        for chosen in plans:
            measured = fitting._measure_plan(step, problem.calls, chosen)
            predicted = _C.fit.predicted_peak(problem.base, problem.atoms, problem.candidates,
                                              chosen, **problem.options)
            self.assertEqual(predicted, measured, chosen)
            if chosen in (branches[:1], branches):  # (the second alone peaks elsewhere)
                self.assertEqual(_C.fit.predicted_peak(
                    kept_too.base, kept_too.atoms, kept_too.candidates, chosen,
                    **kept_too.options), measured + output)
        saved.restore()
        self.assert_fit_predicted(model, x, loss_fn, opt, current.peak)

    def test_a_tail_that_saves_nothing_is_not_counted_in_the_recompute(self):
        # timm's NF-ResNet-26 (batch 8, 128²): each block ends in `out * alpha + shortcut`,
        # ops after its last submodule that save nothing. Backward runs them, and makes the
        # multiply's input gradient, before it reaches the last atom that saves; a checkpoint's
        # recompute begins before them, where backward reaches its output (the level the
        # recorder now takes there, in the eager step). At the least: predicted within 64
        # bytes (56 high), and measured again apart from fit; with the old level (the atom's
        # entry) the least plan was predicted 2.7 % high and the least itself 0.9 % higher.
        # Without compound checkpoints (with them both levels reach a least 3.7 % lower, 72
        # bytes high: their nested peaks are the sub-problems' programs' counts).
        import optional_deps

        if not optional_deps.available("timm"):
            self.skipTest("timm: this environment is made without it (MEMLEAN_WITHOUT)")
        import timm

        from memlean import fitting

        def setup():
            torch.manual_seed(0)
            model = timm.create_model("nf_resnet26", num_classes=10)
            x = torch.randn(8, 3, 128, 128)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            return model, x, cross_entropy_of(torch.randint(0, 10, (8,))), opt

        leasts = {}
        for old in (False, True):
            with contextlib.ExitStack() as stack:
                stack.enter_context(plain_checkpoints())
                if old:  # (the level where backward reaches a call not taken)
                    stack.enter_context(mock.patch.object(
                        fitting._Recorder, "_reached", lambda self, call: None))
                model, x, loss_fn, opt = setup()
                least, _ = self.least_and_eager(model, x, loss_fn, opt)
                plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
            leasts[old] = least
            self.assertEqual(plan.peak_bytes, least)
            if old:
                self.assertGreater(plan.predicted_peak_bytes, plan.peak_bytes * 1.02)
            else:
                self.assertLessEqual(abs(plan.predicted_peak_bytes - plan.peak_bytes), 64)
                step_peak(model, (x,), loss_fn, opt)  # the optimizer's state
                self.assertEqual(step_peak(model, (x,), loss_fn, opt), plan.peak_bytes)
            plan.undo()
        self.assertLess(leasts[False], leasts[True])

    def test_a_run_ending_in_a_layer_with_a_temporary_is_predicted_to_the_byte(self):
        # A chain of GELUs around a layer that adds a buffer's sum (x + table.sum(0): a
        # temporary as large as half its input, none of it saved). Checkpointed alone, and in
        # every run of sibling layers, each candidate's step is predicted to the byte: while a
        # run ending with that layer is recomputed, the layer's input (made inside the run,
        # saved by nothing) and its temporary are alive, and the level the forward measured
        # where the run ended still held that input (nn.Sequential's loop keeps it until the
        # next layer), so the recompute's excess was counted 262,112-524,288 bytes low until
        # the planner took it off that level. The planner's own plans: within 64 bytes.
        torch.manual_seed(0)
        wide = 1 << 16
        model = nn.Sequential(nn.Linear(8, wide), *[nn.GELU() for _ in range(5)],
                              Table(wide), *[nn.GELU() for _ in range(5)], nn.Linear(wide, 4))
        x, y = torch.randn(2, 8), torch.randn(2, 4)

        def loss_fn(out):
            return F.mse_loss(out, y)

        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        from memlean import _C, fitting

        saved, step, current, problem = recorded_problem(model, x, loss_fn, opt, runs=True)
        runs_with_table = 0
        for i, (b, e, freed, seconds, extra, held) in enumerate(problem.candidates):
            call = problem.calls[i]
            measured = fitting._measure_plan(step, problem.calls, (i,))
            predicted = _C.fit.predicted_peak(
                problem.base, problem.atoms, problem.candidates, [i],
                **problem.options)
            self.assertEqual(predicted, measured, call.module)
            if isinstance(call.module, fitting._Run) and isinstance(call.module.modules[-1],
                                                                   Table):
                runs_with_table += 1
        saved.restore()
        self.assertGreaterEqual(runs_with_table, 5)
        self.check_plans_predicted(model, x, loss_fn, opt, runs=True)

    def test_a_step_peaking_inside_backward_is_predicted_within_bytes(self):
        # A language model whose step peaks inside backward (its vocabulary head's logits,
        # their gradient and what the head's backward makes): the planner's base counts what
        # the step holds besides saved tensors in the forward and until backward first uses
        # one, and the per-atom backward extras the rest (backward's working memory there,
        # which is gone while a checkpoint recomputes), so its plans are predicted within a
        # few bytes. (Taking base as the step's peak less every saved byte, fit counted that
        # working memory at every moment of every plan and predicted these 5-6 % high, as it
        # did 8 % and 27 % for transformers' GPT-NeoX and GPT-2 with sliced MLPs, where the
        # peak came in an MLP's backward, and it chose among plans by that.)
        # Random plans: predicted at or above their measured peaks, within 2 %.
        torch.manual_seed(0)
        model = TokenLM()
        idx = torch.randint(0, 256, (8, 129))
        x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()

        def loss_fn(out):
            return F.cross_entropy(out.flatten(0, 1), y.flatten())

        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        current, _, _, _ = self.check_plans_predicted(model, x, loss_fn, opt)
        rec = current.recorder
        self.assertEqual(max(rec.backward_levels.values()), current.forward_backward_peak)
        self.assertGreater(current.forward_backward_peak,
                           max(current.forward_peak, rec.backward_start_level))

    def test_the_buffer_copies_checkpoints_keep_are_predicted(self):
        # A checkpointed module whose forward changes a buffer it reads keeps a copy of it
        # until its backward (its recompute begins from it): the planner counts the copy as
        # kept, and held through the recompute and the backward, so every block's checkpoint
        # is predicted to within a few bytes (without it, each measured the copy, 256 KiB,
        # above its prediction). The last two blocks' recomputes set the peak: they were
        # predicted 0.5 MiB low until the planner counted what a recompute holds besides its
        # saved bytes and output (the SiLU's output while the scaling makes the block's) and
        # the gradients backward brings to it.
        from memlean import _C, fitting

        model = nn.Sequential(*[Observed(256, 1 << 16) for _ in range(4)], nn.Linear(256, 10))
        x = torch.randn(512, 256)
        loss_fn = cross_entropy_of(torch.randint(0, 10, (512,)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        saved, step, current, problem = recorded_problem(model, x, loss_fn, opt)
        blocks = [i for i, c in enumerate(problem.calls) if isinstance(c.module, Observed)]
        self.assertEqual(len(blocks), 4)
        for i in blocks:
            self.assertEqual(list(dict(problem.calls[i].changed_buffers).values()), [1 << 18])
        self.assertEqual([c.changed_buffers for c in problem.calls
                          if not isinstance(c.module, Observed)], [()] * (len(problem.calls) - 4))
        for chosen in [blocks[:1], blocks[1:2], blocks[:2], blocks[2:3], blocks[3:], blocks]:
            measured = fitting._measure_plan(step, problem.calls, tuple(chosen))
            predicted = _C.fit.predicted_peak(problem.base, problem.atoms, problem.candidates,
                                              list(chosen),
                                              **problem.options)
            self.assertLessEqual(abs(predicted - measured), 64, (chosen, predicted, measured))
        saved.restore()

    def test_a_module_changing_a_buffer_through_data_is_never_checkpointed(self):
        # Its recompute would read the changed value (the version counter never moved, so no
        # checkpoint rewinds it): gradients silently off. fit finds such modules by value in
        # its recorded step and checkpoints what lies inside them instead (each block's body);
        # training equals the unfitted twin's in float64.
        check_no_checkpoint_holds_a_data_change(self, "cpu")

    def test_a_module_given_a_cache_its_forward_updates_is_never_checkpointed(self):
        # A recompute would update the cache again and attend over twice the keys: before
        # 2026-11-28 fit checkpointed the attention modules (and transformers' GPT-2
        # attention, use_cache=True), and gradients were 100 % off, silently. Now no module
        # called with such an object (nor one it runs inside) is checkpointed, fit says so in
        # a warning, and training through the plan equals the unfitted twin's in float64;
        # without a cache (use_cache=False), the same modules are candidates again.
        for use_cache in (True, False):
            with self.subTest(use_cache=use_cache):
                torch.manual_seed(0)
                model = CachedLM(use_cache=use_cache).double()
                twin = copy.deepcopy(model)
                x = torch.randn(4, 64, 32, dtype=torch.double)
                loss_fn = lm_loss_of(torch.randint(0, 16, (4, 64)))
                opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                opt_twin = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    least, eager = least_and_eager(self, model, x, loss_fn, opt)
                    self.assertLess(least, eager)
                    plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
                said = [str(w.message) for w in caught if "KeyValueCache" in str(w.message)]
                checkpointed = [a.path for a in plan.actions if a.action == "checkpoint"]
                self.assertTrue(checkpointed, str(plan))
                called_with_cache = {f"blocks.{i}" for i in range(3)} | {
                    f"blocks.{i}.attn" for i in range(3)}
                if use_cache:
                    self.assertTrue(said)
                    self.assertIn("blocks.0, blocks.0.attn", said[0])
                    self.assertFalse(called_with_cache & set(checkpointed), str(plan))
                else:
                    self.assertFalse(said)
                    self.assertTrue(called_with_cache & set(checkpointed), str(plan))
                train_alike(model, opt, twin, opt_twin, x, loss_fn, rtol=1e-9, atol=1e-11)
                self.assertLessEqual(step_peak(model, (x,), loss_fn, opt), least)
                plan.undo()

    def test_runs_of_sibling_modules(self):
        # fit's finer candidates: consecutive sibling calls that hand one tensor along. Only
        # those whose inner tensors nothing else reads: here b..c and d..e (a's output is read
        # again by the sum; an op stands between c and d; g is called twice).
        from memlean import fitting

        class Siblings(nn.Module):
            def __init__(self):
                super().__init__()
                for name in "abcdefg":
                    self.add_module(name, nn.Sequential(nn.Linear(16, 16), nn.Tanh()))

            def forward(self, x):
                h = self.a(x)
                y = self.c(self.b(h))
                w = self.e(self.d(y * 2))
                return self.g(self.f(self.g(w))) + h

        torch.manual_seed(0)
        model = Siblings().double()
        x = torch.randn(64, 16, dtype=torch.double, requires_grad=True)
        inputs, loss_fn, device = fitting._check(model, x, lambda o: o.square().sum(), None)
        step = fitting._Step(model, inputs, loss_fn, None, device)
        measured = step.run(record=True, dataflow=True)
        runs = fitting._runs(measured.recorder, measured.recorder, model)
        problem = fitting._problem(measured, model, runs)
        paths = fitting._paths(model)
        found = {c.module.path(paths) for c in problem.calls if isinstance(c.module, fitting._Run)}
        # Inside each Sequential: Linear then Tanh is a run too, but it is all of its parent.
        self.assertEqual(found, {"(b..c)", "(d..e)"})

        # The recorded step tells storages apart by identity, not address: a storage freed in
        # the forward (each Linear's output, once its Tanh ran) leaves its address to a later
        # one (d's output can take c's Linear's: d..e then looked handed to a call outside
        # it, likely why CI under torch 2.13 once missed it). Here every storage of a size
        # has one address, as if the allocator reused each at once: the same runs are found.
        memstats = memlean.memstats
        storage_key = memstats.storage_key
        try:
            memstats.storage_key = lambda t: ("nbytes", t.untyped_storage().nbytes())
            colliding = step.run(record=True, dataflow=True).recorder
        finally:
            memstats.storage_key = storage_key
        self.assertEqual({fitting._Run((colliding.calls[k].module for k in run), model).path(paths)
                          for run in fitting._runs(colliding, colliding, model)},
                         {"(b..c)", "(d..e)"})

        # Checkpointed, they train as without: output, input gradient, parameter gradients
        # (float64 autograd as the reference).
        reference = copy.deepcopy(model)
        xr = x.detach().clone().requires_grad_()
        reference(xr).square().sum().backward()
        undo = [fitting._wrap(c.module) for c in problem.calls if isinstance(c.module, fitting._Run)]
        x.grad = None
        out = model(x)
        out.square().sum().backward()
        self.assertTrue(torch.allclose(out, reference(xr)))
        self.assertTrue(torch.allclose(x.grad, xr.grad))
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            self.assertTrue(torch.allclose(p.grad, q.grad), name)
        for u in reversed(undo):
            u()
        self.assertEqual(wrapped_forwards(model), [])

    def test_timm_act_layer_memlean_swish(self):
        # timm builds its activations from act_layer: with memlean.Swish(variant="naive") fit
        # swaps them to the in-place variant (saving memory with no recompute) and keeps every
        # budget; with plain memlean.Swish (in place already, as timm's inplace=True selects)
        # there is nothing to swap and the budgets are kept by checkpoints alone.
        import functools

        import optional_deps

        if not optional_deps.available("timm"):
            self.skipTest("timm: this environment is made without it (MEMLEAN_WITHOUT)")
        import timm

        for variant in ["naive", None]:
            with self.subTest(variant=variant):
                torch.manual_seed(0)
                act = (functools.partial(memlean.Swish, variant=variant) if variant
                       else memlean.Swish)
                model = timm.create_model("efficientnet_b0", pretrained=False, num_classes=3,
                                          act_layer=act).train()
                x = torch.randn(2, 3, 64, 64)
                loss_fn = cross_entropy_of(torch.tensor([0, 2]))
                opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                least, eager, _ = self.check_budgets(model, (x,), loss_fn, opt, count=3)
                self.assertLess(least, eager)
                plan = memlean.fit(model, (x,), eager - 1, loss_fn=loss_fn, optimizer=opt)
                swaps = [a for a in plan.actions if a.action.endswith("swish")]
                if variant == "naive":
                    self.assertGreater(len(swaps), 20, str(plan))
                    self.assertTrue(all(a.action == "inplace swish" for a in swaps), str(plan))
                else:
                    self.assertEqual(swaps, [], str(plan))
                    self.assertTrue(plan.actions, str(plan))
                plan.undo()

    def test_budget_strings(self):
        model, x, loss_fn, opt = self.conv_setup()
        plan = memlean.fit(model, x, "1TiB", loss_fn=loss_fn, optimizer=opt)
        self.assertEqual(plan.budget_bytes, 2**40)
        self.assertEqual(memlean.parse_budget("512MiB"), 512 * 2**20)
        self.assertEqual(memlean.parse_budget("2.5GB"), 2_500_000_000)
        self.assertEqual(memlean.parse_budget("6 gib"), 6 * 2**30)
        # Whole numbers exactly, beyond a double's 2^53 and up to int64's largest.
        self.assertEqual(memlean.parse_budget("9007199254740993"), 2**53 + 1)
        self.assertEqual(memlean.parse_budget("+9223372036854775807 B"), 2**63 - 1)
        self.assertEqual(memlean.parse_budget("8589934591GiB"), 2**63 - 2**30)
        self.assertEqual(memlean.parse_budget(2**63 - 1), 2**63 - 1)
        for text in ("9223372036854775808", "8589934592GiB", "99999999999999999999999 KB"):
            with self.assertRaisesRegex(ValueError, "budget_bytes: more than int64 bytes"):
                memlean.parse_budget(text)

    def test_fit_leaves_the_training_state_as_it_found_it(self):
        model, x, loss_fn, opt = self.conv_setup()
        # A step first: gradients and momentum exist, as in a training loop.
        loss_fn(model(x)).backward()
        opt.step()
        loss_fn(model(x)).backward()
        model.eval()
        model.head.train()
        before = snapshot(model, opt)
        flags = [m.training for m in model.modules()]
        momenta = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
        least, eager = self.least_and_eager(model, x, loss_fn, opt)
        plan = memlean.fit(model, x, (least + eager) // 2, loss_fn=loss_fn, optimizer=opt)
        self.assertTrue(any(a.action == "checkpoint" for a in plan.actions), str(plan))
        assert_same_state(self, before, snapshot(model, opt))
        self.assertEqual(flags, [m.training for m in model.modules()])
        # The optimizer's own state tensors, put back in place: a reference the caller holds
        # stays valid (and on CUDA, so do their allocator blocks, which the budget counts).
        for p, m in zip(model.parameters(), momenta):
            self.assertIs(opt.state[p]["momentum_buffer"], m)
        plan.undo()
        # A batch that requires grad (adversarial training, input attributions): its gradient
        # is left as it was too, none or the caller's own tensor (before 2026-11-29 fit left
        # the sum of its steps' input gradients in x.grad). Each measured step begins, as a
        # fresh batch, without one: the same plan and peak as for a batch without grad.
        mine = torch.full_like(x, 7.0)
        for grad in (None, mine):
            with self.subTest(grad=grad is not None):
                x_grad = x.detach().clone().requires_grad_()
                x_grad.grad = grad
                again = memlean.fit(model, x_grad, (least + eager) // 2, loss_fn=loss_fn,
                                    optimizer=opt)
                self.assertIs(x_grad.grad, grad)
                if grad is not None:
                    self.assertTrue(torch.equal(grad, torch.full_like(x, 7.0)))
                again.undo()
                self.assertEqual((changes(again), again.peak_bytes),
                                 (changes(plan), plan.peak_bytes))

    def test_fit_holds_nothing_beyond_its_steps_and_copies_and_leaves_nothing(self):
        # While fit runs it holds its steps' bytes and its copies of what it puts back
        # (parameters, buffers, Adam's state, the RNG's state: on the CPU, so on CUDA no device
        # memory), nothing more, and leaves nothing behind: on the CPU, where the copies live,
        # the most memstats sees above fit's start is the eager step's bytes above its
        # resident ones plus the copies. Every stage runs: a FitError (swaps, checkpoints,
        # channel slices) and a plan halfway. (memlean::fit: HoldsNothingBeyondItsSteps...)
        model, x, loss_fn, _ = classified(FlatMBNet, 32)
        opt = torch.optim.Adam(model.parameters(), 1e-3)
        loss_fn(model(x)).backward()
        opt.step()
        opt.zero_grad()
        copies = sum(t.nbytes for t in list(model.parameters()) + list(model.buffers()))
        copies += sum(t.nbytes for state in opt.state.values() for t in state.values()
                      if isinstance(t, torch.Tensor))
        copies += torch.get_rng_state().nbytes
        eager = memlean.fit(model, x, "1TiB", loss_fn=loss_fn, optimizer=opt)
        step = eager.eager_peak_bytes - eager.fixed_bytes
        least = None
        for budget in (1, None):
            gc.collect()  # (earlier tests' garbage, which the collect below would free)
            with memlean.memstats.Tracker() as tracker:
                start = tracker.current
                if budget is None:
                    budget = (least + eager.eager_peak_bytes) // 2
                    plan = memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt)
                    self.assertTrue(any(a.action == "checkpoint" for a in plan.actions),
                                    str(plan))
                    plan.undo()
                    del plan
                else:
                    with self.assertRaises(memlean.FitError) as caught:
                        memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt)
                    least = caught.exception.least_peak_bytes
                    del caught
                gc.collect()
                self.assertEqual(tracker.current, start, f"fit left bytes behind ({budget})")
                self.assertLessEqual(tracker.peak - start, step + copies, f"budget {budget}")

    def test_a_fresh_optimizer_is_measured_with_the_state_a_real_first_step_gives(self):
        # fit gives a stateless optimizer its state by a step on zero gradients, except where
        # a real first step would give other state: a parameter that gets no gradient (no
        # state at all) and a sparse gradient (sparse momentum). Each: fit's eager peak is
        # the step measured here after a real first step, and the optimizer is left empty.
        class WithUnused(nn.Module):
            def __init__(self):
                super().__init__()
                self.net = ConvNet()
                self.unused = nn.Parameter(torch.zeros(50_000))

            def forward(self, x):
                return self.net(x)

        class SparseBag(nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = nn.Embedding(20_000, 16, sparse=True)
                self.head = nn.Sequential(nn.Linear(16, 64), nn.SiLU(), nn.Linear(64, 1))

            def forward(self, idx):
                return self.head(self.emb(idx).mean(1))

        x = torch.randn(8, 3, 24, 24)
        cases = [("unused parameter, AdamW", WithUnused(), x,
                  lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3)),
                 ("dense, SGD momentum", ConvNet(), x,
                  lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)),
                 ("sparse gradient, SGD momentum", SparseBag(), torch.randint(0, 20_000, (8, 5)),
                  lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))]
        for name, model, inputs, make_opt in cases:
            with self.subTest(name):
                opt = make_opt(model)
                plan = memlean.fit(model, inputs, 2**50, loss_fn=lambda o: o.sum(), optimizer=opt)
                self.assertEqual(len(opt.state), 0, "fit left the optimizer's state")
                step_peak(model, (inputs,), lambda o: o.sum(), opt)  # a real first step
                self.assertEqual(plan.eager_peak_bytes,
                                 step_peak(model, (inputs,), lambda o: o.sum(), opt))

    def test_fitted_training_equals_eager_training(self):
        # float64, no Swish (checkpoints only): equal to float tolerance; three steps with
        # BatchNorm statistics and dropout (the RNG is preserved for the recompute).
        torch.manual_seed(1)
        model = ConvNet(act=nn.ReLU).double()
        model.blocks = nn.ModuleList([b for b in model.blocks if isinstance(b, ConvBlock)])
        for b in model.blocks:
            b.act1, b.act2 = nn.ReLU(), nn.ReLU()
        x = torch.randn(6, 3, 20, 20, dtype=torch.float64)
        y = torch.randint(0, 10, (6,))
        twin = copy.deepcopy(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt_twin = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
        loss_fn = cross_entropy_of(y)
        least, eager = self.least_and_eager(model, x, loss_fn, opt)
        plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
        self.assertGreaterEqual(sum(a.action == "checkpoint" for a in plan.actions), 2, str(plan))
        train_alike(model, opt, twin, opt_twin, x, loss_fn, rtol=1e-10, atol=1e-12)

    def test_checkpoints_nest_inside_checkpoints(self):
        # Compound candidates (_with_compounds): a module or run checkpointed around the
        # checkpoints inside it, which its recompute runs, keeps its input alone where they
        # kept one each. BottleneckNet with runs, float64: the least peak is lower than
        # without compounds (exact bytes: 14 % here), predicted to the byte and measured
        # again apart from fit; the plan nests (a wrapped forward inside another), and
        # apply_plan makes it again, to the byte; three training steps equal the unfitted
        # twin's (gradients, parameters, BatchNorm statistics); undo leaves nothing wrapped.
        def setup():
            model, x, loss_fn, opt = classified(BottleneckNet, 32)
            return model.double(), x.double(), loss_fn, opt

        def nests(model, plan):
            wrapped = wrapped_forwards(model)
            return any(q.startswith(p + ".") for p in wrapped for q in wrapped)

        self.check_compounds_lower_the_least(setup, 0.95, nests)

    def check_compounds_lower_the_least(self, setup, below, nests):
        """With runs, setup()'s model fitted at its least peak: that least is below `below`
        times the least without compounds, predicted to the byte and measured again apart
        from fit; nests(model, plan) holds; three training steps equal an unfitted twin's
        (float64, to 1e-10); apply_plan on another twin makes the same plan, to the byte,
        wrapping the same forwards, its checkpoints at the same depths (and from JSON without
        depths, as plans saved before them, at depth 0); str(plan) shows each
        nested one below its outer one, indented by its depth; undo leaves nothing
        wrapped."""
        with plain_checkpoints():
            plain, _ = self.least_and_eager(*setup(), runs=True)
        model, x, loss_fn, opt = setup()
        twin, twin2 = copy.deepcopy(model), copy.deepcopy(model)
        least, _ = self.least_and_eager(model, x, loss_fn, opt, runs=True)
        self.assertLess(least, plain * below)
        plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt, runs=True)
        self.assertEqual(plan.peak_bytes, least)
        self.assertEqual(plan.predicted_peak_bytes, least)
        self.assertTrue(nests(model, plan), str(plan))
        opt_twin = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
        train_alike(model, opt, twin, opt_twin, x, loss_fn, rtol=1e-10, atol=1e-12)
        self.assertEqual(step_peak(model, (x,), loss_fn, opt), least)
        wrapped = wrapped_forwards(model)
        opt2 = torch.optim.SGD(twin2.parameters(), lr=0.05, momentum=0.9)
        applied = memlean.apply_plan(twin2, x, plan.to_json(), loss_fn=loss_fn, optimizer=opt2)
        self.assertEqual(changes(applied), changes(plan))
        self.assertEqual(applied.peak_bytes, least)
        self.assertEqual(wrapped_forwards(twin2), wrapped)
        # Each nested checkpoint's depth, kept by apply_plan, and shown under its outer one.
        depths = [a.depth for a in plan.actions]
        self.assertGreater(max(depths), 0)
        self.assertEqual([a.depth for a in applied.actions], depths)
        lines = str(plan).splitlines()
        for k, a in enumerate(plan.actions):
            if a.depth:
                row = next(i for i, line in enumerate(lines)
                           if line.startswith("  " + "  " * a.depth + a.path + " "))
                outer = next(b for b in plan.actions[k + 1:] if b.depth == a.depth - 1)
                above = [line for line in lines[:row]
                         if line.startswith("  " + "  " * outer.depth + outer.path + " ")]
                self.assertTrue(above, (a.path, outer.path, lines))
        # A plan saved before FitAction.depth (no "depth" in its actions) applies as well.
        applied.undo()
        old = json.loads(plan.to_json())
        for a in old["actions"]:
            del a["depth"]
        applied = memlean.apply_plan(twin2, x, json.dumps(old), loss_fn=loss_fn, optimizer=opt2)
        self.assertEqual(changes(applied), changes(plan))
        self.assertEqual(applied.peak_bytes, least)
        self.assertEqual({a.depth for a in applied.actions}, {0})
        plan.undo()
        applied.undo()
        self.assertEqual(wrapped_forwards(model), [])
        self.assertEqual(wrapped_forwards(twin2), [])

    def test_runs_nest_inside_sibling_runs(self):
        # A run of sibling modules nested in a run of the same parent: the outer run's chain,
        # not the parent's forward, calls the inner run's modules in its recompute, and runs
        # them as one there too (_CHAINS). A flat nn.Sequential of Linear and Tanh layers
        # (float64), whose only candidates are its layers and runs of them: compounds lower
        # its least (by 19 % here; without nested runs, not at all), predicted to the byte and
        # measured again apart from fit; the plan nests runs of the same modules; three
        # training steps equal the unfitted twin's; apply_plan makes it again, to the byte;
        # undo leaves nothing wrapped.
        def setup():
            torch.manual_seed(0)
            layers = []
            for _ in range(12):
                layers += [nn.Linear(64, 64), nn.Tanh()]
            model = nn.Sequential(*layers, nn.Linear(64, 10)).double()
            x = torch.randn(512, 64, dtype=torch.float64)
            return (model, x, cross_entropy_of(torch.randint(0, 10, (512,))),
                    torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))

        def nests(model, plan):
            spans = [tuple(map(int, a.path.strip("()").split(".."))) for a in plan.actions]
            return any(b0 <= b1 and e1 <= e0 and (b0, e0) != (b1, e1)
                       for b0, e0 in spans for b1, e1 in spans)

        self.check_compounds_lower_the_least(setup, 0.9, nests)

    def test_hooks_added_to_a_runs_modules_after_fit_are_a_clear_error(self):
        # A run's first module calls all of its modules' forwards, so a hook added to one of
        # them after fit (FSDP2's fully_shard adds them; before this check, fully_shard on
        # blocks of a run failed with DTensor's "mixed Tensor and DTensor" error, and a user's
        # forward hook on a later module saw the run's output, not its module's) would not run
        # around its module's forward: the training step raises, naming the run and the
        # module. Without grad the modules run as they are, hooks included; plan.undo()
        # leaves them as they were.
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.Tanh())],
                              nn.Linear(64, 10)).double()
        x = torch.randn(256, 64, dtype=torch.float64)
        loss_fn = cross_entropy_of(torch.randint(0, 10, (256,)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        least, _ = self.least_and_eager(model, x, loss_fn, opt, runs=True)
        plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt, runs=True)
        run = next(a.path for a in plan.actions if a.path.startswith("("))
        later = str(int(run.strip("()").split("..")[0]) + 1)
        seen = []
        handle = model.get_submodule(later).register_forward_hook(
            lambda m, i, o: seen.append(o.shape))
        with self.assertRaisesRegex(RuntimeError, rf"the run \(\d+\.\.\d+\).*"
                                    rf"{type(model[int(later)]).__name__} {later} has hooks"
                                    rf".*fully_shard"):
            loss_fn(model(x)).backward()
        with torch.no_grad():
            model(x)
        self.assertEqual(len(seen), 1)
        handle.remove()
        loss_fn(model(x)).backward()  # (without the hook: the plan as it was)
        plan.undo()
        handle = model.get_submodule(later).register_forward_hook(
            lambda m, i, o: seen.append(o.shape))
        loss_fn(model(x)).backward()
        self.assertEqual(len(seen), 2)
        # Fitted again with the hook in place, as the error says: no run through its module,
        # and the hook sees its module's output once a step.
        least, _ = self.least_and_eager(model, x, loss_fn, opt, runs=True)
        plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt, runs=True)
        spans = [tuple(map(int, a.path.strip("()").split(".."))) for a in plan.actions
                 if a.path.startswith("(")]
        self.assertTrue(spans, str(plan))
        self.assertFalse([s for s in spans if s[0] <= int(later) <= s[1]], str(plan))
        seen.clear()
        loss_fn(model(x)).backward()
        self.assertEqual(seen, [torch.Size([256, 64])])

    def test_no_run_inside_a_region_its_parent_enters(self):
        # torchvision's memory-efficient DenseNet layer runs its bottleneck (norm, ReLU, 1x1
        # convolution) inside torch.utils.checkpoint from its own forward: torch's recompute
        # runs those modules again without the layer's forward, which is where a run's chain
        # (and a sliced chain) takes them over. Sliced, the recompute ran them in turn, saved
        # other tensors and raised CheckpointError in fit's sliced step; fit warned and gave
        # slicing up (torchvision densenet121(memory_efficient=True), 96², batch 4, runs,
        # 2026-11-30). Such calls are in no run: no warning, every budget kept, training at
        # the least equal to the unfitted twin's (float64).
        class CheckpointedBottleneck(nn.Module):
            def __init__(self, c):
                super().__init__()
                self.norm, self.act, self.conv = nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c, 1)

            def forward(self, x):
                return x + torch.utils.checkpoint.checkpoint(
                    lambda t: self.conv(self.act(self.norm(t))), x, use_reentrant=False)

        def make():
            return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1),
                                 *[CheckpointedBottleneck(16) for _ in range(3)],
                                 nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))

        from memlean import fitting

        torch.manual_seed(0)
        model = make().double()
        twin = copy.deepcopy(model)
        x = torch.randn(8, 3, 32, 32, dtype=torch.float64)
        loss_fn = cross_entropy_of(torch.randint(0, 10, (8,)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt_twin = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
        with mock.patch.object(fitting, "_SLICE_MIN_BYTES", 0), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            least, _ = self.least_and_eager(model, x, loss_fn, opt, runs=True)
            plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt, runs=True)
            self.assertEqual([str(w.message)[:200] for w in caught
                              if issubclass(w.category, RuntimeWarning)], [])
            self.assertLessEqual(plan.peak_bytes, least)
            self.assertFalse([a.path for a in plan.actions if ".(norm" in a.path
                              or a.action == "sliced recompute"], str(plan))
            train_alike(model, opt, twin, opt_twin, x, loss_fn, rtol=1e-9, atol=1e-11)
        plan.undo()
        self.assertEqual(wrapped_forwards(model), [])

    def test_no_run_spans_the_end_of_a_torch_checkpoint_region(self):
        # A model that checkpoints its own blocks with torch.utils.checkpoint (as timm's
        # set_grad_checkpointing does): its blocks are called inside a checkpoint region each,
        # the head's modules after them outside any; all are calls of the root's forward in
        # turn. A run of the last block and the head would carry the head into the block's
        # region, whose recompute then fails (torch's CheckpointError: timm's efficientnet_b0
        # so, 2026-11-29): fit offers runs only of calls in one context (grad mode,
        # saved-tensors region, autocast). Fitted at its least with runs=True: a run of the
        # head's modules, none through a block; training equals the unfitted twin's (the old
        # code raised CheckpointError in fit's own measured step). Nor does an MLP split
        # between modules span it (_split_mlps: the last block's Linear, inside its region,
        # and fc1 after it were sliced as one, whose recompute failed in fit's sliced step:
        # fit warned and went on without slicing, its least 3 % higher): the head's MLP is
        # sliced, with no warning.
        class SelfCheckpointed(nn.Module):
            def __init__(self):
                super().__init__()
                self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh())
                                            for _ in range(3))
                self.fc1, self.act1 = nn.Linear(64, 256), nn.Tanh()
                self.fc2, self.act2 = nn.Linear(256, 256), nn.Tanh()
                self.out = nn.Linear(256, 10)

            def forward(self, x):
                for b in self.blocks:
                    x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
                return self.out(self.act2(self.fc2(self.act1(self.fc1(x)))))

        torch.manual_seed(0)
        model = SelfCheckpointed().double()
        twin = copy.deepcopy(model)
        x = torch.randn(2048, 64, dtype=torch.float64)
        loss_fn = cross_entropy_of(torch.randint(0, 10, (2048,)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            least, _ = self.least_and_eager(model, x, loss_fn, opt, runs=True)
            plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt, runs=True)
        self.assertEqual([str(w.message) for w in caught
                          if issubclass(w.category, RuntimeWarning)], [])
        self.assertIn(("(fc1..fc2)", "sliced mlp"), [(a.path, a.action) for a in plan.actions],
                      str(plan))
        self.assertTrue(any(a.path.startswith("(") for a in plan.actions), str(plan))
        self.assertFalse([a.path for a in plan.actions if "blocks" in a.path
                          and a.path.startswith("(")], str(plan))
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
            loss_fn(m(x)).backward()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)

    def test_chains_inside_a_torch_checkpoint_region_are_sliced(self):
        # Blocks that checkpoint themselves with torch.utils.checkpoint (timm's
        # set_grad_checkpointing): fit's recorder sees nothing such a region saves, so no
        # prediction of what slicing the chains inside reach may skip measuring it. With
        # runs=True fit predicted slicing no lower than checkpoints alone and never measured
        # it: timm's efficientnet_b0 so checkpointed (batch 8, 128²) had a least of 99,515,884
        # bytes with runs, 78,553,238 without (2026-11-30). Here with runs the chains are
        # sliced as without, the least no higher, and training equals the unfitted twin's.
        class SelfCheckpointed(FlatMBNet):
            def forward(self, x):
                x = self.stem(x)
                for b in self.blocks:
                    x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
                return self.head(x)

        model, x, loss_fn, opt = classified(SelfCheckpointed, 32)
        least = {}
        for runs in (False, True):
            least[runs], _ = self.least_and_eager(model, x, loss_fn, opt, runs=runs)
            plan = memlean.fit(model, x, least[runs], loss_fn=loss_fn, optimizer=opt,
                               runs=runs)
            self.assertIn("sliced recompute", {a.action for a in plan.actions}, str(plan))
            plan.undo()
        self.assertLessEqual(least[True], least[False])
        model, twin, x, opt, opt_twin = relu_twins_float64(SelfCheckpointed, x)
        least, _ = self.least_and_eager(model, x, loss_fn, opt, runs=True)
        plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt, runs=True)
        self.assertIn("sliced recompute", {a.action for a in plan.actions}, str(plan))
        train_alike(model, opt, twin, opt_twin, x, loss_fn, rtol=1e-9, atol=1e-11)

    def test_a_search_misled_by_compounds_falls_back_to_plain_checkpoints(self):
        # Where plans with compounds measure above their prediction, fit searches the plain
        # checkpoints too when the least it measured is above what they are predicted to
        # reach: here compounds that lie (each its outer module's plain checkpoint, said to
        # hold nothing in its recompute) still leave fit the plain least, exactly.
        from memlean import fitting

        real = fitting._with_compounds

        def lying(problem):
            made, n = real(problem), len(problem.candidates)
            self.assertGreater(len(made.candidates), n)
            return replace(made, calls=made.calls[:n] + [
                replace(c, module=c.module.outer) for c in made.calls[n:]],
                nested=[-1] * n + [0] * (len(made.candidates) - n))

        model, x, loss_fn, opt = classified(BottleneckNet, 16)
        with plain_checkpoints():
            plain, _ = self.least_and_eager(model, x, loss_fn, opt, runs=True)
        with mock.patch.object(fitting, "_with_compounds", lying):
            least, _ = self.least_and_eager(model, x, loss_fn, opt, runs=True)
            plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt, runs=True)
        self.assertEqual(least, plain)
        self.assertEqual(plan.peak_bytes, plain)
        plan.undo()
        self.assertEqual(wrapped_forwards(model), [])

    def test_fine_tuning_with_frozen_parameters(self):
        # Fine-tuning paths: the stem and the first two blocks frozen (their BatchNorms still
        # train their statistics), and every BatchNorm's affine parameters frozen; the
        # optimizer given the trainable parameters only (also runs=True, whose runs and
        # slices cross frozen modules). Budgets kept in exact bytes; at the least peak, three
        # float64 training steps (ReLU: no Swish swap, so to float tolerance) equal the
        # model's without the plan: gradients, parameters, BatchNorm statistics; frozen
        # parameters get no gradient.
        def frozen(model, case):
            if case == "stem and blocks 0-1":
                for m in [model.stem, model.blocks[0], model.blocks[1]]:
                    m.requires_grad_(False)
            else:
                for m in model.modules():
                    if isinstance(m, nn.BatchNorm2d):
                        m.requires_grad_(False)
            return model

        def sgd(model):
            return torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                   lr=0.05, momentum=0.9)

        for case in ("stem and blocks 0-1", "batchnorm affine"):
            for runs in (False, True):
                with self.subTest(case=case, runs=runs):
                    torch.manual_seed(0)
                    model, x, loss_fn, _ = self.conv_setup()
                    frozen(model, case)
                    self.check_budgets(model, (x,), loss_fn, sgd(model), count=3, runs=runs)
                    torch.manual_seed(1)
                    model = frozen(ConvNet(act=nn.ReLU).double(), case)
                    twin = copy.deepcopy(model)
                    x64 = x.double()
                    opt, opt_twin = sgd(model), sgd(twin)
                    least, _ = self.least_and_eager(model, x64, loss_fn, opt, runs=runs)
                    plan = memlean.fit(model, x64, least, loss_fn=loss_fn, optimizer=opt,
                                       runs=runs)
                    self.assertTrue(any(a.action == "checkpoint" for a in plan.actions),
                                    str(plan))
                    train_alike(model, opt, twin, opt_twin, x64, loss_fn, rtol=1e-9,
                                atol=1e-11)
                    for p in model.parameters():
                        self.assertEqual(p.grad is None, not p.requires_grad)
                    plan.undo()

    def test_sliced_recompute_below_what_checkpoints_reach(self):
        # Below the least that checkpoints reach, fit recomputes each block's channelwise
        # chain (conv_pw .. act2) slice by slice of channels: a lower least, every budget down
        # to it kept in exact bytes, and training equal to eager's (float64: gradients,
        # BatchNorm statistics and num_batches_tracked after 3 steps).
        model, x, loss_fn, opt, without = self.flat_setup()
        least, eager, actions = self.check_budgets(model, (x,), loss_fn, opt, count=4)
        self.assertLess(least, 0.9 * without, (least, without))
        sliced = sorted({a.path for a in actions if a.action == "sliced recompute"})
        # (blocks.3's, at 8x8, is under 1 MiB: not worth its recompute.)
        self.assertEqual(sliced, [f"blocks.{i}.(conv_pw..act2)" for i in range(3)])
        # In float64 with ReLU (no Swish swap, so equal to float tolerance), trained 3 steps.
        model, twin, x, opt, opt_twin = relu_twins_float64(FlatMBNet, x)
        least, _ = self.least_and_eager(model, x, loss_fn, opt)
        plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
        sliced = {a.path for a in plan.actions if a.action == "sliced recompute"}
        self.assertGreaterEqual(len(sliced), 3, str(plan))
        self.assertIn(f"{len(sliced)} chain(s) recomputed in channel slices", str(plan))
        train_alike(model, opt, twin, opt_twin, x, loss_fn, rtol=1e-9, atol=1e-11)
        # Compiled (aot_eager), the fitted model trains as the twin does (the sliced chains
        # run as their modules there: eager-only, like runs).
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
        loss_fn(torch.compile(model, backend="aot_eager")(x)).backward()
        loss_fn(twin(x)).backward()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-11, msg=name)
        # eval and no_grad run the modules as they are; undo puts every forward back.
        model.eval()
        twin.eval()
        with torch.no_grad():
            torch.testing.assert_close(model(x), twin(x), rtol=1e-10, atol=1e-12)
        self.assertEqual(model.state_dict().keys(), twin.state_dict().keys())
        plan.undo()
        self.assertEqual(wrapped_forwards(model), [])

    def test_fit_slices_the_chains_its_budget_needs(self):
        # Between slicing's least and what checkpoints alone reach, fit slices the chains that
        # save the most first, as few as its planner predicts to be fastest (_chains_needed),
        # not all of them: each sliced chain costs its forward again. The plan keeps its
        # budget, is predicted to the byte, and apply_plan makes it again (the same subset).
        from memlean import fitting

        model, x, loss_fn, opt, without = self.flat_setup()
        least, _ = self.least_and_eager(model, x, loss_fn, opt)
        budget = least + (without - least) * 4 // 5
        model, x, loss_fn, opt = classified(FlatMBNet, 32)
        twin = copy.deepcopy(model)
        opt_twin = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
        plan = memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt)
        sliced = sorted(a.path for a in plan.actions if a.action == "sliced recompute")
        # (At the least, blocks.0..2's chains are sliced: test_sliced_recompute_below_...)
        self.assertTrue(sliced, str(plan))
        self.assertLess(len(sliced), 3, str(plan))
        self.assertIn("blocks.0.(conv_pw..act2)", sliced)  # (the chain saving the most)
        self.assertLessEqual(plan.peak_bytes, budget)
        self.assertEqual(plan.predicted_peak_bytes, plan.peak_bytes)
        step_peak(model, (x,), loss_fn, opt)  # (a warm step: the optimizer's state)
        self.assertEqual(step_peak(model, (x,), loss_fn, opt), plan.peak_bytes)
        applied = memlean.apply_plan(twin, x, plan.to_json(), loss_fn=loss_fn,
                                     optimizer=opt_twin)
        self.assertEqual([(a.path, a.action) for a in applied.actions],
                         [(a.path, a.action) for a in plan.actions])
        self.assertEqual(applied.peak_bytes, plan.peak_bytes)
        # Where the fewer chains, measured, do not fit (the planner predicts them at their
        # lowest), fit slices all of them after all, from the lean step again: here made so
        # by offering it the smallest chain alone, at slicing's least.
        slicing = fitting._Fitting._slicing

        def fit_offered_one_chain(model, x, loss_fn, opt, least):
            smallest = mock.patch.object(fitting, "_chains_needed",
                                         lambda m, chains, *a: chains[-1:])
            with smallest, mock.patch.object(fitting._Fitting, "_slicing", autospec=True,
                                             side_effect=slicing) as tries:
                plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
            self.assertEqual(tries.call_count, 2)
            self.assertEqual(plan.peak_bytes, least)
            step_peak(model, (x,), loss_fn, opt)
            self.assertEqual(step_peak(model, (x,), loss_fn, opt), least)
            return plan

        model, x, loss_fn, opt = classified(FlatMBNet, 32)
        plan = fit_offered_one_chain(model, x, loss_fn, opt, least)
        self.assertEqual(sorted(a.path for a in plan.actions if a.action == "sliced recompute"),
                         [f"blocks.{i}.(conv_pw..act2)" for i in range(3)])
        plan.undo()
        self.assertEqual(wrapped_forwards(model), [])
        # The same where the lean step was predicted, not measured (ReLU: lean backwards
        # alone, _lean_step_predicted): the first try keeps the lean modules and measures
        # that step (its one chain goes no lower than checkpoints alone); the plan makes what
        # an unforced fit makes, each action once.
        def relu_net():
            return FlatMBNet(act=nn.ReLU)

        model, x, loss_fn, opt = classified(relu_net, 32)
        least, _ = self.least_and_eager(model, x, loss_fn, opt)
        unforced = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
        unforced.undo()
        plan = fit_offered_one_chain(model, x, loss_fn, opt, least)
        made = [(a.path, a.action) for a in plan.actions]
        self.assertEqual(len(made), len(set(made)), str(plan))
        self.assertEqual(sorted(made), sorted((a.path, a.action) for a in unforced.actions))
        plan.undo()
        self.assertEqual(wrapped_forwards(model), [])

    def test_sliced_chains_in_a_bf16_autocast_step(self):
        # FlatMBNet trained in a CPU bfloat16 autocast region (fit inside one, each step
        # measured in one of its own): its channel chains are sliced there too (since
        # 2026-11-27, the chain's recompute runs in the forward's autocast state), a lower
        # least than checkpoints alone reach, every budget down to it kept in exact bytes; its
        # BatchNorms and depthwise convolutions get the lean backwards there too (since
        # 2026-11-27, ninth session: bfloat16 inputs, autocast's casts).
        from memlean import fitting

        model, x, loss_fn, opt = classified(FlatMBNet, 32, batch=16)  # (1 MiB in bfloat16)

        def region():
            return torch.autocast("cpu", dtype=torch.bfloat16)

        with mock.patch.object(fitting, "_slices", lambda *a: []):
            without, _ = self.least_and_eager(model, x, loss_fn, opt, fit_region=region)
        least, eager, actions = self.check_budgets(model, (x,), loss_fn, opt, count=4,
                                                   fit_region=region, step_region=region)
        self.assertLess(least, 0.9 * without, (least, without))
        self.assertIn("sliced recompute", {a.action for a in actions})
        self.assertLessEqual({"lean batchnorm", "lean depthwise conv"},
                             {a.action for a in actions})
        self.assertEqual(wrapped_forwards(model), [])

    def test_sliced_chains_whose_head_an_in_place_activation_follows(self):
        # timm's efficientvit_b0 shape: a 1x1 head, no norm (Identity), an in-place Hardswish.
        # Fitted at its least (chains sliced), it trains as its float64 twin; before
        # 2026-11-27 the activation overwrote the head's output the backward takes the
        # gradient of, and input gradients were silently wrong.
        torch.manual_seed(1)
        model = FlatMBNet(act=lambda: nn.Hardswish(inplace=True)).double()
        for block in model.blocks:
            block.bn1 = nn.Identity()
        twin = copy.deepcopy(model)
        x = torch.randn(8, 3, 64, 64, dtype=torch.float64)
        loss_fn = cross_entropy_of(torch.randint(0, 10, (8,)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt_twin = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
        least, _ = self.least_and_eager(model, x, loss_fn, opt)
        plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
        sliced = {a.path for a in plan.actions if a.action == "sliced recompute"}
        self.assertIn("blocks.0.(conv_pw..act2)", sliced, str(plan))
        train_alike(model, opt, twin, opt_twin, x, loss_fn, rtol=1e-9, atol=1e-11)
        plan.undo()
        self.assertEqual(wrapped_forwards(model), [])

    def fitted_at_least_trains_alike(self, model, twin, x, loss_fn, opt, opt_twin, mlps):
        """Fit model (float64) at its least peak (slices of 2 MiB): `mlps` MLPs sliced; then
        3 steps train as the twin's (train_alike); undone, no forward left wrapped."""
        with mock.patch.object(memlean.sliced, "SLICE_BYTES", 1 << 18):
            least, _ = self.least_and_eager(model, x, loss_fn, opt)
            plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
            self.assertIn(f"{mlps} MLP(s) recomputed in hidden-feature slices", str(plan))
            train_alike(model, opt, twin, opt_twin, x, loss_fn, rtol=1e-9, atol=1e-11)
        plan.undo()
        self.assertEqual(wrapped_forwards(model), [])

    def made_at_least_trains_alike(self, make, mlps):
        """make() (seeded, in float64) on a batch of 8 x 128 x 64, square-mean loss, SGD with
        momentum: fitted_at_least_trains_alike beside a copy."""
        torch.manual_seed(0)
        model = make().double()
        twin = copy.deepcopy(model)
        x = torch.randn(8, 128, 64, dtype=torch.float64)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt_twin = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)

        def loss_fn(y):
            return y.square().mean()

        self.fitted_at_least_trains_alike(model, twin, x, loss_fn, opt, opt_twin, mlps)

    def test_sliced_mlps_below_what_checkpoints_reach(self):
        # Below the least that checkpoints reach, fit recomputes each ViT block's MLP slice by
        # slice of its hidden features (memlean.sliced_mlp, keeping only the MLP's input): a
        # lower least than without MLP slicing, every budget down to it kept in exact bytes;
        # training equal to eager's (float64: gradients and parameters after 3 steps).
        model, x, loss_fn, opt = vit_step()
        with mock.patch.object(memlean.sliced, "SLICE_BYTES", 1 << 17):  # 8 slices of 1 MiB
            with mock.patch.object(memlean.sliced, "mlp_parts", lambda modules: None):
                without, _ = self.least_and_eager(model, x, loss_fn, opt)
            least, eager, actions = self.check_budgets(model, (x,), loss_fn, opt, count=4)
        self.assertLess(least, 0.8 * without, (least, without))  # (0.70x here)
        sliced = sorted({a.path for a in actions if a.action == "sliced mlp"})
        self.assertEqual(sliced, [f"blocks.{i}.mlp.(0..3)" for i in range(3)])
        self.assertEqual(wrapped_forwards(model), [])
        torch.manual_seed(1)
        model = ViT().double()
        twin = copy.deepcopy(model)
        x = x.double()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt_twin = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
        self.fitted_at_least_trains_alike(model, twin, x, loss_fn, opt, opt_twin, mlps=3)

    def test_sliced_mlps_in_a_bf16_autocast_step(self):
        # The same ViT trained in a CPU bfloat16 autocast region (fit called inside one, each
        # step measured in one of its own): its MLPs are sliced there too (since 2026-11-27,
        # memlean::sliced_mlp computes in autocast's dtype as nn.Linear does), a lower least
        # than without MLP slicing, every budget down to it kept in exact bytes; the fitted
        # step's gradients float32 and no further from float64 autograd than the unfitted
        # twin's in the same region (twice its error at most; bfloat16's own error is large
        # here: both miss the LayerNorm biases' gradients by their size).
        torch.manual_seed(0)
        model, x = ViT(), torch.randn(16, 128, 48)  # (hidden tensors of 1 MiB in bfloat16)
        loss_fn = cross_entropy_of(torch.randint(0, 10, (16,)))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

        def region():
            return torch.autocast("cpu", dtype=torch.bfloat16)

        with mock.patch.object(memlean.sliced, "SLICE_BYTES", 1 << 16):
            with mock.patch.object(memlean.sliced, "mlp_parts", lambda modules: None):
                without, _ = self.least_and_eager(model, x, loss_fn, opt, fit_region=region)
            least, eager, actions = self.check_budgets(model, (x,), loss_fn, opt, count=4,
                                                       fit_region=region, step_region=region)
            self.assertLess(least, 0.85 * without, (least, without))
            sliced = sorted({a.path for a in actions if a.action == "sliced mlp"})
            self.assertEqual(sliced, [f"blocks.{i}.mlp.(0..3)" for i in range(3)])
            # Predicted to the byte in the region too: autocast's cached bfloat16 copies of the
            # weights live to the region's end, checkpointed or not, so they are base bytes,
            # no checkpoint's saving (counted as saved, these plans were predicted 124,416 to
            # 164,416 bytes low).
            for i in (1, 2, 3):
                with region():
                    plan = memlean.fit(model, x, least + (eager - least) * i // 4,
                                       loss_fn=loss_fn, optimizer=opt)
                self.assertTrue(plan.actions)
                self.assertLessEqual(abs(plan.predicted_peak_bytes - plan.peak_bytes), 64, str(plan))
                plan.undo()
            twin, ref = copy.deepcopy(model), copy.deepcopy(model).double()
            with region():
                plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
            self.assertIn("sliced mlp", {a.action for a in plan.actions})
            for m in (model, twin):
                m.zero_grad(set_to_none=True)
                with region():
                    loss = loss_fn(m(x))
                loss.backward()
            loss_fn(ref(x.double())).backward()
            for (name, p), q, r in zip(model.named_parameters(), twin.parameters(),
                                       ref.parameters()):
                self.assertEqual(p.grad.dtype, torch.float32)
                mine, theirs = ((g.double() - r.grad).abs().max().item() for g in (p.grad, q.grad))
                self.assertLessEqual(mine, 2 * theirs + 1e-3 * r.grad.abs().max().item(), name)
            plan.undo()
        self.assertEqual(wrapped_forwards(model), [])

    def test_gated_mlps_are_found_by_their_dataflow(self):
        # fit slices a module as a gated MLP only where the recorded forward shows
        # down(act(gate(x)) * up(x)) and nothing else: the SwiGLU and its up-first twin, its
        # activation a function (F.silu; F.gelu as GeGLU, its approximate kept), its gate
        # checkpointed by its own forward (torch.utils.checkpoint), not a sum, a scaled or
        # detached product, a residual output, nor a function fit does not know.

        hows = ["swiglu", "add", "up first", "scaled", "functional", "detached", "residual",
                "functional gelu", "functional mish", "functional tanh gelu", "gate in region"]
        found = gated_mlps_of([GatedVariant(8, 16, how) for how in hows])
        self.assertEqual([g.modules[0].how for _, g, _ in found],
                         ["swiglu", "up first", "functional", "functional gelu",
                          "functional tanh gelu", "gate in region"])
        acts = {"functional": (nn.SiLU, None), "functional gelu": (nn.GELU, "none"),
                "functional tanh gelu": (nn.GELU, "tanh")}
        for _, g, _ in found:
            m = g.modules[0]
            self.assertEqual((g.gate, g.up, g.down), (m.w1, m.w3, m.w2))
            if m.how in acts:
                kind, approximate = acts[m.how]
                self.assertEqual([type(a) for a in g.acts], [kind])
                self.assertEqual(getattr(g.acts[0], "approximate", None), approximate)
            else:
                self.assertEqual(g.acts, (m.act,))
        # Functional ones (SwiGLU, tanh GeGLU) and one whose gate is in a region of its own,
        # fitted at their least, train as their twin (float64).
        self.made_at_least_trains_alike(
            lambda: nn.Sequential(GatedVariant(64, 256, "functional"), nn.Tanh(),
                                  GatedVariant(64, 256, "functional tanh gelu"), nn.Tanh(),
                                  GatedVariant(64, 256, "gate in region")), mlps=3)

    def test_mlps_split_between_two_modules_are_found_by_their_dataflow(self):
        # transformers' encoders (BERT, RoBERTa, HF ViT) split a layer's MLP between two
        # modules: an intermediate (dense, activation) and an output whose dense takes its
        # output. fit slices the two as one MLP only where the recorded forward shows that and
        # nothing else: not an intermediate that scales its result, an output that reads the
        # hidden tensor again, an op between them, a hidden tensor a second module takes, a
        # dense with a hook, nor an intermediate inside a saved-tensors region the output is
        # not in (sliced as one, the region's recompute failed: fit warned and went on without
        # slicing, 2026-11-30). The output module (between the layer and its dense) is then
        # no checkpoint candidate. Fitted at their least, two such layers train as their twin
        # (float64), and undone leave no forward wrapped.
        hows = ["split", "scaled", "reread", "op between", "handed twice", "hooked", "region"]
        found = mlps_of([SplitLayer(8, 16, how) for how in hows], "_split_mlps")
        self.assertEqual([s.parent.how for _, s, _ in found], ["split"])
        (_, split, _), = found
        layer = split.parent
        self.assertEqual(split.modules, (layer.intermediate, layer.output.dense))
        self.assertEqual(split.parts, (layer.intermediate.dense, [layer.intermediate.act],
                                       layer.output.dense))
        self.assertEqual(split.between, (layer.output,))
        from memlean import fitting

        self.assertIn(id(layer.output), fitting._inside([split]))  # (no candidate)
        self.made_at_least_trains_alike(
            lambda: nn.Sequential(SplitLayer(64, 256), nn.Tanh(), SplitLayer(64, 256)), mlps=2)

    def test_a_sliced_step_that_fails_leaves_fit_to_checkpoints(self):
        # Were a sliced chain to fail in the step (here memlean.sliced_mlp raising), fit warns
        # and goes on without slicing: a plan of checkpoints at a budget they reach, the
        # FitError below it naming what they reach; the model left unwrapped.
        model, x, loss_fn, opt = vit_step()
        with mock.patch.object(memlean.sliced, "SLICE_BYTES", 1 << 17):
            with mock.patch.object(memlean.sliced, "mlp_parts", lambda modules: None):
                without, _ = self.least_and_eager(model, x, loss_fn, opt)

            def fails(*args, **kwargs):
                raise RuntimeError("boom")

            with mock.patch.object(memlean.sliced, "run_sliced_mlp", fails):
                # Just below (checkpoints searched first) and far below (their search skipped
                # for slicing, then run after all).
                for budget in (without - 1, without // 2):
                    with self.assertWarnsRegex(RuntimeWarning, "boom.*without slicing") as w:
                        with self.assertRaises(memlean.FitError) as caught:
                            memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt)
                    self.assertEqual(w.filename, __file__)  # (the warning names fit's caller)
                    self.assertEqual(caught.exception.least_peak_bytes, without)
                    self.assertNotIn("sliced recompute", str(caught.exception))
                    self.assertEqual(wrapped_forwards(model), [])
                plan = memlean.fit(model, x, without, loss_fn=loss_fn, optimizer=opt)
                self.assertLessEqual(plan.peak_bytes, without)
                self.assertNotIn("sliced mlp", {a.action for a in plan.actions})
                plan.undo()
        self.assertEqual(wrapped_forwards(model), [])

    def test_a_failed_sliced_step_after_a_predicted_lean_step_measures_that_step(self):
        # Where fit predicted the step with the lean BatchNorms alone (no Swish: a ResNet's
        # shape, below the least of checkpoints) and the sliced step then fails, fit measures
        # the lean step after all and searches checkpoints on it: the least it names is that
        # of checkpoints alone, as without chains; the model is left unwrapped.
        from memlean import fitting

        def fails(self, chain, args, kwargs):
            raise RuntimeError("boom")

        model, x, loss_fn, opt = classified(BottleneckNet, 16)
        with mock.patch.object(fitting, "_SLICE_MIN_BYTES", 0):
            with mock.patch.object(fitting, "_slices", lambda *a: []):
                without, _ = self.least_and_eager(model, x, loss_fn, opt)
            outcomes = []
            real = fitting._Step.run

            def run(step, *args, **kwargs):
                try:
                    measured = real(step, *args, **kwargs)
                except RuntimeError:
                    outcomes.append("failed")
                    raise
                outcomes.append("measured")
                return measured

            with mock.patch.object(fitting._Slice, "run", fails), \
                    mock.patch.object(fitting._Step, "run", run):
                with self.assertWarnsRegex(RuntimeWarning, "boom.*without slicing"):
                    with self.assertRaises(memlean.FitError) as caught:
                        memlean.fit(model, x, 1, loss_fn=loss_fn, optimizer=opt)
        self.assertEqual(caught.exception.least_peak_bytes, without)
        self.assertEqual(wrapped_forwards(model), [])
        # The eager step, the sliced one (failed; the lean step predicted), the lean one, the
        # least plan's.
        self.assertEqual(outcomes, ["measured", "failed", "measured", "measured"])

    def test_a_sliced_mlps_output_written_in_place_by_its_caller(self):
        # A parent that adds the residual in place (`y = mlp(x); y += x`, as torchvision's
        # blocks do): fitted at its least, plain and gated MLPs sliced, it trains as its
        # float64 twin (before, the sliced MLPs returned a view made inside their Function,
        # and `+=` raised "a view ... is being modified inplace").
        class InPlaceResidual(nn.Module):
            def __init__(self, d=64):
                super().__init__()
                self.blocks = nn.ModuleList(
                    [nn.Sequential(nn.Linear(d, 4 * d), nn.SiLU(), nn.Linear(4 * d, d)),
                     GatedVariant(d, 4 * d, "swiglu"),
                     nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))])
                self.head = nn.Linear(d, 10)

            def forward(self, x):
                for block in self.blocks:
                    y = block(x)
                    y += x
                    x = y
                return self.head(x)

        self.made_at_least_trains_alike(InPlaceResidual, mlps=3)

    def test_timms_swiglu_is_found_by_its_dataflow(self):
        # timm's SwiGLU (DINOv3 and AIMv2 ViTs; EVA-02 base and large put a LayerNorm on the
        # product, refused; EVA-02 tiny and small use GluMlp, not found) calls fc1_g, fc1_x, then its
        # activation, then drop1 and norm on the product, fc2, drop2: found as a gated MLP when
        # its dropouts are 0 and its norm an Identity (they pass the product on), not with a
        # dropout or a LayerNorm; fitted at its least (sliced), a stack of them trains as its
        # float64 twin.
        import optional_deps

        if not optional_deps.available("timm"):
            self.skipTest("timm: this environment is made without it (MEMLEAN_WITHOUT)")
        from timm.layers import SwiGLU

        variants = [SwiGLU(8, 16), SwiGLU(8, 16, drop=0.1), SwiGLU(8, 16, norm_layer=nn.LayerNorm),
                    SwiGLU(8, 16, act_layer=nn.GELU)]
        found = gated_mlps_of(variants)
        self.assertEqual([g.modules[0] for _, g, _ in found], [variants[0], variants[3]])
        for _, g, _ in found:
            m = g.modules[0]
            self.assertEqual((g.gate, g.up, g.down, g.acts), (m.fc1_g, m.fc1_x, m.fc2, (m.act,)))

        class Blocks(nn.Module):
            def __init__(self, d=64):
                super().__init__()
                self.mlps = nn.ModuleList([SwiGLU(d, 4 * d) for _ in range(3)])
                self.head = nn.Linear(d, 10)

            def forward(self, x):
                for mlp in self.mlps:
                    x = x + mlp(x)
                return self.head(x)

        self.made_at_least_trains_alike(Blocks, mlps=3)

    def test_packed_gated_mlps_are_found_by_their_dataflow(self):
        # A gated MLP whose one Linear makes gate and up as two halves of its output (timm's
        # GluMlp: EVA-02 tiny and small, DINOv2 giant, gMixer; packed SwiGLUs written by
        # hand) is found where the dataflow shows the activation on one half and the
        # product with the other, whichever half is the gate's and however the halves are
        # cut (chunk, split, slicing); not the same half twice, interleaved halves, a sum, a
        # scaled product, nor timm's GluMlp with a dropout or a LayerNorm on the product.
        # Fitted at their least (sliced), stacks of them train as their float64 twin.
        hows = ["chunk", "split", "slices", "gate last", "same half", "interleaved", "add",
                "scaled"]
        found = gated_mlps_of([PackedVariant(8, 16, how) for how in hows])
        self.assertEqual([g.modules[0].how for _, g, _ in found],
                         ["chunk", "split", "slices", "gate last"])
        for _, g, _ in found:
            m = g.modules[0]
            self.assertEqual((g.gate, g.up, g.down, g.gate_first),
                             (m.w12, None, m.w3, m.how != "gate last"))
            self.assertEqual([type(a) for a in g.acts], [nn.SiLU])

        class Stack(nn.Module):
            def __init__(self, make, d=64):
                super().__init__()
                self.mlps = nn.ModuleList([make(d, i) for i in range(3)])
                self.head = nn.Linear(d, 10)

            def forward(self, x):
                for mlp in self.mlps:
                    x = x + mlp(x)
                return self.head(x)

        self.made_at_least_trains_alike(
            lambda: Stack(lambda d, i: PackedVariant(d, 2 * d, ["chunk", "gate last"][i % 2])),
            mlps=3)
        import optional_deps

        if not optional_deps.available("timm"):
            self.skipTest("timm: this environment is made without it (MEMLEAN_WITHOUT)")
        from timm.layers import GluMlp, SwiGLUPacked

        variants = [SwiGLUPacked(8, 32), GluMlp(8, 32), GluMlp(8, 32, drop=0.1),
                    SwiGLUPacked(8, 32, norm_layer=nn.LayerNorm)]
        found = gated_mlps_of(variants)
        self.assertEqual([g.modules[0] for _, g, _ in found], variants[:2])
        for (_, g, _), first in zip(found, (True, False)):
            m = g.modules[0]
            self.assertEqual((g.gate, g.up, g.down, g.acts, g.gate_first),
                             (m.fc1, None, m.fc2, (m.act,), first))
        self.made_at_least_trains_alike(
            lambda: Stack(lambda d, i: (SwiGLUPacked if i % 2 else GluMlp)(d, 4 * d)), mlps=3)

    def test_sliced_gated_mlps_below_what_checkpoints_reach(self):
        # A GPT stack's SwiGLU MLPs, sliced over their hidden features below the least that
        # checkpoints reach: a lower least than without, every budget down to it kept in exact
        # bytes, training equal to eager's (float64: gradients and parameters after 3 steps,
        # dropout masks as eager's).
        from memlean import fitting

        def setup(dtype=torch.float32):
            torch.manual_seed(0)
            model = GPT(d=64, layers=3).to(dtype)
            idx = torch.randint(0, 50, (16, 128))
            return (model, idx, lm_loss_of(torch.randint(0, 50, (16, 128))),
                    torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))

        model, idx, loss_fn, opt = setup()
        with mock.patch.object(memlean.sliced, "SLICE_BYTES", 1 << 17):
            with mock.patch.object(fitting, "_gated_mlps", lambda *a: []):
                without, _ = self.least_and_eager(model, idx, loss_fn, opt)
            least, _, actions = self.check_budgets(model, (idx,), loss_fn, opt, count=4)
        self.assertLess(least, 0.9 * without, (least, without))
        sliced = sorted({a.path for a in actions if a.action == "sliced mlp"})
        self.assertEqual(sliced, [f"blocks.{i}.mlp" for i in range(3)])
        self.assertEqual(wrapped_forwards(model), [])
        model, idx, loss_fn, opt = setup(torch.float64)
        twin = copy.deepcopy(model)
        opt_twin = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
        with mock.patch.object(memlean.sliced, "SLICE_BYTES", 1 << 18):
            least, _ = self.least_and_eager(model, idx, loss_fn, opt)
            plan = memlean.fit(model, idx, least, loss_fn=loss_fn, optimizer=opt)
            self.assertIn("3 MLP(s) recomputed in hidden-feature slices", str(plan))
            self.assertIn("or gated MLPs, checkpointed or sliced in eager steps only",
                          str(plan))
            # Saved whole and loaded (pickle), the fitted model slices its MLPs as this one
            # does: the plan's peak.
            loaded = pickle.loads(pickle.dumps(model))
            opt_loaded = torch.optim.SGD(loaded.parameters(), lr=0.05, momentum=0.9)
            step_peak(loaded, (idx,), loss_fn, opt_loaded)  # the optimizer's state
            self.assertEqual(step_peak(loaded, (idx,), loss_fn, opt_loaded), plan.peak_bytes)
            train_alike(model, opt, twin, opt_twin, idx, loss_fn, rtol=1e-9, atol=1e-11)
        # Compiled (aot_eager), the gated MLPs run their own forward: gradients as the twin's
        # (dropout off: compiled and eager draw their masks differently).
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
            for sub in m.modules():
                if isinstance(sub, nn.Dropout):
                    sub.p = 0.0
        loss_fn(torch.compile(model, backend="aot_eager")(idx)).backward()
        loss_fn(twin(idx)).backward()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-11, msg=name)
        plan.undo()
        self.assertEqual(wrapped_forwards(model), [])

    def test_finer_slices_below_what_the_first_slicing_reaches(self):
        # Below the least that checkpoints over the first slicing reach, fit slices the chains
        # behind 1x1 heads finer (more slices than the head's expansion, its input gradient
        # added in place): a lower least, every budget down to it kept in exact bytes.
        model, x, loss_fn, opt = classified(StridedMBNet, 64)
        with mock.patch.object(memlean.sliced, "SLICE_BYTES", 1 << 17):  # 16 slices, not 4
            with mock.patch.object(memlean.sliced, "pointwise", lambda module: False):
                coarse, _ = self.least_and_eager(model, x, loss_fn, opt)  # no finer slices
            least, _, actions = self.check_budgets(model, (x,), loss_fn, opt, count=3)
            self.assertEqual(wrapped_forwards(model), [])
            # The plan at the least says its slices are finer, and memlean.apply_plan slices
            # a twin's chains as finely: the same peak.
            twin = copy.deepcopy(model)
            opt_twin = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
            plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
            self.assertTrue(plan.to_dict()["fine_slices"], str(plan))
            applied = memlean.apply_plan(twin, x, plan.to_json(), loss_fn=loss_fn,
                                         optimizer=opt_twin)
            self.assertEqual(applied.peak_bytes, plan.peak_bytes)
            applied.undo()
            # Saved whole and loaded (pickle), the fitted model slices as finely: the same peak.
            loaded = pickle.loads(pickle.dumps(model))
            opt_loaded = torch.optim.SGD(loaded.parameters(), lr=0.05, momentum=0.9)
            step_peak(loaded, (x,), loss_fn, opt_loaded)  # the optimizer's state
            self.assertEqual(step_peak(loaded, (x,), loss_fn, opt_loaded), plan.peak_bytes)
            plan.undo()
        self.assertLess(least, coarse - coarse // 50, (least, coarse))
        self.assertIn("sliced recompute", {a.action for a in actions})
        self.assertEqual(wrapped_forwards(model), [])

    def test_plans_with_lean_backwards_are_predicted_to_the_byte(self):
        # A checkpointed block holding a lean depthwise convolution and a lean BatchNorm: its
        # recompute holds more than its saved bytes and output at its highest. Until the
        # planner counted that (and the gradients backward brings), one of these 8 plans was
        # predicted 181,656 bytes below its measured peak. (The modules' times are replaced
        # by fixed ones, so the plans do not depend on the machine's speed or load: with
        # measured times, a plan chosen under CI's load was predicted 238,268 bytes high.)
        from memlean import fitting

        def fixed_times(calls, memo=None):
            return [float(c.end - c.begin) for c in calls]

        model, x, loss_fn, opt = classified(FlatMBNet, 32)
        with mock.patch.object(fitting, "_twin_seconds", fixed_times):
            least, eager = self.least_and_eager(model, x, loss_fn, opt)
            leans = 0
            for i in range(8):
                budget = least + (eager - least) * i // 7
                plan = memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt)
                self.assertLessEqual(abs(plan.predicted_peak_bytes - plan.peak_bytes), 64,
                                     str(plan))
                leans += any(a.action.startswith("lean") for a in plan.actions)
                plan.undo()
        self.assertGreater(leans, 0)

    def test_slicing_predicted_no_lower_than_checkpoints_measures_no_sliced_step(self):
        # ResNet's shape: each bottleneck's widening conv3..bn3 and its bn..act pairs are
        # chains fit can slice, but they sit inside the runs checkpoints take, which slicing
        # takes away: the planner's least with them sliced, even with nothing held by their
        # backward (_as_sliced, from the unsliced step), is no lower than checkpoints alone
        # reach. Below both, fit measures neither sliced step (before 2026-11-30 it measured
        # both, and before 2026-11-29 searched plans over them too: ResNet-50 at batch 32,
        # 224x224, 35.6 s for its FitError, then 26.9 s, now 15.5 s), and runs the steps and
        # names the least it would without chains.
        from memlean import fitting

        model, x, loss_fn, opt = classified(BottleneckNet, 16)
        found = {}
        for slicing in (True, False):
            floors = []

            def floor(problem, measured):
                floors.append(_floor(problem, measured))
                return floors[-1]

            _floor = fitting._floor
            with mock.patch.object(fitting, "_SLICE_MIN_BYTES", 0), \
                    mock.patch.object(fitting, "_floor", floor), \
                    mock.patch.object(fitting, "_slices",
                                      fitting._slices if slicing else lambda *a: []), \
                    mock.patch.object(fitting._Step, "run", autospec=True,
                                      side_effect=fitting._Step.run) as steps:
                with self.assertRaises(memlean.FitError) as caught:
                    memlean.fit(model, x, 1, loss_fn=loss_fn, optimizer=opt, runs=True)
            found[slicing] = caught.exception.least_peak_bytes, steps.call_count, floors
        (least, measured, floors), (alone, measured_alone, _) = found[True], found[False]
        # (chains were found, and the bound predicted slicing no lower than checkpoints alone:
        # the last two floors; the lean step's prediction, first, decided nothing)
        self.assertGreaterEqual(len(floors), 2)
        self.assertLessEqual(floors[-2], floors[-1])
        self.assertEqual(least, alone)
        self.assertEqual(measured, measured_alone)
        self.assertEqual(measured, 3)  # the eager step, the lean one, the least plan's
        self.assertEqual(wrapped_forwards(model), [])

    def test_the_sliced_steps_saved_bytes_are_predicted_to_the_byte(self):
        # _as_sliced, from a step recorded without slices, predicts the saved bytes of the
        # step with every chain sliced exactly (each chain keeps its input alone; what its
        # atoms saved first that a later module saves too moves there): the lower bound that
        # spares fit the sliced steps rests on it.
        from memlean import fitting

        for net in (BottleneckNet, StridedMBNet):
            with self.subTest(net=net.__name__):
                model, x, loss_fn, opt = classified(net, 16)
                with mock.patch.object(fitting, "_SLICE_MIN_BYTES", 0):
                    saved, step, current, _ = recorded_problem(model, x, loss_fn, opt)
                    chains = fitting._slices(current.recorder, current.recorder, model)
                    predicted = fitting._as_sliced(current, chains)
                    thin = recorded_sliced(step, chains)
                    saved.restore()
                self.assertTrue(chains)
                self.assertEqual(sum(predicted.recorder.atom_bytes),
                                 sum(thin.recorder.atom_bytes))
                self.assertLess(sum(thin.recorder.atom_bytes), sum(current.recorder.atom_bytes))
                self.assertEqual(wrapped_forwards(model), [])

    def test_the_sliced_steps_backward_is_predicted_to_the_byte_from_its_chains_alone(self):
        # What a sliced chain's backward holds above the level backward reaches it at, measured
        # on the chain alone (_chain_rise: a forward and backward of its modules on an input of
        # its shape), added to that level as the unsliced step recorded it, less what slicing
        # drops (_as_sliced with rises), is the level the sliced step measures there, to the
        # byte: MLP chains (the ViT's) and channelwise ones (an inverted residual's). Without
        # the rises, the lower bound misses the gradients made by then. Measuring leaves the
        # RNG (dropout masks) and the parameters' gradients as they were.
        from memlean import fitting

        cases = (("ViT", vit_step, 1 << 17),
                 ("StridedMBNet", lambda: classified(StridedMBNet, 16),
                  memlean.sliced.SLICE_BYTES))
        for name, make, slice_bytes in cases:
            with self.subTest(model=name):
                model, x, loss_fn, opt = make()
                with mock.patch.object(fitting, "_SLICE_MIN_BYTES", 0), \
                        mock.patch.object(memlean.sliced, "SLICE_BYTES", slice_bytes):
                    saved, step, current, _ = recorded_problem(model, x, loss_fn, opt)
                    chains = fitting._slices(current.recorder, current.recorder, model)
                    first = fitting._first_calls(current.recorder)
                    grads = {p: torch.full_like(p, 0.5) for p in model.parameters()}
                    for p, g in grads.items():
                        p.grad = g
                    rng = torch.get_rng_state()
                    rises = [fitting._chain_rise(c, first[id(c.modules[0])]) for c in chains]
                    self.assertTrue(torch.equal(torch.get_rng_state(), rng))
                    for p, g in grads.items():
                        self.assertIs(p.grad, g)
                        self.assertTrue(torch.equal(g, torch.full_like(p, 0.5)))
                        p.grad = None
                    predicted = fitting._as_sliced(current, chains, rises=rises)
                    lowest = fitting._as_sliced(current, chains)
                    thin = recorded_sliced(step, chains)
                    saved.restore()
                self.assertTrue(chains)
                self.assertNotIn(None, rises)
                thin_first = fitting._first_calls(thin.recorder)
                for chain in chains:
                    head = first[id(chain.modules[0])].begin
                    measured = thin.recorder.backward_levels[thin_first[id(chain.modules[0])].begin]
                    self.assertEqual(predicted.recorder.backward_levels[head], measured)
                    self.assertLess(lowest.recorder.backward_levels[head], measured)
                self.assertEqual(wrapped_forwards(model), [])

    def test_fit_predicts_the_sliced_step_where_its_chains_are_cheap_to_measure(self):
        # Below what checkpoints alone reach, fit used to measure the step with the chains
        # sliced, then search checkpoints on it: three steps at least, the sliced one longer
        # than an eager step (timm's ViT-S at batch 32, 224x224: 1.3x). Where its chains cost
        # little to measure alone (equal MLPs measured once), it predicts that step exactly
        # instead (_sliced_predicted) and measures only the plans: one step fewer, the same
        # plan. Where a plan measures above its prediction (forced: every chain's rise
        # predicted as 0), it measures the sliced step after all: the same plan still.
        from memlean import fitting

        model, x, loss_fn, opt = vit_step()
        with mock.patch.object(memlean.sliced, "SLICE_BYTES", 1 << 17):
            least, _ = self.least_and_eager(model, x, loss_fn, opt)
            found = {}
            for how in ("predicted", "measured", "mispredicted"):
                patches = {"measured": ("_sliced_predicted", lambda self, seen: None),
                           "mispredicted": ("_chain_rise", None)}
                where = fitting._Fitting if how == "measured" else fitting
                name, replacement = patches.get(how, (None, None))
                patch = (mock.patch.object(where, name, replacement or (lambda c, call: 0))
                         if name else contextlib.nullcontext())
                with patch, mock.patch.object(fitting._Step, "run", autospec=True,
                                              side_effect=fitting._Step.run) as steps:
                    plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
                found[how] = steps.call_count, plan.peak_bytes, plan.predicted_peak_bytes, \
                    changes(plan)
                self.assertIn("sliced mlp", {a.action for a in plan.actions}, str(plan))
                plan.undo()
        self.assertEqual(found["predicted"][0], found["measured"][0] - 1)
        self.assertGreater(found["mispredicted"][0], found["measured"][0])
        for how in ("predicted", "mispredicted"):
            self.assertEqual(found[how][1:], found["measured"][1:], how)
        self.assertLessEqual(found["predicted"][1], least)
        self.assertEqual(found["predicted"][1], found["predicted"][2])
        self.assertEqual(wrapped_forwards(model), [])

    def test_a_deferred_lean_step_of_depthwise_convolutions_is_predicted_too(self):
        # ConvNeXt's shape: below what checkpoints reach, fit does not measure the step with
        # the lean depthwise convolutions alone (deferred: _lean_step_predicted) but the
        # sliced one. Their backward, measured alone as a chain's is (_backward_rise), makes
        # that sliced step predictable from the eager one too: at the least, the eager step
        # and the plan's, one step fewer than with the sliced step measured, the same plan
        # (timm's ConvNeXt-T at batch 8, 224x224, runs: 2 steps instead of 3).
        from memlean import fitting

        model, x, loss_fn, opt = classified(NeXtNet, 64, batch=8)
        deferred = []
        predicted = fitting._Fitting._sliced_predicted

        def spy(self, seen):
            deferred.append(self.deferred is not None)
            return predicted(self, seen)

        with mock.patch.object(memlean.sliced, "SLICE_BYTES", 1 << 14), \
                mock.patch.object(fitting, "_SLICE_MIN_BYTES", 0):
            least, _ = self.least_and_eager(model, x, loss_fn, opt)
            found = {}
            for how, replacement in (("predicted", spy), ("measured", lambda self, seen: None)):
                with mock.patch.object(fitting._Fitting, "_sliced_predicted", replacement), \
                        mock.patch.object(fitting._Step, "run", autospec=True,
                                          side_effect=fitting._Step.run) as steps:
                    plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
                found[how] = steps.call_count, plan.peak_bytes, plan.predicted_peak_bytes, \
                    changes(plan)
                actions = {a.action for a in plan.actions}
                self.assertLessEqual({"lean depthwise conv", "sliced mlp"}, actions, str(plan))
                plan.undo()
        self.assertEqual(deferred, [True])
        self.assertEqual(found["predicted"][0], 2)
        self.assertEqual(found["measured"][0], 3)
        # (which checkpoints reach the least depends on the recompute times each measured:
        # the slices and lean modules are the same, every peak at the least, as predicted)
        for how in found:
            self.assertEqual(found[how][1], least, how)
            self.assertEqual(found[how][2], least, how)
        self.assertEqual(*[[c for c in found[how][3] if c[1] != "checkpoint"]
                           for how in ("predicted", "measured")])
        self.assertEqual(wrapped_forwards(model), [])

    def test_finer_slices_predicted_no_lower_are_not_measured(self):
        # Finer slices lower only what the backward through the chains holds. Where the
        # planner's least over the first slicing goes no lower with nothing held there
        # (_as_sliced on the sliced step), fit measures no step with finer slices: one step
        # fewer, the same least (ResNet-50, batch 32, 224x224, no runs: FitError in 19.3 s
        # instead of 25.9 s). Here the 1x1-headed chains can be sliced finer (small slices).
        # And the lean BatchNorms' step is predicted, not measured, where it would only
        # decide to slice (ResNet-50 without runs: one step fewer again).
        from memlean import fitting

        found = {}
        for bound in (True, False):
            model, x, loss_fn, opt = classified(BottleneckNet, 16)
            with mock.patch.object(fitting, "_SLICE_MIN_BYTES", 0), \
                    mock.patch.object(memlean.sliced, "SLICE_BYTES", 1 << 14), \
                    mock.patch.object(fitting, "_sliced_floor", fitting._sliced_floor if bound
                                      else lambda *a: None), \
                    mock.patch.object(fitting, "_finer_predicted", fitting._finer_predicted
                                      if bound else lambda *a: (None, None)), \
                    mock.patch.object(fitting._Step, "run", autospec=True,
                                      side_effect=fitting._Step.run) as steps:
                with self.assertRaises(memlean.FitError) as caught:
                    memlean.fit(model, x, 1, loss_fn=loss_fn, optimizer=opt)
            found[bound] = caught.exception.least_peak_bytes, steps.call_count
            self.assertEqual(wrapped_forwards(model), [])
        (least, measured), (unbounded, measured_unbounded) = found[True], found[False]
        self.assertEqual(least, unbounded)
        # The eager step, the sliced one, the least plan's; without the bounds and predictions
        # also the step with the lean BatchNorms alone (predicted with them:
        # _lean_step_predicted) and the finer step.
        self.assertEqual(measured, 3)
        self.assertEqual(measured_unbounded, 5)
        # At the least, the same three steps: a plan with the lean BatchNorms (their saving
        # not measured apart: 0), the chains sliced and checkpoints, within the budget.
        with mock.patch.object(fitting, "_SLICE_MIN_BYTES", 0), \
                mock.patch.object(memlean.sliced, "SLICE_BYTES", 1 << 14), \
                mock.patch.object(fitting._Step, "run", autospec=True,
                                  side_effect=fitting._Step.run) as steps:
            plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
        self.assertEqual(steps.call_count, 3)
        self.assertLessEqual(plan.peak_bytes, least)
        actions = {a.action for a in plan.actions}
        self.assertTrue({"lean batchnorm", "sliced recompute"} <= actions, str(plan))
        self.assertEqual({a.bytes_saved for a in plan.actions if a.action.startswith("lean")},
                         {0})
        plan.undo()
        self.assertEqual(wrapped_forwards(model), [])

    def test_the_finer_step_is_predicted_and_measured_where_the_prediction_misses(self):
        # After the sliced step, fit predicts the step with finer slices (5b) rather than
        # measure it: they save what the first slicing saves and change only what the
        # backward through the chains they slice finer holds, predicted at its lowest
        # (_finer_predicted). Where every plan its search measures meets its predicted peak,
        # the least is what the measured step gives (MobileNetV3, batch 32, 224x224: FitError
        # in 3 steps instead of 4). Where a plan measures above its prediction (forced here
        # by predicting all the chains at their lowest, also those finer slicing leaves as
        # they are), fit measures the finer step after all: the same least (without that,
        # 0.7 % above it).
        import optional_deps

        if not optional_deps.available("timm"):
            self.skipTest("timm: this environment is made without it (MEMLEAN_WITHOUT)")
        import timm

        from memlean import fitting

        def fitted(budget, *patches):
            """(the plan or FitError's least, steps recorded, steps run)."""
            model, x, loss_fn, opt = classified(
                lambda: timm.create_model("mobilenetv3_large_100", num_classes=10), 128)
            with contextlib.ExitStack() as stack:
                for p in patches:
                    stack.enter_context(p)
                steps = stack.enter_context(mock.patch.object(
                    fitting._Step, "run", autospec=True, side_effect=fitting._Step.run))
                try:
                    found = memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt)
                except memlean.FitError as e:
                    found = e.least_peak_bytes
                    self.assertEqual(wrapped_forwards(model), [])
            recorded = sum(bool(c.kwargs.get("record")) for c in steps.call_args_list)
            return found, recorded, steps.call_count

        least, recorded, count = fitted(1)
        measured = fitted(1, mock.patch.object(fitting, "_finer_predicted",
                                               lambda *a: (None, None)))
        # The eager step and the sliced one recorded (the lean modules' step predicted), then
        # plans measured (which, and how many, the recompute times measured decide); measured,
        # also the finer step.
        self.assertEqual(recorded, 2)
        self.assertEqual(measured[:2], (least, 3))
        missed = fitted(1, mock.patch.object(fitting, "_finer", lambda chains: chains))
        self.assertEqual(missed[:2], (least, 3))
        plan, recorded, _ = fitted(least)
        self.assertLessEqual(plan.peak_bytes, least)
        self.assertEqual(recorded, 2)
        self.assertTrue(json.loads(plan.to_json())["fine_slices"], str(plan))
        self.assertIn("sliced recompute", {a.action for a in plan.actions})

    def test_slicing_that_saves_nothing_is_not_kept(self):
        # A budget far below the planner's least for checkpoints alone slices first. Where
        # the slices save nothing (here: made to run their modules as they are), the least
        # fit names is no higher than checkpoints alone reach, the plan at it slices nothing,
        # and the FitError leaves no module wrapped.
        from memlean import fitting

        model, x, loss_fn, opt, plain = self.flat_setup()
        with mock.patch.object(fitting._Slice, "run", lambda self, chain, args, kwargs: None):
            least, _ = self.least_and_eager(model, x, loss_fn, opt)
            self.assertEqual(wrapped_forwards(model), [])
            plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
        self.assertLessEqual(least, plain + plain // 100)
        self.assertEqual([a for a in plan.actions if a.action == "sliced recompute"], [])
        plan.undo()

    def test_swish_swap_is_safe_and_close(self):
        model, x, loss_fn, opt = self.conv_setup(dtype=torch.float64)
        twin = copy.deepcopy(model)
        eager = memlean.fit(model, x, 2**50, loss_fn=loss_fn, optimizer=opt).eager_peak_bytes
        plan = memlean.fit(model, x, eager - 1, loss_fn=loss_fn, optimizer=opt)
        swaps = {a.path: a.action for a in plan.actions if a.action.endswith("swish")}
        # Every activation whose input is not read again is in place; ReuseBlock's is not.
        self.assertEqual(swaps.get("blocks.0.act1"), "inplace swish", str(plan))
        self.assertEqual(swaps.get("blocks.3.act2"), "inplace swish", str(plan))
        self.assertNotIn("blocks.4.act", swaps)
        self.assertIsInstance(model.blocks[0].act1, memlean.Swish)
        self.assertIs(type(model.blocks[4].act), nn.SiLU)
        self.assertLess(plan.peak_bytes, eager)
        # Two steps (autograd's version counter never fires) with gradients as eager's, within
        # the in-place backward's float64 bound (docs/swish.md).
        for _ in range(2):
            torch.manual_seed(5)
            loss_fn(model(x)).backward()
            torch.manual_seed(5)
            loss_fn(twin(x)).backward()
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9, msg=name)

    def test_no_in_place_swish_where_a_later_op_writes_its_output(self):
        # memlean's in-place Swish saves its output (and one bit per element): an op that
        # writes that output in place later (a residual's `out += x` after SiLU(inplace=True),
        # as torchvision's EfficientNetV2 does; a ReLU(inplace=True)) would make autograd's
        # version check fire in the user's backward. Until 2026-11-27 fit swapped them (the
        # user's first step failed: "modified by an inplace operation"); now only the others.
        check_no_in_place_swish_where_written(self, "cpu")

    def test_a_missed_in_place_write_falls_back_to_no_in_place_swish(self):
        # The safety net behind the dataflow check: fit measures the step with the swaps and,
        # if autograd's version check fires, swaps none in place. Its recorded steps save
        # tensors through saved_tensors_hooks, for which autograd skips that check, so the
        # recorder checks versions itself (before 2026-11-27 the check could not fire there:
        # with the dataflow check made blind here, fit kept in-place swaps that failed in the
        # user's step).
        from memlean import fitting

        torch.manual_seed(0)
        model = LaterWrites().double()
        x = torch.randn(4, 3, 16, 16, dtype=torch.double)
        with mock.patch.object(fitting, "_safe_in_place", lambda call, recorder: True):
            swaps = swish_swaps_and_two_steps(self, model, x,
                                              cross_entropy_of(torch.randint(0, 10, (4,))))
        self.assertNotIn("inplace swish", swaps.values(), swaps)

    def test_undo_and_state_dict(self):
        model, x, loss_fn, opt = self.conv_setup()
        keys = list(model.state_dict().keys())
        types = [type(m) for m in model.modules()]
        least, eager = self.least_and_eager(model, x, loss_fn, opt)
        plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
        checkpointed = [a.path for a in plan.actions if a.action == "checkpoint"]
        self.assertTrue(checkpointed)
        self.assertEqual(list(model.state_dict().keys()), keys)
        model.load_state_dict(copy.deepcopy(model.state_dict()))
        self.assertIn("forward", model.get_submodule(checkpointed[0]).__dict__)
        text = str(plan)
        self.assertIn("checkpoint", text)
        self.assertIn("MiB", text)
        data = __import__("json").loads(plan.to_json())
        self.assertEqual(data["peak_bytes"], plan.peak_bytes)
        # Pickled (torch.save of a dict holding it) or copied, the plan keeps its figures and
        # actions, which apply_plan takes; its undo() raises: it changed no model here (before
        # 2026-11-30 pickle failed on a local function, and a copy's undo() undid this model).
        for twin_plan in (pickle.loads(pickle.dumps(plan)), copy.deepcopy(plan)):
            self.assertEqual(twin_plan.to_dict(), plan.to_dict())
            self.assertEqual(str(twin_plan), str(plan))
            with self.assertRaisesRegex(RuntimeError, "loaded from a pickle.*apply_plan"):
                twin_plan.undo()
        self.assertIn("forward", model.get_submodule(checkpointed[0]).__dict__)
        self.assertEqual(len(data["actions"]), len(plan.actions))
        self.assertEqual(data["eager_only_runs"], 0)
        # Every BatchNorm of the training step got the lean backward (CPU eager steps).
        norms = sorted(n for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d))
        self.assertTrue(norms)
        self.assertEqual(sorted(a.path for a in plan.actions if a.action == "lean batchnorm"),
                         norms)
        self.assertIn(f"{len(norms)} BatchNorm(s) with the lean backward", text)
        # str(plan): a swap done to more than 3 modules is one row, its saving summed.
        lean = [a for a in plan.actions if a.action == "lean batchnorm"]
        rows = [line for line in text.splitlines() if " lean batchnorm " in line]
        if len(lean) > 3:
            self.assertEqual(len(rows), 1, text)
            self.assertTrue(rows[0].strip().startswith(
                f"{lean[0].path} .. {lean[-1].path} ({len(lean)})"), text)
        else:
            self.assertEqual(len(rows), len(lean), text)
        checkpoints = [a for a in plan.actions if a.action == "checkpoint"]
        self.assertEqual(sum(" checkpoint " in line for line in text.splitlines()),
                         len(checkpoints), text)
        # Its state_dict saves, and after undo the model itself, which loads and computes as
        # this one (a fitted model saved whole: test_a_copy_of_a_fitted_model_...).
        import io

        torch.save(model.state_dict(), io.BytesIO())
        plan.undo()
        plan.undo()
        saved = io.BytesIO()
        torch.save(model, saved)
        saved.seek(0)
        loaded = torch.load(saved, weights_only=False)
        model.eval()
        loaded.eval()
        self.assertTrue(torch.equal(loaded(x), model(x)))
        model.train()
        self.assertEqual([type(m) for m in model.modules()], types)
        # No wrapped forward is left: checkpoints, lean BatchNorms and convolutions alike.
        self.assertEqual(wrapped_forwards(model), [])
        step_peak(model, (x,), loss_fn, opt)  # the optimizer's state, as fit measured with
        self.assertEqual(step_peak(model, (x,), loss_fn, opt), eager)

    def test_fit_again_on_a_fitted_model_and_undo_in_either_order(self):
        # A tighter budget on a fitted model: the second plan is made on top of the first and
        # keeps its budget (measured here). Undone in reverse order each step is back where
        # it was; undoing the first plan first also undoes the second (made on top of it),
        # the model then as before both (no wrapper left, eager's peak); the second's undo
        # afterwards is harmless. A model dropped with its plans is freed.
        import weakref

        for order in ("later first", "earlier first"):
            with self.subTest(order=order):
                model, x, loss_fn, opt = self.conv_setup()
                types = [type(m) for m in model.modules()]
                least, eager = self.least_and_eager(model, x, loss_fn, opt)
                first_budget = least + (eager - least) * 2 // 3
                first = memlean.fit(model, x, first_budget, loss_fn=loss_fn, optimizer=opt)
                second_budget = least + (eager - least) // 4
                second = memlean.fit(model, x, second_budget, loss_fn=loss_fn, optimizer=opt)
                self.assertEqual(second.eager_peak_bytes, first.peak_bytes)
                step_peak(model, (x,), loss_fn, opt)  # the optimizer's state, as fit's steps
                measured = step_peak(model, (x,), loss_fn, opt)
                self.assertLessEqual(measured, second_budget, str(second))
                self.assertEqual(measured, second.peak_bytes, str(second))
                if order == "later first":
                    second.undo()
                    self.assertEqual(step_peak(model, (x,), loss_fn, opt), first.peak_bytes)
                    first.undo()
                else:
                    first.undo()
                    self.assertTrue(second.undone)
                    second.undo()
                self.assertEqual([type(m) for m in model.modules()], types)
                self.assertEqual(wrapped_forwards(model), [])
                self.assertEqual(step_peak(model, (x,), loss_fn, opt), eager)
        model, x, loss_fn, opt = self.conv_setup()
        plan = memlean.fit(model, x, self.least_and_eager(model, x, loss_fn, opt)[0],
                           loss_fn=loss_fn, optimizer=opt)
        gone = weakref.ref(model)
        del model, opt, plan
        gc.collect()
        self.assertIsNone(gone())

    def test_unfit_puts_back_a_loaded_or_copied_fitted_model(self):
        # A fitted model that torch.load loaded or copy.deepcopy copied has no plan of this
        # process to undo: memlean.unfit puts its changes back itself (before 2026-11-29 it
        # could only be rebuilt and given its state_dict). The tests' ConvNet at its least with
        # runs (module and run checkpoints, lean BatchNorms, in-place Swish) and MobileNet-
        # shaped net at its least (sliced chains, lean depthwise convolutions): for each twin,
        # and the original, unfit gives the unfitted model again: its modules' types (in the
        # model's train/eval mode), no wrapped forward, the same state_dict keys, the outputs
        # of an unfitted model with its weights, its training step at the eager peak, in bytes.
        import io

        from memlean import fitting

        settings = {"ConvNet, runs": (lambda: self.conv_setup(), True,
                                      {"checkpoint", "lean batchnorm", "inplace swish"}),
                    "StridedMBNet": (lambda: classified(StridedMBNet, 48), False,
                                     {"sliced recompute", "lean depthwise conv"})}
        for name, (setup, runs, actions) in settings.items():
            with mock.patch.object(fitting, "_SLICE_MIN_BYTES", 0):
                model, x, loss_fn, opt = setup()
                least, eager = self.least_and_eager(model, x, loss_fn, opt, runs=runs)
                plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt, runs=runs)
            self.assertTrue(actions <= {a.action for a in plan.actions}, str(plan))
            unfitted = setup()[0]
            kinds = [(n, type(m)) for n, m in unfitted.named_modules()]
            self.assertNotEqual([(n, type(m)) for n, m in model.named_modules()], kinds)
            saved = io.BytesIO()
            torch.save(model, saved)
            saved.seek(0)
            twins = {"deepcopy": copy.deepcopy(model),
                     "torch.save": torch.load(saved, weights_only=False), "original": model}
            for how, twin in twins.items():
                with self.subTest(model=name, how=how):
                    twin.eval()  # (the Swish modules put back take the model's mode)
                    self.assertTrue(wrapped_forwards(twin))
                    self.assertTrue(memlean.unfit(twin))
                    self.assertEqual(wrapped_forwards(twin), [])
                    self.assertEqual([(n, type(m)) for n, m in twin.named_modules()], kinds)
                    self.assertTrue(all(not m.training for m in twin.modules()))
                    self.assertEqual(list(twin.state_dict()), list(unfitted.state_dict()))
                    self.assertFalse(memlean.unfit(twin))  # (nothing left: harmless)
                    twin.train()
                    reference = setup()[0]
                    reference.load_state_dict(twin.state_dict())
                    outputs = []
                    for m in (twin, reference):
                        torch.manual_seed(3)
                        outputs.append(m(x))
                    torch.testing.assert_close(*outputs, rtol=0, atol=0)
                    twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
                    step_peak(twin, (x,), loss_fn, twin_opt)  # the optimizer's state
                    self.assertEqual(step_peak(twin, (x,), loss_fn, twin_opt), eager)
            self.assertTrue(plan.undone)  # (unfit of the original undid its plan)
        with self.assertRaisesRegex(TypeError, "memlean.unfit: model must be a torch.nn.Module"):
            memlean.unfit(plan)

    def test_a_copy_of_a_fitted_model_is_fitted_on_its_own_modules(self):
        # copy.deepcopy of a fitted model (an EMA copy; torch's AveragedModel makes one), and
        # the model torch.save saves and torch.load loads (since 2026-11-30; before, a
        # TypeError), get the plan on their own modules: checkpoints, runs, lean BatchNorms
        # and the in-place Swish wrap the copy's modules, not the original's (a wrapper
        # function copied as itself ran the original's). Each copy's outputs are those of an
        # unfitted model with the same weights, in eval and train mode; its training step
        # peaks at the plan's bytes (measured here) and leaves the original's gradients alone;
        # undoing the plan leaves the copies fitted.
        import io

        from torch.optim.swa_utils import AveragedModel

        model, x, loss_fn, opt = self.conv_setup()
        least, _ = self.least_and_eager(model, x, loss_fn, opt, runs=True)
        plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt, runs=True)
        self.assertTrue({"checkpoint", "lean batchnorm", "inplace swish"}
                        <= {a.action for a in plan.actions}, str(plan))
        self.assertIn("run(s) of sibling modules", str(plan))
        saved = io.BytesIO()
        torch.save(model, saved)
        saved.seek(0)
        twins = {"deepcopy": copy.deepcopy(model),
                 "torch.save": torch.load(saved, weights_only=False)}

        def outputs(a, b, training):
            """a(x) and b(x), both in train or eval mode, each from the same RNG state."""
            out = []
            for m in (a, b):
                m.train(training)
                torch.manual_seed(3)
                out.append(m(x))
            return out

        for how, twin in twins.items():
            with self.subTest(how=how):
                self.assertEqual(wrapped_forwards(twin), wrapped_forwards(model))
                with torch.no_grad():
                    for p in twin.parameters():
                        p.mul_(0.5)
                for training in (False, True):
                    self.assertFalse(torch.allclose(*outputs(twin, model, training)))
                model.train()
                twin.train()
                twin_opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
                step_peak(twin, (x,), loss_fn, twin_opt)  # the optimizer's state
                for p in model.parameters():
                    p.grad = None
                self.assertEqual(step_peak(twin, (x,), loss_fn, twin_opt), plan.peak_bytes)
                self.assertTrue(all(p.grad is None for p in model.parameters()))
                # It computes as an unfitted model with its weights (the same state_dict keys).
                reference = self.conv_setup()[0]
                reference.load_state_dict(twin.state_dict())
                for training in (False, True):
                    torch.testing.assert_close(*outputs(twin, reference, training), rtol=1e-5,
                                               atol=1e-6)
        # copy.copy shares a module's submodules: a checkpointed module's copy gets a
        # checkpoint of its own forward (a plan without runs: it checkpoints modules); that of
        # a run's parent raises, saying so.
        plain_model, plain_x, plain_loss_fn, plain_opt = self.conv_setup()
        plain = memlean.fit(plain_model, plain_x,
                            self.least_and_eager(plain_model, plain_x, plain_loss_fn,
                                                 plain_opt)[0],
                            loss_fn=plain_loss_fn, optimizer=plain_opt)
        checkpointed = next(a.path for a in plain.actions if a.action == "checkpoint")
        shallow = copy.copy(plain_model.get_submodule(checkpointed))
        self.assertIsNot(shallow.forward, plain_model.get_submodule(checkpointed).forward)
        plain.undo()
        parent = next(a.path for a in plan.actions if a.action == "checkpoint"
                      and "(" in a.path).rpartition(".(")[0]
        with self.assertRaisesRegex(TypeError, r"cannot copy.copy \w+ as fitted.* copy.deepcopy"):
            copy.copy(model.get_submodule(parent))
        plan.undo()
        self.assertEqual(wrapped_forwards(model), [])
        for twin in twins.values():
            self.assertTrue(wrapped_forwards(twin))
            averaged = AveragedModel(twin)
            self.assertEqual(wrapped_forwards(averaged.module), wrapped_forwards(twin))
            twin.eval()
            averaged.eval()
            torch.testing.assert_close(averaged(x), twin(x))

    def test_the_least_a_fit_error_names_is_reached_at_that_budget(self):
        # A later call's search may walk to other plans (recompute times are measured afresh,
        # and a plan can measure above its prediction): fit then tries the plan that reached
        # the least the earlier FitError named. Here the second search is made to find none.
        from memlean import fitting

        model, x, loss_fn, opt = self.conv_setup()
        with self.assertRaises(memlean.FitError) as caught:
            memlean.fit(model, x, 1, loss_fn=loss_fn, optimizer=opt)
        least = caught.exception.least_peak_bytes
        search = fitting._C.fit.search

        def finds_none(*args, **kwargs):
            _, _, _, _, fastest_peak, least_measured, plans = search(*args, **kwargs)
            return False, [], 0, 0, fastest_peak, least_measured, plans

        with mock.patch.object(fitting._C.fit, "search", finds_none):
            plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
            self.assertLessEqual(plan.peak_bytes, least)
            self.assertIn("checkpoint", {a.action for a in plan.actions})
            plan.undo()
            with self.assertRaises(memlean.FitError):  # not below it
                memlean.fit(model, x, least - 1, loss_fn=loss_fn, optimizer=opt)

    def test_below_the_least_peak_is_a_fit_error_naming_it(self):
        model, x, loss_fn, opt = self.conv_setup()
        before = snapshot(model, opt)
        types = [type(m) for m in model.modules()]
        with self.assertRaises(memlean.FitError) as caught:
            memlean.fit(model, x, "1KiB", loss_fn=loss_fn, optimizer=opt)
        e = caught.exception
        self.assertIsInstance(e, ValueError)
        self.assertIn("budget_bytes=1024", str(e))
        self.assertIn(f"{e.least_peak_bytes:,} bytes", str(e))
        self.assertIn("GiB", str(e))
        # The least peak is reachable: fit at exactly it works.
        plan = memlean.fit(model, x, e.least_peak_bytes, loss_fn=loss_fn, optimizer=opt)
        self.assertLessEqual(plan.peak_bytes, e.least_peak_bytes)
        plan.undo()
        self.assertEqual([type(m) for m in model.modules()], types)
        assert_same_state(self, before, snapshot(model, opt))

    def test_the_least_named_is_never_above_the_eager_step(self):
        # Were the swaps to raise the step's peak (here a Swish that saves more than nn.SiLU,
        # standing in for a swap gone wrong) and nothing go lower, the least a FitError names
        # is the eager step's, and fit at it returns the empty plan.
        from memlean import fitting

        class Naive(fitting.Swish):
            def __init__(self, beta=1.0, variant=None):
                super().__init__(beta=beta, variant="naive")

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 512), nn.SiLU(), nn.Linear(512, 64))
        x = torch.randn(256, 64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with mock.patch.object(fitting, "Swish", Naive):
            with self.assertRaises(memlean.FitError) as caught:
                memlean.fit(model, x, 1, optimizer=opt)
            plan = memlean.fit(model, x, caught.exception.least_peak_bytes, optimizer=opt)
        self.assertEqual(caught.exception.least_peak_bytes, plan.eager_peak_bytes)
        self.assertEqual((plan.actions, plan.peak_bytes), ([], plan.eager_peak_bytes))
        self.assertIsInstance(model[1], nn.SiLU)

    def test_a_saved_plan_applies_to_a_twin_without_a_search(self):
        # memlean.apply_plan: fit's plan (its JSON file) applied to a fresh twin of the model
        # (another rank, a restarted job) makes the same changes, measured in three steps at
        # most: the same exact peak, the same actions, training bitwise as the fitted model's.
        # Plans of every kind: lean backwards, Swish swaps, slices, module and run checkpoints.
        import os
        import tempfile

        model, x, loss_fn, opt = classified(FlatMBNet, 32)
        twin = copy.deepcopy(model)
        opt_twin = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
        least, eager = self.least_and_eager(model, x, loss_fn, opt, runs=True)
        kinds, run_checkpoints = set(), 0
        calls = []
        twin.register_forward_pre_hook(lambda m, a: calls.append(1))
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "plan.json")
            for budget in (least, (least + eager) // 2, eager - 1):
                plan = memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt, runs=True)
                # Made on a machine 10^6 times slower: the applied plan's recompute times are
                # this one's, measured in its recorded step.
                data = plan.to_dict()
                for a in data["actions"]:
                    a["recompute_seconds"] = a["recompute_seconds"] * 1e6
                with open(path, "w") as f:
                    json.dump(data, f)
                calls.clear()
                applied = memlean.apply_plan(twin, x, path, loss_fn=loss_fn, optimizer=opt_twin)
                self.assertLessEqual(len(calls), 3, str(plan))  # steps: no search
                self.assertEqual(applied.peak_bytes, plan.peak_bytes, str(plan))
                self.assertEqual(changes(applied), changes(plan))
                for a, b in zip(applied.actions, plan.actions):
                    if a.action in ("checkpoint", "sliced recompute"):
                        self.assertGreater(a.recompute_seconds, 0, a)
                        self.assertLess(a.recompute_seconds, 1000 * b.recompute_seconds, a)
                    else:
                        self.assertEqual(a.recompute_seconds, 0, a)
                self.assertEqual(applied.eager_peak_bytes, plan.eager_peak_bytes)
                self.assertEqual(applied.budget_bytes, budget)
                for m, o in ((model, opt), (twin, opt_twin)):  # (in step, as trained below)
                    torch.manual_seed(7)
                    if not o.state:
                        step_peak(m, (x,), loss_fn, o)  # (the optimizer's state, as fit's)
                    torch.manual_seed(8)
                    self.assertEqual(step_peak(m, (x,), loss_fn, o), plan.peak_bytes)
                kinds |= {a.action for a in plan.actions}
                run_checkpoints += sum(a.action == "checkpoint" and "(" in a.path
                                       for a in plan.actions)
                train_alike(model, opt, twin, opt_twin, x, loss_fn, rtol=0, atol=0)
                plan.undo()
                applied.undo()
                self.assertEqual(wrapped_forwards(twin), [])
        self.assertTrue({"sliced recompute", "checkpoint", "lean batchnorm",
                         "lean depthwise conv", "inplace swish"} <= kinds, kinds)
        self.assertGreater(run_checkpoints, 0)

    def test_a_saved_plan_applies_on_the_paths_users_take(self):
        # apply_plan where users train: channels_last weights and batch, a CPU bfloat16
        # autocast region (fit and apply_plan inside one, each step in one of its own), and
        # timm's act_layer=memlean.Swish (variant "naive", which fit swaps). fit's least plan
        # (slices, lean backwards, run checkpoints) saved as JSON applies to a twin made the
        # same way: the same actions and peak, the twin's step measured here at that peak, and
        # the two train bitwise alike for three steps.
        import functools

        import optional_deps

        paths = ["channels_last", "autocast bf16"]
        if optional_deps.available("timm"):
            paths.append("timm act_layer")
        for path in paths:
            with self.subTest(path=path):
                if path == "timm act_layer":
                    import timm

                    torch.manual_seed(0)
                    model = timm.create_model(
                        "efficientnet_b0", pretrained=False, num_classes=3,
                        act_layer=functools.partial(memlean.Swish, variant="naive")).train()
                    x = torch.randn(2, 3, 64, 64)
                    loss_fn = cross_entropy_of(torch.tensor([0, 2]))
                    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
                else:
                    model, x, loss_fn, opt = classified(FlatMBNet, 32, batch=16)
                if path == "channels_last":
                    model = model.to(memory_format=torch.channels_last)
                    x = x.contiguous(memory_format=torch.channels_last)
                twin = copy.deepcopy(model)
                opt_twin = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)

                def region():
                    return (torch.autocast("cpu", dtype=torch.bfloat16)
                            if path == "autocast bf16" else contextlib.nullcontext())

                least, _ = self.least_and_eager(model, x, loss_fn, opt, fit_region=region,
                                                runs=True)
                with region():
                    plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt,
                                       runs=True)
                with region():
                    applied = memlean.apply_plan(twin, x, plan.to_json(), loss_fn=loss_fn,
                                                 optimizer=opt_twin)
                kinds = {a.action for a in plan.actions}
                want = {"checkpoint", "lean batchnorm"} | (
                    {"inplace swish"} if path == "timm act_layer" else {"sliced recompute"})
                self.assertLessEqual(want, kinds, str(plan))
                self.assertEqual(changes(applied), changes(plan))
                self.assertEqual(applied.peak_bytes, plan.peak_bytes)
                for m, o in ((model, opt), (twin, opt_twin)):
                    with region():
                        torch.manual_seed(7)
                        step_peak(m, (x,), loss_fn, o)  # (the optimizer's state, as fit's)
                    with region():
                        torch.manual_seed(8)
                        self.assertEqual(step_peak(m, (x,), loss_fn, o), plan.peak_bytes)
                train_alike(model, opt, twin, opt_twin, x, loss_fn, rtol=0, atol=0,
                            region=region)
                applied.undo()
                plan.undo()
                self.assertEqual(wrapped_forwards(twin), [])

    def test_plans_made_on_top_of_each_other_apply_in_turn(self):
        # fit called twice (a tighter budget on the fitted model): the two plans applied to a
        # twin in the same order reach the same peaks; undoing the first undoes both, as fit's.
        model, x, loss_fn, opt = self.conv_setup()
        twin = copy.deepcopy(model)
        opt_twin = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
        least, eager = self.least_and_eager(model, x, loss_fn, opt)
        first = memlean.fit(model, x, (least + 3 * eager) // 4, loss_fn=loss_fn, optimizer=opt)
        second = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
        self.assertLess(second.peak_bytes, first.peak_bytes)
        again = [memlean.apply_plan(twin, x, p.to_json(), loss_fn=loss_fn, optimizer=opt_twin)
                 for p in (first, second)]
        self.assertEqual([p.peak_bytes for p in again], [first.peak_bytes, second.peak_bytes])
        again[0].undo()
        self.assertTrue(again[1].undone)
        self.assertEqual(wrapped_forwards(twin), [])
        first.undo()

    def test_apply_plan_refuses_a_plan_that_does_not_match(self):
        # A plan applied where it does not hold is refused with the model left as it was: a
        # module it names that this step does not offer, a larger batch that peaks above its
        # budget, a plan for compiled steps, a model fitted already, and what is no plan.
        model, x, loss_fn, opt = self.conv_setup()
        least, eager = self.least_and_eager(model, x, loss_fn, opt)
        plan = memlean.fit(model, x, least, loss_fn=loss_fn, optimizer=opt)
        text = plan.to_json()
        # (fitted already: its Swishes are memlean's in-place ones, no longer swappable)
        with self.assertRaisesRegex(ValueError, "plan does not match this model's training "
                                                "step: fit's inplace swish of"):
            memlean.apply_plan(model, x, text, loss_fn=loss_fn, optimizer=opt)
        plan.undo()
        other, x_other, loss_other, opt_other = classified(FlatMBNet, 32)
        state = copy.deepcopy(other.state_dict())
        with self.assertRaisesRegex(ValueError, "plan does not match this model's training "
                                                "step"):
            memlean.apply_plan(other, x_other, text, loss_fn=loss_other, optimizer=opt_other)
        self.assertEqual(wrapped_forwards(other), [])
        for k, v in other.state_dict().items():
            self.assertTrue(torch.equal(v, state[k]), k)
        twice = torch.cat([x, x])
        with self.assertRaises(memlean.FitError) as caught:
            memlean.apply_plan(model, twice, text, loss_fn=lambda out: out.square().mean(),
                               optimizer=opt)
        self.assertIn("above the plan's budget_bytes", str(caught.exception))
        self.assertGreater(caught.exception.least_peak_bytes, least)
        self.assertEqual(wrapped_forwards(model), [])
        self.assertTrue(all(type(m) is not memlean.Swish for m in model.modules()))
        compiled = json.loads(text)
        compiled["compile"] = True
        with self.assertRaisesRegex(ValueError, "plan was made for compiled steps"):
            memlean.apply_plan(model, x, compiled, loss_fn=loss_fn, optimizer=opt)
        with self.assertRaisesRegex(ValueError, "plan was made for eager steps"):
            memlean.apply_plan(model, x, text, loss_fn=loss_fn, optimizer=opt, compile=True)
        unknown = json.loads(text)
        unknown["actions"][0]["action"] = "teleport"
        with self.assertRaisesRegex(ValueError, "plan's action 'teleport'"):
            memlean.apply_plan(model, x, unknown, loss_fn=loss_fn, optimizer=opt)
        for depth in (-1, "1", 1.5, True):
            deep = json.loads(text)
            deep["actions"][0]["depth"] = depth
            with self.assertRaisesRegex(ValueError, "has depth"):
                memlean.apply_plan(model, x, deep, loss_fn=loss_fn, optimizer=opt)
        with self.assertRaisesRegex(ValueError, "plan has no budget_bytes, actions"):
            memlean.apply_plan(model, x, {}, loss_fn=loss_fn, optimizer=opt)
        with self.assertRaisesRegex(ValueError, "plan is not the JSON of a FitPlan"):
            memlean.apply_plan(model, x, "{not json", loss_fn=loss_fn, optimizer=opt)
        with self.assertRaisesRegex(ValueError, "neither JSON text nor a file"):
            memlean.apply_plan(model, x, "/nonexistent/plan.json", loss_fn=loss_fn)
        with self.assertRaisesRegex(TypeError, "plan must be a FitPlan"):
            memlean.apply_plan(model, x, 42, loss_fn=loss_fn)
        zero = json.loads(text)
        zero["budget_bytes"] = 0
        with self.assertRaisesRegex(ValueError, "plan's budget_bytes"):
            memlean.apply_plan(model, x, zero, loss_fn=loss_fn)
        self.assertEqual(wrapped_forwards(model), [])
        # The plan object itself, applied as it is (to the model it came from, undone).
        again = memlean.apply_plan(model, x, plan, loss_fn=loss_fn, optimizer=opt)
        self.assertEqual(again.peak_bytes, plan.peak_bytes)
        again.undo()

    def test_the_planners_optional_lists_are_checked_per_candidate(self):
        # _C.fit's per-candidate keywords (the gradients held apart, the compounds' nested
        # peaks) take one value per candidate or none: another count is a ValueError naming
        # the keyword, not a read past the list; with_compounds' excluded lists likewise.
        from memlean import _C

        atoms, candidates = [10, 10], [(0, 1, 8, 1.0, 0, 0), (0, 2, 18, 2.0, 0, 0)]
        for keyword, values in (("candidate_backward_extras", [(0, 0)]),
                                ("candidate_nested_peaks", [5, 5, 5])):
            with self.assertRaisesRegex(ValueError, keyword + ": .* values for 2 candidates"):
                _C.fit.predicted_peak(0, atoms, candidates, [], **{keyword: values})
        with self.assertRaisesRegex(ValueError, "nested_peak_bytes must be -1"):
            _C.fit.predicted_peak(0, atoms, candidates, [], candidate_nested_peaks=[-1, -2])
        with self.assertRaisesRegex(ValueError, "excluded: 1 lists for 2 candidates"):
            _C.fit.with_compounds(0, atoms, candidates, [[]])
        made = _C.fit.with_compounds(0, atoms, candidates, [[], []])[4]
        self.assertEqual(made, [(1, [0])])  # ([0, 2) around [0, 1): 2 + 10 = 12 < 20)

    def test_bad_input_is_named(self):
        model, x, loss_fn, opt = self.conv_setup()
        for budget, kind, text in [(0, ValueError, "budget_bytes"), (-5, ValueError, "budget_bytes"),
                                   ("-1GiB", ValueError, "budget_bytes"),
                                   ("six gigs", ValueError, "budget_bytes"),
                                   ("5 parsecs", ValueError, "unknown unit"),
                                   (2**63, ValueError, "budget_bytes: more than int64 bytes"),
                                   ("8EiB", ValueError, "budget_bytes"),
                                   (1.5, TypeError, "budget_bytes"), (True, TypeError, "budget_bytes")]:
            with self.assertRaisesRegex(kind, text):
                memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt)
        with self.assertRaisesRegex(ValueError, "model has no parameters"):
            memlean.fit(nn.Sequential(nn.ReLU()), x, "1GiB")
        lazy = nn.Sequential(nn.Flatten(), nn.LazyLinear(10))
        with self.assertRaisesRegex(ValueError, r"model has parameters not made yet \(1.weight"):
            memlean.fit(lazy, x, "1GiB", loss_fn=loss_fn)
        lazy(x)  # (made: then it fits)
        self.assertEqual(memlean.fit(lazy, x, "1GiB", loss_fn=loss_fn).actions, [])
        # Called inside torch.inference_mode() (no training step can run there), or with a
        # batch made there: named. Under torch.no_grad() (inside a validation loop) fit
        # measures the training step all the same.
        with self.assertRaisesRegex(RuntimeError, "inference_mode"), torch.inference_mode():
            memlean.fit(model, x, "1GiB", loss_fn=loss_fn, optimizer=opt)
        with torch.inference_mode():
            inference_batch = torch.randn_like(x)
        with self.assertRaisesRegex(ValueError, "example_inputs holds a tensor made in"):
            memlean.fit(model, inference_batch, "1GiB", loss_fn=loss_fn, optimizer=opt)
        eager = memlean.fit(model, x, 2**50, loss_fn=loss_fn, optimizer=opt).eager_peak_bytes
        with torch.no_grad():
            plan = memlean.fit(model, x, eager - 1, loss_fn=loss_fn, optimizer=opt)
        self.assertEqual(plan.eager_peak_bytes, eager)
        self.assertTrue(plan.actions)
        plan.undo()
        with self.assertRaisesRegex(ValueError, "no floating-point tensor"):
            memlean.fit(_IntOutput(), torch.randn(2, 4), "1GiB")
        with self.assertRaisesRegex(ValueError, "example_inputs holds a tensor on meta"):
            memlean.fit(model, x.to("meta"), "1GiB", loss_fn=loss_fn, optimizer=opt)
        with self.assertRaisesRegex(ValueError, "loss_fn must return a floating-point scalar"):
            memlean.fit(model, x, "1GiB", loss_fn=lambda out: out)
        with self.assertRaisesRegex(TypeError, "optimizer must be a torch.optim.Optimizer"):
            memlean.fit(model, x, "1GiB", optimizer="sgd")
        before = [p.detach().clone() for p in model.parameters()]
        with self.assertRaisesRegex(ValueError, r"optimizer \(LBFGS\) has a step\(\) that "
                                                r"needs a closure"):
            memlean.fit(model, x, "1GiB", optimizer=torch.optim.LBFGS(model.parameters()))
        for b, p in zip(before, model.parameters()):
            self.assertTrue(torch.equal(b, p))  # (refused before any step)
        with self.assertRaisesRegex(TypeError, "model must be a torch.nn.Module"):
            memlean.fit(lambda t: t, x, "1GiB")
        # A compiled model, or one holding a compiled module (torch.compile(block) in its
        # place): fit cannot see or change the modules behind compiled code, and named a least
        # of nothing changed (a submodule compiling in its first step) that a second call
        # then went below; refused before any step, naming it, for fit and apply_plan.
        compiled = copy.deepcopy(model)
        compiled.stem = torch.compile(compiled.stem)
        for m, name in ((torch.compile(model), "model is"), (compiled, "submodule 'stem' is")):
            with self.assertRaisesRegex(ValueError, f"{name} a torch.compile'd module"):
                memlean.fit(m, x, "1GiB", loss_fn=loss_fn, optimizer=opt)
            with self.assertRaisesRegex(ValueError, f"{name} a torch.compile'd module"):
                memlean.apply_plan(m, x, plan.to_json(), loss_fn=loss_fn, optimizer=opt)
        for b, p in zip(before, model.parameters()):
            self.assertTrue(torch.equal(b, p))

    def test_fitted_model_compiles(self):
        model, x, loss_fn, opt = self.conv_setup()
        least, eager = self.least_and_eager(model, x, loss_fn, opt)
        plan = memlean.fit(model, x, (least + eager) // 2, loss_fn=loss_fn, optimizer=opt)
        self.assertTrue(any(a.action == "checkpoint" for a in plan.actions))
        model.eval()  # dropout off: compare values
        expected = model(x)
        compiled = torch.compile(model, backend="aot_eager")
        torch.testing.assert_close(compiled(x), expected)
        model.train()
        loss_fn(compiled(x)).backward()
        self.assertTrue(all(p.grad is not None for p in model.parameters()))

    def test_fitted_then_compiled_with_inductor_keeps_its_checkpoints(self):
        # A plan for eager steps, compiled afterwards: its checkpoints run eagerly between
        # inductor's graphs (graph breaks) and still save under compile: the compiled fitted
        # step peaks below the compiled unfitted one, from the least peak to halfway to
        # eager's. It is not held to the budget: inductor's graphs between the checkpoints may
        # keep more than eager did, and how much depends on the CPU inductor compiles for (this
        # ConvNet at 1/5 of the way from its least: 5.1 % over the budget on an AMD EPYC with
        # AVX2 only, under it on an Intel Xeon with AVX512). fit(compile=True) holds a compiled
        # step to the budget (fit_compile_test.py). (Not with fit(runs=True): runs of sibling
        # modules are eager-only.)
        model, x, loss_fn, opt = self.conv_setup()
        least, eager = self.least_and_eager(model, x, loss_fn, opt)
        compiled = torch.compile(model, backend="inductor")
        step_peak(compiled, (x,), loss_fn, opt)  # compiles
        unfitted = step_peak(compiled, (x,), loss_fn, opt)
        torch._dynamo.reset()
        for budget in [least, least + (eager - least) // 5, (least + eager) // 2]:
            plan = memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt)
            self.assertTrue(any(a.action == "checkpoint" for a in plan.actions), str(plan))
            compiled = torch.compile(model, backend="inductor")
            step_peak(compiled, (x,), loss_fn, opt)  # compiles
            measured = step_peak(compiled, (x,), loss_fn, opt)
            self.assertLess(measured, unfitted, f"compiled: {measured}, unfitted compiled: "
                                                f"{unfitted}, budget {budget}\n{plan}")
            plan.undo()
            torch._dynamo.reset()

    def test_a_plan_for_eager_steps_says_so_when_compiled(self):
        # Runs of sibling modules and sliced chains are eager-only: a model fitted with them
        # and then compiled runs them as plain modules and is not held to the budget. When
        # torch.compile traces the forward of such a run's parent, a UserWarning says so, once
        # per run, naming it; the note adds no graph break; eager steps say nothing.
        from torch._dynamo.utils import counters

        from memlean import fitting

        model, x, loss_fn, opt = self.conv_setup()
        with self.assertRaises(memlean.FitError) as caught:
            memlean.fit(model, x, 1, loss_fn=loss_fn, optimizer=opt, runs=True)
        plan = memlean.fit(model, x, caught.exception.least_peak_bytes, loss_fn=loss_fn,
                           optimizer=opt, runs=True)
        eager_only = {a.path for a in plan.actions
                      if "(" in a.path
                      and a.action in ("checkpoint", "sliced recompute", "sliced mlp")}
        self.assertTrue(eager_only, str(plan))

        def notes(step):
            with mock.patch.object(fitting, "_NOTED", set()), \
                    warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step()
            return [str(w.message) for w in caught if "eager steps only" in str(w.message)]

        def compiled_steps():
            torch._dynamo.reset()
            counters.clear()
            compiled = torch.compile(model, backend="aot_eager")
            for _ in range(2):
                loss_fn(compiled(x)).backward()
            opt.zero_grad()
            return sum(counters["graph_break"].values())

        self.assertEqual(notes(lambda: loss_fn(model(x)).backward()), [])
        said = notes(compiled_steps)
        self.assertTrue(said)
        self.assertEqual(len(said), len(set(said)), said)  # once each, over two steps
        for note in said:
            self.assertIn("fit with compile=True", note)
            named = note.split("the forward of ")[1].split(",")[0]
            self.assertIn(named, eager_only, note)
        breaks = {}
        for on in (True, False):
            with mock.patch.object(fitting, "_NOTE_IN_GRAPH", on), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                breaks[on] = compiled_steps()
        self.assertEqual(breaks[True], breaks[False])
        plan.undo()
        torch._dynamo.reset()


def cuda_step(model, x, loss_fn, opt, region=contextlib.nullcontext):
    """One training step on CUDA, measured with torch's own counters (not memstats): (bytes
    allocated when it starts, the most allocated during it). The whole step runs inside
    region() (an autocast region), as fit measured it."""
    for p in model.parameters():
        p.grad = None
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with region():
        out = model(x)
        loss = loss_fn(out)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out, loss
    torch.clear_autocast_cache()
    torch.cuda.synchronize()
    return before, torch.cuda.max_memory_allocated()


def cuda_process_bytes(make, region=contextlib.nullcontext, compiled=False):
    """The bytes the process keeps on the device once steps of this kind have run (cuBLAS
    workspaces), made by a throwaway twin from make() -> (model, batch, loss_fn, optimizer):
    one step (through torch.compile(dynamic=False) if compiled), then one through
    memlean.checkpoint of the whole model. cuBLAS keeps a workspace per thread: the autograd
    engine's device thread gets its own cuBLASLt one (1 MiB on an H100) the first time a
    checkpoint recomputes a linear layer there."""
    model, x, loss_fn, opt = make()
    if compiled:
        torch._dynamo.reset()
    cuda_step(torch.compile(model, dynamic=False) if compiled else model, x, loss_fn, opt,
              region)
    with region():
        loss_fn(memlean.checkpoint(model, x)).backward()
    del model, x, opt
    if compiled:
        torch._dynamo.reset()
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def squared_mean(out):
    return out.float().square().mean()


@unittest.skipUnless(torch.cuda.is_available(), "needs a CUDA GPU")
class FitCudaTest(unittest.TestCase):
    """On CUDA the budget counts what torch.cuda.max_memory_allocated counts, checked here with
    torch's counters: the model's resident bytes as the allocator rounds them, and every
    step's peak above what lived before the model (cuBLAS's workspaces) at or under the
    budget. (The losses read no labels: nothing but the step lives on the device.)"""

    def setUp(self):
        torch.manual_seed(0)

    def on_cuda(self, make, region):
        """(cuda_process_bytes(make, region)), then make()'s model, batch, loss and
        optimizer."""
        base = cuda_process_bytes(make, region)
        torch.manual_seed(0)
        return (base,) + make()

    def check_cuda_budgets(self, make, region=contextlib.nullcontext, count=5, runs=False):
        base, model, x, loss_fn, opt = self.on_cuda(make, region)
        with self.assertRaises(memlean.FitError) as caught, region():
            memlean.fit(model, x, 1, loss_fn=loss_fn, optimizer=opt, runs=runs)
        least = caught.exception.least_peak_bytes
        with region():
            eager = memlean.fit(model, x, 2**50, loss_fn=loss_fn, optimizer=opt,
                                runs=runs).eager_peak_bytes
        self.assertLess(least, eager)
        previous = None
        for i in range(count):
            budget = eager - (eager - least) * i // (count - 1)
            with region():
                plan = memlean.fit(model, x, budget, loss_fn=loss_fn, optimizer=opt, runs=runs)
            self.assertEqual(plan.device, "cuda:0")
            if not opt.state:
                cuda_step(model, x, loss_fn, opt, region)
            before, peak = cuda_step(model, x, loss_fn, opt, region)
            # Parameters, buffers, momentum and batch, as the allocator counts them.
            self.assertEqual(before - base, plan.fixed_bytes, str(plan))
            self.assertLessEqual(peak - base, budget, f"budget {budget}: {plan}")
            self.assertLessEqual(abs(peak - base - plan.peak_bytes),
                                 max(plan.peak_bytes // 50, 1 << 20), str(plan))
            if previous is not None:
                self.assertLessEqual(plan.peak_bytes, previous, "the peak rose as the budget fell")
            previous = plan.peak_bytes
            print(f"cuda budget {budget}: fit measured {plan.peak_bytes}, torch "
                  f"{peak - base} (+{peak - base - plan.peak_bytes}), predicted "
                  f"{plan.predicted_peak_bytes}, {len(plan.actions)} actions", flush=True)
            plan.undo()
        return least, eager

    @staticmethod
    def conv():
        model = ConvNet(w=32).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, torch.randn(32, 3, 32, 32, device="cuda"), squared_mean, opt

    @staticmethod
    def gpt():
        model = GPT(d=64).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, torch.randint(0, 50, (8, 128), device="cuda"), squared_mean, opt

    def test_budget_is_a_promise_on_cuda_conv(self):
        least, eager = self.check_cuda_budgets(self.conv)
        self.assertLess(least, 0.75 * eager)

    def test_budget_is_a_promise_on_cuda_conv_channels_last_bf16_autocast(self):
        def make():
            model, x, loss_fn, opt = self.conv()
            return (model.to(memory_format=torch.channels_last),
                    x.to(memory_format=torch.channels_last), loss_fn, opt)

        self.check_cuda_budgets(make, lambda: torch.autocast("cuda", torch.bfloat16))

    def test_budget_is_a_promise_on_cuda_with_runs_channels_last_bf16_autocast(self):
        # Runs of sibling modules, nested ones among them, and the weight gradients a
        # checkpoint's backward defers under autocast (its recompute reuses the cached bfloat16
        # weight copies), measured with torch's counters.
        def make():
            model, x, loss_fn, opt = self.conv()
            return (model.to(memory_format=torch.channels_last),
                    x.to(memory_format=torch.channels_last), loss_fn, opt)

        region = lambda: torch.autocast("cuda", torch.bfloat16)
        least, _ = self.check_cuda_budgets(make, region, runs=True)
        model, x, loss_fn, opt = make()
        with self.assertRaises(memlean.FitError) as caught, region():
            memlean.fit(model, x, 1, loss_fn=loss_fn, optimizer=opt)
        self.assertLess(least, caught.exception.least_peak_bytes)  # (runs lower it)

    def test_budget_is_a_promise_on_cuda_transformer(self):
        least, eager = self.check_cuda_budgets(self.gpt)
        self.assertLess(least, 0.9 * eager)

    def test_fitted_training_on_cuda_equals_eager_training(self):
        # Dropout masks (the CUDA generator) and BatchNorm statistics included.
        model, x, _, opt = self.conv()
        y = torch.randint(0, 10, (32,), device="cuda")
        loss_fn = cross_entropy_of(y)
        twin = copy.deepcopy(model)
        opt_twin = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
        with self.assertRaises(memlean.FitError) as caught:
            memlean.fit(model, x, 1, loss_fn=loss_fn, optimizer=opt)
        plan = memlean.fit(model, x, caught.exception.least_peak_bytes, loss_fn=loss_fn,
                           optimizer=opt)
        self.assertTrue(any(a.action == "checkpoint" for a in plan.actions), str(plan))
        # (TF32 convolutions: both models run the same algorithms on the same shapes.)
        train_alike(model, opt, twin, opt_twin, x, loss_fn, rtol=1e-3, atol=1e-4)

    def test_fit_needs_no_device_memory_beyond_its_steps_on_cuda(self):
        # What fit puts back it holds on the CPU: the most torch's allocator counts while fit
        # runs, above what was allocated before it, is the eager step's own bytes above its
        # resident ones (here 32 MiB of parameters and 64 MiB of AdamW state that copies on
        # the device would add); nothing is left allocated, with no plan and with the plan of
        # the least peak. (C++: FitCuda's NeedsNoDeviceMemoryBeyondItsSteps.) The activations
        # (32 MiB each) outweigh the gradients, so checkpoints lower the peak (at 512 rows
        # they did not: the least was the eager peak, and a budget 4 MiB below it raised a
        # FitError on an H200, 2026-11-29).
        model = nn.Sequential(nn.Linear(2048, 2048), nn.SiLU(), nn.Linear(2048, 2048), nn.SiLU(),
                              nn.Linear(2048, 10)).cuda()
        x = torch.randn(4096, 2048, device="cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        cuda_step(model, x, squared_mean, opt, contextlib.nullcontext)
        eager = memlean.fit(model, x, 2**50, loss_fn=squared_mean, optimizer=opt)
        own = eager.eager_peak_bytes - eager.fixed_bytes
        with self.assertRaises(memlean.FitError) as caught:
            memlean.fit(model, x, 1, loss_fn=squared_mean, optimizer=opt)
        least = caught.exception.least_peak_bytes
        self.assertLess(least, eager.eager_peak_bytes)
        for budget in (2**50, least):
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            plan = memlean.fit(model, x, budget, loss_fn=squared_mean, optimizer=opt)
            torch.cuda.synchronize()
            most = torch.cuda.max_memory_allocated() - before
            print(f"cuda budget {budget}: fit's most above its start {most}, the eager "
                  f"step's own {own}", flush=True)
            self.assertLessEqual(most, own + (1 << 20), str(plan))
            self.assertEqual(bool(plan.actions), budget == least, str(plan))
            plan.undo()
            del plan
            torch.cuda.synchronize()
            self.assertEqual(torch.cuda.memory_allocated(), before, "fit left device memory")

    def test_no_in_place_swish_where_a_later_op_writes_its_output_on_cuda(self):
        # FitTest's case on cuda:0 (the dataflow check and the recorder's version check see
        # device tensors as they see the CPU's), at 4 MiB per activation: fit keeps a margin
        # of 2 MiB or more below the budget there.
        check_no_in_place_swish_where_written(self, "cuda", batch=64, size=32)

    def test_a_module_changing_a_buffer_through_data_is_never_checkpointed_on_cuda(self):
        # FitTest's case on cuda:0 (the value check reads device buffers), 4 MiB per
        # activation.
        check_no_checkpoint_holds_a_data_change(self, "cuda", batch=8192)


class _IntOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x).argmax(-1)


if __name__ == "__main__":
    unittest.main()
