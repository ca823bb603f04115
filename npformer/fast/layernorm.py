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

from typing import Any

from ..backend import Array
from ..ops import layernorm as _textbook
from ..ops.contracts import backward_op, forward_op, layernorm_inputs
from . import kernels

EPS = _textbook.EPS


@forward_op(layernorm_inputs)
def layernorm_forward(x: Array, gamma: Array, beta: Array, eps: float = EPS) -> tuple[Array, Any]:
    """x (..., D), gamma (D,), beta (D,) -> y (..., D), cache (x_hat, r, gamma)."""
    if not kernels.usable(x, gamma, beta):
        return _textbook.layernorm_forward.unchecked(x, gamma, beta, eps)
    y, x_hat, r = kernels.layernorm_forward(x, gamma, beta, eps)  # (..., D), (..., D), (..., 1)
    return y, (x_hat, r, gamma)


@backward_op(layernorm_forward)
def layernorm_backward(dy: Array, saved: Any) -> tuple[Array, Array, Array]:
    """dy (..., D) -> dx (..., D), dgamma (D,), dbeta (D,)."""
    x_hat, r, gamma = saved
    if not kernels.usable(dy, x_hat, r, gamma):
        return _textbook.layernorm_backward.unchecked(dy, saved)
    return kernels.layernorm_backward(dy, x_hat, r, gamma)
