"""memlean.swish / memlean.Swish through the Python package."""
import math

import pytest
import torch
import torch.nn.functional as F

import memlean
import memlean.memstats

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
BETAS = [0.0, 0.5, 1.0, 1.702, -2.0, 10.0]
TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    torch.float16: dict(rtol=1e-2, atol=1e-2),
}


def inputs(dtype):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 48, generator=g, dtype=torch.float64) * 4
    return [
        torch.empty(0, dtype=dtype),
        torch.tensor(0.7, dtype=dtype),
        (torch.randn(37, generator=g, dtype=torch.float64) * 4).to(dtype),
        (torch.randn(4, 8, 32, 33, generator=g, dtype=torch.float64) * 4).to(dtype),
        base.to(dtype).t(),  # non-contiguous
        base.to(dtype)[:, ::3],  # strided
    ]


def reference(x, beta):
    x64 = x.double()
    return (x64 * torch.sigmoid(beta * x64)).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_equals_silu_for_beta_one(dtype):
    for x in inputs(dtype):
        torch.testing.assert_close(memlean.swish(x), F.silu(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", BETAS)
def test_forward_equals_formula(dtype, beta):
    for x in inputs(dtype):
        y = memlean.swish(x, beta)
        assert y.dtype == dtype and y.shape == x.shape
        torch.testing.assert_close(y, reference(x, beta), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", BETAS)
def test_backward_matches_float64_autograd(dtype, beta):
    for x0 in inputs(dtype):
        x = x0.detach().clone().requires_grad_(True)
        g = torch.randn(x.shape, dtype=torch.float64).to(dtype)
        memlean.swish(x, beta).backward(g)
        x64 = x0.detach().double().requires_grad_(True)
        (x64 * torch.sigmoid(beta * x64)).backward(g.double())
        assert x.grad.dtype == dtype
        tol = {k: 2 * v for k, v in TOL[dtype].items()}
        torch.testing.assert_close(x.grad.double(), x64.grad, **tol)


@pytest.mark.parametrize("beta", [0.0, 1.0, -0.8, 2.5])
def test_gradcheck_and_gradgradcheck_float64(beta):
    x = (torch.randn(5, 7, dtype=torch.float64) * 3).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: memlean.swish(t, beta), (x,))
    assert torch.autograd.gradgradcheck(lambda t: memlean.swish(t, beta), (x,))


def saved_tensors(fn, x):
    """Sizes of the distinct storages autograd saves for backward while fn(x) runs."""
    with memlean.memstats.saved_storages() as saved:
        fn(x)
    return sorted(saved.values())


def test_saves_exactly_one_tensor_of_x_nbytes():
    x = torch.randn(1000, 33, requires_grad=True)
    assert saved_tensors(lambda t: memlean.swish(t), x) == [x.nbytes]
    assert saved_tensors(lambda t: memlean.Swish(1.5)(t), x) == [x.nbytes]
    # The naive composition keeps x and sigmoid(x).
    assert saved_tensors(lambda t: t * torch.sigmoid(t), x) == [x.nbytes, x.nbytes]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", [1.0, -1.0, 0.0])
def test_nan_and_inf_propagate_as_in_the_formula(dtype, beta):
    x = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -100.0] * 5).to(dtype)
    y, ref = memlean.swish(x, beta).double(), reference(x, beta).double()
    assert torch.equal(y.isnan(), ref.isnan())
    assert torch.equal(y.isinf(), ref.isinf())
    torch.testing.assert_close(y, ref, equal_nan=True, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.uint8])
def test_integer_and_bool_inputs_name_the_dtype(dtype):
    name = {torch.int32: "Int", torch.int64: "Long", torch.bool: "Bool", torch.uint8: "Byte"}[dtype]
    with pytest.raises(RuntimeError, match=f"x must be float32, float64, bfloat16 or float16, got {name}"):
        memlean.swish(torch.zeros(3, dtype=dtype))


def test_bad_arguments():
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        memlean.swish([1.0, 2.0])
    with pytest.raises(ValueError, match="beta must be finite, got inf"):
        memlean.swish(torch.ones(2), math.inf)
    with pytest.raises(ValueError, match="beta must be finite, got nan"):
        memlean.Swish(math.nan)
    with pytest.raises(TypeError, match="beta must be a real number, got str"):
        memlean.Swish("1")
    # Straight to the op: the C++ check names beta too.
    with pytest.raises(RuntimeError, match="beta must be finite"):
        torch.ops.memlean.swish(torch.ones(2), math.inf)


def test_module():
    m = memlean.Swish(beta=0.5)
    assert repr(m) == "Swish(beta=0.5)"
    assert list(m.parameters()) == [] and m.state_dict() == {}
    x = torch.randn(4, 5)
    torch.testing.assert_close(m(x), reference(x, 0.5))


def test_op_schema_and_raw_kernels():
    assert "memlean::swish(Tensor x, float beta=1." in str(torch.ops.memlean.swish.default._schema)
    x, g = torch.randn(100, dtype=torch.float64), torch.randn(100, dtype=torch.float64)
    torch.testing.assert_close(torch.ops.memlean.swish(x, 2.0), reference(x, 2.0))
    s = torch.sigmoid(2.0 * x)
    torch.testing.assert_close(torch.ops.memlean.swish_backward(g, x, 2.0),
                               g * s * (1 + 2.0 * x * (1 - s)))
    assert memlean._C.TORCH_VERSION == torch.__version__


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
