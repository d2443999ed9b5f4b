"""memlean's lean backwards, swapped into a module's forward: lean_forward(module) makes the
module's F.batch_norm calls run memlean.batch_norm and its F.conv2d calls memlean.conv2d
(each the torch function itself wherever its lean backward does not apply). memlean.fit
gives every training BatchNorm and every depthwise Conv2d of the model it fits this forward,
on CPU eager steps (docs/fit.md)."""
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from memlean.batchnorm import _batch_norm, _lean_applies as _lean_batch_norm
from memlean.checkpoint import wrap_forward
from memlean.conv import _conv2d, _lean_applies as _lean_conv


class _LeanMode(TorchFunctionMode):
    """While active, every F.batch_norm call runs memlean.batch_norm and every F.conv2d call
    memlean.conv2d; everything else runs as it is. `calls` counts the calls that ran a lean
    backward."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm:
            return self._batch_norm(*args, **kwargs)
        if func is F.conv2d:
            return self._conv2d(*args, **kwargs)
        return func(*args, **kwargs)

    def _batch_norm(self, input, running_mean, running_var, weight=None, bias=None,
                    training=False, momentum=0.1, eps=1e-5):
        lean = _lean_batch_norm(input, running_mean, running_var, weight, bias, training)
        self.calls += lean
        return _batch_norm(lean, input, running_mean, running_var, weight, bias, training,
                           momentum, eps)

    def _conv2d(self, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        lean = _lean_conv(input, weight, bias, padding, groups)
        self.calls += lean
        return _conv2d(lean, input, weight, bias, stride, padding, dilation, groups)


def lean_forward(module: torch.nn.Module):
    """Make `module`'s forward run memlean.batch_norm wherever it calls F.batch_norm (torch's
    BatchNorm1d/2d/3d, memlean.BatchNorm2d, subclasses such as timm's BatchNormAct2d) and
    memlean.conv2d wherever it calls F.conv2d (nn.Conv2d; the lean backward for depthwise
    ones): an instance forward over its own, outside torch.compile (compiled, its own runs as
    it is). Returns (undo, calls): undo() puts its forward back; calls() says how many of its
    calls ran a lean backward so far (0: none did, e.g. the module calls neither function, or
    only in eval mode, on a non-dense input or for a convolution that is not depthwise)."""
    original = module.forward
    taken = [0]

    def forward(*args, **kwargs):
        if torch.compiler.is_compiling():
            return original(*args, **kwargs)
        mode = _LeanMode()
        with mode:
            out = original(*args, **kwargs)
        taken[0] += mode.calls
        return out

    forward.__memlean_lean__ = True  # (memlean.sliced may run the module's chain sliced)
    # (A deep copy of the module gets a lean forward of its own.)
    undo = wrap_forward(module, forward, (_lean_again, ()))
    return undo, lambda: taken[0]


def _lean_again(module: torch.nn.Module) -> None:
    """wrap_forward's rewrap: a copy of a lean module (deepcopy, pickle) gets a lean forward of
    its own."""
    lean_forward(module)
