r"""The gated SiLU, fast: the textbook op (:mod:`npformer.ops.swiglu`) as one compiled
pass each way on NumPy arrays (docs/derivations.md §4; the kernels §19, where a, b, s, h
are $x_{\text{gate}}$, $x_{\text{up}}$, $\text{sig}$, $y$): the forward reads a and b
and writes h and s, $e = e^{-|a|}$, $s = 1 / (1 + e)$ for $a \ge 0$, $e / (1 + e)$ below;
the backward, $\bar a = \bar h\, b\, s (1 + a (1 - s))$, $\bar b = \bar h\, a s$.
Without numba, or on other arrays (CuPy, the strict namespace), the textbook op.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import Array
from ..ops import swiglu as _textbook
from ..ops.contracts import backward_op, door, forward_op, opened, state, swiglu_inputs, with_saved
from .compiler import compilable, jit
from .numerics import exp


@forward_op(swiglu_inputs)
def swiglu_forward(a: Array, b: Array) -> tuple[Array, Any]:
    """a (...) the gate, b (...) the up projection -> h = silu(a) b (...), saved (a, b, s)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(swiglu_forward, a, b)
    if not compilable(a, b):
        return with_saved(swiglu_forward, *_textbook.swiglu_forward.unchecked(a, b))
    h, s = np.empty_like(a), np.empty_like(a)
    _swiglu_forward(a.reshape(-1), b.reshape(-1), h.reshape(-1), s.reshape(-1))
    return with_saved(swiglu_forward, h, (a, b, s))


@backward_op(swiglu_forward)
def swiglu_backward(dh: Array, saved: Any) -> tuple[Array, Array]:
    """dh (...) -> da (...), db (...)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(swiglu_backward, dh, saved)
    values = opened(swiglu_forward, saved)
    a, b, s = values
    if not compilable(dh, a, b, s):
        return _textbook.swiglu_backward.unchecked(dh, values)
    da, db = np.empty_like(a), np.empty_like(b)
    _swiglu_backward(dh.reshape(-1), a.reshape(-1), b.reshape(-1), s.reshape(-1),
                     da.reshape(-1), db.reshape(-1))
    return da, db


# =========================================================================== the kernels
@jit
def _swiglu_forward(a, b, h, s):
    """a, b (N,) -> s = sigmoid(a), h = a s b, written into h and s (N,)."""
    one = a.dtype.type(1.0)
    for i in range(a.size):
        ai = a[i]
        e = exp(-abs(ai))  # in (0, 1]
        si = one / (one + e) if ai >= 0 else e / (one + e)
        s[i] = si
        h[i] = ai * si * b[i]
    return None


@jit
def _swiglu_backward(dh, a, b, s, da, db):
    """dh, a, b, s (N,) -> da = dh b silu'(a), db = dh a s, written into da and db (N,)."""
    one = a.dtype.type(1.0)
    for i in range(a.size):
        ai, si = a[i], s[i]
        dsilu = si * (one + ai * (one - si))  # silu'(a)
        da[i] = dh[i] * b[i] * dsilu
        db[i] = dh[i] * (ai * si)
    return None
