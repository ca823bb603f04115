r"""The gated SiLU, fast: the textbook op (:mod:`npformer.ops.swiglu`) as one compiled
pass each way on NumPy arrays, the kernels below.

The textbook's forward makes six passes over the hidden width (|a|, the exp, the two
branches of the sigmoid, the where, the two products) and keeps (a, b, s); this one
makes one, reading a and b and writing h and s, with the same stable sigmoid
(docs/derivations.md §4 and §19: a, b, s and h are $x_{\text{gate}}$, $x_{\text{up}}$,
$\text{sig}$ and $y$): $e^{-|x_{\text{gate}}|}$ (the exp of :mod:`.numerics`),
$\text{sig} = 1 / (1 + e^{-|x_{\text{gate}}|})$ for $x_{\text{gate}} \ge 0$ and
$e^{-|x_{\text{gate}}|} / (1 + e^{-|x_{\text{gate}}|})$ for $x_{\text{gate}} < 0$.  Its backward
reads (dh, a, b, s) once and writes da and db:
$\bar x_{\text{gate}} = \bar y\, x_{\text{up}}\, \text{sig} (1 + x_{\text{gate}} (1 - \text{sig}))$,
$\bar x_{\text{up}} = \bar y\, x_{\text{gate}}\, \text{sig}$, in the textbook's order.  Without
numba, or on other arrays (CuPy, the strict namespace), the textbook op.

The derivation is the textbook one.
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
