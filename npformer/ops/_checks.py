"""Input checks shared by the ops: each names the problem instead of letting a
broadcast or an index error surface from deep inside the math.

The documented exceptions: TypeError for something of the wrong kind (not an array,
wrong dtype, not a cache), ValueError for a wrong shape or value (an upstream gradient
whose shape is not the forward's output's, a size below its minimum), RuntimeError for
a backward with no forward to differentiate, and :class:`TokenIdError` (an IndexError
and a ValueError) for a token id outside the vocabulary.  Every check is O(1) except
the token-id range scan, which the ops already made.
"""
from __future__ import annotations

import math
import numbers

from .. import backend

FLOAT_DTYPES = ("float32", "float64")  # what the ops compute in


class TokenIdError(IndexError, ValueError):
    """A token id outside the vocabulary: an IndexError, as PyTorch's embedding raises, and a
    ValueError, as :mod:`npformer.decoding` raises for the same mistake."""


def check_array(x, what: str) -> None:
    """x must be an array of some array library (not a list, a number or None)."""
    import array_api_compat

    if not array_api_compat.is_array_api_obj(x):
        raise TypeError(f"{what} must be an array, got {type(x).__name__}: convert host data "
                        "with npformer.backend.asarray(...)")


def check_float(x, what: str) -> None:
    check_array(x, what)
    xp = backend.namespace_of(x)
    if x.dtype not in tuple(getattr(xp, name) for name in FLOAT_DTYPES):
        raise TypeError(f"{what} must be a floating-point array ({' or '.join(FLOAT_DTYPES)}), "
                        f"got dtype {x.dtype}")


def check_rank(x, ranks, what: str) -> None:
    check_array(x, what)
    ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if x.ndim not in ranks:
        expected = " or ".join(str(r) for r in ranks)
        raise ValueError(
            f"{what} must have {expected} dimensions, got shape {tuple(x.shape)}"
        )


def check_last_dim(x, width: int, what: str) -> None:
    check_array(x, what)
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
        out.append(db if da == 1 else da)  # a 1 takes the other's size, 0 included
    return tuple(reversed(out))


def check_mask(mask, scores_shape: tuple, what: str = "attention mask",
               target: str = "the attention scores") -> None:
    """A mask must be boolean (True = may attend) and broadcast to the scores
    (``target`` names what it must broadcast to, for the message)."""
    check_array(mask, what)
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
    check_array(ids, what)
    if not backend.is_integer_array(ids):
        raise TypeError(f"{what} must be an integer array, got dtype {ids.dtype}")
    if math.prod(ids.shape) == 0:
        return
    xp = backend.namespace_of(ids)
    checked = ids
    if allowed_extra is not None:
        checked = xp.where(ids == allowed_extra, xp.zeros_like(ids), ids)
    low, high = backend.host_range(checked)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise TokenIdError(
            f"{what} out of range: found id {bad}, but the vocabulary has {vocab_size} "
            f"entries (valid ids are 0..{vocab_size - 1})"
        )


def check_size(value, what: str, minimum: int = 0) -> int:
    """A count or size (an integer, not a bool) of at least ``minimum``; returned as an int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{what} must be at least {minimum}, got {value}")
    return int(value)


def check_axis(x, axis, what: str) -> None:
    """``axis`` must be an integer naming an axis of x."""
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"{what} axis must be an integer, got {axis!r}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{what} has no axis {axis}: its shape is {tuple(x.shape)}")


def check_same_dtype(what: str, **arrays) -> None:
    """The floating-point inputs of one op share one dtype (none is silently cast)."""
    present = {name: a for name, a in arrays.items() if a is not None}
    backend.check_one_library(what, **present)  # arrays of two libraries: named first
    dtypes = {name: a.dtype for name, a in present.items()}
    if len(set(map(str, dtypes.values()))) > 1:
        listed = ", ".join(f"{name} {dtype}" for name, dtype in dtypes.items())
        raise TypeError(f"{what} inputs must share one dtype, got {listed}")


def check_cache(cache, length: int | None, forward: str, backward: str) -> None:
    """``cache`` must be what ``forward`` returned: not None (backward before forward is a
    RuntimeError) and, for a tuple cache, a tuple of ``length`` items."""
    if cache is None:
        raise RuntimeError(f"{backward} got no cache (None): run {forward} first and pass "
                           "the cache it returned")
    if length is not None and not (isinstance(cache, tuple) and len(cache) == length):
        raise TypeError(f"{backward} got an invalid cache ({type(cache).__name__}): pass the "
                        f"cache that {forward} of the same tier returned")


def check_upstream(dy, expected: tuple, what: str, dtype=None) -> None:
    """The upstream gradient must be a floating-point array of the forward's output shape
    (and, given ``dtype``, of the output's dtype: the fast tier writes into its buffers)."""
    check_float(dy, f"the upstream gradient of {what}")
    if tuple(dy.shape) != tuple(expected):
        raise ValueError(f"the upstream gradient of {what} has shape {tuple(dy.shape)}, but "
                         f"the forward's output had shape {tuple(expected)}")
    if dtype is not None and dy.dtype != dtype:
        raise TypeError(f"the upstream gradient of {what} has dtype {dy.dtype}, but the "
                        f"forward's output had dtype {dtype}")
