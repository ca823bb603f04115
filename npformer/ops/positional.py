r"""Position information added to token embeddings.  The derivation:
docs/derivations.md §12.

Sinusoidal (Vaswani et al., 2017, section 3.5), fixed:
    $PE_{t, 2i} = \sin(t / 10000^{2i/D})$,   $PE_{t, 2i+1} = \cos(t / 10000^{2i/D})$

Learned (BERT, GPT-2): a trainable table P of shape (L, D).

Either way the forward adds the first T rows to x of shape (B, T, D):
    $y_{b,t} = x_{b,t} + P_t$
and the backward passes the gradient through and, for a learned table, sums it
over the batch:  $\bar x = \bar y$,  $\bar P_t = \sum_b \bar y_{b,t}$ for t < T, 0 beyond.
"""
from __future__ import annotations

from typing import Any

from .. import backend
from ..backend import Array
from .contracts import (
    backward_op,
    checked_op,
    door,
    forward_op,
    opened,
    positions_inputs,
    sinusoidal_inputs,
    state,
    with_saved,
)


@checked_op(sinusoidal_inputs)
def sinusoidal_table(block_size: int, d_model: int, dtype: Any = None,
                     like: Array | None = None) -> Array:
    """(block_size, d_model) table of sines (even columns) and cosines (odd columns)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(sinusoidal_table, block_size, d_model, dtype, like)
    xp = backend.xp() if like is None else backend.namespace_of(like)
    dev = backend.device() if like is None else backend.device_of(like)
    dtype = dtype or backend.default_float()
    position = xp.astype(xp.arange(block_size, device=dev), xp.float64)[:, None]  # (L, 1)
    column = xp.arange(d_model, device=dev)  # (D,)
    pair_index = xp.astype(column - column % 2, xp.float64)  # 2i for columns 2i and 2i+1
    angle = position / (10000.0 ** (pair_index / d_model))[None, :]  # (L, D)
    table = xp.where(column % 2 == 0, xp.sin(angle), xp.cos(angle))
    return xp.astype(table, dtype)


@forward_op(positions_inputs)
def add_positions_forward(x: Array, table: Array) -> tuple[Array, Any]:
    """x (B, T, D), table (L, D) with T <= L -> y (B, T, D), saved."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(add_positions_forward, x, table)
    seq_len, block_size = x.shape[1], table.shape[0]
    y = x + table[:seq_len, :][None, :, :]  # (B, T, D) + (1, T, D)
    return with_saved(add_positions_forward, y, (seq_len, block_size))


@backward_op(add_positions_forward)
def add_positions_backward(dy: Array, saved: Any) -> tuple[Array, Array]:
    """dy (B, T, D) -> dx (B, T, D), dtable (L, D) (used only when the table is learned)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(add_positions_backward, dy, saved)
    values = opened(add_positions_forward, saved)
    seq_len, block_size = values
    xp = backend.namespace_of(dy)
    dtable_used = xp.sum(dy, axis=0)  # (T, D)
    unused = xp.zeros((block_size - seq_len, dy.shape[-1]), dtype=dy.dtype,
                      device=backend.device_of(dy))  # (L - T, D)
    dtable = xp.concat([dtable_used, unused], axis=0)  # (L, D)
    return dy, dtable
