"""ONNX export of memlean's Swish operators as standard ONNX Sigmoid and Mul.

    memlean.onnx.export(model, (x,), "model.onnx")          # torch.onnx.export, with the table
    torch.onnx.export(model, (x,), dynamo=True,
                      custom_translation_table=memlean.onnx.translation_table())

Importing this module also registers the symbolic functions of the TorchScript-based
exporter (``torch.onnx.export(..., dynamo=False)``). Needs the ``onnx`` and ``onnxscript``
packages (``pip install onnx onnxscript``).

All three variants export as Sigmoid and Mul. The in-place one (memlean.Swish(inplace=True),
memlean.swish_, memlean.swish(..., variant="inplace")) is exported as torch's in-place
``x.mul_(torch.sigmoid(beta * x))``: the mutating operator memlean::swish_ returns nothing,
which the TorchScript exporter would silently drop and the dynamo exporter cannot
translate. A direct ``torch.ops.memlean.swish_`` call exports with ``memlean.onnx.export``
and with ``torch.onnx.export(dynamo=False)``; plain ``torch.onnx.export(dynamo=True)``
refuses it with a ConversionError naming memlean.swish_ (it is never dropped). Not
covered: a torch.jit.script-ed model with the in-place variant through the TorchScript
exporter (nothing of memlean runs during that export); export the eager model instead.
"""
import torch
from torch.overrides import TorchFunctionMode

from memlean.swish import _swish_inplace_for_onnx


def _swish_onnx(x, beta: float = 1.0):
    from onnxscript import opset18 as op  # pylint: disable=import-outside-toplevel

    if beta == 1.0:
        return op.Mul(x, op.Sigmoid(x))
    return op.Mul(x, op.Sigmoid(op.Mul(x, op.CastLike(beta, x))))


def translation_table():
    """custom_translation_table for torch.onnx.export(dynamo=True)."""
    return {torch.ops.memlean.swish.default: _swish_onnx}


def _swish_symbolic(g, x, beta):
    from torch.onnx import symbolic_helper  # pylint: disable=import-outside-toplevel

    b = symbolic_helper._maybe_get_const(beta, "f")
    scaled = x if b == 1.0 else g.op("Mul", x, g.op("Constant", value_t=torch.tensor(b)).setType(x.type()))
    return g.op("Mul", x, g.op("Sigmoid", scaled))


torch.onnx.register_custom_op_symbolic("memlean::swish", _swish_symbolic, 9)


class _OutOfPlaceSwish(TorchFunctionMode):
    """Exports direct torch.ops.memlean.swish_(x, beta) calls as x.mul_(sigmoid(beta * x))."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.memlean.swish_ or func is torch.ops.memlean.swish_.default:
            x = args[0] if args else kwargs["x"]
            beta = args[1] if len(args) > 1 else kwargs.get("beta", 1.0)
            _swish_inplace_for_onnx(x, float(beta))
            return None
        return func(*args, **kwargs)


def export(model, args, f=None, **kwargs):
    """torch.onnx.export with memlean's translation table added (dynamo exporter)."""
    table = dict(kwargs.pop("custom_translation_table", None) or {})
    for k, v in translation_table().items():
        table.setdefault(k, v)
    kwargs.setdefault("dynamo", True)
    if kwargs["dynamo"]:
        kwargs["custom_translation_table"] = table
    with _OutOfPlaceSwish():
        return torch.onnx.export(model, args, f, **kwargs)
