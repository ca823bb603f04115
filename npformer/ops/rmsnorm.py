r"""Root-mean-square normalisation over the last axis (Zhang and Sennrich, 2019), as Hugging
Face's ``LlamaRMSNorm`` computes it (Llama, Qwen2, Qwen3, SmolLM2), eps = 1e-6.

Layer norm without the centring and the bias: each row is divided by its root mean
square and scaled by a weight.

Forward, per row $x \in \mathbb{R}^D$:
    $\text{ms} = \frac1D \sum_j x_j^2$              (the mean of squares, ``mean_square``)
    $r = (\text{ms} + \epsilon)^{-1/2}$             (one over the row's rms)
    $\hat x = x\, r$
    $y = w \odot \hat x$

The mean of squares in float32 or wider: ``LlamaRMSNorm`` casts its input to float32
before squaring (a bfloat16 or float16 square would lose the row's scale), normalises,
then casts back.  npformer computes in float32 or float64 only, each in its own dtype:
a float32 input is computed in float32, as Hugging Face does; a float64 input stays
float64 (Hugging Face would round it to float32 there, and be only float32-accurate).

Backward.  Write $g = \bar y \odot w$, the gradient with respect to $\hat x$, and
differentiate $\hat x_i = x_i\, r$ with $r$ depending on every $x_j$:
    $\frac{\partial r}{\partial x_j} = -\tfrac12 (\text{ms} + \epsilon)^{-3/2} \cdot \frac{2 x_j}{D}
     = -\frac{r^3 x_j}{D}$
    $\frac{\partial \hat x_i}{\partial x_j} = r\,\delta_{ij} + x_i \frac{\partial r}{\partial x_j}
     = r\,\delta_{ij} - \frac{r\, \hat x_i \hat x_j}{D}$
so
    $\bar x_j = \sum_i g_i \frac{\partial \hat x_i}{\partial x_j}
     = r \,\big(g_j - \hat x_j\, \text{mean}_i(g \odot \hat x)\big)$
(layer norm's form without its $\text{mean}(g)$ term: no mean was subtracted), and
    $\bar w = \sum_{rows} \bar y \odot \hat x$.
The subtracted term removes the component of $g$ along $\hat x$: scaling a row does not
change $\hat x$ (when $\epsilon$ is small), so no gradient flows along the row itself.
"""
from __future__ import annotations

from typing import Any

from .. import backend
from ..backend import Array
from .contracts import backward_op, door, forward_op, opened, rmsnorm_inputs, state, with_cache

EPS = 1e-6  # LlamaConfig's rms_norm_eps default


@forward_op(rmsnorm_inputs)
def rmsnorm_forward(x: Array, weight: Array, eps: float = EPS) -> tuple[Array, Any]:
    """x (..., D), weight (D,) -> y (..., D), cache (x_hat, r, weight)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(rmsnorm_forward, x, weight, eps)
    xp = backend.namespace_of(x, weight)
    mean_square = xp.mean(x * x, axis=-1, keepdims=True)  # (..., 1) in x's dtype
    r = 1.0 / xp.sqrt(mean_square + eps)  # (..., 1)
    x_hat = x * r  # (..., D)
    y = weight * x_hat  # (..., D)
    return with_cache(rmsnorm_forward, y, (x_hat, r, weight))


@backward_op(rmsnorm_forward)
def rmsnorm_backward(dy: Array, cache: Any) -> tuple[Array, Array]:
    """dy (..., D) -> dx (..., D), dweight (D,)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(rmsnorm_backward, dy, cache)
    saved = opened(rmsnorm_forward, cache)
    x_hat, r, weight = saved
    xp = backend.namespace_of(dy, x_hat)
    d = x_hat.shape[-1]
    dweight = xp.sum(xp.reshape(dy, (-1, d)) * xp.reshape(x_hat, (-1, d)), axis=0)  # (D,)
    g = dy * weight  # (..., D) gradient w.r.t. x_hat
    mean_g_xhat = xp.mean(g * x_hat, axis=-1, keepdims=True)  # (..., 1)
    dx = r * (g - x_hat * mean_g_xhat)  # (..., D)
    return dx, dweight
