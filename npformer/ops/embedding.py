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

from typing import Any

from .. import backend
from ..backend import Array
from .contracts import backward_op, embedding_inputs, forward_op


@forward_op(embedding_inputs)
def embedding_forward(ids: Array, table: Array) -> tuple[Array, Any]:
    """ids (...) integers in [0, V), table (V, D) -> y (..., D), cache."""
    xp = backend.namespace_of(ids, table)
    vocab_size, width = table.shape
    flat_ids = xp.reshape(ids, (-1,))  # (N,)
    rows = xp.take(table, flat_ids, axis=0)  # (N, D)
    y = xp.reshape(rows, tuple(ids.shape) + (width,))  # (..., D)
    return y, (flat_ids, vocab_size)


@backward_op(embedding_forward)
def embedding_backward(dy: Array, saved: Any) -> Array:
    """dy (..., D) -> dtable (V, D).  (Integer ids have no gradient.)"""
    flat_ids, vocab_size = saved
    xp = backend.namespace_of(dy)
    dy_rows = xp.reshape(dy, (-1, dy.shape[-1]))  # (N, D)
    return backend.scatter_add_rows(flat_ids, dy_rows, vocab_size)  # (V, D)
