"""memlean.BatchNorm2d: torch.nn.BatchNorm2d whose running statistics are updated exactly
once per training forward, also when a memlean checkpoint recomputes that forward.

It is no longer needed: a memlean checkpoint's recompute now keeps the running statistics of
every torch BatchNorm it calls (any torch.nn.modules.batchnorm._BatchNorm: BatchNorm1d, 2d,
3d, SyncBatchNorm, and subclasses such as timm's BatchNormAct2d), so each is updated once per
training step as it is. memlean.BatchNorm2d and its convert() stay for code that uses them."""
import torch
import torch.nn.functional as F

from memlean.checkpoint import is_recomputing


class BatchNorm2d(torch.nn.BatchNorm2d):
    """A drop-in for torch.nn.BatchNorm2d (same arguments, parameters, buffers and
    state-dict keys; an instance of it too).

    (No longer needed, see the module docstring.) While a memlean checkpoint recomputes a
    forward in backward (memlean.is_recomputing()), it normalizes with the batch statistics
    as before but leaves running_mean, running_var and num_batches_tracked alone: the
    forward being recomputed updated them already. In
    every other case it behaves as torch's, including a train-mode forward under no_grad
    (which updates the statistics). This is pytorch-checkpoint's cp_BatchNorm2d
    (docs/sources.md), done right: that one updated the statistics in the recompute instead,
    so never under no_grad.
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        update = self.training and self.track_running_stats and not is_recomputing()
        if update and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                factor = 1.0 / float(self.num_batches_tracked)
            else:
                factor = self.momentum
        if self.training:
            batch_stats = True
        else:
            batch_stats = self.running_mean is None and self.running_var is None
        # In training, pass the running statistics only when they are to be updated.
        use_running = not self.training or update
        return F.batch_norm(
            input,
            self.running_mean if use_running else None,
            self.running_var if use_running else None,
            self.weight,
            self.bias,
            batch_stats,
            factor,
            self.eps,
        )

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
