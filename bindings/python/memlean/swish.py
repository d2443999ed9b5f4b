"""Swish-beta, y = x * sigmoid(beta * x), with a backward that saves only x."""
import math

import torch


def _check_beta(beta):
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise TypeError(f"memlean.swish: beta must be a real number, got {type(beta).__name__}")
    if not math.isfinite(beta):
        raise ValueError(f"memlean.swish: beta must be finite, got {beta}")
    return float(beta)


def swish(x: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """Swish-beta of x. Backward saves only x and recomputes sigmoid(beta * x).

    x: a float32, float64, bfloat16 or float16 tensor. beta: any finite number (1 is SiLU,
    0 gives x / 2).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"memlean.swish: x must be a torch.Tensor, got {type(x).__name__}")
    return torch.ops.memlean.swish(x, _check_beta(beta))


class Swish(torch.nn.Module):
    """nn.Module for memlean.swish: y = x * sigmoid(beta * x), memory-efficient backward."""

    def __init__(self, beta: float = 1.0):
        super().__init__()
        self.beta = _check_beta(beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.memlean.swish(x, self.beta)

    def extra_repr(self) -> str:
        return f"beta={self.beta}"
