r"""Softmax over one axis, fast: the textbook op (:mod:`npformer.ops.softmax`), its values
(docs/derivations.md §19), with ``overwrite_input=True`` writing the result over the
input, for a caller that owns it (the blocked attention's backward, in
``softmax_backward``): no allocation, no page faults on (B, H, T, S) arrays.
"""
from __future__ import annotations

from typing import Any

from .. import backend
from ..backend import Array
from ..ops.contracts import backward_op, door, forward_op, opened, softmax_inputs, state, with_saved
from ..ops.softmax import empty_like_input, mask_bias
from .inplace import exp_into


@forward_op(softmax_inputs)
def softmax_forward(x: Array, axis: int = -1, mask: Array | None = None,
                    overwrite_input: bool = False) -> tuple[Array, Any]:
    """x (...) -> p (...), saved (p, axis).  mask: boolean, broadcasts to x, True = keep.

    ``overwrite_input=True`` lets the op reuse x's buffer for p (for a caller that owns
    x and no longer needs it); the result is identical.
    """
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(softmax_forward, x, axis, mask, overwrite_input)
    xp = backend.namespace_of(x)
    if x.shape[axis] == 0:  # nothing to normalise over: p is as empty as x
        return with_saved(softmax_forward, *empty_like_input(x))
    if mask is not None:
        x = x + mask_bias(mask, x.dtype)  # masked entries become -inf (a new array)
        overwrite_input = True
    m = xp.max(x, axis=axis, keepdims=True)
    if mask is not None:
        m = xp.where(xp.isfinite(m), m, xp.zeros_like(m))  # a fully masked row has max -inf
    if overwrite_input:
        x -= m  # in place
        e = exp_into(x)  # exp(-inf) = 0 at masked entries
    else:
        e = xp.exp(x - m)
    total = xp.sum(e, axis=axis, keepdims=True)
    if mask is not None:
        total = xp.where(total > 0, total, xp.ones_like(total))  # 0 / 1 on fully masked rows
    e /= total  # e is ours: normalise in place
    return with_saved(softmax_forward, e, (e, axis))


@backward_op(softmax_forward)
def softmax_backward(dp: Array, saved: Any, overwrite_input: bool = False) -> Array:
    """dp (...) -> dx (...) = p * (dp - sum(dp * p)).  ``overwrite_input``: reuse dp's buffer."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(softmax_backward, dp, saved, overwrite_input)
    values = opened(softmax_forward, saved)
    p, axis = values
    xp = backend.namespace_of(dp, p)
    inner = xp.sum(dp * p, axis=axis, keepdims=True)  # <dp, p> per row
    if overwrite_input:
        dp -= inner
        dp *= p
        return dp
    return p * (dp - inner)
