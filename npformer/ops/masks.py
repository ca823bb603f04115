"""The two attention masks: boolean, True where a query may attend to a key."""
from __future__ import annotations

from .. import backend
from ..backend import Array
from .contracts import causal_mask_inputs, checked_op, padding_mask_inputs


@checked_op(padding_mask_inputs)
def padding_mask(valid_lens: Array, num_keys: int) -> Array:
    """valid_lens (B,) integers -> (B, 1, 1, S) bool, True at the first valid_lens[b] keys."""
    xp = backend.namespace_of(valid_lens)
    positions = xp.arange(num_keys, dtype=valid_lens.dtype, device=backend.device_of(valid_lens))
    keep = positions[None, :] < valid_lens[:, None]  # (B, S)
    return keep[:, None, None, :]  # (B, 1, 1, S)


@checked_op(causal_mask_inputs)
def causal_mask(num_queries: int, num_keys: int | None = None, like: Array | None = None) -> Array:
    """(T, S) bool: query i may see keys j <= i + (S - T).

    With S == T this is the lower triangle; with S > T (a decoder continuing a
    cached prefix of S - T tokens) the queries are the last T positions.
    ``like``: any array of the target namespace/device (default: the current backend).
    """
    num_keys = num_queries if num_keys is None else num_keys
    xp = backend.xp() if like is None else backend.namespace_of(like)
    dev = backend.device() if like is None else backend.device_of(like)
    i = xp.arange(num_queries, device=dev)[:, None]  # (T, 1)
    j = xp.arange(num_keys, device=dev)[None, :]  # (1, S)
    return j <= i + (num_keys - num_queries)  # (T, S)
