"""Turning lists of token ids into batches of int64 arrays (B the batch size, T the padded
sequence length).  Randomness always comes from a ``numpy.random.Generator`` passed in, so
a seed reproduces a run.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator, Sequence
from copy import deepcopy

import numpy as np

from ..ops.contracts import check_flag, check_size

__all__ = ["pad_batch", "batches", "length_bucketed_batches", "lm_batch"]


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int,
              max_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad sequences of ids to a rectangle, truncating them to ``max_len``.

    Returns:
        ``ids``: int64 ``(B, T)`` with ``T`` the longest (truncated) length, the
        positions past each sequence's end holding ``pad_id``;
        ``valid_lens``: int64 ``(B,)``, the number of real tokens in each row.

    Raises:
        TypeError: a sequence holds something other than integers (a float id would
            be cut to an integer, silently), or ``pad_id`` / ``max_len`` is not one.
        ValueError: ``max_len`` is negative.
    """
    check_size(pad_id, "pad_id", minimum=-2**63)
    max_len = check_size(max_len, "max_len", optional=True)
    rows = [_token_ids(seq, row) for row, seq in enumerate(seqs)]
    lengths = [len(r) if max_len is None else min(len(r), max_len) for r in rows]
    valid_lens = np.asarray(lengths, dtype=np.int64).reshape(len(lengths))      # (B,)
    ids = np.full((len(lengths), max(lengths, default=0)), pad_id, dtype=np.int64)  # (B, T)
    for row, (seq, n) in enumerate(zip(rows, lengths)):
        ids[row, :n] = seq[:n]
    return ids, valid_lens


def _token_ids(seq: Sequence[int], row: int) -> np.ndarray:
    """One sequence of ``pad_batch`` as an int64 (T,) array, refused unless it holds
    integers (Python's or NumPy's; not bools, floats or strings)."""
    try:
        host = np.asarray(seq)
    except (TypeError, ValueError) as exc:  # ragged nesting, objects
        raise TypeError(f"sequence {row} must be a flat sequence of integer token ids: "
                        f"{exc}") from None
    if host.ndim != 1:
        raise TypeError(f"sequence {row} must be a flat sequence of integer token ids, got "
                        f"an array of shape {host.shape}")
    if host.size and host.dtype.kind not in "iu":
        first = next((x for x in host.tolist()
                      if isinstance(x, bool) or not isinstance(x, numbers.Integral)), None)
        if first is None:  # Python integers beyond int64
            raise ValueError(f"sequence {row} holds token ids beyond int64")
        raise TypeError(f"sequence {row} must hold integer token ids, got {first!r} "
                        f"({type(first).__name__})")
    return host.astype(np.int64, copy=False)


def batches(n: int, batch_size: int, shuffle: bool = False,
            rng: np.random.Generator | None = None,
            drop_last: bool = False) -> Iterator[np.ndarray]:
    """Yield int64 index arrays covering ``range(n)`` in batches of ``batch_size``.

    With ``shuffle`` the order is a permutation drawn from ``rng`` (required).  The last
    batch is smaller when ``batch_size`` does not divide ``n``, unless ``drop_last``.
    """
    n = check_size(n, "n", 0)
    check_size(batch_size, "batch_size", 1)
    shuffle, drop_last = check_flag(shuffle, "shuffle"), check_flag(drop_last, "drop_last")
    if shuffle and rng is None:
        raise ValueError("shuffle=True needs rng, a numpy.random.Generator")
    order = rng.permutation(n) if shuffle else np.arange(n)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        yield order[start:start + batch_size].astype(np.int64, copy=False)


def length_bucketed_batches(lengths: Sequence[int], batch_size: int,
                            rng: np.random.Generator | None = None,
                            pool_batches: int = 50) -> list[np.ndarray]:
    """Index batches of ``batch_size`` examples of similar ``lengths`` (one per example;
    for pairs, e.g. the longer side): less padding for sequence-to-sequence training.

    The examples are shuffled by ``rng``, cut into pools of ``pool_batches * batch_size``
    (larger pools pad less but are less random), each pool sorted by length and cut into
    batches (a pool's last may be smaller); then the order of the batches is shuffled.
    Each example is in exactly one batch.  Without ``rng`` the examples are sorted by
    length (stably) and the batches are in that order.
    """
    if batch_size < 1 or pool_batches < 1:
        raise ValueError("batch_size and pool_batches must be >= 1")
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    order = rng.permutation(n) if rng is not None else np.arange(n)
    pool = max(n, 1) if rng is None else pool_batches * batch_size
    result = []
    for start in range(0, n, pool):
        members = order[start:start + pool]
        members = members[np.argsort(lengths[members], kind="stable")]
        result.extend(members[i:i + batch_size] for i in range(0, len(members), batch_size))
    if rng is not None:
        result = [result[i] for i in rng.permutation(len(result))]
    return result


def lm_batch(data_ids: np.ndarray, block_size: int, batch_size: int,
             rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random windows of a token stream, as nanoGPT's ``get_batch``.

    Draws ``batch_size`` start offsets ``i`` uniformly in
    ``[0, len(data_ids) - block_size)`` and returns ``x[b] = data[i : i + block_size]``
    and ``y[b] = data[i + 1 : i + 1 + block_size]`` (the next token at each
    position), both int64 ``(B, T)`` with ``T = block_size``.
    """
    data_ids = np.asarray(data_ids)
    if len(data_ids) <= block_size:
        raise ValueError(f"need more than block_size={block_size} tokens, got {len(data_ids)}")
    starts = rng.integers(0, len(data_ids) - block_size, size=batch_size)  # (B,)
    window = starts[:, None] + np.arange(block_size)                        # (B, T)
    x = data_ids[window].astype(np.int64, copy=False)                       # (B, T)
    y = data_ids[window + 1].astype(np.int64, copy=False)                   # (B, T)
    return x, y


class EpochBatches:
    """``next_batch(rng)`` over epochs, with a state a resumed run continues from.

    ``plan(rng)`` orders one epoch (a list of row-index arrays, one per batch) and
    ``make(rows)`` builds a batch.  The state is small: the generator's state when the
    current epoch was planned and how many of its batches were taken; resuming plans
    that epoch again from that state and goes on where it stopped.  Batches are taken
    from the end of the plan (the demos always popped them that way).
    """

    def __init__(self, plan: Callable, make: Callable):
        self.plan, self.make = plan, make
        self.epoch: list = []
        self.planned_from: dict | None = None  # the generator's state before plan()
        self.taken = 0

    def __call__(self, rng: np.random.Generator):
        if self.taken == len(self.epoch):
            self.planned_from = deepcopy(rng.bit_generator.state)
            self.epoch, self.taken = self.plan(rng), 0
        self.taken += 1
        return self.make(self.epoch[-self.taken])

    def state_dict(self) -> dict:
        return {"planned_from": self.planned_from, "taken": self.taken}

    def load_state_dict(self, state: dict) -> None:
        self.planned_from, self.taken, self.epoch = state["planned_from"], state["taken"], []
        if self.planned_from is not None:
            rng = np.random.default_rng()
            rng.bit_generator.state = self.planned_from
            self.epoch = self.plan(rng)
