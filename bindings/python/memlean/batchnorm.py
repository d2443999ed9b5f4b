"""memlean.BatchNorm2d: torch.nn.BatchNorm2d, kept for code written against pytorch-checkpoint's
cp_BatchNorm2d (docs/sources.md).

A memlean checkpoint's recompute keeps the running statistics of every torch BatchNorm it
calls (any torch.nn.modules.batchnorm._BatchNorm: BatchNorm1d, 2d, 3d, SyncBatchNorm, and
subclasses such as timm's BatchNormAct2d): the checkpoint puts their buffers back after the
recompute, in C++ (ops/checkpoint), so each is updated once per training step as it is. That
is the one implementation of "updated once"; this class adds nothing to torch's forward.

memlean.batch_norm is torch.nn.functional.batch_norm with memlean's lean backward in training
(ops/checkpoint/lean_batchnorm.h, docs/checkpoint.md): the same output and running
statistics, and a backward that allocates at most the input gradient, written over the
incoming gradient when autograd alone holds it, where torch's CPU backward allocates that and
a temporary of the input's size. memlean.fit swaps it into the training BatchNorms of the
model it fits (memlean.lean.lean_forward)."""
import torch
import torch.nn.functional as F
from torch.overrides import has_torch_function

from memlean import _C


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False,
               momentum=0.1, eps=1e-5):
    """torch.nn.functional.batch_norm (same arguments, output, running-statistics update and
    errors) whose training-mode backward keeps less memory: it allocates at most the input
    gradient, written over the incoming gradient when autograd alone holds it (torch's CPU
    backward allocates that and a temporary of the input's size beside it). Gradients equal
    torch's to float tolerance; double backward works.

    The lean backward runs for CPU float32, float64, bfloat16 and float16 inputs (the last
    two with float32 sums, beside weights of their type or float32 ones, as in a CPU autocast
    region) of 2 or more dimensions, contiguous or channels_last, in training with autograd
    recording, outside torch.compile. Everything else (eval, no_grad, CUDA, other layouts,
    tensor subclasses, compiled code) is torch's F.batch_norm itself."""
    return _batch_norm(_lean_applies(input, running_mean, running_var, weight, bias, training),
                       input, running_mean, running_var, weight, bias, training, momentum, eps)


def _batch_norm(lean, input, running_mean, running_var, weight, bias, training, momentum,
                eps):
    """memlean.batch_norm once _lean_applies has answered `lean` for these arguments."""
    if lean:
        size = input.size()
        if input.numel() // size[1] == 1:  # as F.batch_norm (its _verify_batch_size)
            raise ValueError(f"Expected more than 1 value per channel when training, got input "
                             f"size {size}")
        return _C.lean_batch_norm(input, weight, bias, running_mean, running_var,
                                  float(momentum), float(eps))
    return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)


def _lean_applies(input, running_mean, running_var, weight, bias, training) -> bool:
    """Whether memlean.batch_norm runs the lean backward for these arguments."""
    tensors = tuple(t for t in (input, running_mean, running_var, weight, bias)
                    if t is not None)
    return bool(training and torch.is_tensor(input) and torch.is_grad_enabled()
                and not torch.compiler.is_compiling()
                and not has_torch_function(tensors)  # no subclass (DTensor, FakeTensor, ...)
                and _C.lean_batch_norm_applies(input))


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
