r"""Token embedding: a table lookup.  The derivation: docs/derivations.md §11.

Forward
    $y_{n} = W_{\text{ids}_n}$,  W of shape (V, D), ids of any shape (...), y (..., D)

Backward
    $\bar W_v = \sum_{n : \text{ids}_n = v} \bar y_n$   (the backend's scatter-add, which
    accumulates repeated ids)

Hashed word pairs (fastText's bigrams; Joulin et al., 2017, section 2.2)
    Position t's pair (ids[t-1], ids[t]) becomes one id in [0, K):
    $b_t = ((\text{ids}_{t-1} + 1) \cdot p_1 + \text{ids}_t \cdot p_2) \bmod K$, with
    ids[-1] taken as -1 (the row's start) and p1, p2 two large primes; a table of K rows
    is looked up at the b_t, with the gradient above.
"""
from __future__ import annotations

from typing import Any

from .. import backend
from ..backend import Array
from .contracts import (
    Saved,
    backward_op,
    door,
    embedding_inputs,
    forward_op,
    opened,
    state,
    with_saved,
)


@forward_op(embedding_inputs)
def embedding_forward(ids: Array, table: Array) -> tuple[Array, Any]:
    """ids (...) integers in [0, V), table (V, D) -> y (..., D), saved."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(embedding_forward, ids, table)
    xp = backend.namespace_of(ids, table)
    vocab_size, width = table.shape
    flat_ids = xp.reshape(ids, (-1,))  # (N,)
    rows = xp.take(table, flat_ids, axis=0)  # (N, D)
    y = xp.reshape(rows, tuple(ids.shape) + (width,))  # (..., D)
    return with_saved(embedding_forward, y, (flat_ids, vocab_size))


def embedding_rows(saved: Any) -> Array | None:
    """The ids (N,) an :func:`embedding_forward`'s saved values hold: the rows of the table
    its backward's gradient can hold anything in (every other row is +0.0, from the zeros
    the scatter-add starts with), which the fast tier's Embedding records in its flat
    buffer for data parallelism's row-sparse sum (:func:`npformer.nn.flat.accumulate`).
    None where ``saved`` is not this op's (an exercise's own forward made it): the rows are
    then not known, and that sum reads the table to find them."""
    if type(saved) is not Saved or saved.op != embedding_forward.op_name \
            or saved.tier != embedding_forward.tier:
        return None
    flat_ids, _ = saved.values
    return flat_ids


# The two multipliers of hashed_bigrams: primes, so that neither id's low bits alone decide
# the bucket.  (V + 1) * p1 + V * p2 stays far below 2**63 for any vocabulary under 2**31.
BIGRAM_PRIMES = (1_000_003, 998_244_353)


def hashed_bigrams(ids: Array, buckets: int) -> Array:
    """ids (B, T) integers in [0, V) -> pair ids (B, T) in [0, buckets): position t's
    (ids[t-1], ids[t]) hashed (the module docstring), position 0's previous id -1.
    Integers in, integers out: nothing to differentiate."""
    xp = backend.namespace_of(ids)
    current = xp.astype(ids, xp.int64)  # (B, T): the products overflow 32 bits
    start = xp.full((current.shape[0], 1), -1, dtype=xp.int64, device=backend.device_of(ids))
    previous = xp.concat([start, current[:, :-1]], axis=1)  # (B, T): ids shifted right
    p1, p2 = BIGRAM_PRIMES
    return ((previous + 1) * p1 + current * p2) % buckets  # (B, T)


@backward_op(embedding_forward)
def embedding_backward(dy: Array, saved: Any) -> Array:
    """dy (..., D) -> dtable (V, D).  (Integer ids have no gradient.)"""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(embedding_backward, dy, saved)
    values = opened(embedding_forward, saved)
    flat_ids, vocab_size = values
    xp = backend.namespace_of(dy)
    dy_rows = xp.reshape(dy, (-1, dy.shape[-1]))  # (N, D)
    return backend.scatter_add_rows(flat_ids, dy_rows, vocab_size)  # (V, D)
