"""How rows are shared out: contiguous shards, in rank order, sizes differing by at most one,
or, where the rows' costs differ (a task's ``costs``), costs differing by at most a row's.

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

    # optional: ``costs(batch) -> (B,)``, what each row costs to compute (the positions
    # the model computes for it), where rows differ: the shards are then balanced by it


def shard_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """[(lo, hi)] of ``parts`` contiguous shards covering ``range(rows)``, sizes differing
    by at most one (the later shards are the larger); shards are empty when rows < parts."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    bounds = np.linspace(0, rows, parts + 1).astype(int)
    return [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]


def balanced_bounds(costs: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """[(lo, hi)] of ``parts`` contiguous shards covering the rows, each costing about a
    ``parts``-th of the total: row r costs ``costs[r]`` (>= 0); shard k ends at the row
    boundary whose cumulative cost is nearest (k + 1) / parts of the total (the earlier
    one on a tie), so its cost is within a row's of its share.  Rows that cost nothing:
    :func:`shard_bounds`."""
    costs = np.asarray(costs, dtype=np.float64)
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    if costs.size == 0 or not costs.sum() > 0:
        return shard_bounds(costs.size, parts)
    cumulative = np.concatenate([[0.0], np.cumsum(costs)])  # (B + 1,): cost before row r
    shares = cumulative[-1] * np.arange(parts + 1) / parts  # (parts + 1,)
    after = np.clip(np.searchsorted(cumulative, shares), 1, costs.size)  # first >= share
    nearer_before = shares - cumulative[after - 1] <= cumulative[after] - shares
    cuts = np.maximum.accumulate(np.where(nearer_before, after - 1, after))
    cuts[0], cuts[-1] = 0, costs.size
    return [(int(lo), int(hi)) for lo, hi in zip(cuts[:-1], cuts[1:])]
