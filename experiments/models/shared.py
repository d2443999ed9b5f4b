"""What the Python twins of //experiments/models share: the activations and the parsing of
checkpoint modes (the same names as the C++ models and the trainer's flags)."""

import torch

import memlean

# Swish with beta = 1 (= SiLU), five ways with the same forward: memlean's three variants,
# torch's SiLU and torch's in-place SiLU (which autograd makes keep a copy of x).
ACTIVATIONS = ("naive", "memory_efficient", "inplace", "silu", "silu_inplace")


def make_activation(name: str) -> torch.nn.Module:
    """An nn.Module computing the named activation (see ACTIVATIONS)."""
    if name == "silu":
        return torch.nn.SiLU()
    if name == "silu_inplace":
        return torch.nn.SiLU(inplace=True)
    if name in memlean.VARIANTS:
        return memlean.Swish(variant=name)
    raise ValueError(f"unknown activation {name!r}; expected one of {', '.join(ACTIVATIONS)}")


def parse_segments(mode: str, extra=()):
    """'none', 'memlean', 'segments:K' or one of `extra` -> (mode, K or None)."""
    if mode in ("none", "memlean") or mode in extra:
        return mode, None
    if isinstance(mode, str) and mode.startswith("segments:"):
        k = mode[len("segments:"):]
        if k.isdigit() and int(k) >= 1:
            return "segments", int(k)
        raise ValueError(f"checkpoint {mode!r}: K in segments:K must be a positive integer")
    names = ", ".join(("none", "memlean", "segments:K") + tuple(extra))
    raise ValueError(f"unknown checkpoint mode {mode!r}; expected one of {names}")


def check_segments(k, n_stages, model):
    if k is not None and not 1 <= k <= n_stages:
        raise ValueError(f"{model}: checkpoint segments:{k} asks for more segments than the model "
                         f"has stages ({n_stages}); use 1 to {n_stages}")


def run_stages(stages, mode, k, x):
    """Runs the chain `stages` plainly ('none'), in K segments ('segments') or in
    round(sqrt(n)) segments ('memlean'), with memlean.checkpoint_sequential."""
    if mode == "segments":
        return memlean.checkpoint_sequential(stages, k, x)
    if mode == "memlean":
        return memlean.checkpoint_sequential(stages, "sqrt", x)
    for stage in stages:
        x = stage(x)
    return x


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["ACTIVATIONS", "check_segments", "make_activation", "num_parameters",
           "parse_segments", "run_stages"]
