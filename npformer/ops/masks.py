"""The two attention masks: boolean, True where a query may attend to a key; and the
real positions of a padded batch, which the padding mask, pooling and the losses read."""
from __future__ import annotations

from .. import backend
from ..backend import Array
from .contracts import causal_mask_inputs, checked_op, door, padding_mask_inputs, state


def real_positions(lengths: Array, length: int) -> Array:
    """lengths (B,) integers -> (B, T) bool, True at the first lengths[b] positions of row
    b: the real tokens of a padded batch.  Unchecked (its callers check their lengths),
    and it reads nothing back to the host, so a captured CUDA graph may run it."""
    xp = backend.namespace_of(lengths)
    positions = xp.arange(length, dtype=lengths.dtype, device=backend.device_of(lengths))
    return positions[None, :] < lengths[:, None]  # (B, T)


def align_mask(mask: Array | None, ndim: int) -> Array | None:
    """A mask with leading axes of 1 added until it has the scores' ``ndim`` axes (what
    broadcasting does implicitly, made explicit for code that indexes the mask's axes).
    Unchecked: its callers' doors checked that the mask broadcasts."""
    if mask is None or mask.ndim == ndim:
        return mask
    xp = backend.namespace_of(mask)
    return xp.reshape(mask, (1,) * (ndim - mask.ndim) + tuple(mask.shape))


@checked_op(padding_mask_inputs)
def padding_mask(valid_lens: Array, num_keys: int) -> Array:
    """valid_lens (B,) integers -> (B, 1, 1, S) bool, True at the first valid_lens[b] keys."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(padding_mask, valid_lens, num_keys)
    keep = real_positions(valid_lens, num_keys)  # (B, S)
    return keep[:, None, None, :]  # (B, 1, 1, S)


@checked_op(causal_mask_inputs)
def causal_mask(num_queries: int, num_keys: int | None = None, like: Array | None = None) -> Array:
    """(T, S) bool: query i may see keys j <= i + (S - T).

    With S == T this is the lower triangle; with S > T (a decoder continuing a
    cached prefix of S - T tokens) the queries are the last T positions.
    ``like``: any array of the target namespace/device (default: the current backend).
    """
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(causal_mask, num_queries, num_keys, like)
    num_keys = num_queries if num_keys is None else num_keys
    xp = backend.xp() if like is None else backend.namespace_of(like)
    dev = backend.device() if like is None else backend.device_of(like)
    i = xp.arange(num_queries, device=dev)[:, None]  # (T, 1)
    j = xp.arange(num_keys, device=dev)[None, :]  # (1, S)
    return j <= i + (num_keys - num_queries)  # (T, S)
