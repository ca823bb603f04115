r"""Pooling a sequence of vectors into one, over the valid (non-padding) positions only.
The derivation: docs/derivations.md §14.

h (B, T, D); valid lengths n_b >= 1; m_{b,t} = 1 if t < n_b else 0.

Empty axes: a batch of no sequences (B = 0) pools to the empty (0, D); sequences of
length 0 (T = 0, B > 0) are refused: no pooling is defined over no positions.

Mean
    forward  $y_b = \frac{1}{n_b} \sum_t m_{b,t}\, h_{b,t}$
    backward $\bar h_{b,t} = m_{b,t}\, \bar y_b / n_b$
Max (per feature, over valid positions)
    forward  $y_{b,d} = \max_{t < n_b} h_{b,t,d}$, attained at $t^*_{b,d}$ (the first, on ties)
    backward $\bar h_{b,t,d} = \bar y_{b,d}\,[t = t^*_{b,d}]$
First token
    forward  $y_b = h_{b,0}$;  backward $\bar h_{b,0} = \bar y_b$, 0 elsewhere

Valid rows (every valid position kept, as rows: what a loss over real tokens reads)
    forward  $R = (h_{b,t})_{t < n_b}$, the $N = \sum_b n_b$ valid positions in order
             (b, then t), an (N, D) array
    backward $\bar h_{b,t} = \bar R_{\text{row of } (b, t)}$ at valid positions, 0 at padding
"""
from __future__ import annotations

import math
from typing import Any

from .. import backend
from ..backend import Array
from .contracts import (
    POOLINGS,  # noqa: F401  (ops.POOLINGS: the poolings there are)
    backward_op,
    door,
    forward_op,
    opened,
    pool_inputs,
    state,
    valid_rows_inputs,
    with_saved,
)
from .masks import real_positions


def _valid_positions(valid_lens, length: int, dtype):
    """(B, T, 1) float: 1 at valid positions, 0 at padding."""
    xp = backend.namespace_of(valid_lens)
    return xp.astype(real_positions(valid_lens, length), dtype)[:, :, None]


@forward_op(pool_inputs)
def pool_forward(h: Array, valid_lens: Array, how: str = "mean") -> tuple[Array, Any]:
    """h (B, T, D), valid_lens (B,) integers in [1, T] -> y (B, D), saved."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(pool_forward, h, valid_lens, how)
    xp = backend.namespace_of(h, valid_lens)
    batch, length, width = h.shape
    if batch == 0:  # no sequences: nothing to pool
        empty = xp.zeros((0, width), dtype=h.dtype, device=backend.device_of(h))
        return with_saved(pool_forward, empty, (how, tuple(h.shape), None))
    if how == "first":
        return with_saved(pool_forward, h[:, 0, :], ("first", tuple(h.shape), None))
    valid = _valid_positions(valid_lens, length, h.dtype)  # (B, T, 1)
    if how == "mean":
        counts = xp.astype(valid_lens, h.dtype)[:, None]  # (B, 1)
        y = xp.sum(h * valid, axis=1) / counts  # (B, D)
        return with_saved(pool_forward, y, ("mean", tuple(h.shape), valid / counts[:, :, None]))
    masked = xp.where(valid > 0, h, xp.full_like(h, -float("inf")))  # (B, T, D)
    winner = xp.argmax(masked, axis=1)  # (B, D): first maximal position
    y = xp.max(masked, axis=1)  # (B, D)
    return with_saved(pool_forward, y, ("max", tuple(h.shape), winner))


@backward_op(pool_forward)
def pool_backward(dy: Array, saved: Any) -> Array:
    """dy (B, D) -> dh (B, T, D)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(pool_backward, dy, saved)
    values = opened(pool_forward, saved)
    how, shape, kept = values
    xp = backend.namespace_of(dy)
    batch, length, width = shape
    if batch == 0:  # no sequences: the (empty) gradient of h
        return xp.zeros(shape, dtype=dy.dtype, device=backend.device_of(dy))
    if how == "first":
        rest = xp.zeros((batch, length - 1, width), dtype=dy.dtype, device=backend.device_of(dy))
        return xp.concat([dy[:, None, :], rest], axis=1)
    if how == "mean":
        weights = kept  # (B, T, 1) = valid / n_b
        return dy[:, None, :] * weights  # (B, T, D)
    winner = kept  # (B, D)
    positions = xp.arange(length, dtype=winner.dtype, device=backend.device_of(dy))
    chosen = xp.astype(positions[None, :, None] == winner[:, None, :], dy.dtype)  # (B, T, D)
    return chosen * dy[:, None, :]


def _valid_index(valid_lens: Array, length: int) -> Array:
    """(N,) the flat positions b * T + t of the valid positions, in order."""
    xp = backend.namespace_of(valid_lens)
    valid = real_positions(valid_lens, length)  # (B, T)
    return xp.nonzero(xp.reshape(valid, (-1,)))[0]  # (N,)


@forward_op(valid_rows_inputs)
def valid_rows_forward(h: Array, valid_lens: Array) -> tuple[Array, Any]:
    """h (B, T, ...), valid_lens (B,) integers in [0, T] -> rows (N, ...), saved."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(valid_rows_forward, h, valid_lens)
    xp = backend.namespace_of(h, valid_lens)
    batch, length = h.shape[0], h.shape[1]
    index = _valid_index(valid_lens, length)  # (N,)
    flat = xp.reshape(h, (batch * length,) + tuple(h.shape[2:]))  # (B*T, ...)
    return with_saved(valid_rows_forward, xp.take(flat, index, axis=0), (index, tuple(h.shape)))


@backward_op(valid_rows_forward)
def valid_rows_backward(drows: Array, saved: Any) -> Array:
    """drows (N, ...) -> dh (B, T, ...), zeros at padding."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(valid_rows_backward, drows, saved)
    values = opened(valid_rows_forward, saved)
    index, shape = values
    xp = backend.namespace_of(drows)
    width = math.prod(shape[2:])
    flat = backend.scatter_add_rows(index, xp.reshape(drows, (-1, width)), shape[0] * shape[1])
    return xp.reshape(flat, shape)  # (B*T, ...) -> (B, T, ...)
