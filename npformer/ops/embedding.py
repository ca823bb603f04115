r"""Token embedding: a table lookup.

Forward
    $y_{n} = W_{\text{ids}_n}$,  W of shape (V, D), ids of any shape (...), y (..., D)

Backward
    Each row of W receives the sum of the upstream gradients of every position
    that looked it up:  $\bar W_v = \sum_{n : \text{ids}_n = v} \bar y_n$.
    A plain ``dW[ids] += dy`` would keep only one of several repeated ids, so the
    backend's scatter-add (which accumulates repeats) does it.
"""
from __future__ import annotations

import math

from .. import backend
from ._checks import check_array, check_cache, check_float, check_rank, check_token_ids


def embedding_forward(ids, table):
    """ids (...) integers in [0, V), table (V, D) -> y (..., D), cache."""
    check_array(ids, "token ids")
    check_float(table, "embedding table")
    check_rank(table, 2, "embedding table (vocabulary, width)")
    if 0 in tuple(table.shape):
        raise ValueError(f"embedding table must have at least one entry and a width of at "
                         f"least 1, got shape {tuple(table.shape)}")
    xp = backend.namespace_of(ids, table)
    vocab_size, width = table.shape
    check_token_ids(ids, vocab_size)
    flat_ids = xp.reshape(ids, (-1,))  # (N,)
    rows = xp.take(table, flat_ids, axis=0)  # (N, D)
    y = xp.reshape(rows, tuple(ids.shape) + (width,))  # (..., D)
    return y, (flat_ids, vocab_size)


def embedding_backward(dy, cache):
    """dy (..., D) -> dtable (V, D).  (Integer ids have no gradient.)"""
    check_cache(cache, 2, "embedding_forward", "embedding_backward")
    check_float(dy, "the upstream gradient of embedding_backward")
    positions = cache[0].shape[0]  # N, of the flattened ids
    if dy.ndim == 0 or math.prod(dy.shape[:-1]) != positions:
        raise ValueError(f"the upstream gradient of embedding_backward has shape "
                         f"{tuple(dy.shape)}, but the forward's output had shape (..., D) "
                         f"with {positions} positions in all (the ids' shape)")
    flat_ids, vocab_size = cache
    xp = backend.namespace_of(dy)
    dy_rows = xp.reshape(dy, (-1, dy.shape[-1]))  # (N, D)
    return backend.scatter_add_rows(flat_ids, dy_rows, vocab_size)  # (V, D)
