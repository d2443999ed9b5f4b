"""memlean.conv2d: torch.nn.functional.conv2d whose backward keeps less for a depthwise
convolution (ops/checkpoint/lean_conv.h, docs/checkpoint.md). memlean.fit swaps it into the
depthwise convolutions of the model it fits (memlean.lean.lean_forward)."""
import torch
import torch.nn.functional as F
from torch.overrides import has_torch_function

from memlean import _C


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """torch.nn.functional.conv2d (same arguments, output and errors) whose backward, for a
    depthwise convolution (groups == input channels == output channels), allocates the input
    gradient and nothing else of the input's size: torch's CPU backward of a contiguous
    depthwise convolution allocates 2 to 5 more tensors of that size (im2col or oneDNN's
    reorders). Gradients equal torch's to float tolerance; double backward works.

    The lean backward runs for CPU float32, float64, bfloat16 and float16 4-d inputs (the last
    two with float32 sums), contiguous or channels_last, with integer padding, with autograd
    recording, outside torch.compile; in a CPU autocast region too, casting input, weight and
    bias as torch's conv2d does there. Everything else (other groups, CUDA, other layouts,
    padding="same"/"valid", float64 in an autocast region, tensor subclasses, compiled code)
    is torch's F.conv2d itself."""
    return _conv2d(_lean_applies(input, weight, bias, padding, groups), input, weight, bias,
                   stride, padding, dilation, groups)


def _conv2d(lean, input, weight, bias, stride, padding, dilation, groups):
    """memlean.conv2d once _lean_applies has answered `lean` for these arguments."""
    if lean:
        return _C.lean_conv2d(input, weight, bias, _pair(stride), _pair(padding),
                              _pair(dilation), int(groups))
    return F.conv2d(input, weight, bias, stride, padding, dilation, groups)


def _pair(v):
    return [int(v)] * 2 if isinstance(v, int) else [int(i) for i in v]


def _lean_applies(input, weight, bias, padding, groups) -> bool:
    """Whether memlean.conv2d runs the lean backward for these arguments."""
    tensors = tuple(t for t in (input, weight, bias) if t is not None)
    return bool(torch.is_tensor(input) and torch.is_tensor(weight)
                and (bias is None or torch.is_tensor(bias))
                and isinstance(groups, int) and not isinstance(padding, str)
                and torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and any(t.requires_grad for t in tensors)
                and not has_torch_function(tensors)  # no subclass (DTensor, FakeTensor, ...)
                and _C.lean_conv2d_applies(input, weight, groups))
