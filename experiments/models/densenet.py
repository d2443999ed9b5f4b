"""DenseNetBC: the Python twin of memlean::models::DenseNetBC, i.e. pytorch-checkpoint's demo
model (gpleiss/efficient_densenet_pytorch's DenseNet for CIFAR; docs/sources.md) with the same
parameter names.

checkpoint (what the dense layers' cat -> BatchNorm -> ReLU -> 1x1 conv, pytorch-checkpoint's
bn_function, run under):
  'none'              nothing is checkpointed (pytorch-checkpoint's "Naive" rows)
  'torch_reentrant'   torch.utils.checkpoint.checkpoint(use_reentrant=True), the official
                      implementation pytorch-checkpoint compares with ("Official")
  'torch'             torch.utils.checkpoint.checkpoint(use_reentrant=False), today's
                      recommended form of the official one
  'memlean'           memlean.CheckpointFunction, pytorch-checkpoint's call form ("This repo")
  'segments:K'        nothing inside the layers; the chain of `features` in K segments with
                      memlean.checkpoint_sequential
Every BatchNorm is memlean.BatchNorm2d: under 'memlean' its running statistics are updated
once per step; under torch's checkpoint the recompute updates them a second time, as
torch.nn.BatchNorm2d's would (what pytorch-checkpoint's cp_BatchNorm2d was about).
"""
import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp

import memlean
from experiments.models.shared import check_segments, parse_segments, run_stages

CHECKPOINTS = ("none", "memlean", "torch", "torch_reentrant", "segments:K")


class _DenseLayer(torch.nn.Module):
    def __init__(self, in_features, growth_rate, bottleneck, drop_rate, checkpoint):
        super().__init__()
        self.norm1 = memlean.BatchNorm2d(in_features)
        self.conv1 = torch.nn.Conv2d(in_features, bottleneck * growth_rate, 1, bias=False)
        self.norm2 = memlean.BatchNorm2d(bottleneck * growth_rate)
        self.conv2 = torch.nn.Conv2d(bottleneck * growth_rate, growth_rate, 3, padding=1, bias=False)
        self.drop_rate = drop_rate
        self.checkpoint = checkpoint

    def bottleneck(self, *features):
        x = features[0] if len(features) == 1 else torch.cat(features, 1)
        return self.conv1(F.relu(self.norm1(x), inplace=True))

    def forward(self, *features):
        needs_grad = torch.is_grad_enabled() and any(f.requires_grad for f in features)
        if self.checkpoint == "memlean":
            args = features + tuple(self.norm1.parameters()) + tuple(self.conv1.parameters())
            b = memlean.CheckpointFunction.apply(self.bottleneck, len(features), *args)
        elif self.checkpoint in ("torch", "torch_reentrant") and needs_grad:
            b = cp.checkpoint(self.bottleneck, *features,
                              use_reentrant=self.checkpoint == "torch_reentrant")
        else:
            b = self.bottleneck(*features)
        out = self.conv2(F.relu(self.norm2(b), inplace=True))
        if self.drop_rate > 0:
            out = F.dropout(out, p=self.drop_rate, training=self.training)
        return out


class _DenseBlock(torch.nn.Module):
    def __init__(self, layers, in_features, growth_rate, bottleneck, drop_rate, checkpoint):
        super().__init__()
        for i in range(layers):
            self.add_module(f"denselayer{i + 1}",
                            _DenseLayer(in_features + i * growth_rate, growth_rate, bottleneck,
                                        drop_rate, checkpoint))

    def forward(self, x):
        features = [x]
        for layer in self.children():
            features.append(layer(*features))
        return torch.cat(features, 1)


class _Transition(torch.nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.norm = memlean.BatchNorm2d(in_features)
        self.conv = torch.nn.Conv2d(in_features, out_features, 1, bias=False)

    def forward(self, x):
        return F.avg_pool2d(self.conv(F.relu(self.norm(x), inplace=True)), 2, 2)


class DenseNetBC(torch.nn.Module):
    """DenseNet-BC for CIFAR-sized input; defaults: depth 100, growth 12 (0.77M parameters at
    10 classes)."""

    def __init__(self, depth=100, growth_rate=12, compression=0.5, bottleneck=4, init_features=0,
                 num_classes=10, drop_rate=0.0, checkpoint="none"):
        super().__init__()
        if depth < 10 or (depth - 4) % 6:
            raise ValueError(f"DenseNetBC: depth must be 6 * n + 4 with n >= 1 (e.g. 10, 40, 100, 190), got {depth}")
        if not 0 < compression <= 1:
            raise ValueError(f"DenseNetBC: compression must be in (0, 1], got {compression}")
        mode, k = parse_segments(checkpoint, extra=("torch", "torch_reentrant"))
        layer_mode = mode if mode in ("memlean", "torch", "torch_reentrant") else "none"
        per_block = (depth - 4) // 6
        channels = init_features or 2 * growth_rate
        features = OrderedDict(conv0=torch.nn.Conv2d(3, channels, 3, padding=1, bias=False))
        for i in range(3):
            features[f"denseblock{i + 1}"] = _DenseBlock(per_block, channels, growth_rate,
                                                         bottleneck, drop_rate, layer_mode)
            channels += per_block * growth_rate
            if i != 2:
                out = int(math.floor(channels * compression))
                features[f"transition{i + 1}"] = _Transition(channels, out)
                channels = out
        features["norm_final"] = memlean.BatchNorm2d(channels)
        self.features = torch.nn.Sequential(features)
        self.classifier = torch.nn.Linear(channels, num_classes)
        check_segments(k, len(self.features), "DenseNetBC")
        self.segments = k if mode == "segments" else None

        # efficient_densenet_pytorch's initialisation.
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "conv" in name and "weight" in name:
                    n = p.size(0) * p.size(2) * p.size(3)
                    p.normal_(0.0, math.sqrt(2.0 / n))
                elif "norm" in name:
                    p.fill_(1.0 if "weight" in name else 0.0)
                elif "classifier" in name and "bias" in name:
                    p.zero_()

    def forward(self, x):
        if self.segments is not None:
            f = run_stages(self.features, "segments", self.segments, x)
        else:
            f = self.features(x)
        out = F.adaptive_avg_pool2d(F.relu(f, inplace=True), 1).flatten(1)
        return self.classifier(out)
