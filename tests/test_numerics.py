"""The compiled kernels' own numerics (npformer.fast.numerics) and the GELU kernels, element
by element against references in a higher precision: the bounds their docstrings state.

The tolerance rule, stated once for every test here: an element's error is measured in
units of the result's own precision, never against the largest element of the array
(which would hide a bad element in a tail).

* float32 results against float64 references (SciPy's erfc, NumPy's exp) of the same
  float32 input: in float32 ulps of the reference (its spacing rounded to float32) where
  the reference is a normal float32; below, as an absolute error (the kernels flush
  what falls under the smallest normal float32 to 0).
* float64 results against mpmath at 40 digits: in float64 ulps where normal.
* The GELU kernels, whose backward adds two terms that cancel (near x = -0.75 and in the
  left tail): relative to the size of the terms, |dy| (Phi(x) + |x| phi(x)), as
  tests/test_fast_equals_textbook.py measures; in float64 the terms also count the
  rounding of the exponent x^2/2 at the size of x^2/2, which both tiers make:
  Phi(-|x|) x^2/2 in Phi, phi(x) x^2/2 in phi (:func:`gelu64_terms`).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.special import erfc as scipy_erfc

from npformer.fast import activations as fast_activations
from npformer.fast import compiler, numerics

pytestmark = pytest.mark.skipif(not compiler.COMPILED, reason="numba is not installed")
TINY32 = float(np.finfo(np.float32).tiny)
ULP32 = 2.0**-24  # the relative spacing of float32 at its smallest (2^-23 at 1 is 2 x this)
ULP64 = 2.0**-53


def elementwise(function):
    """A compiled loop y[i] = function(x[i]) (the kernels' own options)."""
    import numba

    @numba.njit(error_model="numpy", fastmath={"contract"})
    def loop(x, y):
        for i in range(x.size):
            y[i] = function(x[i])
    return lambda x: (loop(x, out := np.empty_like(x)), out)[1]


def ulps32(got: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """|got - reference| in float32 ulps of the reference (float64)."""
    spacing = np.spacing(np.abs(reference).astype(np.float32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - reference) / spacing


def ulps64(got: np.ndarray, reference: np.ndarray) -> np.ndarray:
    return np.abs(got - reference) / np.spacing(np.abs(reference))


def mp(function, x: np.ndarray) -> np.ndarray:
    """``function`` of mpmath at 40 digits, of every float64 in x, rounded to float64."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(40):
        return np.array([float(function(mpmath, mpmath.mpf(float(v)))) for v in x])


# =========================================================================== exp
def test_exp32_is_within_three_ulps_over_its_whole_range():
    """From -87.3 (below, exp leaves the normal float32 numbers: 0) to 88.37 (from 88.376,
    inf: its scale factor 2^n is one float32, inf from n = 128).  Measured 2.7 ulps
    (NumPy's own float32 exp: 2.4)."""
    x = np.linspace(-87.3, 88.37, 4_000_001).astype(np.float32)
    got = elementwise(numerics.exp32)(x)
    assert got.dtype == np.float32
    worst = ulps32(got, np.exp(x.astype(np.float64)))
    assert worst.max() <= 3.0, x[worst.argmax()]


def test_exp64_is_within_one_ulp_over_its_whole_range():
    x = np.concatenate([np.linspace(-708.3, 709.7, 20001), np.linspace(-1.0, 1.0, 2001)])
    worst = ulps64(elementwise(numerics.exp64)(x), mp(lambda m, v: m.exp(v), x))
    assert worst.max() <= 1.0, x[worst.argmax()]


@pytest.mark.parametrize("dtype,exp,low,high", [("float32", numerics.exp32, -87.4, 88.38),
                                                ("float64", numerics.exp64, -1401.0, 709.79)])
def test_exp_special_values_are_numpys(dtype, exp, low, high):
    """NaN stays NaN, -inf and what underflows give 0, what overflows gives inf (and +inf
    in float64; float32's exp is defined up to 89: its kernels take exp of at most 0)."""
    x = np.array([np.nan, -np.inf, 0.0, low, high, np.inf], dtype)
    got = elementwise(exp)(x)
    assert np.isnan(got[0]) and got[1] == 0.0 and got[2] == 1.0
    assert got[3] == 0.0 and got[4] == np.inf
    assert dtype == "float32" or got[5] == np.inf


def test_exp_takes_the_precision_of_its_argument():
    x32 = np.array([-1.5, 0.25], np.float32)
    np.testing.assert_array_equal(elementwise(numerics.exp)(x32),
                                  elementwise(numerics.exp32)(x32))
    x64 = x32.astype(np.float64)
    np.testing.assert_array_equal(elementwise(numerics.exp)(x64),
                                  elementwise(numerics.exp64)(x64))


# =========================================================================== erfc
def test_erfc32_is_within_seven_ulps_where_erfc_is_a_normal_float32():
    """Every float32 on a grid of 4 million over [-10, 10] and 200,001 over [9, 9.4] (where
    erfc leaves the normal float32 numbers, at 9.19): measured 6.9 ulps, 5.0e-7 relative.
    Before z^2 was kept exact, the error reached 66 ulps (7.7e-6 relative) near
    z = 9.1, and 5.6e-7 relative on |z| <= 1."""
    z = np.concatenate([np.linspace(-10, 10, 4_000_001),
                        np.linspace(9, 9.4, 200_001)]).astype(np.float32)
    got = elementwise(numerics.erfc32)(z)
    reference = scipy_erfc(z.astype(np.float64))
    normal = reference >= TINY32
    worst = ulps32(got[normal], reference[normal])
    assert worst.max() <= 7.0, z[normal][worst.argmax()]
    assert np.abs(got[~normal] - reference[~normal]).max() <= 2.0**-128


def test_normal_cdf32_is_within_eight_ulps_where_phi_is_a_normal_float32():
    """Phi(x) = erfc(-x / sqrt 2) / 2 with its exponent x^2 / 2 exact from x (the rounding
    of -x / sqrt 2 to float32 would cost 2 z^2 of it, 1e-5 relative at x = -12.8):
    measured 7.5 ulps."""
    x = np.linspace(-14, 6, 4_000_001).astype(np.float32)
    got = elementwise(numerics.normal_cdf32)(x)
    reference = 0.5 * scipy_erfc(-x.astype(np.float64) / math.sqrt(2.0))
    normal = reference >= TINY32
    worst = ulps32(got[normal], reference[normal])
    assert worst.max() <= 8.0, x[normal][worst.argmax()]
    assert np.abs(got[~normal] - reference[~normal]).max() <= 2.0**-128


def test_erfc64_is_within_five_ulps_and_eight_subnormal_steps():
    """|erfc64(z) - erfc(z)| <= 5 ulps of erfc(z) + 8 times the smallest subnormal float64:
    5 ulps where erfc is far from underflow (z < 26), up to 9 ulps just above its
    subnormal range (z ~ 26.5, where an ulp is the smallest subnormal), 8 steps in it."""
    z = np.concatenate([np.linspace(-6, 27.3, 30001), np.linspace(26, 26.56, 20001),
                        np.logspace(-300, 1, 300), -np.logspace(-300, 0.5, 100)])
    got = elementwise(numerics.erfc64)(z)
    reference = mp(lambda m, v: m.erfc(v), z)
    bound = 5 * np.spacing(reference) + 8 * float(np.finfo(np.float64).smallest_subnormal)
    excess = np.abs(got - reference) - bound
    assert excess.max() <= 0.0, z[excess.argmax()]


def test_erfc32s_polynomial_is_numerical_recipes_exponential_re_expanded():
    """Q(2t - 1) within 4.4e-8 of exp(P(t)) over t in [0, 1] (P: Numerical Recipes'
    exponent polynomial, the formula erfc32 stands for), its coefficients as float32."""
    q = np.array([getattr(numerics, f"_Q{k}") for k in range(12, -1, -1)], np.float64)
    assert all(getattr(numerics, f"_Q{k}").dtype == np.float32 for k in range(13))
    t = np.linspace(0.0, 1.0, 1_000_001)
    exp_p = np.exp(np.polyval(numerics._NR_P[::-1], t))
    assert np.abs(np.polyval(q, 2 * t - 1) / exp_p - 1).max() <= 4.4e-8


@pytest.mark.parametrize("dtype,erfc", [("float32", numerics.erfc32),
                                        ("float64", numerics.erfc64)])
def test_erfc_special_values(dtype, erfc):
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30], dtype)
    got = elementwise(erfc)(x)
    assert np.isnan(got[0])
    np.testing.assert_array_equal(got[1:], [0.0, 2.0, 1.0, 1.0, 0.0, 2.0])


# =========================================================================== a row's max, sum
def test_a_rows_sum_keeps_a_nan_and_its_max_passes_over_it():
    """Wherever the NaN sits (in the eight or four running chains, or the remainder): the
    sum is NaN, the max the largest of the other values (the kernels' NaN comes through
    exp(NaN - max) in their sums)."""
    import numba

    @numba.njit
    def max_and_sum(row):
        return numerics.max8(row, -np.inf), numerics.sum4(row, row, 0)

    for n in (1, 7, 8, 9, 21):
        for position in range(n):
            row = np.arange(n, dtype=np.float64)
            row[position] = np.nan
            biggest, total = max_and_sum(row)
            assert np.isnan(total), (n, position)
            assert biggest == np.nanmax(row, initial=-np.inf), (n, position)
        row = np.arange(n, dtype=np.float64)
        assert max_and_sum(row) == (n - 1.0, n * (n - 1) / 2.0)


# =========================================================================== the GELU kernels
def gelu64_reference(x: np.ndarray) -> np.ndarray:
    """(y, dy/dx, Phi(x), phi(x), Phi(-|x|)) of every float64 in x, by mpmath."""
    def values(m, v):
        cdf = m.erfc(-v / m.sqrt(2)) / 2
        pdf = m.exp(-v * v / 2) / m.sqrt(2 * m.pi)
        return [v * cdf, cdf + v * pdf, cdf, pdf, m.erfc(abs(v) / m.sqrt(2)) / 2]
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(40):
        return np.array([[float(a) for a in values(mpmath, mpmath.mpf(float(v)))]
                         for v in x]).T


def test_gelu32_kernels_per_element():
    """|y - y_ref| <= 10 2^-24 |y_ref| (y within 5 to 10 float32 ulps of x Phi(x)) and
    |dx - dx_ref| <= 8 2^-24 |dy| (Phi + |x| phi), the size of its terms, wherever Phi(x)
    is a normal float32 (x > -12.95); below, exp(-x^2/2) is flushed to 0 under the
    smallest normal float32, which adds |x| 2^-128 to y's bound and |dy| (1 + |x|) 2^-127
    (+ one subnormal step) to dx's.  Measured 8.8 and 7.0 (times 2^-24).  The whole-array
    test this adds to (3e-7 of the largest element) let an element near x = -12.8 be off
    by 1.5e-5 of itself."""
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-16, 8, 6_000_001),
                        rng.standard_normal(1_000_000) * 4]).astype(np.float32)
    dy = rng.standard_normal(x.size).astype(np.float32)
    x64 = x.astype(np.float64)
    cdf = 0.5 * scipy_erfc(-x64 / math.sqrt(2.0))
    pdf = np.exp(-0.5 * x64 * x64) / math.sqrt(2.0 * math.pi)
    y = fast_activations.gelu_kernel(x)
    assert y.dtype == np.float32
    y_bound = 10 * ULP32 * np.abs(x64 * cdf) + np.abs(x64) * 2.0**-128
    excess = np.abs(y - x64 * cdf) - y_bound
    assert excess.max() <= 0.0, x[excess.argmax()]
    dx = fast_activations.gelu_backward_kernel(dy, x)
    terms = np.abs(dy) * (cdf + np.abs(x64) * pdf)
    dx_bound = 8 * ULP32 * terms + np.abs(dy) * (1 + np.abs(x64)) * 2.0**-127 + 2.0**-149
    excess = np.abs(dx - dy * (cdf + x64 * pdf)) - dx_bound
    assert excess.max() <= 0.0, x[excess.argmax()]


def test_gelu64_kernels_per_element():
    """y and dx within 5 2^-53 of their terms: y's are |x| (Phi(x) + Phi(-|x|) x^2/2),
    dx's Phi(x) + Phi(-|x|) x^2/2 + |x| phi(x) (1 + x^2/2) (dy = 1): the kernel rounds
    -x / sqrt 2 and x^2 / 2 before its exp, as the textbook does, and the exp turns that
    rounding into x^2 / 2 times it.  Where Phi(x) is subnormal (x < -37.5), plus (1 + |x|)
    times 8 subnormal steps, erfc's own bound there."""
    x = np.concatenate([np.linspace(-38, 8, 6001), np.linspace(-1, 1, 2001)])
    y_ref, dx_ref, cdf, pdf, tail = gelu64_reference(x)
    exponent = 0.5 * x * x
    y_terms = np.abs(x) * (cdf + tail * exponent)
    dx_terms = cdf + tail * exponent + np.abs(x) * pdf * (1.0 + exponent)
    y = fast_activations.gelu_kernel(x)
    dx = fast_activations.gelu_backward_kernel(np.ones_like(x), x)
    floor = (1 + np.abs(x)) * 8 * float(np.finfo(np.float64).smallest_subnormal)
    excess = np.abs(y - y_ref) - (5 * ULP64 * y_terms + floor)
    assert excess.max() <= 0.0, x[excess.argmax()]
    excess = np.abs(dx - dx_ref) - (5 * ULP64 * dx_terms + floor)
    assert excess.max() <= 0.0, x[excess.argmax()]
