r"""The gated SiLU of Llama's feed-forward network (Shazeer, 2020, "GLU variants improve
Transformer"): ``down_proj(silu(gate_proj(x)) * up_proj(x))``.

This op is the product in the middle; the three projections are :mod:`.linear`.  With
the gate $a$ = gate_proj(x) and $b$ = up_proj(x), element-wise:

Forward
    $s = \sigma(a) = 1 / (1 + e^{-a})$           (the logistic sigmoid)
    $\mathrm{silu}(a) = a\, s$                    (SiLU, or swish)
    $h = \mathrm{silu}(a) \odot b$

Backward, by the product rule:
    $\bar b = \bar h \odot \mathrm{silu}(a)$
    $\bar a = \bar h \odot b \odot \mathrm{silu}'(a)$, where
    $\mathrm{silu}'(a) = s + a\, s'$ and $s' = s (1 - s)$ (since
    $\frac{d}{da} (1 + e^{-a})^{-1} = e^{-a} / (1 + e^{-a})^2 = s \cdot (1 - s)$), so
    $\mathrm{silu}'(a) = s\,\big(1 + a (1 - s)\big)$.

The sigmoid, computed stably: $e^{-a}$ overflows for $a < -709$ in float64 ($-88$ in
float32).  With $e = e^{-|a|} \in (0, 1]$, never overflowing,
    $\sigma(a) = 1 / (1 + e)$ for $a \ge 0$,   $\sigma(a) = e / (1 + e)$ for $a < 0$
(the second is $e^{a} / (1 + e^{a})$, the same number).  Far out $s$ is exactly 0 or 1,
and $\mathrm{silu}'$ exactly 0 or 1: no inf, no NaN.
"""
from __future__ import annotations

from typing import Any

from .. import backend
from ..backend import Array
from .contracts import backward_op, forward_op, swiglu_inputs


def sigmoid(a: Array) -> Array:
    """sigma(a) = 1 / (1 + exp(-a)) element-wise, from exp(-|a|) (no overflow)."""
    xp = backend.namespace_of(a)
    e = xp.exp(-xp.abs(a))  # in (0, 1]
    return xp.where(a >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@forward_op(swiglu_inputs)
def swiglu_forward(a: Array, b: Array) -> tuple[Array, Any]:
    """a (...) the gate, b (...) the up projection -> h = silu(a) b (...), cache (a, b, s)."""
    s = sigmoid(a)  # (...)
    h = a * s * b  # (...)
    return h, (a, b, s)


@backward_op(swiglu_forward)
def swiglu_backward(dh: Array, saved: Any) -> tuple[Array, Array]:
    """dh (...) -> da (...), db (...)."""
    a, b, s = saved
    dsilu = s * (1.0 + a * (1.0 - s))  # silu'(a)
    da = dh * b * dsilu  # (...)
    db = dh * (a * s)  # (...) dh silu(a)
    return da, db
