"""DenseNet-BC for CIFAR-sized inputs (efficient_densenet_pytorch's layout, seed 003's
model), with the bottleneck's cat -> BN -> ReLU -> 1x1 conv run four ways:

- "naive": no checkpointing;
- "official": torch.utils.checkpoint, reentrant (what seed 003 measured);
- "official_nonreentrant": torch.utils.checkpoint(use_reentrant=False), as recommended today;
- "memlean": memlean.CheckpointFunction.apply (seed 003's call form) with memlean.BatchNorm2d.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as cp

import memlean

METHODS = ("naive", "official", "official_nonreentrant", "memlean")


class DenseLayer(nn.Module):
    def __init__(self, channels, growth, bn_size, method):
        super().__init__()
        bn = memlean.BatchNorm2d if method == "memlean" else nn.BatchNorm2d
        self.norm1 = bn(channels)
        self.conv1 = nn.Conv2d(channels, bn_size * growth, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth)
        self.conv2 = nn.Conv2d(bn_size * growth, growth, 3, padding=1, bias=False)
        self.method = method

    def bn_function(self, *features):
        return self.conv1(F.relu(self.norm1(torch.cat(features, 1))))

    def forward(self, features):
        if self.method == "naive" or not any(f.requires_grad for f in features):
            out = self.bn_function(*features)
        elif self.method == "official":
            out = cp.checkpoint(self.bn_function, *features, use_reentrant=True)
        elif self.method == "official_nonreentrant":
            out = cp.checkpoint(self.bn_function, *features, use_reentrant=False)
        else:  # seed 003's form: inputs, then the parameters the function uses
            args = list(features) + list(self.norm1.parameters()) + list(self.conv1.parameters())
            out = memlean.CheckpointFunction.apply(self.bn_function, len(features), *args)
        return self.conv2(F.relu(self.norm2(out)))


class DenseBlock(nn.Module):
    def __init__(self, layers, channels, growth, bn_size, method):
        super().__init__()
        self.layers = nn.ModuleList(
            DenseLayer(channels + i * growth, growth, bn_size, method) for i in range(layers))

    def forward(self, x):
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


class DenseNetBC(nn.Module):
    def __init__(self, depth=100, growth=12, compression=0.5, bn_size=4, num_classes=10,
                 method="naive"):
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"DenseNetBC: unknown method {method!r}; expected one of {METHODS}")
        if (depth - 4) % 6:
            raise ValueError(f"DenseNetBC: depth must be 6n + 4, got {depth}")
        layers = (depth - 4) // 6
        channels = 2 * growth
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        stages = []
        for i in range(3):
            stages.append(DenseBlock(layers, channels, growth, bn_size, method))
            channels += layers * growth
            if i < 2:
                out = int(math.floor(channels * compression))
                stages.append(nn.Sequential(nn.BatchNorm2d(channels), nn.ReLU(),
                                            nn.Conv2d(channels, out, 1, bias=False), nn.AvgPool2d(2)))
                channels = out
        self.features = nn.Sequential(*stages)
        self.norm = nn.BatchNorm2d(channels)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x):
        x = self.features(self.stem(x))
        x = F.relu(self.norm(x))
        return self.classifier(F.adaptive_avg_pool2d(x, 1).flatten(1))
