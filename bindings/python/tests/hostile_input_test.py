"""Hostile input to the Python API: a clear error naming the argument, or the right value,
never a wrong number or silence. beta (memlean.swish / memlean.Swish),
checkpoint_sequential's segments, and memlean.memstats (a stopped Tracker, plot labels)."""
import fractions
import itertools

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import memlean
import memlean.memstats as memstats


def reference(x, beta):
    x64 = x.detach().double()
    return x64 * torch.sigmoid(beta * x64)


# ---- beta ----------------------------------------------------------------------------------

REAL_BETAS = [
    np.float32(2.0), np.float64(-1.5), np.float16(0.5), np.int64(3), np.int8(-2), np.uint8(2),
    np.array(1.25), np.array(2, dtype=np.int32), fractions.Fraction(3, 4),
    torch.tensor(1.75), torch.tensor(2.5, dtype=torch.float64), torch.tensor(-1, dtype=torch.int64),
    torch.tensor(0.5, dtype=torch.bfloat16),
]


@pytest.mark.parametrize("variant", memlean.VARIANTS)
@pytest.mark.parametrize("beta", REAL_BETAS, ids=lambda v: repr(v)[:40])
def test_any_real_scalar_beta_is_accepted(beta, variant):
    value = float(beta)
    x = torch.linspace(-6, 6, 41, dtype=torch.float64)
    leaf = x.clone().requires_grad_(True)
    y = memlean.swish(leaf * 1, beta, variant)
    torch.testing.assert_close(y.detach(), reference(x, value), rtol=1e-12, atol=1e-12)
    y.sum().backward()
    x64 = x.clone().requires_grad_(True)
    (x64 * torch.sigmoid(value * x64)).sum().backward()
    # The in-place variant recovers x from y: 1e-8 near swish's minimum (swish_variants_test).
    atol = 1e-8 if variant == "inplace" else 1e-12
    torch.testing.assert_close(leaf.grad, x64.grad, rtol=1e-12, atol=atol)
    m = memlean.Swish(beta, variant)
    assert type(m.beta) is float and m.beta == value
    torch.testing.assert_close(m(x.clone()), reference(x, value), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("beta, error, match", [
    (True, TypeError, "beta must be a real number, got bool"),
    (np.bool_(False), TypeError, "beta must be a real number, got numpy.bool"),
    (1 + 0j, TypeError, "beta must be a real number, got complex"),
    (np.complex64(1), TypeError, "beta must be a real number, got numpy.complex64"),
    ("1", TypeError, "beta must be a real number, got str"),
    (None, TypeError, "beta must be a real number, got NoneType"),
    (np.array([1.0]), TypeError, "beta must be a real number, got numpy.ndarray"),
    (np.array(True), TypeError, "beta must be a real number, got numpy.ndarray"),
    (torch.tensor([1.0]), TypeError, r"beta must be a real number or a 0-dim tensor, got a tensor of shape \[1\]"),
    (torch.tensor(True), TypeError, "beta must be a real number, got a torch.bool tensor"),
    (torch.tensor(1 + 1j), TypeError, "beta must be a real number, got a torch.complex64 tensor"),
    (torch.tensor(1.0, requires_grad=True), ValueError, "beta is a constant .* requires grad"),
    (np.float32("inf"), ValueError, "beta must be finite, got inf"),
    (np.float64("nan"), ValueError, "beta must be finite, got nan"),
    (torch.tensor(float("-inf")), ValueError, "beta must be finite, got -inf"),
    (10 ** 400, ValueError, "beta must be finite, got an int beyond float's range"),
], ids=lambda v: repr(v)[:40])
def test_bad_beta_is_refused_by_every_entry_point(beta, error, match):
    for call in (lambda: memlean.swish(torch.ones(3), beta),
                 lambda: memlean.swish(torch.ones(3), beta, "naive"),
                 lambda: memlean.swish(torch.ones(3), beta, "inplace"),
                 lambda: memlean.swish_(torch.ones(3), beta),
                 lambda: memlean.Swish(beta)):
        with pytest.raises(error, match=match):
            call()


# ---- checkpoint_sequential(segments=...) -------------------------------------------------

ACCEPTS = r"segments must be an int \(the number of segments\), 'sqrt', a list of ints \(the first layer of each segment\) or a memlean.SegmentPlan"


def chain():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(3, 3) for _ in range(4)]).double()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.uint8,
                                   torch.complex64])
@pytest.mark.parametrize("variant", memlean.VARIANTS)
def test_every_variant_refuses_non_floating_x_alike(variant, dtype):
    # The naive composition used to promote to float32 / complex64 while the others raised.
    x = torch.zeros(3, dtype=dtype)
    for call in (lambda: memlean.swish(x.clone(), 1.0, variant),
                 lambda: memlean.Swish(variant=variant)(x.clone())):
        with pytest.raises(RuntimeError, match="x must be float32, float64, bfloat16 or float16"):
            call()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("variant", memlean.VARIANTS)
def test_beta_beyond_float_range_is_refused_for_float_dtypes(variant, dtype):
    # 1e300 passes the finite check but is inf in float, where these dtypes are computed.
    x = torch.randn(4).to(dtype)
    with pytest.raises(RuntimeError, match="beyond float's range"):
        memlean.swish(x.clone(), 1e300, variant)
    with pytest.raises(RuntimeError, match="beyond float's range"):
        torch.ops.memlean.swish(x, -1e39)
    # float64 is computed in double: any finite beta works there.
    y = memlean.swish(torch.tensor([-1.0, 0.0, 2.0], dtype=torch.float64), 1e300, variant)
    torch.testing.assert_close(y, torch.tensor([-0.0, 0.0, 2.0], dtype=torch.float64))


@pytest.mark.parametrize("variant", ["memory_efficient", "inplace"])
def test_beta_times_x_overflow_gives_float32_autograds_gradient(variant):
    # beta * x = 4e38 overflows float: the gradient is 1 (right) / 0 (left), not NaN.
    x0 = torch.tensor([2e38, -2e38, 1.0, float("nan")] * 9)
    leaf = x0.clone().requires_grad_(True)
    memlean.swish(leaf * 1, 2.0, variant).sum().backward()
    s1 = 1 / (1 + math.exp(-2.0))
    want = torch.tensor([1.0, 0.0, s1 * (1 + 2.0 * (1 - s1)), float("nan")] * 9)
    torch.testing.assert_close(leaf.grad, want, equal_nan=True, rtol=1e-5, atol=1e-6)


def test_ops_take_beta_as_a_float_like_every_torch_operator():
    # torch.ops.memlean.* declare `float beta`: the dispatcher converts a bool as it does for
    # every operator (True is 1.0); the Python API (memlean.swish, memlean.Swish) refuses it.
    x = torch.randn(5)
    torch.testing.assert_close(torch.ops.memlean.swish(x, True), torch.ops.memlean.swish(x, 1.0))
    with pytest.raises(TypeError, match="beta must be a real number"):
        memlean.swish(x, True)


@pytest.mark.parametrize("segments, got", [
    (2.5, "got a float"), (None, "got None"), (2.0, "got a float"), (True, "got a bool"),
    (np.bool_(True), "got a bool"), (object(), "got an object"), ({0: 1}, "got a dict"),
    ({0, 2}, "got a set"), (b"\x00\x02", "got a bytes"),
    ([0, 2.0], r"segments\[1\] is a float, not an int"), ([0, True], r"segments\[1\] is a bool, not an int"),
    ([0, None], r"segments\[1\] is None, not an int"), (torch.tensor([0, 2]), r"segments\[0\] is a Tensor, not an int"),
], ids=lambda v: repr(v)[:40])
def test_bad_segments_name_the_argument_and_what_it_accepts(segments, got):
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    with pytest.raises(TypeError, match=f"memlean.checkpoint_sequential: {ACCEPTS}.*{got}"):
        memlean.checkpoint_sequential(chain(), segments, x)


@pytest.mark.parametrize("segments", [np.int64(2), [0, np.int32(2)], (0, 2), range(0, 4, 2)], ids=lambda v: repr(v)[:40])
def test_integer_like_segments_work(segments):
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    model = chain()
    memlean.checkpoint_sequential(model, segments, x).sum().backward()
    g = [x.grad] + [p.grad for p in model.parameters()]
    x.grad = None
    model = chain()
    model(x).sum().backward()
    for a, b in zip(g, [x.grad] + [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ---- memstats --------------------------------------------------------------------------------


def test_a_stopped_tracker_cannot_be_reentered():
    t = memstats.track()
    with t:
        t.mark("a")
    assert not t.running
    with pytest.raises(RuntimeError, match="`with` on a stopped Tracker.*Start a new one"):
        with t:
            pass
    t2 = memstats.Tracker()
    t2.stop()
    with pytest.raises(RuntimeError, match="stopped Tracker"):
        with t2:
            pass
    # Its figures stay readable.
    assert [m.name for m in t.marks] == ["a"]


def tick_labels(fig):
    """The visible x tick labels of the figure's first axes and their extents (pixels)."""
    renderer = fig.canvas.get_renderer()
    labels = [lab for lab in fig.axes[0].get_xticklabels() if lab.get_visible() and lab.get_text()]
    return labels, [lab.get_window_extent(renderer) for lab in labels]


@pytest.mark.parametrize("n, name", [
    (60, "optimizer_step_with_a_rather_long_descriptive_phase_name_{:02d}"),
    (8, "short_{}"),
    (12, "{}"),  # data, forward, backward, step: 3 steps
    (700, "phase_{:03d}"),
])
def test_plot_labels_never_overlap(tmp_path, monkeypatch, n, name):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    drawn = []
    savefig = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        result = savefig(fig, *args, **kwargs)
        drawn.append((fig, *tick_labels(fig)))  # as saved, before plot() closes it
        return result

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    with memstats.track() as t:
        keep_alive = []
        for i in range(n):
            keep_alive.append(torch.empty(1024 * (i % 7 + 1)))
            t.mark(name.format(["data", "forward", "backward", "step"][i % 4] if name == "{}" else i))
    path = t.plot(tmp_path / "marks.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    ((fig, labels, boxes),) = drawn
    assert len(labels) >= min(n, 200)
    figure_box = fig.bbox
    for lab, box in zip(labels, boxes):
        # Inside the figure (not cut off), at most 24 characters of name.
        assert box.x0 >= figure_box.x0 - 1 and box.x1 <= figure_box.x1 + 1, lab.get_text()
        assert box.y0 >= figure_box.y0 - 1, lab.get_text()
        assert len(lab.get_text().split("\n")[0].split(": ", 1)[-1]) <= 24
    for (a, abox), (b, bbox) in itertools.combinations(zip(labels, boxes), 2):
        assert not abox.overlaps(bbox), (a.get_text(), b.get_text())
    # Shortened names stay distinct (their ends differ).
    texts = [lab.get_text() for lab in labels]
    assert len(set(texts)) == len(texts)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
