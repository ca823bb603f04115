r"""Grouped-query attention (Ainslie et al., 2023, GQA): H query heads share $H_{kv}$
key/value heads, each in a group of $G = H / H_{kv}$ consecutive query heads, as Hugging
Face's Llama, Qwen2 and Qwen3 have it (``repeat_kv``).  The derivation: Grouped-query
attention (§10) of docs/derivations.md.

Shapes: B batch, H query heads, $H_{kv}$ key/value heads, T queries, S keys, E query/key
width, F value width.  Any leading shape works in place of B.

Forward, with $g(h) = \lfloor h / G \rfloor$:
    $\tilde K_h = K_{g(h)}$,  $\tilde V_h = V_{g(h)}$       (..., H, S, E) and (..., H, S, F)
    $O = \text{attention}(Q, \tilde K, \tilde V, M)$    (:mod:`.attention`), (..., H, T, F)

Backward, with $\bar Q$, $\bar{\tilde K}$, $\bar{\tilde V}$ attention's backward:
    $\bar K_j = \sum_{h:\, g(h) = j} \bar{\tilde K}_h$         (..., $H_{kv}$, S, E)
    $\bar V_j = \sum_{h:\, g(h) = j} \bar{\tilde V}_h$         (..., $H_{kv}$, S, F)
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .. import backend
from ..backend import Array
from .attention import attention_backward, attention_forward
from .contracts import (
    backward_op,
    door,
    forward_op,
    grouped_attention_inputs,
    opened,
    state,
    with_saved,
)


def repeat_heads(x: Array, groups: int) -> Array:
    """(..., Hkv, S, E) -> (..., Hkv*G, S, E): head j copied to heads j*G .. j*G + G - 1."""
    xp = backend.namespace_of(x)
    *lead, kv_heads, length, width = x.shape
    x = xp.expand_dims(x, axis=-3)  # (..., Hkv, 1, S, E)
    x = xp.broadcast_to(x, (*lead, kv_heads, groups, length, width))  # (..., Hkv, G, S, E)
    return xp.reshape(x, (*lead, kv_heads * groups, length, width))  # (..., H, S, E)


def sum_groups(dx: Array, groups: int) -> Array:
    """(..., Hkv*G, S, E) -> (..., Hkv, S, E): each group's gradients summed onto its head,
    the transpose of :func:`repeat_heads`."""
    xp = backend.namespace_of(dx)
    *lead, heads, length, width = dx.shape
    dx = xp.reshape(dx, (*lead, heads // groups, groups, length, width))  # (..., Hkv, G, S, E)
    return xp.sum(dx, axis=-3)  # (..., Hkv, S, E)


@forward_op(grouped_attention_inputs)
def grouped_attention_forward(q: Array, k: Array, v: Array,
                              mask: Array | None = None) -> tuple[Array, Any]:
    """q (..., H, T, E), k (..., Hkv, S, E), v (..., Hkv, S, F), H a multiple of Hkv; mask
    (bool, broadcasts to (..., H, T, S)) -> out (..., H, T, F), saved."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(grouped_attention_forward, q, k, v, mask)
    return with_saved(grouped_attention_forward, *grouped_forward(q, k, v, mask, attention_forward))


@backward_op(grouped_attention_forward)
def grouped_attention_backward(dout: Array, saved: Any) -> tuple[Array, Array, Array]:
    """dout (..., H, T, F) -> dq (..., H, T, E), dk (..., Hkv, S, E), dv (..., Hkv, S, F)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(grouped_attention_backward, dout, saved)
    values = opened(grouped_attention_forward, saved)
    return grouped_backward(dout, values, attention_backward)


# The statements, with the attention they wrap as an argument: the fast tier's op
# (npformer.fast.grouped_attention) runs the same ones around its blocked attention.
def grouped_forward(q: Array, k: Array, v: Array, mask: Array | None,
                    attention: Callable) -> tuple[Array, Any]:
    """:func:`grouped_attention_forward` with ``attention`` (an attention_forward) in the
    middle: the key/value heads repeated over their groups, then attention over H heads."""
    groups = q.shape[-3] // k.shape[-3]  # G query heads per key/value head
    k_repeated, v_repeated = repeat_heads(k, groups), repeat_heads(v, groups)  # H heads each
    out, attention_saved = attention(q, k_repeated, v_repeated, mask)  # (..., H, T, F)
    return out, (attention_saved, groups)


def grouped_backward(dout: Array, values: Any,
                     attention_backward: Callable) -> tuple[Array, Array, Array]:
    """:func:`grouped_attention_backward` with ``attention_backward`` in the middle: the
    gradients of the H heads, then each group's key and value gradients summed."""
    attention_saved, groups = values
    dq, dk_repeated, dv_repeated = attention_backward(dout, attention_saved)  # H heads each
    return dq, sum_groups(dk_repeated, groups), sum_groups(dv_repeated, groups)
