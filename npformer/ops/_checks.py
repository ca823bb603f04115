"""Input checks shared by the ops: each names the problem instead of letting a
broadcast or an index error surface from deep inside the math."""
from __future__ import annotations

import math

from .. import backend


def check_float(x, what: str) -> None:
    if not backend.is_float_array(x):
        raise TypeError(f"{what} must be a floating-point array, got dtype {x.dtype}")


def check_rank(x, ranks, what: str) -> None:
    ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if x.ndim not in ranks:
        expected = " or ".join(str(r) for r in ranks)
        raise ValueError(
            f"{what} must have {expected} dimensions, got shape {tuple(x.shape)}"
        )


def check_last_dim(x, width: int, what: str) -> None:
    if x.ndim == 0 or x.shape[-1] != width:
        raise ValueError(
            f"{what} must have last dimension {width}, got shape {tuple(x.shape)}"
        )


def broadcast_shape(a: tuple, b: tuple) -> tuple | None:
    """NumPy broadcasting of two shapes, or None if they do not broadcast."""
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        da = a[-i] if i <= len(a) else 1
        db = b[-i] if i <= len(b) else 1
        if da != db and 1 not in (da, db):
            return None
        out.append(max(da, db))
    return tuple(reversed(out))


def check_mask(mask, scores_shape: tuple, what: str = "attention mask",
               target: str = "the attention scores") -> None:
    """A mask must be boolean (True = may attend) and broadcast to the scores
    (``target`` names what it must broadcast to, for the message)."""
    xp = backend.namespace_of(mask)
    if mask.dtype != xp.bool:
        raise TypeError(
            f"{what} must be a boolean array (True = may attend), got dtype {mask.dtype}"
        )
    if broadcast_shape(tuple(mask.shape), tuple(scores_shape)) != tuple(scores_shape):
        legend = (" (batch, heads, queries, keys)"
                  if target == "the attention scores" and len(scores_shape) == 4 else "")
        raise ValueError(
            f"{what} of shape {tuple(mask.shape)} does not broadcast to {target} "
            f"of shape {tuple(scores_shape)}{legend}"
        )


def check_token_ids(ids, vocab_size: int, what: str = "token ids", allowed_extra=None) -> None:
    """Ids must be integers in [0, vocab_size) (``allowed_extra``, e.g. an ignore index, passes too)."""
    if not backend.is_integer_array(ids):
        raise TypeError(f"{what} must be an integer array, got dtype {ids.dtype}")
    if math.prod(ids.shape) == 0:
        return
    xp = backend.namespace_of(ids)
    checked = ids
    if allowed_extra is not None:
        checked = xp.where(ids == allowed_extra, xp.zeros_like(ids), ids)
    low = int(backend.to_numpy(xp.min(checked)))
    high = int(backend.to_numpy(xp.max(checked)))
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise IndexError(
            f"{what} out of range: found id {bad}, but the vocabulary has {vocab_size} "
            f"entries (valid ids are 0..{vocab_size - 1})"
        )
