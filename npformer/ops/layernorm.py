r"""Layer normalisation over the last axis (Ba et al., 2016), PyTorch's eps = 1e-5.

Forward, per row $x \in \mathbb{R}^D$:
    $\mu = \frac1D \sum_j x_j$
    $c = x - \mu$ (centred), $\sigma^2 = \frac1D \sum_j c_j^2$   (biased variance)
    $r = (\sigma^2 + \epsilon)^{-1/2}$
    $\hat x = c\, r$
    $y = \gamma \odot \hat x + \beta$

Backward (the classic three-term form; derivation in docs/derivations.md):
    $\bar\gamma = \sum_{rows} \bar y \odot \hat x$,   $\bar\beta = \sum_{rows} \bar y$
    $g = \bar y \odot \gamma$                       (gradient w.r.t. $\hat x$)
    $\bar x = r \,\big(g - \text{mean}_j(g) - \hat x\, \text{mean}_j(g \odot \hat x)\big)$
The mean of g removes the component along the all-ones direction (mu depends on
every x_j); the last term removes the component along x-hat (r depends on every x_j).
"""
from __future__ import annotations

from .. import backend
from ._checks import check_array, check_cache, check_same_dtype, check_float, check_last_dim, check_rank, check_upstream

EPS = 1e-5


def layernorm_forward(x, gamma, beta, eps: float = EPS):
    """x (..., D), gamma (D,), beta (D,) -> y (..., D), cache (x_hat, r, gamma)."""
    check_array(x, "layer norm input")
    for name, parameter in (("layer norm weight", gamma), ("layer norm bias", beta)):
        check_float(parameter, name)
        check_rank(parameter, 1, name)
    if gamma.shape[0] == 0 or tuple(beta.shape) != tuple(gamma.shape):
        raise ValueError(f"layer norm weight and bias must both have shape (D,) with D >= 1, "
                         f"got {tuple(gamma.shape)} and {tuple(beta.shape)}")
    check_float(x, "layer norm input")
    check_last_dim(x, gamma.shape[0], "layer norm input")
    check_same_dtype("layer norm", input=x, weight=gamma, bias=beta)  # and one library
    xp = backend.namespace_of(x, gamma, beta)
    mu = xp.mean(x, axis=-1, keepdims=True)  # (..., 1)
    centred = x - mu  # (..., D)
    var = xp.mean(centred * centred, axis=-1, keepdims=True)  # (..., 1)
    r = 1.0 / xp.sqrt(var + eps)  # (..., 1)
    x_hat = centred * r  # (..., D)
    y = x_hat * gamma + beta  # (..., D)
    return y, (x_hat, r, gamma)


def layernorm_backward(dy, cache):
    """dy (..., D) -> dx (..., D), dgamma (D,), dbeta (D,)."""
    check_cache(cache, 3, "layernorm_forward", "layernorm_backward")
    check_upstream(dy, tuple(cache[0].shape), "layernorm_backward", cache[0].dtype)  # x_hat's
    x_hat, r, gamma = cache
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
