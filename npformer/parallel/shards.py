"""How rows are shared out: contiguous shards, in rank order, sizes differing by at most one.

One rule for every place that splits work (the ranks' shards of a batch in
:mod:`npformer.parallel`, evaluation items in :meth:`.context.Context.shard_map`), so that
the MPI ranks and the thread replicas of a process always agree on who takes which rows;
and what a task must offer to be shared out so (:class:`ShardTask`).
"""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class ShardTask(Protocol):
    """What the workers ask of a training task (:class:`npformer.train.Task` is one; this
    package sits below the training package and names only what it calls)."""

    def count(self, batch: tuple) -> int:
        """The number of items the batch's mean loss averages over."""

    def loss_and_grad(self, model: Any, batch: tuple, grad_scale: float = 1.0) -> float:
        """Forward, loss and backward of ``loss * grad_scale``; returns the mean loss."""


def shard_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """[(lo, hi)] of ``parts`` contiguous shards covering ``range(rows)``, sizes differing
    by at most one (the later shards are the larger); shards are empty when rows < parts."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    bounds = np.linspace(0, rows, parts + 1).astype(int)
    return [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]
