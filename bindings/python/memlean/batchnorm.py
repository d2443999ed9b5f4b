"""memlean.BatchNorm2d: torch.nn.BatchNorm2d, kept for code written against pytorch-checkpoint's
cp_BatchNorm2d (docs/sources.md).

A memlean checkpoint's recompute keeps the running statistics of every torch BatchNorm it
calls (any torch.nn.modules.batchnorm._BatchNorm: BatchNorm1d, 2d, 3d, SyncBatchNorm, and
subclasses such as timm's BatchNormAct2d): the checkpoint puts their buffers back after the
recompute, in C++ (ops/checkpoint), so each is updated once per training step as it is. That
is the one implementation of "updated once"; this class adds nothing to torch's forward."""
import torch


class BatchNorm2d(torch.nn.BatchNorm2d):
    """A drop-in for torch.nn.BatchNorm2d (same arguments, parameters, buffers and
    state-dict keys; an instance of it too), and its forward: under a memlean checkpoint its
    running statistics are updated once per training step, as every torch BatchNorm's are
    (see the module docstring). This is pytorch-checkpoint's cp_BatchNorm2d (docs/sources.md)
    done right: that one updated the statistics in the recompute instead, so never under
    no_grad.
    """

    @classmethod
    def convert(cls, module: torch.nn.Module) -> torch.nn.Module:
        """Returns `module` with every torch.nn.BatchNorm2d in it (itself included) replaced
        by a memlean.BatchNorm2d with the same options, parameters and buffers.

        Not needed any more (see the module docstring): under a memlean checkpoint every
        torch BatchNorm is updated once per step as it is. Only exact torch.nn.BatchNorm2d
        modules are replaced; every other BatchNorm (subclasses such as timm's
        BatchNormAct2d, SyncBatchNorm, BatchNorm1d/3d) is left as it is, keeping what it adds
        (an activation, dropout, synchronized statistics), and is updated once all the same."""
        if type(module) is torch.nn.BatchNorm2d:
            new = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, device=_device_of(module), dtype=_dtype_of(module))
            new.load_state_dict(module.state_dict())
            if module.affine:
                new.weight.requires_grad_(module.weight.requires_grad)
                new.bias.requires_grad_(module.bias.requires_grad)
            new.train(module.training)
            return new
        for name, child in module.named_children():
            converted = cls.convert(child)
            if converted is not child:
                setattr(module, name, converted)
        return module


def _device_of(module):
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return None


def _dtype_of(module):
    for t in list(module.parameters()) + list(module.buffers()):
        if t.is_floating_point():
            return t.dtype
    return None
