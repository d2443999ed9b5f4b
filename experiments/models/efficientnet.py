"""EfficientNetB0: the Python twin of memlean::models::EfficientNetB0, i.e. timm's
efficientnet_b0 (same module and parameter names, so timm's state dicts load into it) with
the Swish of every block chosen among memlean's variants and torch's SiLU.

checkpoint: 'none', 'memlean' (round(sqrt(n)) segments of the n stages: stem, every block,
head) or 'segments:K', with memlean.checkpoint_sequential.
"""
import math

import torch
import torch.nn.functional as F

import memlean
from experiments.models.shared import check_segments, make_activation, parse_segments, run_stages

# repeats, kernel, stride of the first block, expand ratio, out channels.
B0 = ((1, 3, 1, 1, 16), (2, 3, 2, 6, 24), (2, 5, 2, 6, 40), (3, 3, 2, 6, 80),
      (3, 5, 1, 6, 112), (4, 5, 2, 6, 192), (1, 3, 1, 6, 320))


def round_channels(channels, multiplier):
    """timm's round_channels (make_divisible to 8, at least 8, not below 90%)."""
    v = channels * multiplier
    rounded = max(8, int(v + 4) // 8 * 8)
    if rounded < 0.9 * v:
        rounded += 8
    return rounded


def _conv(cin, cout, kernel, stride=1, groups=1, bias=False):
    return torch.nn.Conv2d(cin, cout, kernel, stride, ((stride - 1) + (kernel - 1)) // 2,
                           groups=groups, bias=bias)


def drop_path(x, p, training):
    if p <= 0 or not training:
        return x
    keep = 1.0 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
    if keep > 0:
        mask.div_(keep)
    return x * mask


class SqueezeExcite(torch.nn.Module):
    def __init__(self, channels, reduced, activation):
        super().__init__()
        self.conv_reduce = _conv(channels, reduced, 1, bias=True)
        self.act = make_activation(activation)
        self.conv_expand = _conv(reduced, channels, 1, bias=True)

    def forward(self, x):
        s = self.conv_expand(self.act(self.conv_reduce(x.mean((2, 3), keepdim=True))))
        return x * s.sigmoid()


class MBConv(torch.nn.Module):
    """timm's DepthwiseSeparableConv (expand_ratio 1) or InvertedResidual, with SE."""

    def __init__(self, cin, cout, kernel, stride, expand_ratio, drop_connect, activation):
        super().__init__()
        self.expand = expand_ratio != 1
        self.residual = stride == 1 and cin == cout
        self.drop_connect = drop_connect
        mid = cin * expand_ratio
        reduced = max(1, cin // 4)
        if self.expand:
            self.conv_pw = _conv(cin, mid, 1)
            self.bn1 = memlean.BatchNorm2d(mid)
            self.act1 = make_activation(activation)
            self.conv_dw = _conv(mid, mid, kernel, stride, mid)
            self.bn2 = memlean.BatchNorm2d(mid)
            self.act2 = make_activation(activation)
            self.se = SqueezeExcite(mid, reduced, activation)
            self.conv_pwl = _conv(mid, cout, 1)
            self.bn3 = memlean.BatchNorm2d(cout)
        else:
            self.conv_dw = _conv(cin, cin, kernel, stride, cin)
            self.bn1 = memlean.BatchNorm2d(cin)
            self.act1 = make_activation(activation)
            self.se = SqueezeExcite(cin, reduced, activation)
            self.conv_pw = _conv(cin, cout, 1)
            self.bn2 = memlean.BatchNorm2d(cout)

    def forward(self, x):
        if self.expand:
            h = self.act1(self.bn1(self.conv_pw(x)))
            h = self.act2(self.bn2(self.conv_dw(h)))
            h = self.bn3(self.conv_pwl(self.se(h)))
        else:
            h = self.act1(self.bn1(self.conv_dw(x)))
            h = self.bn2(self.conv_pw(self.se(h)))
        if self.residual:
            h = drop_path(h, self.drop_connect, self.training) + x
        return h


class EfficientNetB0(torch.nn.Module):
    """EfficientNet-B0: 5,288,548 parameters at 1000 classes. width/depth multipliers scale
    it (tiny configurations for tests: 0.25 and 0.25)."""

    def __init__(self, num_classes=1000, width_multiplier=1.0, depth_multiplier=1.0, dropout=0.2,
                 drop_connect=0.2, activation="memory_efficient", checkpoint="none"):
        super().__init__()
        mode, k = parse_segments(checkpoint)
        stem = round_channels(32, width_multiplier)
        self.conv_stem = _conv(3, stem, 3, 2)
        self.bn1 = memlean.BatchNorm2d(stem)
        self.act1 = make_activation(activation)
        repeats = [int(math.ceil(r * depth_multiplier)) for r, *_ in B0]
        total, index, cin = sum(repeats), 0, stem
        stages = []
        for (_, kernel, stride, expand, out), n in zip(B0, repeats):
            cout = round_channels(out, width_multiplier)
            blocks = []
            for r in range(n):
                blocks.append(MBConv(cin, cout, kernel, stride if r == 0 else 1, expand,
                                     drop_connect * index / total, activation))
                cin, index = cout, index + 1
            stages.append(torch.nn.Sequential(*blocks))
        self.blocks = torch.nn.Sequential(*stages)
        head = round_channels(1280, width_multiplier)
        self.conv_head = _conv(cin, head, 1)
        self.bn2 = memlean.BatchNorm2d(head)
        self.act2 = make_activation(activation)
        self.dropout = dropout
        self.classifier = torch.nn.Linear(head, num_classes)
        # A plain list (not registered twice) of modules, no closure over self (see mlp.py).
        self._stages = ([torch.nn.Sequential(self.conv_stem, self.bn1, self.act1)]
                        + [b for s in self.blocks for b in s]
                        + [torch.nn.Sequential(self.conv_head, self.bn2, self.act2)])
        check_segments(k, len(self._stages), "EfficientNetB0")
        self.mode, self.k = mode, k
        self._init_goog()

    def _init_goog(self):
        """timm's _init_weight_goog."""
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, torch.nn.Conv2d):
                    fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels // m.groups
                    m.weight.normal_(0.0, math.sqrt(2.0 / fan_out))
                    if m.bias is not None:
                        m.bias.zero_()
                elif isinstance(m, torch.nn.BatchNorm2d):
                    m.weight.fill_(1.0)
                    m.bias.zero_()
                elif isinstance(m, torch.nn.Linear):
                    r = 1.0 / math.sqrt(m.weight.size(0))
                    m.weight.uniform_(-r, r)
                    m.bias.zero_()

    @property
    def stages(self):
        """[stem, every block, head]: the chain that segments:K cuts."""
        return list(self._stages)

    def forward(self, x):
        f = run_stages(self._stages, self.mode, self.k, x)
        f = F.adaptive_avg_pool2d(f, 1).flatten(1)
        if self.dropout > 0:
            f = F.dropout(f, self.dropout, self.training)
        return self.classifier(f)
