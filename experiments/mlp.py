"""Seed 000's reference network in Python: Linear(in -> hidden) -> Swish -> Linear(hidden -> out).

The activation is any of memlean's Swish variants, or torch's SiLU ("silu")."""
import torch

import memlean

ACTIVATIONS = ("naive", "memory_efficient", "inplace", "silu")


def activation(name: str) -> torch.nn.Module:
    if name == "silu":
        return torch.nn.SiLU()
    return memlean.Swish(variant=name)


class Mlp(torch.nn.Module):
    def __init__(self, in_features=128, hidden=1 << 20, out_features=1, act="memory_efficient"):
        super().__init__()
        self.fc1 = torch.nn.Linear(in_features, hidden)
        self.act = activation(act)
        self.fc2 = torch.nn.Linear(hidden, out_features)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))
