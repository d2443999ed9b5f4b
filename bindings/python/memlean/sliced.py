"""memlean's sliced recompute: a chain of channelwise modules (BatchNorm, elementwise
activations, depthwise convolutions), optionally headed by an ungrouped convolution, run
channel slice by channel slice, keeping only the chain's input for backward.

Every module of such a chain maps channel c of its input to channel c of its output alone
(the head maps all input channels to each output channel c), so the chain's output channels
c0..c1 depend on channels c0..c1 of every tensor inside it and nothing else. The forward
computes the output one slice of channels at a time (the wide tensors inside the chain, an
inverted residual block's expanded ones, never exist whole), and the backward recomputes
each slice under autograd, takes its gradients and drops it before the next: backward
keeps the chain's input and, at any moment, one slice of its inside. BatchNorm's statistics
are per channel, so a slice's are the whole batch's for its channels: the output, the
running-statistics update (once, in the forward) and the gradients are the unsliced chain's
to float tolerance.

memlean.fit slices the chains it finds (runs of sibling modules such as timm's inverted
residual conv_pw, bn1, conv_dw, bn2, aa) when checkpoints alone do not reach the budget
(docs/fit.md). CPU eager steps: 4-d inputs of float32, float64, bfloat16 or float16, in a
CPU autocast region too (the modules compute as they do there), not under torch.compile; no
double backward. (MLPs, sliced over their hidden features by the C++ memlean::sliced_mlp:
the same dtypes and autocast.)"""
from typing import List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from memlean import _C
from memlean.batchnorm import batch_norm as _lean_batch_norm
from memlean.conv import conv2d as _lean_conv2d
from memlean.swish import Swish

# Activation modules that act on each element alone (no parameters, no state).
_ELEMENTWISE = (nn.SiLU, nn.ReLU, nn.ReLU6, nn.Hardswish, nn.Hardsigmoid, nn.GELU,
                nn.LeakyReLU, nn.ELU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.Identity, Swish)

# transformers' activation modules (transformers.activations, what its ACT2FN makes: Llama's
# and Qwen2's SiLUActivation, GPT-2's and Phi's NewGELUActivation, GPT-NeoX's GELUActivation)
# that act on each element alone, without parameters. (Not XIELUActivation: it has some.)
_TRANSFORMERS_ELEMENTWISE = frozenset((
    "SiLUActivation", "GELUActivation", "NewGELUActivation", "GELUTanh", "FastGELUActivation",
    "QuickGELUActivation", "AccurateGELUActivation", "ClippedGELUActivation",
    "ReLUSquaredActivation", "MishActivation", "LaplaceActivation", "LinearActivation"))


def transformers_activation(module) -> Optional[str]:
    """The class name when `module` is one of transformers' elementwise activation modules
    (_TRANSFORMERS_ELEMENTWISE) running the forward transformers.activations defines: not one
    a kernel from the hub replaced (transformers' `kernels` integration), nor an instance
    forward of its own (_patched). Else None."""
    kind = type(module)
    if (kind.__module__ != "transformers.activations"
            or kind.__name__ not in _TRANSFORMERS_ELEMENTWISE
            or getattr(kind.forward, "__module__", None) != "transformers.activations"
            or _patched(module)):
        return None
    return kind.__name__


def _timm_norm_act(module) -> bool:
    """timm's BatchNormAct2d: torch's BatchNorm2d forward, then its drop and act modules."""
    kind = type(module)
    return kind.__name__ == "BatchNormAct2d" and kind.__module__.startswith("timm.")


def elementwise(module) -> bool:
    """Whether `module` is an activation fit may run on a slice of channels: one of torch's
    (or memlean's) parameterless elementwise activation modules, timm's Swish-like ones, or
    transformers' (transformers_activation), its own forward, no hooks."""
    if any(True for _ in module.parameters()) or _hooked(module) or _patched(module):
        return False
    for kind in type(module).__mro__:
        if kind in _ELEMENTWISE:  # (not a subclass with a forward of its own)
            return type(module).forward is kind.forward
    if transformers_activation(module) is not None:
        return True
    kind = type(module)
    return kind.__module__.startswith("timm.") and kind.__name__ in (
        "Swish", "SiLU", "Mish", "HardSwish", "HardSigmoid", "GELU", "Sigmoid", "Tanh")


def _hooked(module) -> bool:
    return any(getattr(module, h, None) for h in (
        "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))


def _patched(module) -> bool:
    """Whether an instance forward stands over the class's (other than memlean's lean
    backward, memlean.lean.lean_forward, whose output is the class forward's)."""
    own = module.__dict__.get("forward")
    return own is not None and not getattr(own, "__memlean_lean__", False)


def role(module) -> Optional[str]:
    """What `module` is in a sliced chain: "head" (an ungrouped nn.Conv2d), "norm" (a torch
    BatchNorm2d with torch's forward, or timm's BatchNormAct2d with no dropout and an
    elementwise act), "depthwise" (a depthwise nn.Conv2d), "act" (elementwise), or None."""
    if _hooked(module) or _patched(module):
        return None
    if isinstance(module, nn.Conv2d):
        if type(module).forward is not nn.Conv2d.forward or module.padding_mode != "zeros" \
                or isinstance(module.padding, str):
            return None
        if module.groups == 1:
            return "head"
        if module.groups == module.in_channels == module.out_channels:
            return "depthwise"
        return None
    if isinstance(module, nn.BatchNorm2d) and not isinstance(module, nn.SyncBatchNorm):
        if type(module).forward is nn.modules.batchnorm._BatchNorm.forward:
            return "norm"
        if _timm_norm_act(module) and isinstance(module.drop, nn.Identity) \
                and elementwise(module.act):
            return "norm"
        return None
    return "act" if elementwise(module) else None


def chain_channels(modules: Sequence[nn.Module]) -> Optional[int]:
    """The channel count of a chain that can be sliced (a head only first, at least one module
    after it, every module's channels equal), else None."""
    roles = [role(m) for m in modules]
    if len(modules) < 2 or None in roles or "head" in roles[1:]:
        return None
    channels = None
    for m, r in zip(modules, roles):
        c = m.num_features if r == "norm" else None if r == "act" else m.out_channels
        if c is not None:
            if channels is not None and c != channels:
                return None
            channels = c
    if channels is None or all(r == "act" for r in roles):
        return None
    return channels


def _tensors_of(module, r) -> List[Optional[torch.Tensor]]:
    """The module's parameters a slice takes channels of, (weight, bias), or () for an act."""
    return [module.weight, module.bias] if r != "act" else []


class _Norm:
    """A BatchNorm's arguments for this forward, decided once (num_batches_tracked counted
    once, as torch's BatchNorm2d.forward counts it)."""

    def __init__(self, module):
        self.eps = module.eps
        factor = 0.0 if module.momentum is None else module.momentum
        if module.training and module.track_running_stats \
                and module.num_batches_tracked is not None:
            module.num_batches_tracked.add_(1)
            factor = (1.0 / float(module.num_batches_tracked) if module.momentum is None
                      else module.momentum)
        self.factor = factor
        self.training = module.training or (module.running_mean is None
                                            and module.running_var is None)
        use = not module.training or module.track_running_stats
        self.mean = module.running_mean if use else None
        self.var = module.running_var if use else None
        if not self.training and self.mean is not None:
            # Eval: the statistics as this forward used them, for the backward's recompute
            # (a training forward of the module in between would change the buffers).
            self.mean, self.var = self.mean.clone(), self.var.clone()
        self.act = module.act if _timm_norm_act(module) else None


def _slice(t, c0, c1):
    return None if t is None else t[c0:c1]


def pointwise(module) -> bool:
    """Whether a head is a 1x1 convolution of stride 1 without padding: its input gradient is
    a matrix product the backward adds into one tensor, slice after slice (_accumulate)."""
    return (tuple(module.kernel_size) == (1, 1) and tuple(module.stride) == (1, 1)
            and tuple(module.padding) == (0, 0))


def _accumulate(grad_x, weight, grad_h, layout):
    """grad_x += the 1x1 head's input gradient for one slice of its output channels: weight
    (slice, C_in, 1, 1), grad_h the gradient of that slice of its output. In place, so no
    gradient of the whole input is made per slice."""
    n, c_in = grad_x.shape[0], grad_x.shape[1]
    w = weight.reshape(weight.shape[0], c_in).to(grad_x.dtype)
    grad_h = grad_h.to(grad_x.dtype)  # (autocast: a bfloat16 gradient, added in x's dtype)
    if layout == torch.channels_last:  # (N*H*W, C) matrices
        grad_x.permute(0, 2, 3, 1).reshape(-1, c_in).addmm_(
            grad_h.permute(0, 2, 3, 1).reshape(-1, w.shape[0]), w)
    else:  # per sample: (C_in, H*W) += w^T (C_in, slice) @ (slice, H*W)
        grad_x.view(n, c_in, -1).baddbmm_(w.t().expand(n, c_in, w.shape[0]),
                                          grad_h.reshape(n, w.shape[0], -1))


def writes(module) -> bool:
    """Whether an activation module writes its input (nn.ReLU(inplace=True), timm's
    act_layer(inplace=True), memlean's in-place Swish)."""
    return getattr(module, "inplace", False) is True or getattr(module, "variant", None) == "inplace"


def _run_slice(x, modules, roles, norms, weights, c0, c1, recompute):
    """Channels c0..c1 of the chain's output (of modules, a stretch of the chain: the
    backward runs a 1x1 head apart). weights: per module, its (weight, bias) slices (or none
    for an act). recompute: the backward's pass (running statistics untouched; batch
    statistics in training, as the forward used). x itself is never written: an activation
    that writes its input and would take x (the chain's input or a slice that may view it;
    in the backward, the tensor whose gradient is taken) takes a copy."""
    y = x
    for m, r, norm, w in zip(modules, roles, norms, weights):
        if y is x and r == "act" and writes(m):
            y = x.clone()
        if r == "head":
            y = F.conv2d(y, w[0], w[1], m.stride, m.padding, m.dilation, 1)
        elif r == "depthwise":
            y = _lean_conv2d(y, w[0], w[1], m.stride, m.padding, m.dilation, c1 - c0)
        elif r == "norm":
            keep = norm.training and recompute  # training: batch statistics, no update
            y = _lean_batch_norm(y, None if keep else _slice(norm.mean, c0, c1),
                                 None if keep else _slice(norm.var, c0, c1), w[0], w[1],
                                 norm.training, norm.factor, norm.eps)
            if norm.act is not None:
                y = type(norm.act).forward(norm.act, y)
        else:
            y = type(m).forward(m, y)  # (its class's: elementwise() checked that one)
    return y


class _SlicedChain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec, *params):
        modules, roles, bounds = spec["modules"], spec["roles"], spec["bounds"]
        norms = [_Norm(m) if r == "norm" else None for m, r in zip(modules, roles)]
        layout = (torch.channels_last if x.dim() == 4 and not x.is_contiguous()
                  and x.is_contiguous(memory_format=torch.channels_last)
                  else torch.contiguous_format)
        head = roles[0] == "head"
        out = None
        for c0, c1 in bounds:
            weights = _weights(modules, roles, params, c0, c1)
            xs = x if head else x[:, c0:c1].contiguous(memory_format=layout)
            y = _run_slice(xs, modules, roles, norms, weights, c0, c1, recompute=False)
            if out is None:
                out = torch.empty((y.shape[0], spec["channels"]) + tuple(y.shape[2:]),
                                  dtype=y.dtype, device=y.device, memory_format=layout)
            out[:, c0:c1] = y
            del y
        ctx.spec, ctx.norms, ctx.layout = spec, norms, layout
        # The recompute runs in the forward's CPU autocast state (its ops in the same dtypes).
        ctx.autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                        torch.is_autocast_cache_enabled())
        ctx.save_for_backward(x, *params)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, *params = ctx.saved_tensors
        spec, norms, layout = ctx.spec, ctx.norms, ctx.layout
        modules, roles = spec["modules"], spec["roles"]
        need_x = ctx.needs_input_grad[0]
        need = ctx.needs_input_grad[2:]
        head = roles[0] == "head"
        # A 1x1 head's input gradient is added into grad_x slice by slice (_accumulate);
        # another head's is made whole per slice and added.
        accumulate = head and need_x and pointwise(modules[0])
        # A head's input gradient is a sum over slices: for bfloat16 and float16 inputs it adds
        # up in float32 and is rounded once (summed in x's dtype, each slice's rounding added
        # up: a MobileNetV3's BatchNorm bias gradient, 0 in float64, came out 7x further from
        # it than the modules' in turn in a bfloat16 autocast step).
        total = (torch.float32 if head and x.dtype in (torch.bfloat16, torch.float16)
                 else x.dtype)
        grad_x = None
        if need_x and not head:
            grad_x = torch.empty_like(x, memory_format=layout)
        elif accumulate:
            grad_x = torch.zeros_like(x, dtype=total, memory_format=layout)
        grads = [torch.zeros_like(p) if n and p is not None else None
                 for p, n in zip(params, need)]
        enabled, dtype, cache = ctx.autocast
        for c0, c1 in spec["bounds"]:
            with torch.enable_grad(), torch.autocast("cpu", dtype=dtype, enabled=enabled,
                                                     cache_enabled=cache):
                xs = x.detach() if head else x.detach()[:, c0:c1].contiguous(
                    memory_format=layout)
                xs.requires_grad_(need_x and not accumulate)
                leaves = [None if p is None else p.detach()[c0:c1].requires_grad_(bool(n))
                          for p, n in zip(params, need)]
                weights = _weights(modules, roles, leaves, 0, None)
                start = 0
                if accumulate:  # the head's output slice: its gradient is what grad_x takes
                    xs = _run_slice(xs, modules[:1], roles[:1], norms[:1], weights[:1], c0, c1,
                                    recompute=True)
                    if not xs.requires_grad:
                        xs.requires_grad_()
                    start = 1
                y = _run_slice(xs, modules[start:], roles[start:], norms[start:],
                               weights[start:], c0, c1, recompute=True)
                wanted = ([xs] if need_x else []) + [t for t in leaves
                                                     if t is not None and t.requires_grad]
                if not wanted:
                    break
                got = list(torch.autograd.grad(
                    y, wanted, grad[:, c0:c1].contiguous(memory_format=layout),
                    allow_unused=True))
            del y, wanted, xs  # (with a 1x1 head, xs is its output slice)
            if need_x:
                g = got.pop(0)
                if accumulate:
                    if g is not None:
                        _accumulate(grad_x, params[0][c0:c1], g, layout)
                    del g
                elif head:
                    grad_x = g.to(total) if grad_x is None else grad_x.add_(g)
                elif g is not None:
                    grad_x[:, c0:c1] = g
                else:
                    grad_x[:, c0:c1] = 0
            for k, t in enumerate(leaves):
                if t is not None and t.requires_grad:
                    g = got.pop(0)
                    if g is not None:
                        grads[k][c0:c1] = g
        if grad_x is not None and grad_x.dtype != x.dtype:
            grad_x = grad_x.to(x.dtype)
        return (grad_x, None) + tuple(grads)


def _weights(modules, roles, params, c0, c1):
    """Per module, its (weight, bias) sliced to c0..c1 (c1 None: params are slices already)."""
    out, k = [], 0
    for m, r in zip(modules, roles):
        if r == "act":
            out.append(())
            continue
        w, b = params[k], params[k + 1]
        k += 2
        out.append((w, b) if c1 is None else (_slice(w, c0, c1), _slice(b, c0, c1)))
    return out


_CHAIN_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def applies(x, mlp: bool = False) -> bool:
    """Whether sliced_chain (mlp: sliced_mlp, sliced_gated_mlp) runs sliced for this input,
    else the modules in turn, not traced by torch.compile: a plain CPU tensor of float32,
    float64, bfloat16 or float16, in a CPU autocast region too; for a chain of channels 4-d,
    for an MLP of 2 or more dimensions, its last the features (memlean::sliced_mlp's
    sliced_mlp_applies)."""
    if not (isinstance(x, torch.Tensor) and type(x) is torch.Tensor
            and not torch.compiler.is_compiling()):
        return False
    if mlp:
        return x.dim() >= 2 and _C.sliced_mlp_applies(x)
    return bool(x.dim() == 4 and x.dtype in _CHAIN_DTYPES and x.device.type == "cpu")


SLICE_BYTES = 1 << 20  # about this much of the wide tensor per slice (tests lower it)


def slices_for(x: torch.Tensor, head: bool, channels: int, wide: int,
               fine: bool = False) -> int:
    """How many slices for a chain whose widest inner tensor has `wide` bytes: about one per
    SLICE_BYTES (1 MiB) of it, at most 16 and one per channel (memlean::sliced_mlp_slices' rule,
    as for an MLP); with a head, at most one per
    input's size in it (each slice's forward reads the whole input, and its backward adds a
    gradient of all of it), unless `fine`: fewer bytes, more time (memlean.fit passes it
    for a 1x1 head alone, whose input gradient the backward adds in place)."""
    slices = _C.sliced_mlp_slices(wide, channels, SLICE_BYTES)
    if head and not fine:
        slices = min(slices, max(1, -(-wide // max(1, x.numel() * x.element_size()))))
    return slices


def widest(x: torch.Tensor, modules, roles, channels) -> int:
    """Bytes of the chain's widest inner tensor: channels at the head's output size (its
    input's size for a chain without a head)."""
    h, w = x.shape[-2], x.shape[-1]
    if roles[0] == "head":
        m = modules[0]
        h, w = (((size + 2 * p - d * (k - 1) - 1) // s + 1) for size, p, d, k, s in zip(
            (h, w), m.padding, m.dilation, m.kernel_size, m.stride))
    return x.shape[0] * channels * h * w * x.element_size()


def sliced_chain(x: torch.Tensor, modules: Sequence[nn.Module],
                 slices: Optional[int] = None) -> torch.Tensor:
    """The chain's output, modules[-1](...modules[0](x)), computed slice by slice of channels
    and recomputed that way in backward, which keeps x (and the parameters) alone. modules: an
    optional ungrouped nn.Conv2d, then BatchNorm2d (or timm's BatchNormAct2d), elementwise
    activation and depthwise nn.Conv2d modules, all of one channel count, without hooks.
    x: a CPU tensor of float32, float64, bfloat16 or float16; in a CPU autocast region the
    modules compute as they do there (the convolutions in its dtype), and the backward's
    recompute too. Where the sliced path does not apply (another device or dtype,
    torch.compile) it runs the modules in turn."""
    modules = list(modules)
    channels = chain_channels(modules)
    if channels is None:
        raise ValueError("memlean.sliced_chain: modules must be an optional ungrouped Conv2d "
                         "then BatchNorm2d, elementwise activation and depthwise Conv2d "
                         "modules of one channel count (two or more, no hooks), got "
                         f"{[type(m).__name__ for m in modules]}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"memlean.sliced_chain: x must be a tensor, got {type(x).__name__}")
    _check_slices("memlean.sliced_chain", slices, channels)
    if not applies(x):
        return _in_turn(x, modules)
    roles = [role(m) for m in modules]
    takes = modules[0].in_channels if roles[0] == "head" else channels
    if x.shape[1] != takes:
        raise ValueError(f"memlean.sliced_chain: x has {x.shape[1]} channels, the chain takes "
                         f"{takes}")
    return run_sliced(x, modules, roles, channels, slices)


def _check_slices(name, slices, most):
    """A ValueError naming `slices` unless it is None or an int in 1..most."""
    if slices is not None and (isinstance(slices, bool) or not isinstance(slices, int)
                               or not 1 <= slices <= most):
        raise ValueError(f"{name}: slices must be an int in 1..{most}, got {slices!r}")


def _in_turn(x, modules):
    """The modules run in turn: where the sliced path does not apply."""
    for m in modules:
        x = m(x)
    return x


def run_sliced(x, modules, roles, channels, slices=None):
    """sliced_chain for a chain checked already (memlean.fit checks it once and passes
    slices: slices_for's, coarse or fine)."""
    if slices is None:
        slices = slices_for(x, roles[0] == "head", channels, widest(x, modules, roles, channels))
    bounds = [(channels * i // slices, channels * (i + 1) // slices) for i in range(slices)]
    params = [t for m, r in zip(modules, roles) for t in _tensors_of(m, r)]
    spec = {"modules": modules, "roles": roles, "bounds": bounds, "channels": channels}
    return _SlicedChain.apply(x, spec, *params)


# ---- MLPs: Linear, elementwise activations, Linear, sliced over the hidden features ---------
#
# A transformer's (or ConvNeXt's) MLP, fc2(act(fc1(x))), maps each hidden feature j through
# fc1's row j and the activation alone, and fc2 sums over the hidden features: the output is
# the sum over slices of hidden features of fc2's columns times that slice. The forward adds
# the slices' parts into the output one slice at a time (the hidden tensors, 4x the width of
# x in a ViT, never exist whole), and the backward recomputes each slice, takes its
# gradients and drops it before the next: backward keeps x alone. The Function is C++'s
# (memlean::sliced_mlp, ops/checkpoint/sliced_mlp.h: one implementation for both languages),
# run with the Python activation modules.


def _passes(module) -> bool:
    """Whether `module` passes its input on unchanged in a training forward: nn.Identity, or
    an nn.Dropout with p == 0 (timm's Mlp has both), its class's forward, no hooks."""
    if _hooked(module) or _patched(module):
        return False
    if type(module) is nn.Identity:
        return True
    return type(module) is nn.Dropout and module.p == 0


def _conv1d(module) -> bool:
    """transformers' Conv1D (GPT-2's MLP and attention projections): a Linear whose weight
    is stored transposed, [in, out]; its forward is addmm(bias, x, weight)."""
    kind = type(module)
    return kind.__name__ == "Conv1D" and kind.__module__ == "transformers.pytorch_utils"


def _linear(module) -> bool:
    """An nn.Linear or transformers' Conv1D, its class's forward, no hooks."""
    return ((type(module) is nn.Linear or _conv1d(module)) and not _hooked(module)
            and not _patched(module))


def _features(module):
    """(in features, out features) of a _linear module."""
    if _conv1d(module):
        return tuple(module.weight.shape)
    return module.in_features, module.out_features


def _weight(module) -> torch.Tensor:
    """A _linear module's weight as nn.Linear keeps it, [out, in] (Conv1D's: a transposed
    view, through which autograd hands the gradient back)."""
    return module.weight.t() if _conv1d(module) else module.weight


def mlp_parts(modules: Sequence[nn.Module]):
    """(fc1, acts, fc2) when `modules` are an nn.Linear (or transformers' Conv1D, GPT-2's),
    elementwise activations (elementwise) or modules that pass their input on (_passes), an
    nn.Linear (Conv1D) taking fc1's features, then optionally modules that pass their input
    on; acts: the activations in order. Else None."""
    modules = list(modules)
    if len(modules) < 3 or not _linear(modules[0]):
        return None
    fc1 = modules[0]
    tails = [k for k in range(1, len(modules)) if _linear(modules[k])]
    if len(tails) != 1:
        return None
    k = tails[0]
    fc2 = modules[k]
    middle, after = modules[1:k], modules[k + 1:]
    if _features(fc2)[0] != _features(fc1)[1] or not all(
            _passes(m) or elementwise(m) for m in middle) or not all(map(_passes, after)):
        return None
    acts = [m for m in middle if not _passes(m)]
    return fc1, acts, fc2


def _activate(acts, h):
    for m in acts:
        h = type(m).forward(m, h)  # (its class's: elementwise() checked that one)
    return h


def _sliced(x, gate, acts, up, down, gated, gate_first, slices):
    """memlean::sliced_mlp (C++, ops/checkpoint/sliced_mlp.h; _C.sliced_mlp) with the
    activation modules' class forwards on each slice (an activation that writes its input,
    e.g. fit's in-place Swish, runs on a copy in the backward, whose gradient it takes).
    slices None: the C++ default, about one per SLICE_BYTES (1 MiB) of the hidden tensor in
    the dtype the MLP computes in, at most 16 (memlean::sliced_mlp_slices)."""
    act = (lambda h: _activate(acts, h)) if acts else None
    return _C.sliced_mlp(x, _weight(gate), gate.bias, act, None if up is None else _weight(up),
                         None if up is None else up.bias, _weight(down), down.bias, gated,
                         gate_first, slices or 0, any(writes(m) for m in acts), SLICE_BYTES)


def run_sliced_mlp(x, fc1, acts, fc2, slices=None):
    """sliced_mlp for parts checked already (mlp_parts)."""
    return _sliced(x, fc1, list(acts), None, fc2, False, True, slices)


def sliced_mlp(x: torch.Tensor, modules: Sequence[nn.Module],
               slices: Optional[int] = None) -> torch.Tensor:
    """The MLP's output, modules[-1](...modules[0](x)), computed slice by slice of its hidden
    features and recomputed that way in backward, which keeps x (and the parameters) alone.
    modules: an nn.Linear, elementwise activation modules (and nn.Identity, nn.Dropout(p=0)),
    an nn.Linear taking the first one's features, then optionally nn.Identity/nn.Dropout(p=0)
    (timm's Mlp: fc1, act, drop1, norm, fc2, drop2), without hooks; transformers' Conv1D
    (GPT-2's c_fc and c_proj) in place of an nn.Linear, and its activation modules
    (NewGELUActivation, ...) among the activations. x: a CPU tensor of
    float32, float64, bfloat16 or float16, the modules' dtype; in a CPU autocast region the
    MLP computes in its dtype as nn.Linear does there (output of that dtype, float32
    parameters' gradients float32). Where the sliced path does not apply (another device or
    dtype, torch.compile) it runs the modules in turn."""
    modules = list(modules)
    parts = mlp_parts(modules)
    if parts is None:
        raise ValueError("memlean.sliced_mlp: modules must be an nn.Linear, elementwise "
                         "activations (nn.Identity and nn.Dropout(p=0) allowed), an nn.Linear "
                         "taking the first one's features, then optionally nn.Identity or "
                         "nn.Dropout(p=0), without hooks; got "
                         f"{[type(m).__name__ for m in modules]}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"memlean.sliced_mlp: x must be a tensor, got {type(x).__name__}")
    fc1, acts, fc2 = parts
    features, hidden = _features(fc1)
    _check_slices("memlean.sliced_mlp", slices, hidden)
    if not applies(x, mlp=True):
        return _in_turn(x, modules)
    if x.shape[-1] != features:
        raise ValueError(f"memlean.sliced_mlp: x has {x.shape[-1]} features in its last "
                         f"dimension, the MLP takes {features}")
    return run_sliced_mlp(x, fc1, acts, fc2, slices)


# ---- gated MLPs (SwiGLU, GeGLU): down(act(gate(x)) * up(x)), sliced over the hidden --------


def gated_parts(gate, acts, up, down):
    """Whether gate, up and down are nn.Linears (or transformers' Conv1Ds) of a gated MLP
    (gate and up map x's features to the same hidden ones, down maps them back; up None: gate
    packs both, its output twice down's input features) and acts elementwise activations (or
    modules that pass their input on), none hooked."""
    if up is None:
        return (_linear(gate) and _linear(down)
                and _features(gate)[1] == 2 * _features(down)[0]
                and all(_passes(m) or elementwise(m) for m in acts))
    return (all(map(_linear, (gate, up, down))) and _features(gate) == _features(up)
            and _features(gate)[1] == _features(down)[0]
            and all(_passes(m) or elementwise(m) for m in acts))


def run_sliced_gated_mlp(x, gate, acts, up, down, slices=None, gate_first=True):
    """sliced_gated_mlp for parts checked already (gated_parts)."""
    return _sliced(x, gate, list(acts), up, down, True, gate_first, slices)


def _packed_in_turn(x, gate, acts, down, gate_first):
    """down(act(g) * u) where g, u = gate(x).chunk(2, -1) (gate_first; else u, g = ...)."""
    first, second = gate(x).chunk(2, dim=-1)
    g, u = (first, second) if gate_first else (second, first)
    return down(_in_turn(g, acts) * u)


def sliced_gated_mlp(x: torch.Tensor, gate: nn.Module, act: Sequence[nn.Module],
                     up: Optional[nn.Module], down: nn.Module, slices: Optional[int] = None,
                     *, gate_first: bool = True) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) (a SwiGLU or GeGLU MLP; act: the activation modules in
    order, e.g. [nn.SiLU()]), computed slice by slice of the hidden features and recomputed
    that way in backward, which keeps x (and the parameters) alone. gate, up, down:
    nn.Linear (or transformers' Conv1D) without hooks. up None: gate packs both, its
    output's first half the gate's and second half up's where gate_first (else the other way
    round: timm's GluMlp with gate_last=True), i.e. down(act(g) * u) with
    g, u = gate(x).chunk(2, dim=-1). Dtypes and autocast as sliced_mlp. Where the sliced path does not apply (another device or dtype,
    torch.compile) it computes the formula with the modules."""
    acts = list(act) if isinstance(act, (list, tuple)) else [act]
    if not gated_parts(gate, acts, up, down):
        raise ValueError("memlean.sliced_gated_mlp: gate, up and down must be nn.Linear "
                         "without hooks (gate and up of the same shape, down taking their "
                         "features; or up None and gate with twice down's input features) "
                         "and act elementwise activation modules; got "
                         f"{[type(m).__name__ for m in (gate, *acts, up, down)]}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"memlean.sliced_gated_mlp: x must be a tensor, got "
                        f"{type(x).__name__}")
    if not isinstance(gate_first, bool):
        raise TypeError(f"memlean.sliced_gated_mlp: gate_first must be a bool, got "
                        f"{type(gate_first).__name__}")
    _check_slices("memlean.sliced_gated_mlp", slices, _features(down)[0])
    if not applies(x, mlp=True):
        if up is None:
            return _packed_in_turn(x, gate, acts, down, gate_first)
        return down(_in_turn(gate(x), acts) * up(x))
    if x.shape[-1] != _features(gate)[0]:
        raise ValueError(f"memlean.sliced_gated_mlp: x has {x.shape[-1]} features in its last "
                         f"dimension, the MLP takes {_features(gate)[0]}")
    return run_sliced_gated_mlp(x, gate, acts, up, down, slices, gate_first)
