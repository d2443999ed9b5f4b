"""memlean: train PyTorch models in less memory, and see exactly where the memory goes.

    import memlean
    y = memlean.swish(x, beta=1.0)      # Swish-beta whose backward saves only x
    act = memlean.Swish(beta=1.0)       # the same as an nn.Module
    act = memlean.Swish(variant="inplace")   # overwrites x, saves one bit per element
    plan = memlean.fit(model, x, "6GiB", optimizer=opt)   # a training step under 6 GiB

Importing memlean registers its operators under torch.ops.memlean.
"""
import torch as _torch

from memlean._build_info import TORCH_VERSION as _BUILT_TORCH_VERSION
from memlean._build_info import VERSION as __version__


def _check_torch_version():
    built = _BUILT_TORCH_VERSION.split("+")[0]
    found = _torch.__version__.split("+")[0]
    if built != found:
        raise ImportError(
            f"memlean {__version__} was built against torch {_BUILT_TORCH_VERSION}, but the "
            f"torch imported here is {_torch.__version__} ({_torch.__file__}). Its C++ "
            f"extension only works with the torch it was built against: install "
            f"torch=={built}, or rebuild memlean with this torch (./bazelw build "
            f"//bindings/python:wheel)."
        )


_check_torch_version()

from memlean import _C  # noqa: E402  (registers torch.ops.memlean.*)
from memlean.swish import VARIANTS, Swish, swish, swish_  # noqa: E402
from memlean.checkpoint import CheckpointFunction, checkpoint, is_recomputing  # noqa: E402
from memlean.sequential import (  # noqa: E402
    LayerCost, SegmentPlan, checkpoint_sequential, measure_layer_costs, plan_segments)
from memlean.batchnorm import BatchNorm2d, batch_norm  # noqa: E402
from memlean.conv import conv2d  # noqa: E402
from memlean.sliced import sliced_chain, sliced_gated_mlp, sliced_mlp  # noqa: E402
from memlean import memstats  # noqa: E402,F401  (memlean.memstats.track(), ...)
from memlean.fitting import (  # noqa: E402
    FitAction, FitError, FitPlan, apply_plan, fit, parse_budget, unfit)

__all__ = ["Swish", "VARIANTS", "swish", "swish_", "__version__",
           "BatchNorm2d", "batch_norm", "conv2d", "sliced_chain", "sliced_mlp", "sliced_gated_mlp", "FitAction", "FitError", "FitPlan", "apply_plan", "fit", "parse_budget", "unfit", "CheckpointFunction", "LayerCost", "SegmentPlan", "checkpoint",
           "checkpoint_sequential", "is_recomputing", "measure_layer_costs", "plan_segments"]
