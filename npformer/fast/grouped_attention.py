r"""Grouped-query attention, fast: the textbook op (:mod:`npformer.ops.grouped_attention`),
its three statements, with the fast tier's blocked attention (:mod:`.attention`) in the
middle.
"""
from __future__ import annotations

from typing import Any

from ..backend import Array
from ..ops.contracts import (
    backward_op,
    door,
    forward_op,
    grouped_attention_inputs,
    opened,
    state,
    with_saved,
)
from ..ops.grouped_attention import grouped_backward, grouped_forward
from .attention import attention_backward, attention_forward


@forward_op(grouped_attention_inputs)
def grouped_attention_forward(q: Array, k: Array, v: Array,
                              mask: Array | None = None) -> tuple[Array, Any]:
    """q (..., H, T, E), k (..., Hkv, S, E), v (..., Hkv, S, F), H a multiple of Hkv; mask
    (bool, broadcasts to (..., H, T, S)) -> out (..., H, T, F), saved."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(grouped_attention_forward, q, k, v, mask)
    return with_saved(grouped_attention_forward,
                      *grouped_forward(q, k, v, mask, attention_forward))  # the blocked attention


@backward_op(grouped_attention_forward)
def grouped_attention_backward(dout: Array, saved: Any) -> tuple[Array, Array, Array]:
    """dout (..., H, T, F) -> dq (..., H, T, E), dk (..., Hkv, S, E), dv (..., Hkv, S, F)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(grouped_attention_backward, dout, saved)
    values = opened(grouped_attention_forward, saved)
    return grouped_backward(dout, values, attention_backward)
