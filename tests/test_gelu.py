"""The exact GELU ("gelu", x Phi(x), PyTorch's default) and its error function.

* ``erf`` / ``erfc`` (Cody's rational approximations, array-API only) against
  ``math.erf`` / ``math.erfc`` over the whole range: in ulps of the result, float64
  and float32, with the special values (+-0, +-inf, NaN, huge |x|) and on the strict
  backend (bit-identical to NumPy: the same operations);
* both GELUs against ``torch.nn.functional.gelu`` (exact and ``approximate="tanh"``),
  outputs and gradients, float64 and float32; the two differ (by ~1e-3 near x = +-2),
  so confusing them fails;
* Hypothesis gradient checks of both on NumPy and on the strict backend.

The layer and model parity with ``TransformerEncoderLayer(activation="gelu")`` and
``TransformerDecoderLayer`` lives in tests/test_layers_parity.py and test_models_parity.py.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from npformer import backend, ops
from npformer.gradcheck import check_op
from npformer.ops.activations import erf, erfc

from .conftest import using_backend
from .helpers import GRADCHECK_TOL, PARITY_RTOL, assert_close

# The measured accuracy the docstring of npformer.ops.activations states.
ULP_BOUND = {"float64": {"erf": 4, "erfc": 7}, "float32": {"erf": 6, "erfc": 10}}


def _grid() -> np.ndarray:
    rng = np.random.default_rng(0)
    tiny = np.logspace(-300, 1.5, 4000)
    return np.concatenate([np.linspace(-30.0, 30.0, 60001), rng.standard_normal(20000) * 3,
                           tiny, -tiny, [0.46875, np.nextafter(0.46875, 1), 4.0,
                                         np.nextafter(4.0, 5), 26.5, 26.6, 27.0, 27.2, 27.3,
                                         28.0, 40.0]])


def _ulps(actual: np.ndarray, exact: np.ndarray, dtype) -> np.ndarray:
    spacing = np.spacing(np.abs(exact).astype(dtype)).astype(np.float64)
    return np.abs(actual.astype(np.float64) - exact) / spacing


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_erf_and_erfc_match_math_within_a_few_ulps(dtype):
    x = _grid().astype(dtype)
    exact_erf = np.array([math.erf(float(v)) for v in x])
    exact_erfc = np.array([math.erfc(float(v)) for v in x])
    got_erf, got_erfc = erf(x), erfc(x)
    assert got_erf.dtype == np.dtype(dtype) and got_erfc.dtype == np.dtype(dtype)
    worst_erf = _ulps(got_erf, exact_erf, dtype)
    assert worst_erf.max() <= ULP_BOUND[dtype]["erf"], x[worst_erf.argmax()]
    normal = exact_erfc >= np.finfo(dtype).tiny  # below it, erfc is subnormal: absolute error
    worst_erfc = _ulps(got_erfc[normal], exact_erfc[normal], dtype)
    assert worst_erfc.max() <= ULP_BOUND[dtype]["erfc"], x[normal][worst_erfc.argmax()]
    subnormal_error = np.abs(got_erfc[~normal].astype(np.float64) - exact_erfc[~normal])
    assert subnormal_error.max(initial=0.0) <= 2 * np.finfo(dtype).smallest_subnormal


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_erf_special_values(dtype):
    big = np.finfo(dtype).max
    x = np.array([0.0, -0.0, np.inf, -np.inf, big, -big, np.nan], dtype)
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # none inside
        e, c = erf(x), erfc(x)
    np.testing.assert_array_equal(e[:6], [0.0, -0.0, 1.0, -1.0, 1.0, -1.0])
    assert np.signbit(e[1]) and not np.signbit(e[0])
    np.testing.assert_array_equal(c[:6], [1.0, 1.0, 0.0, 2.0, 0.0, 2.0])
    assert np.isnan(e[6]) and np.isnan(c[6])


def test_erf_on_the_strict_backend_is_numpy_bit_for_bit():
    x = _grid()[::7]
    with using_backend("strict"):
        on_strict = backend.asarray(x)
        strict_erf = backend.to_numpy(erf(on_strict))
        strict_erfc = backend.to_numpy(erfc(on_strict))
    np.testing.assert_array_equal(strict_erf, erf(x))
    np.testing.assert_array_equal(strict_erfc, erfc(x))


def test_the_names_mean_what_torch_means():
    """'gelu' is torch's default (erf) form, 'gelu_tanh' the approximation; they differ."""
    x = np.linspace(-3, 3, 61)
    exact = np.array([v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x])
    y, _ = ops.activation("gelu")[0](x)
    y_tanh, _ = ops.activation("gelu_tanh")[0](x)
    np.testing.assert_allclose(y, exact, rtol=0, atol=1e-15)
    assert np.abs(y_tanh - exact).max() > 1e-4  # the approximation is not the exact form


@pytest.mark.parametrize("name,approximate", [("gelu", "none"), ("gelu_tanh", "tanh")])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@given(seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([0.5, 1.0, 4.0]))
def test_gelu_matches_torch(torch, dtype, name, approximate, seed, scale):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((3, 17)) * scale).astype(dtype)
    x[0, :3] = [0.0, -0.0, 8.0]
    g = rng.standard_normal(x.shape).astype(dtype)
    tx = torch.tensor(x, requires_grad=True)
    ty = torch.nn.functional.gelu(tx, approximate=approximate)
    ty.backward(torch.tensor(g))
    with using_backend("numpy", dtype):
        forward, backward = ops.activation(name)
        y, cache = forward(x)
        dx = backward(g, cache)
    assert y.dtype == np.dtype(dtype) and dx.dtype == np.dtype(dtype)
    assert_close(y, ty.detach().numpy(), PARITY_RTOL[dtype], f"{name} output")
    assert_close(dx, tx.grad.numpy(), PARITY_RTOL[dtype], f"{name} gradient")


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh"])
@given(seed=st.integers(0, 2**32 - 1), shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       scale=st.sampled_from([0.3, 1.0, 3.0]))
def test_gelu_gradcheck(xb, on_device, name, seed, shape, scale):
    rng = np.random.default_rng(seed)
    # Clipped at -3.5: further out gelu'(x) shrinks below what central differences resolve.
    x = on_device(np.maximum(rng.standard_normal(tuple(shape)) * scale, -3.5))
    forward, backward = ops.activation(name)
    result = check_op(forward, backward, [x], [0])
    assert result.worst_error < GRADCHECK_TOL, f"gradient check failed:\n{result}"


def test_exact_gelu_in_the_far_left_tail_is_not_zero_by_cancellation():
    """Phi comes from erfc, so x Phi(x) keeps its digits where 1 + erf would cancel."""
    x = np.array([-10.0, -20.0])
    y, _ = ops.gelu_forward(x)
    expected = [v * 0.5 * math.erfc(-v / math.sqrt(2)) for v in x]
    np.testing.assert_allclose(y, expected, rtol=1e-13)
