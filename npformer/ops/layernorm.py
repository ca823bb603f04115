r"""Layer normalisation over the last axis (Ba et al., 2016), PyTorch's eps = 1e-5.  The
derivation: docs/derivations.md §6.

Forward, per row $x \in \mathbb{R}^D$:
    $\mu = \frac1D \sum_j x_j$
    $c = x - \mu$ (centred), $\sigma^2 = \frac1D \sum_j c_j^2$   (biased variance)
    $r = (\sigma^2 + \epsilon)^{-1/2}$
    $\hat x = c\, r$
    $y = \gamma \odot \hat x + \beta$

Backward:
    $\bar\gamma = \sum_{rows} \bar y \odot \hat x$,   $\bar\beta = \sum_{rows} \bar y$
    $g = \bar y \odot \gamma$                       (gradient w.r.t. $\hat x$)
    $\bar x = r \,\big(g - \text{mean}_j(g) - \hat x\, \text{mean}_j(g \odot \hat x)\big)$
"""
from __future__ import annotations

from typing import Any

from .. import backend
from ..backend import Array
from .contracts import backward_op, door, forward_op, layernorm_inputs, opened, state, with_saved

EPS = 1e-5


@forward_op(layernorm_inputs)
def layernorm_forward(x: Array, gamma: Array, beta: Array, eps: float = EPS) -> tuple[Array, Any]:
    """x (..., D), gamma (D,), beta (D,) -> y (..., D), saved (x_hat, r, gamma)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(layernorm_forward, x, gamma, beta, eps)
    xp = backend.namespace_of(x, gamma, beta)
    mu = xp.mean(x, axis=-1, keepdims=True)  # (..., 1)
    centred = x - mu  # (..., D)
    var = xp.mean(centred * centred, axis=-1, keepdims=True)  # (..., 1)
    r = 1.0 / xp.sqrt(var + eps)  # (..., 1)
    x_hat = centred * r  # (..., D)
    y = x_hat * gamma + beta  # (..., D)
    return with_saved(layernorm_forward, y, (x_hat, r, gamma))


@backward_op(layernorm_forward)
def layernorm_backward(dy: Array, saved: Any) -> tuple[Array, Array, Array]:
    """dy (..., D) -> dx (..., D), dgamma (D,), dbeta (D,)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(layernorm_backward, dy, saved)
    values = opened(layernorm_forward, saved)
    x_hat, r, gamma = values
    xp = backend.namespace_of(dy, x_hat)
    d = x_hat.shape[-1]
    dy_rows = xp.reshape(dy, (-1, d))  # (N, D)
    dgamma = xp.sum(dy_rows * xp.reshape(x_hat, (-1, d)), axis=0)  # (D,)
    dbeta = xp.sum(dy_rows, axis=0)  # (D,)
    g = dy * gamma  # (..., D) gradient w.r.t. x_hat
    mean_g = xp.mean(g, axis=-1, keepdims=True)  # (..., 1)
    mean_g_xhat = xp.mean(g * x_hat, axis=-1, keepdims=True)  # (..., 1)
    dx = r * (g - mean_g - x_hat * mean_g_xhat)  # (..., D)
    return dx, dgamma, dbeta
