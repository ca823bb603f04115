r"""Inverted dropout, fast: the textbook op (:mod:`npformer.ops.dropout`) with the keep
mask cached as booleans (one byte an element), not the scaled float mask: the same draws
and, $m\,s$ rebuilt in each pass as the textbook builds it (``astype(m) * s``), the same
products bit for bit (docs/derivations.md §19).
"""
from __future__ import annotations

from typing import Any

from .. import backend
from ..backend import Array
from ..ops.contracts import backward_op, door, dropout_inputs, forward_op, opened, state, with_saved


def _scaled(keep: Array, scale: float, dtype) -> Array:
    """m s: the textbook's scaled mask, from the boolean keep mask."""
    xp = backend.namespace_of(keep)
    return xp.astype(keep, dtype) * scale


@forward_op(dropout_inputs)
def dropout_forward(x: Array, p: float, training: bool = True) -> tuple[Array, Any]:
    """x (...) -> y (...), saved = (keep mask (bool), 1 / (1 - p)), or None (identity)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(dropout_forward, x, p, training)
    if not training or p == 0.0:
        return with_saved(dropout_forward, x, None)
    keep = backend.random_uniform(x.shape, dtype=x.dtype) >= p  # P(keep) = 1 - p
    scale = 1.0 / (1.0 - p)
    return with_saved(dropout_forward, x * _scaled(keep, scale, x.dtype), (keep, scale))


@backward_op(dropout_forward)
def dropout_backward(dy: Array, saved: Any) -> Array:
    """dy (...) -> dx = dy m / (1 - p) (...), or dy (the identity: no mask)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(dropout_backward, dy, saved)
    values = opened(dropout_forward, saved)
    if values is None:
        return dy
    keep, scale = values
    return dy * _scaled(keep, scale, dy.dtype)
