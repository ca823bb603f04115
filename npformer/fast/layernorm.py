r"""Layer normalisation, fast: the textbook op (:mod:`npformer.ops.layernorm`) as one
compiled kernel each way (:mod:`.kernels`) on NumPy arrays.

Forward: per row, one pass for the mean and one for the variance, x-hat and y
(the textbook makes five passes over (N, D) and three temporaries).  Backward: per
row, one pass for the two means of g = dy gamma and g x-hat, with dgamma and dbeta
accumulated on the way, and one pass for dx (the textbook: eight passes and five
temporaries).  The same cache (x_hat, r, gamma) and the same formulas in the same
order; the row sums are accumulated in float64.  Without numba, or on other arrays
(CuPy, the strict namespace), it is the textbook op.

The derivation is the textbook one.
"""
from __future__ import annotations

from ..ops import layernorm as _textbook
from ..ops._checks import check_cache, check_upstream
from . import kernels

EPS = _textbook.EPS


def layernorm_forward(x, gamma, beta, eps: float = EPS):
    """x (..., D), gamma (D,), beta (D,) -> y (..., D), cache (x_hat, r, gamma)."""
    if not kernels.usable(x, gamma, beta) or x.ndim == 0 or x.shape[-1] != gamma.shape[0] \
            or gamma.ndim != 1 or beta.shape != gamma.shape or gamma.shape[0] == 0:
        return _textbook.layernorm_forward(x, gamma, beta, eps)  # it checks and refuses
    y, x_hat, r = kernels.layernorm_forward(x, gamma, beta, eps)
    return y, (x_hat, r, gamma)


def layernorm_backward(dy, cache):
    """dy (..., D) -> dx (..., D), dgamma (D,), dbeta (D,)."""
    check_cache(cache, 3, "layernorm_forward", "layernorm_backward")
    check_upstream(dy, tuple(cache[0].shape), "layernorm_backward", cache[0].dtype)  # x_hat's
    x_hat, r, gamma = cache
    if not kernels.usable(dy, x_hat, r, gamma):
        return _textbook.layernorm_backward(dy, cache)
    return kernels.layernorm_backward(dy, x_hat, r, gamma)
