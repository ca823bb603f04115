r"""The gated SiLU of Llama's feed-forward network (Shazeer, 2020, "GLU variants improve
Transformer"): ``down_proj(silu(gate_proj(x)) * up_proj(x))``.  The derivation: SwiGLU
(§4) of docs/derivations.md.

This op is the product in the middle; the three projections are :mod:`.linear`.  With
the gate $x_{\text{gate}}$ = gate_proj(x) (``a``) and $x_{\text{up}}$ = up_proj(x) (``b``),
of one shape, element-wise:

Forward
    $e = e^{-|x_{\text{gate}}|}$                                          ``e``
    $\text{sig} = 1/(1 + e)$ where $x_{\text{gate}} \ge 0$, else $e/(1 + e)$   ``s``
    $y = x_{\text{gate}}\, \text{sig} \odot x_{\text{up}}$                ``h``

Backward
    $\bar x_{\text{up}} = \bar y \odot x_{\text{gate}}\, \text{sig}$                     ``db``
    $\mathrm{silu}' = \text{sig}\,\big(1 + x_{\text{gate}} (1 - \text{sig})\big)$      ``dsilu``
    $\bar x_{\text{gate}} = \bar y \odot x_{\text{up}} \odot \mathrm{silu}'$           ``da``
"""
from __future__ import annotations

from typing import Any

from .. import backend
from ..backend import Array
from .contracts import backward_op, door, forward_op, opened, state, swiglu_inputs, with_saved


def sigmoid(a: Array) -> Array:
    """sigma(a) = 1 / (1 + exp(-a)) element-wise, from exp(-|a|) (no overflow)."""
    xp = backend.namespace_of(a)
    e = xp.exp(-xp.abs(a))  # in (0, 1]
    return xp.where(a >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@forward_op(swiglu_inputs)
def swiglu_forward(a: Array, b: Array) -> tuple[Array, Any]:
    """a (...) the gate, b (...) the up projection -> h = silu(a) b (...), saved (a, b, s)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(swiglu_forward, a, b)
    s = sigmoid(a)  # (...)
    h = a * s * b  # (...)
    return with_saved(swiglu_forward, h, (a, b, s))


@backward_op(swiglu_forward)
def swiglu_backward(dh: Array, saved: Any) -> tuple[Array, Array]:
    """dh (...) -> da (...), db (...)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(swiglu_backward, dh, saved)
    values = opened(swiglu_forward, saved)
    a, b, s = values
    dsilu = s * (1.0 + a * (1.0 - s))  # silu'(a)
    da = dh * b * dsilu  # (...)
    db = dh * (a * s)  # (...) dh silu(a)
    return da, db
