r"""RMS normalisation, fast: the textbook op (:mod:`npformer.ops.rmsnorm`) as one compiled
kernel each way on NumPy arrays, row by row (docs/derivations.md §6; the kernels §19): the
same saved values (x_hat, r, weight), formulas and order, the row sums in float64 (four
running sums), the mean of squares, r and the mean of g x-hat rounded to the row's dtype.
Without numba, or on other arrays (CuPy, the strict namespace), the textbook op.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import Array
from ..ops import rmsnorm as _textbook
from ..ops.contracts import backward_op, door, forward_op, opened, rmsnorm_inputs, state, with_saved
from .compiler import compilable, jit
from .numerics import sum4

EPS = _textbook.EPS


@forward_op(rmsnorm_inputs)
def rmsnorm_forward(x: Array, weight: Array, eps: float = EPS) -> tuple[Array, Any]:
    """x (..., D), weight (D,) -> y (..., D), saved (x_hat, r, weight)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(rmsnorm_forward, x, weight, eps)
    if not compilable(x, weight):
        return with_saved(rmsnorm_forward, *_textbook.rmsnorm_forward.unchecked(x, weight, eps))
    y, x_hat, r = rmsnorm_kernel(x, weight, eps)  # (..., D), (..., D), (..., 1)
    return with_saved(rmsnorm_forward, y, (x_hat, r, weight))


@backward_op(rmsnorm_forward)
def rmsnorm_backward(dy: Array, saved: Any) -> tuple[Array, Array]:
    """dy (..., D) -> dx (..., D), dweight (D,)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(rmsnorm_backward, dy, saved)
    values = opened(rmsnorm_forward, saved)
    x_hat, r, weight = values
    if not compilable(dy, x_hat, r, weight):
        return _textbook.rmsnorm_backward.unchecked(dy, values)
    return rmsnorm_backward_kernel(dy, x_hat, r, weight)


# =========================================================================== the kernels
def rmsnorm_kernel(x: np.ndarray, weight: np.ndarray,
                   eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (..., D), weight (D,) NumPy float arrays of one dtype (a strided x is copied
    first), eps a real number -> y, x_hat (..., D), r (..., 1), compiled."""
    x, weight = np.ascontiguousarray(x), np.ascontiguousarray(weight)
    y, x_hat = np.empty_like(x), np.empty_like(x)
    r = np.empty(x.shape[:-1] + (1,), dtype=x.dtype)
    d = x.shape[-1]
    _rmsnorm_forward(x.reshape(-1, d), weight, float(eps), y.reshape(-1, d),
                     x_hat.reshape(-1, d), r.reshape(-1, 1))
    return y, x_hat, r


def rmsnorm_backward_kernel(dy: np.ndarray, x_hat: np.ndarray, r: np.ndarray,
                            weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """dy, x_hat (..., D), r (..., 1), weight (D,) -> dx (..., D), dweight (D,)."""
    dy, x_hat, r, weight = (np.ascontiguousarray(a) for a in (dy, x_hat, r, weight))
    dx, dweight = np.empty_like(dy), np.empty_like(weight)
    d = dy.shape[-1]
    _rmsnorm_backward(dy.reshape(-1, d), x_hat.reshape(-1, d), r.reshape(-1, 1), weight,
                      dx.reshape(-1, d), dweight)
    return dx, dweight


@jit
def _rmsnorm_forward(x, weight, eps, y, x_hat, r):
    """x (N, D), weight (D,), eps -> y, x_hat (N, D), r (N, 1), written in place; eps
    rounded to x's dtype, as NumPy rounds a Python float that meets the array."""
    n, d = x.shape
    for i in range(n):
        row = x[i]
        mean_square = x.dtype.type(sum4(row, row, 1) / d)
        ri = x.dtype.type(1.0) / np.sqrt(mean_square + x.dtype.type(eps))
        r[i, 0] = ri
        for j in range(d):
            h = x[i, j] * ri
            x_hat[i, j] = h
            y[i, j] = weight[j] * h
    return None


@jit
def _rmsnorm_backward(dy, x_hat, r, weight, dx, dweight):
    """dy, x_hat (N, D), r (N, 1), weight (D,) -> dx (N, D), dweight (D,), in place:
    dx = r (g - x_hat mean(g x_hat)), g = dy weight."""
    n, d = dy.shape
    dweight_acc = np.zeros(d)
    g = np.empty(d, dtype=dy.dtype)
    for i in range(n):
        for j in range(d):  # independent across j: vectorizes
            dweight_acc[j] += dy[i, j] * x_hat[i, j]
            g[j] = dy[i, j] * weight[j]
        mean_g_xhat = dy.dtype.type(sum4(g, x_hat[i], 1) / d)
        ri = r[i, 0]
        for j in range(d):
            dx[i, j] = ri * (g[j] - x_hat[i, j] * mean_g_xhat)
    for j in range(d):
        dweight[j] = dweight_acc[j]
    return None
