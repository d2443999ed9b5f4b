"""Swish-beta, y = x * sigmoid(beta * x), in three variants with the same forward.

- ``"naive"``: the autograd composition ``x * torch.sigmoid(beta * x)``; saves x and the
  sigmoid (the baseline).
- ``"memory_efficient"`` (default): saves only x; backward recomputes sigmoid(beta * x).
- ``"inplace"``: overwrites x with y and saves one bit per element (which side of swish's
  minimum beta * x lies on); backward recovers x from y and the bit. As for any in-place
  op, a leaf that requires grad is refused, and a tensor saved earlier in the graph that is
  overwritten makes backward fail (version counter) instead of giving a wrong gradient.
"""
import math

import torch

VARIANTS = ("naive", "memory_efficient", "inplace")


def _check_beta(beta):
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise TypeError(f"memlean.swish: beta must be a real number, got {type(beta).__name__}")
    if not math.isfinite(beta):
        raise ValueError(f"memlean.swish: beta must be finite, got {beta}")
    return float(beta)


def _check_variant(variant):
    if variant not in VARIANTS:
        raise ValueError(f"memlean.swish: unknown variant {variant!r}; expected one of {VARIANTS}")
    return variant


def _check_x(x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"memlean.swish: x must be a torch.Tensor, got {type(x).__name__}")


def swish(x: torch.Tensor, beta: float = 1.0, variant: str = "memory_efficient") -> torch.Tensor:
    """Swish-beta of x with the given variant's backward (see the module docstring).

    x: a float32, float64, bfloat16 or float16 tensor. beta: any finite number (1 is SiLU,
    0 gives x / 2). With variant="inplace", x is overwritten and returned.
    """
    _check_x(x)
    beta = _check_beta(beta)
    variant = _check_variant(variant)
    if variant == "naive":
        return x * torch.sigmoid(x if beta == 1.0 else beta * x)
    if variant == "inplace":
        torch.ops.memlean.swish_(x, beta)
        return x
    return torch.ops.memlean.swish(x, beta)


def swish_(x: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """In-place Swish-beta: overwrites x with y, saves one bit per element; returns x."""
    _check_x(x)
    torch.ops.memlean.swish_(x, _check_beta(beta))
    return x


class Swish(torch.nn.Module):
    """nn.Module for Swish-beta, y = x * sigmoid(beta * x).

    variant: "naive", "memory_efficient" (default) or "inplace" (see memlean.swish).
    inplace: timm's activation convention (``act_layer(inplace=True)``); True selects the
    "inplace" variant when no variant is given.
    """

    beta: float
    variant: str

    def __init__(self, beta: float = 1.0, variant: str = None, inplace: bool = False):
        super().__init__()
        self.beta = _check_beta(beta)
        if variant is None:
            variant = "inplace" if inplace else "memory_efficient"
        elif inplace and variant != "inplace":
            raise ValueError(f"memlean.Swish: inplace=True contradicts variant={variant!r}")
        self.variant = _check_variant(variant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.variant == "naive":
            if self.beta == 1.0:
                return x * torch.sigmoid(x)
            return x * torch.sigmoid(x * self.beta)
        if self.variant == "inplace":
            torch.ops.memlean.swish_(x, self.beta)
            return x
        return torch.ops.memlean.swish(x, self.beta)

    def extra_repr(self) -> str:
        if self.variant == "memory_efficient":
            return f"beta={self.beta}"
        return f"beta={self.beta}, variant={self.variant!r}"
