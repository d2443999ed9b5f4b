"""The Python twins against the C++ models: the C++ model_dump binary builds a model from a
seed, runs a training forward and backward, and saves its weights, input, output and
gradients; the twin loads the same weights (same names: strict) and must give the same
parameter count, output, gradients and BatchNorm running statistics, under every
activation variant and checkpoint mode. EfficientNet-B0 is also checked against timm's."""
import os
import subprocess

import pytest
import torch
import torch.jit._pickle

import memlean  # noqa: F401  (registers torch.ops.memlean)
from experiments.models.shared import ACTIVATIONS, num_parameters
from experiments.models.densenet import DenseNetBC
from experiments.models.efficientnet import EfficientNetB0
from experiments.models.mlp import Mlp
from optional_deps import require

_DUMPS = {}


def _binary():
    root = os.path.join(os.environ["TEST_SRCDIR"], os.environ.get("TEST_WORKSPACE", "memlean"))
    return os.path.join(root, "experiments", "models", "model_dump")


def dump(tmp_path_factory, **options):
    """The C++ model's dict (cached per options)."""
    key = tuple(sorted(options.items()))
    if key not in _DUMPS:
        path = tmp_path_factory.mktemp("dump") / "model.pt"
        args = [_binary(), str(path)] + [f"{k}={v}" for k, v in options.items()]
        subprocess.run(args, check=True, timeout=300)
        with torch.serialization.safe_globals([torch.jit._pickle.restore_type_tag]):
            _DUMPS[key] = torch.load(path, weights_only=True)
    return _DUMPS[key]


def close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def compare(d, twin, check_buffers=True):
    """Loads the C++ weights into `twin`, runs the same training step, compares."""
    state = {k.split("/", 1)[1]: v for k, v in d.items() if k.startswith(("param/", "buffer/"))}
    assert set(state) == set(twin.state_dict()), "the C++ model and its twin name their state differently"
    twin.load_state_dict(state, strict=True)
    assert num_parameters(twin) == d["num_parameters"].item()
    twin.train()
    y = twin(d["input"].clone())
    close(y, d["output"], "output")
    (y * d["loss_weight"]).sum().backward()
    for name, p in twin.named_parameters():
        close(p.grad, d[f"grad/{name}"], f"gradient of {name}")
    if check_buffers:
        for name, b in twin.named_buffers():
            close(b, d[f"buffer_after/{name}"], f"buffer {name}")


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("checkpoint", ["none", "memlean", "segments:1", "segments:2"])
def test_mlp(tmp_path_factory, activation, checkpoint):
    d = dump(tmp_path_factory, model="mlp", activation=activation, **{"in": 8, "hidden": 32, "out": 3})
    compare(d, Mlp(8, 32, 3, activation=activation, checkpoint=checkpoint))


@pytest.mark.parametrize("cpp_checkpoint", ["none", "memlean"])
@pytest.mark.parametrize("checkpoint", ["none", "memlean", "segments:3"])
def test_densenet(tmp_path_factory, cpp_checkpoint, checkpoint):
    d = dump(tmp_path_factory, model="densenet_bc", checkpoint=cpp_checkpoint, size=8)
    compare(d, DenseNetBC(depth=10, growth_rate=4, checkpoint=checkpoint))


@pytest.mark.parametrize("checkpoint", ["torch", "torch_reentrant"])
def test_densenet_torch_checkpoint_updates_batchnorm_twice(tmp_path_factory, checkpoint):
    """torch.utils.checkpoint gives the same output and gradients, but its recompute updates
    the running statistics of the checkpointed BatchNorms a second time (pytorch-checkpoint's
    note; docs/sources.md)."""
    d = dump(tmp_path_factory, model="densenet_bc", checkpoint="none", size=8)
    twin = DenseNetBC(depth=10, growth_rate=4, checkpoint=checkpoint)
    compare(d, twin, check_buffers=False)
    tracked = dict(twin.named_buffers())
    assert tracked["features.denseblock1.denselayer1.norm1.num_batches_tracked"].item() == 2
    assert tracked["features.denseblock1.denselayer1.norm2.num_batches_tracked"].item() == 1
    assert d["buffer_after/features.denseblock1.denselayer1.norm1.num_batches_tracked"].item() == 1


def test_densenet_defaults_are_pytorch_checkpoints_densenet():
    m = DenseNetBC()
    assert num_parameters(m) == 769162
    assert len(m.features) == 7


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("checkpoint", ["none", "memlean", "segments:9"])
def test_efficientnet(tmp_path_factory, activation, checkpoint):
    d = dump(tmp_path_factory, model="efficientnet_b0", activation=activation, checkpoint="memlean")
    compare(d, EfficientNetB0(10, 0.25, 0.25, dropout=0.0, drop_connect=0.0, activation=activation,
                              checkpoint=checkpoint))


def test_efficientnet_b0_full_size(tmp_path_factory):
    d = dump(tmp_path_factory, model="efficientnet_b0", width=1.0, depth_multiplier=1.0,
             classes=1000, batch=2, size=32)
    assert d["num_parameters"].item() == 5288548
    twin = EfficientNetB0(dropout=0.0, drop_connect=0.0)
    assert len(twin.stages) == 18
    compare(d, twin)


def test_efficientnet_b0_is_timms():
    timm = require("timm")
    ours, theirs = EfficientNetB0(), timm.create_model("efficientnet_b0")
    assert num_parameters(ours) == num_parameters(theirs) == 5288548
    ours.load_state_dict(theirs.state_dict(), strict=True)
    ours.eval()
    theirs.eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        close(ours(x), theirs(x), "output against timm")


@pytest.mark.parametrize("make", [lambda: Mlp(8, 16, 2), lambda: DenseNetBC(depth=10),
                                  lambda: EfficientNetB0(width_multiplier=0.25, depth_multiplier=0.25)])
def test_a_dropped_model_is_freed_without_the_garbage_collector(make):
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        model = make()
        ref = weakref.ref(model)
        del model
        assert ref() is None  # no reference cycle keeps the parameters alive
    finally:
        gc.enable()


def test_errors():
    with pytest.raises(ValueError, match="unknown activation 'relu'"):
        Mlp(2, 2, 1, activation="relu")
    with pytest.raises(ValueError, match="segments:3 asks for more segments than the model has stages"):
        Mlp(2, 2, 1, checkpoint="segments:3")
    with pytest.raises(ValueError, match="depth must be 6 \\* n \\+ 4"):
        DenseNetBC(depth=12)
    with pytest.raises(ValueError, match="unknown checkpoint mode 'torch'"):
        EfficientNetB0(checkpoint="torch")


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
