r"""Root-mean-square normalisation over the last axis (Zhang and Sennrich, 2019), as Hugging
Face's ``LlamaRMSNorm`` computes it (Llama, Qwen2, Qwen3, SmolLM2), eps = 1e-6.  The
derivation: RMSNorm (§6) of docs/derivations.md.

Shapes: x, y (..., D); w (D,).  Computed in the input's own dtype, float32 or float64.

Forward, per row $x \in \mathbb{R}^D$:
    $\text{ms} = \frac1D \sum_j x_j^2$              ``mean_square``
    $r = (\text{ms} + \epsilon)^{-1/2}$
    $\hat x = x\, r$
    $y = w \odot \hat x$

Backward, with $g = \bar y \odot w$:
    $\bar x = r \,\big(g - \hat x\, \text{mean}(g \odot \hat x)\big)$
    $\bar w = \sum_{rows} \bar y \odot \hat x$
"""
from __future__ import annotations

from typing import Any

from .. import backend
from ..backend import Array
from .contracts import backward_op, door, forward_op, opened, rmsnorm_inputs, state, with_saved

EPS = 1e-6  # LlamaConfig's norm_eps default


@forward_op(rmsnorm_inputs)
def rmsnorm_forward(x: Array, weight: Array, eps: float = EPS) -> tuple[Array, Any]:
    """x (..., D), weight (D,) -> y (..., D), saved (x_hat, r, weight)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(rmsnorm_forward, x, weight, eps)
    xp = backend.namespace_of(x, weight)
    mean_square = xp.mean(x * x, axis=-1, keepdims=True)  # (..., 1) in x's dtype
    r = 1.0 / xp.sqrt(mean_square + eps)  # (..., 1)
    x_hat = x * r  # (..., D)
    y = weight * x_hat  # (..., D)
    return with_saved(rmsnorm_forward, y, (x_hat, r, weight))


@backward_op(rmsnorm_forward)
def rmsnorm_backward(dy: Array, saved: Any) -> tuple[Array, Array]:
    """dy (..., D) -> dx (..., D), dweight (D,)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(rmsnorm_backward, dy, saved)
    values = opened(rmsnorm_forward, saved)
    x_hat, r, weight = values
    xp = backend.namespace_of(dy, x_hat)
    d = x_hat.shape[-1]
    dweight = xp.sum(xp.reshape(dy, (-1, d)) * xp.reshape(x_hat, (-1, d)), axis=0)  # (D,)
    g = dy * weight  # (..., D) gradient w.r.t. x_hat
    mean_g_xhat = xp.mean(g * x_hat, axis=-1, keepdims=True)  # (..., 1)
    dx = r * (g - x_hat * mean_g_xhat)  # (..., D)
    return dx, dweight
