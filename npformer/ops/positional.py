r"""Position information added to token embeddings.

Sinusoidal (Vaswani et al., 2017, section 3.5), fixed:
    $PE_{t, 2i} = \sin(t / 10000^{2i/D})$,   $PE_{t, 2i+1} = \cos(t / 10000^{2i/D})$

Learned (BERT, GPT-2): a trainable table P of shape (L, D).

Either way the forward adds the first T rows to x of shape (B, T, D):
    $y_{b,t} = x_{b,t} + P_t$
and the backward passes the gradient through and, for a learned table, sums it
over the batch:  $\bar x = \bar y$,  $\bar P_t = \sum_b \bar y_{b,t}$ for t < T, 0 beyond.
"""
from __future__ import annotations

from .. import backend
from ._checks import check_cache, check_same_dtype, check_float, check_rank, check_size


def sinusoidal_table(max_len: int, width: int, dtype=None, like=None):
    """(max_len, width) table of sines (even columns) and cosines (odd columns)."""
    check_size(max_len, "max_len")
    check_size(width, "width", 1)
    xp = backend.xp() if like is None else backend.namespace_of(like)
    dev = backend.device() if like is None else backend.device_of(like)
    dtype = dtype or backend.default_float()
    position = xp.astype(xp.arange(max_len, device=dev), xp.float64)[:, None]  # (L, 1)
    column = xp.arange(width, device=dev)  # (D,)
    pair_index = xp.astype(column - column % 2, xp.float64)  # 2i for columns 2i and 2i+1
    angle = position / (10000.0 ** (pair_index / width))[None, :]  # (L, D)
    table = xp.where(column % 2 == 0, xp.sin(angle), xp.cos(angle))
    return xp.astype(table, dtype)


def add_positions_forward(x, table):
    """x (B, T, D), table (L, D) with T <= L -> y (B, T, D), cache."""
    check_float(x, "input to the positional encoding")
    check_rank(x, 3, "input to the positional encoding")
    check_float(table, "positional table")
    check_rank(table, 2, "positional table (max_len, width)")
    check_same_dtype("positional encoding", input=x, table=table)
    _, seq_len, width = x.shape
    max_len = table.shape[0]
    if seq_len > max_len:
        raise ValueError(f"sequence of length {seq_len} is longer than the positional "
                         f"table ({max_len} positions); raise max_len in the config")
    if width != table.shape[1]:
        raise ValueError(f"input width {width} does not match the positional table "
                         f"width {table.shape[1]}")
    y = x + table[:seq_len, :][None, :, :]  # (B, T, D) + (1, T, D)
    return y, (seq_len, max_len)


def add_positions_backward(dy, cache):
    """dy (B, T, D) -> dx (B, T, D), dtable (L, D) (used only when the table is learned)."""
    check_cache(cache, 2, "add_positions_forward", "add_positions_backward")
    check_float(dy, "the upstream gradient of add_positions_backward")
    if dy.ndim != 3 or dy.shape[1] != cache[0]:  # T, the forward's positions
        raise ValueError(f"the upstream gradient of add_positions_backward has shape "
                         f"{tuple(dy.shape)}, but the forward's output had shape "
                         f"(B, {cache[0]}, D)")
    seq_len, max_len = cache
    xp = backend.namespace_of(dy)
    dtable_used = xp.sum(dy, axis=0)  # (T, D)
    unused = xp.zeros((max_len - seq_len, dy.shape[-1]), dtype=dy.dtype,
                      device=backend.device_of(dy))  # (L - T, D)
    dtable = xp.concat([dtable_used, unused], axis=0)  # (L, D)
    return dy, dtable
