r"""Layer normalisation, fast: the textbook op (:mod:`npformer.ops.layernorm`) as one
compiled kernel each way on NumPy arrays, row by row (docs/derivations.md §6; the kernels
§19): the same saved values (x_hat, r, gamma), formulas and order, the row sums in float64
(four running sums), mu, the variance, r and the means rounded to the row's dtype.
Without numba, or on other arrays (CuPy, the strict namespace), the textbook op.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend
from ..backend import Array
from ..gpu.gemm import capturing, column_sum
from ..ops import layernorm as _textbook
from ..ops.contracts import (
    backward_op,
    door,
    forward_op,
    layernorm_inputs,
    opened,
    state,
    with_saved,
)
from .compiler import compilable, jit
from .numerics import sum4

EPS = _textbook.EPS


@forward_op(layernorm_inputs)
def layernorm_forward(x: Array, gamma: Array, beta: Array, eps: float = EPS) -> tuple[Array, Any]:
    """x (..., D), gamma (D,), beta (D,) -> y (..., D), saved (x_hat, r, gamma)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(layernorm_forward, x, gamma, beta, eps)
    if not compilable(x, gamma, beta):
        return with_saved(layernorm_forward,
                          *_textbook.layernorm_forward.unchecked(x, gamma, beta, eps))
    y, x_hat, r = layernorm_kernel(x, gamma, beta, eps)  # (..., D), (..., D), (..., 1)
    return with_saved(layernorm_forward, y, (x_hat, r, gamma))


@backward_op(layernorm_forward)
def layernorm_backward(dy: Array, saved: Any) -> tuple[Array, Array, Array]:
    """dy (..., D) -> dx (..., D), dgamma (D,), dbeta (D,)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(layernorm_backward, dy, saved)
    values = opened(layernorm_forward, saved)
    x_hat, r, gamma = values
    if capturing():  # a step captured as a CUDA graph: the column sums through cuBLAS
        return _routed_backward(dy, x_hat, r, gamma)
    if not compilable(dy, x_hat, r, gamma):
        return _textbook.layernorm_backward.unchecked(dy, values)
    return layernorm_backward_kernel(dy, x_hat, r, gamma)


def _routed_backward(dy: Array, x_hat: Array, r: Array, gamma: Array
                     ) -> tuple[Array, Array, Array]:
    """The textbook backward's statements, dgamma and dbeta as :func:`.gemm.column_sum`."""
    xp = backend.namespace_of(dy, x_hat)
    d = x_hat.shape[-1]
    dy_rows = xp.reshape(dy, (-1, d))  # (N, D)
    dgamma = column_sum(dy_rows * xp.reshape(x_hat, (-1, d)))  # (D,)
    dbeta = column_sum(dy_rows)  # (D,)
    g = dy * gamma  # (..., D) gradient w.r.t. x_hat
    mean_g = xp.mean(g, axis=-1, keepdims=True)  # (..., 1)
    mean_g_xhat = xp.mean(g * x_hat, axis=-1, keepdims=True)  # (..., 1)
    dx = r * (g - mean_g - x_hat * mean_g_xhat)  # (..., D)
    return dx, dgamma, dbeta


# =========================================================================== the kernels
def layernorm_kernel(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray,
                     eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (..., D), gamma, beta (D,) NumPy float arrays of one dtype (any layout: a strided
    one is copied first), eps a real number -> y, x_hat (..., D), r (..., 1), compiled."""
    x, gamma, beta = (np.ascontiguousarray(a) for a in (x, gamma, beta))
    y, x_hat = np.empty_like(x), np.empty_like(x)
    r = np.empty(x.shape[:-1] + (1,), dtype=x.dtype)
    d = x.shape[-1]
    _layernorm_forward(x.reshape(-1, d), gamma, beta, float(eps), y.reshape(-1, d),
                       x_hat.reshape(-1, d), r.reshape(-1, 1))
    return y, x_hat, r


def layernorm_backward_kernel(dy: np.ndarray, x_hat: np.ndarray, r: np.ndarray,
                              gamma: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """dy, x_hat (..., D), r (..., 1), gamma (D,) -> dx (..., D), dgamma, dbeta (D,)."""
    dy, x_hat, r, gamma = (np.ascontiguousarray(a) for a in (dy, x_hat, r, gamma))
    dx = np.empty_like(dy)
    dgamma, dbeta = np.empty_like(gamma), np.empty_like(gamma)
    d = dy.shape[-1]
    _layernorm_backward(dy.reshape(-1, d), x_hat.reshape(-1, d), r.reshape(-1, 1), gamma,
                        dx.reshape(-1, d), dgamma, dbeta)
    return dx, dgamma, dbeta


@jit(inline="always")
def _sum_of_squares_about(x, mu):
    """sum (x - mu)^2 over a row, in float64 as four running sums."""
    d = x.size
    s0 = s1 = s2 = s3 = 0.0
    j = 0
    while j + 4 <= d:
        c0, c1, c2, c3 = x[j] - mu, x[j + 1] - mu, x[j + 2] - mu, x[j + 3] - mu
        s0 += np.float64(c0 * c0)
        s1 += np.float64(c1 * c1)
        s2 += np.float64(c2 * c2)
        s3 += np.float64(c3 * c3)
        j += 4
    while j < d:
        c = x[j] - mu
        s0 += np.float64(c * c)
        j += 1
    return (s0 + s1) + (s2 + s3)


@jit
def _layernorm_forward(x, gamma, beta, eps, y, x_hat, r):
    """x (N, D), gamma, beta (D,), eps -> y, x_hat (N, D), r (N, 1), written in place;
    eps rounded to x's dtype, as NumPy rounds a Python float that meets the array."""
    n, d = x.shape
    for i in range(n):
        row = x[i]
        mu = x.dtype.type(sum4(row, row, 0) / d)
        var = x.dtype.type(_sum_of_squares_about(row, mu) / d)
        ri = x.dtype.type(1.0) / np.sqrt(var + x.dtype.type(eps))
        r[i, 0] = ri
        for j in range(d):
            h = (x[i, j] - mu) * ri
            x_hat[i, j] = h
            y[i, j] = h * gamma[j] + beta[j]
    return None


@jit(inline="always")
def _row_sum_of_g_x_hat(dy, gamma, x_hat):
    """sum g x_hat over a row, g = dy gamma, in float64 as four running sums."""
    d = dy.size
    s0 = s1 = s2 = s3 = 0.0
    j = 0
    while j + 4 <= d:
        s0 += np.float64(dy[j] * gamma[j] * x_hat[j])
        s1 += np.float64(dy[j + 1] * gamma[j + 1] * x_hat[j + 1])
        s2 += np.float64(dy[j + 2] * gamma[j + 2] * x_hat[j + 2])
        s3 += np.float64(dy[j + 3] * gamma[j + 3] * x_hat[j + 3])
        j += 4
    while j < d:
        s0 += np.float64(dy[j] * gamma[j] * x_hat[j])
        j += 1
    return (s0 + s1) + (s2 + s3)


@jit
def _layernorm_backward(dy, x_hat, r, gamma, dx, dgamma, dbeta):
    """dy, x_hat (N, D), r (N, 1), gamma (D,) -> dx (N, D), dgamma, dbeta (D,), in place:
    dx = r (g - mean(g) - x_hat mean(g x_hat)), g = dy gamma."""
    n, d = dy.shape
    dgamma_acc = np.zeros(d)
    dbeta_acc = np.zeros(d)
    for i in range(n):
        for j in range(d):  # independent across j: vectorizes
            dgamma_acc[j] += dy[i, j] * x_hat[i, j]
            dbeta_acc[j] += dy[i, j]
        mean_g = dy.dtype.type(sum4(dy[i], gamma, 1) / d)  # sum g, g = dy gamma
        mean_gx = dy.dtype.type(_row_sum_of_g_x_hat(dy[i], gamma, x_hat[i]) / d)
        ri = r[i, 0]
        for j in range(d):
            g = dy[i, j] * gamma[j]
            dx[i, j] = ri * (g - mean_g - x_hat[i, j] * mean_gx)
    for j in range(d):
        dgamma[j] = dgamma_acc[j]
        dbeta[j] = dbeta_acc[j]
    return None
