r"""Token embedding, fast: the textbook op (:mod:`npformer.ops.embedding`) with its
backward's scatter-add, $\bar W_v = \sum_{n : \text{ids}_n = v} \bar y_n$, as one
compiled loop over the positions (:func:`scatter_add_rows`): the additions of the
textbook's ``np.add.at`` in its order, bit for bit (docs/derivations.md §19).  Elsewhere
(no numba, CuPy, the strict namespace), and in the forward, the textbook op.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import backend
from ..backend import Array
from ..ops import embedding as _textbook
from ..ops.contracts import backward_op, door, opened, state
from .compiler import compilable, jit


@backward_op(_textbook.embedding_forward)
def embedding_backward(dy: Array, saved: Any) -> Array:
    """dy (..., D) -> dtable (V, D).  (Integer ids have no gradient.)"""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(embedding_backward, dy, saved)
    values = opened(_textbook.embedding_forward, saved)
    flat_ids, vocab_size = values
    xp = backend.namespace_of(dy)
    dy_rows = xp.reshape(dy, (-1, dy.shape[-1]))  # (N, D)
    if not compilable(dy_rows):
        return _textbook.embedding_backward.unchecked(dy, values)
    dtable = xp.zeros((vocab_size, dy.shape[-1]), dtype=dy.dtype)  # (V, D)
    scatter_add_rows(flat_ids, dy_rows, dtable)  # dtable[ids[n]] += dy[n], in order
    return dtable


# =========================================================================== the kernel
@jit
def _scatter_add_rows(index, values, out):
    """out[index[n], :] += values[n, :] for n = 0, 1, ... in order: index (N,), values
    (N, D), out (V, D)."""
    for n in range(index.size):
        row, value = out[index[n]], values[n]
        for j in range(value.size):  # contiguous, element-wise: vectorizes
            row[j] += value[j]
    return None


def scatter_add_rows(index: np.ndarray, values: np.ndarray, out: np.ndarray) -> None:
    """out[index[n], :] += values[n, :] for n = 0, 1, ... in order (repeated indices
    accumulate, in the order ``np.add.at`` adds them): index (N,) integers in [0, V),
    values (N, D) floats (any layout: a strided one is copied first), out (V, D) of
    values' dtype, C-contiguous and writable (written in place)."""
    _scatter_add_rows(np.ascontiguousarray(index, dtype=np.int64),
                      np.ascontiguousarray(values), out)
