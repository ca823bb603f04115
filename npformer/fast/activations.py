r"""Activations, fast (docs/derivations.md §19): the textbook ops
(:mod:`npformer.ops.activations`), ReLU computed from its output, and the exact and tanh
GELUs as one compiled pass each way, their numba kernels below.

ReLU: $y = \max(x, 0)$, $\bar x = \bar y \cdot \text{sign}(y)$ ($= \bar y\,[x > 0]$, and
NaN for a NaN x), saved y, the product taken in sign(y)'s buffer.

GELU (exact): $y = x \Phi(x)$, $\bar x = \bar y (\Phi(x) + x \varphi(x))$, saved x alone
($\Phi(x)$ computed again in the backward's pass, bit for bit the forward's).  Kernels
with the erfc and exp of :mod:`.numerics` (float32 in float32 arithmetic, ``contract=True``,
$\Phi$ and $\varphi$ from one exp); without numba or on CuPy, the library's own erfc; in
the strict namespace, the textbook op.  tests/test_numerics.py holds their accuracy.

GELU (tanh form, GPT-2's): the textbook's $y = x (1 + t)/2$, $t = \tanh(c (x + a x^3))$,
saved (x, t), with $\tanh u = \text{sign}(u) (1 - e)/(1 + e)$, $e = e^{-2|u|}$.  Every other
activation is the textbook one.
"""
from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import backend
from ..backend import Array
from ..ops import activations as _textbook
from ..ops.contracts import (
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
from .compiler import compilable, jit
from .numerics import erfc64, exp32, exp64, normal_cdf32, normal_cdf32_given, normal_exp32


@forward_op(activation_input("relu"))
def relu_forward(x: Array) -> tuple[Array, Any]:
    """x (...) -> y (...), saved = y (which the next linear layer keeps anyway)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(relu_forward, x)
    xp = backend.namespace_of(x)
    y = xp.maximum(x, 0.0)
    return with_saved(relu_forward, y, y)


@backward_op(relu_forward)
def relu_backward(dy: Array, saved: Array) -> Array:
    """dy (...) -> dx = dy sign(y) (...)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(relu_backward, dy, saved)
    y = opened(relu_forward, saved)
    xp = backend.namespace_of(dy)
    if type(y).__module__.startswith("cupy"):  # array_api_compat's sign for CuPy writes
        # NaN through a boolean mask, which waits for the device: the same values as
        # sign(y) dy for y = max(x, 0) >= 0 or NaN (0 dy is 0, or NaN for an infinite dy)
        return xp.where(y > 0, dy, y * dy)
    dx = xp.sign(y)  # [x > 0]
    dx *= dy  # in place: one new array, not two
    return dx


def _special_functions(x):
    """The array library's scipy.special (SciPy for NumPy arrays, cupyx.scipy.special
    for CuPy arrays), or None (no such library for this namespace, or not installed)."""
    library = type(x).__module__.split(".")[0]
    name = {"numpy": "scipy.special", "cupy": "cupyx.scipy.special"}.get(library)
    try:
        return importlib.import_module(name) if name else None
    except ImportError:
        return None


def _phi_cdf(x: Array, special) -> Array:
    """Phi(x) = erfc(-x / sqrt 2) / 2 from the array library's erfc, in x's dtype."""
    phi_cdf = special.erfc(-_textbook.SQRT1_2 * x)     # 2 Phi(x), in x's dtype
    phi_cdf *= 0.5                                      # Phi(x), the normal CDF, in place
    return phi_cdf


@forward_op(activation_input("gelu"))
def gelu_forward(x: Array) -> tuple[Array, Any]:
    """x (...) -> y = x Phi(x) (...), saved x: the textbook op, erfc compiled.  Only x is
    kept (the textbook keeps (x, Phi(x))): the backward recomputes Phi(x) in its own pass,
    so a GELU holds one hidden-width array for its backward instead of two."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(gelu_forward, x)
    if compilable(x):
        return with_saved(gelu_forward, gelu_kernel(x), x)  # one compiled pass: y
    special = _special_functions(x)
    if special is None:
        y, _ = _textbook.gelu_forward.unchecked(x)
        return with_saved(gelu_forward, y, x)
    return with_saved(gelu_forward, x * _phi_cdf(x, special), x)


@backward_op(gelu_forward)
def gelu_backward(dy: Array, saved: Array) -> Array:
    """dy (...) -> dx = dy (Phi(x) + x phi(x)): the textbook op, Phi(x) recomputed and
    fused into one compiled pass (elsewhere the textbook statements, on (x, Phi(x)) with
    Phi(x) computed again as the forward computed it)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(gelu_backward, dy, saved)
    x = opened(gelu_forward, saved)
    if compilable(dy, x):
        return gelu_backward_kernel(dy, x)
    special = _special_functions(x)
    if special is None:
        _, values = _textbook.gelu_forward.unchecked(x)
    else:
        values = (x, _phi_cdf(x, special))
    return _textbook.gelu_backward.unchecked(dy, values)


@forward_op(activation_input("gelu_tanh"))
def gelu_tanh_forward(x: Array) -> tuple[Array, Any]:
    """x (...) -> y (...), saved (x, t), t = tanh(c (x + a x^3)): the textbook op, one
    compiled pass on NumPy arrays (:func:`gelu_tanh_kernel`; its statements elsewhere)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(gelu_tanh_forward, x)
    if compilable(x):
        y, t = gelu_tanh_kernel(x)
        return with_saved(gelu_tanh_forward, y, (x, t))
    return with_saved(gelu_tanh_forward, *_textbook.gelu_tanh_forward.unchecked(x))


@backward_op(gelu_tanh_forward)
def gelu_tanh_backward(dy: Array, saved: Any) -> Array:
    """dy (...) -> dx (...): the textbook op, one compiled pass on NumPy arrays."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(gelu_tanh_backward, dy, saved)
    values = opened(gelu_tanh_forward, saved)
    x, t = values
    if compilable(dy, x, t):
        return gelu_tanh_backward_kernel(dy, x, t)
    return _textbook.gelu_tanh_backward.unchecked(dy, values)


ACTIVATIONS = {**_textbook.ACTIVATIONS, "relu": (relu_forward, relu_backward),
               "gelu": (gelu_forward, gelu_backward),
               "gelu_tanh": (gelu_tanh_forward, gelu_tanh_backward)}


@checked_op(activation_choice)
def activation(name: str) -> tuple[Callable, Callable]:
    """(forward, backward) of the activation called ``name``, this tier's ReLU."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(activation, name)
    return ACTIVATIONS[name]


# =========================================================================== GELU kernels
_SQRT1_2, _INV_SQRT_2PI = math.sqrt(0.5), 1.0 / math.sqrt(2.0 * math.pi)
_INV_SQRT_2PI_F = np.float32(_INV_SQRT_2PI)


@jit
def gelu_forward64(x: np.ndarray, y: np.ndarray) -> None:
    """x (N,) -> y = x Phi(x), Phi(x) = erfc(-x / sqrt 2) / 2, written into y (N,)."""
    for i in range(x.size):
        xi = x[i]
        y[i] = xi * (0.5 * erfc64(-_SQRT1_2 * xi))
    return None


@jit
def gelu_backward64(dy: np.ndarray, x: np.ndarray, dx: np.ndarray) -> None:
    """dy, x (N,) -> dx = dy (Phi(x) + x phi(x)), phi(x) = exp(-x^2/2)/sqrt(2 pi), with
    Phi(x) recomputed exactly as the forward computes it (so nothing but x is kept)."""
    for i in range(x.size):
        xi = x[i]
        cdf = 0.5 * erfc64(-_SQRT1_2 * xi)
        pdf = _INV_SQRT_2PI * exp64(-0.5 * xi * xi)
        dx[i] = dy[i] * (cdf + xi * pdf)
    return None


@jit(contract=True)
def gelu_forward32(x: np.ndarray, y: np.ndarray) -> None:
    """:func:`gelu_forward64` of float32 arrays, in float32 arithmetic."""
    for i in range(x.size):
        xi = x[i]
        y[i] = xi * normal_cdf32(xi)
    return None


@jit(contract=True)
def gelu_backward32(dy: np.ndarray, x: np.ndarray, dx: np.ndarray) -> None:
    """:func:`gelu_backward64` of float32 arrays, in float32 arithmetic: one exp,
    exp(-x^2/2) (x^2 exact), for both Phi(x) and phi(x)."""
    for i in range(x.size):
        xi = x[i]
        e = normal_exp32(xi)
        dx[i] = dy[i] * (normal_cdf32_given(xi, e) + xi * (_INV_SQRT_2PI_F * e))
    return None


def _launch(kernel32, kernel64, inputs: list, outputs: int) -> list:
    """New arrays ``outputs`` of the first input's shape, written by the compiled kernel of
    the inputs' dtype on them all flattened (NumPy float arrays of any layout: a strided
    one is copied first; np.ascontiguousarray would make a 0-d array 1-d)."""
    inputs = [np.require(a, requirements="C") for a in inputs]
    out = [np.empty_like(inputs[0]) for _ in range(outputs)]
    kernel = kernel32 if inputs[-1].dtype == np.float32 else kernel64
    kernel(*(a.reshape(-1) for a in inputs + out))
    return out


def gelu_kernel(x: np.ndarray) -> np.ndarray:
    """x (...) -> y = x Phi(x) (...), compiled."""
    return _launch(gelu_forward32, gelu_forward64, [x], 1)[0]


def gelu_backward_kernel(dy: np.ndarray, x: np.ndarray) -> np.ndarray:
    """dy, x (...) -> dx = dy (Phi(x) + x phi(x)) (...), compiled, Phi(x) recomputed."""
    return _launch(gelu_backward32, gelu_backward64, [dy, x], 1)[0]


# =========================================================================== tanh GELU kernels
_GELU_C, _GELU_A = _textbook.GELU_C, _textbook.GELU_A
_GELU_C_F, _GELU_A_F = np.float32(_GELU_C), np.float32(_GELU_A)
_HALF_F, _ONE_F, _TWO_F, _THREE_F, _ZERO_F = (np.float32(v) for v in (0.5, 1.0, 2.0, 3.0, 0.0))


@jit(inline="always")
def _tanh64(u: float) -> float:
    """tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2|u|) <= 1: no overflow, and an
    absolute error of a few ulps of 1.  NaN stays NaN (exp64 keeps it)."""
    e = exp64(-2.0 * abs(u))
    t = (1.0 - e) / (1.0 + e)
    return t if u >= 0.0 else -t


@jit(inline="always")
def _tanh32(u: float) -> float:
    """:func:`_tanh64` in float32 arithmetic."""
    e = exp32(-_TWO_F * abs(u))
    t = (_ONE_F - e) / (_ONE_F + e)
    return t if u >= _ZERO_F else -t


@jit
def gelu_tanh_forward64(x: np.ndarray, y: np.ndarray, t: np.ndarray) -> None:
    """x (N,) -> t = tanh(c (x + a x^3)) and y = x (1 + t) / 2, written into t and y (N,):
    the textbook's statements (:func:`npformer.ops.activations.gelu_tanh_forward`) in its
    order, one pass."""
    for i in range(x.size):
        xi = x[i]
        ti = _tanh64(_GELU_C * (xi + _GELU_A * xi * xi * xi))
        t[i] = ti
        y[i] = 0.5 * xi * (1.0 + ti)
    return None


@jit
def gelu_tanh_forward32(x: np.ndarray, y: np.ndarray, t: np.ndarray) -> None:
    """:func:`gelu_tanh_forward64` of float32 arrays, in float32 arithmetic."""
    for i in range(x.size):
        xi = x[i]
        ti = _tanh32(_GELU_C_F * (xi + _GELU_A_F * xi * xi * xi))
        t[i] = ti
        y[i] = _HALF_F * xi * (_ONE_F + ti)
    return None


@jit
def gelu_tanh_backward64(dy: np.ndarray, x: np.ndarray, t: np.ndarray,
                         dx: np.ndarray) -> None:
    """dy, x, t (N,) -> dx = dy ((1 + t) / 2 + x (1 - t^2) c (1 + 3 a x^2) / 2), one pass."""
    for i in range(x.size):
        xi, ti = x[i], t[i]
        dx[i] = dy[i] * (0.5 * (1.0 + ti) + 0.5 * xi * (1.0 - ti * ti) * _GELU_C
                         * (1.0 + 3.0 * _GELU_A * xi * xi))
    return None


@jit
def gelu_tanh_backward32(dy: np.ndarray, x: np.ndarray, t: np.ndarray,
                         dx: np.ndarray) -> None:
    """:func:`gelu_tanh_backward64` of float32 arrays, in float32 arithmetic."""
    for i in range(x.size):
        xi, ti = x[i], t[i]
        dx[i] = dy[i] * (_HALF_F * (_ONE_F + ti) + _HALF_F * xi * (_ONE_F - ti * ti)
                         * _GELU_C_F * (_ONE_F + _THREE_F * _GELU_A_F * xi * xi))
    return None


def gelu_tanh_kernel(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x (...) -> y, t (...) of the tanh GELU, compiled."""
    y, t = _launch(gelu_tanh_forward32, gelu_tanh_forward64, [x], 2)
    return y, t


def gelu_tanh_backward_kernel(dy: np.ndarray, x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """dy, x, t (...) -> dx (...) of the tanh GELU, compiled."""
    return _launch(gelu_tanh_backward32, gelu_tanh_backward64, [dy, x, t], 1)[0]
