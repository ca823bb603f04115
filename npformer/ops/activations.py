r"""Element-wise non-linearities of the position-wise feed-forward network.  The
derivations: ReLU (§3), GELU, exact and tanh form (§4) of docs/derivations.md.

ReLU
    forward  $y = \max(x, 0)$ (NaN stays NaN)
    backward $\bar x = \bar y \cdot [x > 0]$ (0 at the kink, as in PyTorch; NaN where x is
             NaN)

GELU, exact (``"gelu"``: ``torch.nn.GELU()``)
    forward  $\Phi(x) = \tfrac12\,\mathrm{erfc}(-x/\sqrt2)$, $y = x\,\Phi(x)$
    backward $\varphi(x) = e^{-x^2/2}/\sqrt{2\pi}$,
             $\bar x = \bar y \cdot (\Phi(x) + x\,\varphi(x))$

GELU, tanh form (``"gelu_tanh"``: GPT-2, ``torch.nn.GELU(approximate="tanh")``), with
$a = 0.044715$ (``GELU_A``) and ``GELU_C`` $= \sqrt{2/\pi}$:
    forward  $u = \sqrt{2/\pi}\,(x + a x^3)$, $t = \tanh u$, $y = \tfrac12 x (1 + t)$
    backward $\bar x = \bar y \cdot \bigl(\tfrac12 (1 + t) + \tfrac12 x\,(1 - t^2)\,
             \sqrt{2/\pi}\,(1 + 3 a x^2)\bigr)$

The error function
    NumPy and the array API standard have no ``erf``: :func:`erf` and :func:`erfc` are
    W. J. Cody's rational Chebyshev approximations (Math. Comp. 23 (1969) 631-637; his
    Fortran CALERF's coefficients, SPECFUN/netlib) in array-API functions only, one code for
    every backend.  Against ``math.erf`` / ``math.erfc`` over [-30, 30], normal draws and
    grids down to 1e-300 (tests/test_gelu.py keeps the bounds): float64 erf within 4 ulp,
    erfc within 7 wherever it is a normal number (its subnormal tail, 26.55 < x < 27.3,
    within 2 subnormal steps; 0 beyond); float32 within 6 and 10 ulp.  erf(+-0) = +-0,
    erf(+-inf) = +-1, NaN stays NaN.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from .. import backend
from ..backend import Array
from .contracts import (
    activation_choice,
    activation_input,
    backward_op,
    checked_op,
    door,
    forward_op,
    opened,
    state,
    with_saved,
)

GELU_C = math.sqrt(2.0 / math.pi)  # Python floats keep float32 arrays float32
GELU_A = 0.044715
SQRT1_2 = math.sqrt(0.5)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


# =========================================================================== relu
@forward_op(activation_input("relu"))
def relu_forward(x: Array) -> tuple[Array, Any]:
    """x (...) -> y = max(x, 0) (...), saved x."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(relu_forward, x)
    xp = backend.namespace_of(x)
    y = xp.where(x <= 0, xp.zeros_like(x), x)  # max(x, 0); a NaN stays NaN
    return with_saved(relu_forward, y, x)


@backward_op(relu_forward)
def relu_backward(dy: Array, saved: Array) -> Array:
    """dy (...) -> dx = dy [x > 0] (...), NaN where x is NaN."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(relu_backward, dy, saved)
    x = opened(relu_forward, saved)
    xp = backend.namespace_of(dy, x)
    step = xp.astype(x > 0, dy.dtype)  # [x > 0]: 1 where x > 0, else 0
    step = xp.where(xp.isnan(x), x, step)  # NaN where x is NaN (the derivative of NaN)
    return dy * step


# =========================================================================== erf, erfc
# Cody's coefficients: erf(x) = x P(x^2)/Q(x^2) for |x| <= 0.46875;
# erfc(y) = exp(-y^2) R(y) for 0.46875 < y <= 4;
# erfc(y) = exp(-y^2)/y (1/sqrt(pi) - z S(z)) with z = 1/y^2 for y > 4.
_ERF_SMALL = 0.46875
_ERF_MID = 4.0
_ERFC_CLAMP = 28.0  # erfc(28) underflows to 0 in float64; clamping keeps y^2 finite
_SMALL_P = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02,
            3.20937758913846947e03, 1.85777706184603153e-1)
_SMALL_Q = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03,
            2.84423683343917062e03)
_MID_P = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01,
          2.98635138197400131e02, 8.81952221241769090e02, 1.71204761263407058e03,
          2.05107837782607147e03, 1.23033935479799725e03, 2.15311535474403846e-8)
_MID_Q = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02,
          1.62138957456669019e03, 3.29079923573345963e03, 4.36261909014324716e03,
          3.43936767414372164e03, 1.23033935480374942e03)
_LARGE_P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1,
            1.60837851487422766e-2, 6.58749161529837803e-4, 1.63153871373020978e-2)
_LARGE_Q = (2.56852019228982242e00, 1.87295284992346047e00, 5.27905102951428412e-1,
            6.05183413124413191e-2, 2.33520497626869185e-3)
_INV_SQRT_PI = 1.0 / math.sqrt(math.pi)


def _cody_ratio(z, p, q):
    """Cody's evaluation of P(z)/Q(z) (Q monic, one degree below P's leading term p[-1]):
    num = p[-1] z, den = z, then (num + p[i]) z and (den + q[i]) z for all but the last
    coefficients, and (num + p[n]) / (den + q[n]) at the end."""
    n = len(q) - 1
    num, den = p[-1] * z, z
    for i in range(n):
        num = (num + p[i]) * z
        den = (den + q[i]) * z
    return (num + p[n]) / (den + q[n])


def _exp_minus_square(y):
    """exp(-y^2) with y^2 split as s^2 + (y - s)(y + s), s = y rounded down to 1/16:
    s^2 is exact, so the rounding error of y^2 (which exp would amplify by y^2) is
    confined to the small second term (Cody's device)."""
    xp = backend.namespace_of(y)
    s = xp.trunc(y * 16.0) / 16.0
    return xp.exp(-s * s) * xp.exp(-(y - s) * (y + s))


def _erfc_of_large(y):
    """erfc(y) for y > 0.46875 (inputs below are clamped to it: the caller discards them).
    y (...) -> (...)."""
    xp = backend.namespace_of(y)
    mid = xp.clip(y, _ERF_SMALL, _ERF_MID)               # 0.46875 <= y <= 4
    erfc_mid = _exp_minus_square(mid) * _cody_ratio(mid, _MID_P, _MID_Q)
    large = xp.clip(y, _ERF_MID, _ERFC_CLAMP)            # 4 <= y <= 28: no overflow in y^2
    z = 1.0 / (large * large)
    erfc_large = (_exp_minus_square(large) / large
                  * (_INV_SQRT_PI - z * _cody_ratio(z, _LARGE_P, _LARGE_Q)))
    return xp.where(y <= _ERF_MID, erfc_mid, erfc_large)


def _erf_of_small(x):
    """erf(x) for |x| <= 0.46875 (inputs beyond are clamped: the caller discards them)."""
    xp = backend.namespace_of(x)
    x = xp.clip(x, -_ERF_SMALL, _ERF_SMALL)
    return x * _cody_ratio(x * x, _SMALL_P, _SMALL_Q)    # keeps the sign of -0.0


def erf(x: Array) -> Array:
    """The error function, erf(x) = 2/sqrt(pi) * int_0^x exp(-t^2) dt, element-wise.

    x (...) real floating -> (...) same dtype. erf(+-0) = +-0, erf(+-inf) = +-1, NaN -> NaN.
    """
    xp = backend.namespace_of(x)
    y = xp.abs(x)
    one_minus = 1.0 - _erfc_of_large(y)                  # erf(|x|) for |x| > 0.46875
    signed = xp.where(x < 0, -one_minus, one_minus)
    return xp.where(y <= _ERF_SMALL, _erf_of_small(x), signed)


def erfc(x: Array) -> Array:
    """The complementary error function, erfc(x) = 1 - erf(x), accurate in its tail.

    x (...) -> (...) same dtype. erfc(-x) = 2 - erfc(x); erfc(+inf) = 0, erfc(-inf) = 2.
    """
    xp = backend.namespace_of(x)
    y = xp.abs(x)
    tail = _erfc_of_large(y)                             # erfc(|x|) for |x| > 0.46875
    large = xp.where(x < 0, 2.0 - tail, tail)
    return xp.where(y <= _ERF_SMALL, 1.0 - _erf_of_small(x), large)


# =========================================================================== gelu (exact)
@forward_op(activation_input("gelu"))
def gelu_forward(x: Array) -> tuple[Array, Any]:
    """x (...) -> y = x Phi(x) (...), saved (x, Phi(x)); Phi(x) = erfc(-x / sqrt 2) / 2."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(gelu_forward, x)
    phi_cdf = 0.5 * erfc(-SQRT1_2 * x)                   # Phi(x), the normal CDF
    y = x * phi_cdf
    return with_saved(gelu_forward, y, (x, phi_cdf))


@backward_op(gelu_forward)
def gelu_backward(dy: Array, saved: Any) -> Array:
    """dy (...) -> dx = dy (Phi(x) + x phi(x)), phi(x) = exp(-x^2 / 2) / sqrt(2 pi)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(gelu_backward, dy, saved)
    values = opened(gelu_forward, saved)
    x, phi_cdf = values
    xp = backend.namespace_of(dy)
    phi_pdf = INV_SQRT_2PI * xp.exp(-0.5 * x * x)        # phi(x), the normal density
    dy_dx = phi_cdf + x * phi_pdf                        # product rule: Phi + x Phi'
    return dy * dy_dx


# =========================================================================== gelu (tanh form)
@forward_op(activation_input("gelu_tanh"))
def gelu_tanh_forward(x: Array) -> tuple[Array, Any]:
    """x (...) -> y (...), saved (x, t) with t = tanh(c (x + a x^3))."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(gelu_tanh_forward, x)
    xp = backend.namespace_of(x)
    u = GELU_C * (x + GELU_A * x * x * x)
    t = xp.tanh(u)
    y = 0.5 * x * (1.0 + t)
    return with_saved(gelu_tanh_forward, y, (x, t))


@backward_op(gelu_tanh_forward)
def gelu_tanh_backward(dy: Array, saved: Any) -> Array:
    """dy (...) -> dx = dy dy/dx (...)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(gelu_tanh_backward, dy, saved)
    values = opened(gelu_tanh_forward, saved)
    x, t = values
    dy_dx = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_A * x * x)
    return dy * dy_dx


ACTIVATIONS = {
    "relu": (relu_forward, relu_backward),
    "gelu": (gelu_forward, gelu_backward),
    "gelu_tanh": (gelu_tanh_forward, gelu_tanh_backward),
}


@checked_op(activation_choice)
def activation(name: str, activations: dict = ACTIVATIONS) -> tuple[Callable, Callable]:
    """(forward, backward) of the activation called ``name``: "relu", "gelu" (exact, erf)
    or "gelu_tanh" (the tanh approximation); ``activations``: the tier's table."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(activation, name, activations)
    return activations[name]
