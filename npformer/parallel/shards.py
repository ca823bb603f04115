"""How rows are shared out: contiguous shards, in rank order, sizes differing by at most one.

One rule for every place that splits work (the ranks' shards of a batch in
:mod:`npformer.parallel`, evaluation items in :meth:`.context.Context.shard_map`), so that
the MPI ranks and the thread replicas of a process always agree on who takes which rows.
"""
from __future__ import annotations

import numpy as np


def shard_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """[(lo, hi)] of ``parts`` contiguous shards covering ``range(rows)``, sizes differing
    by at most one (the later shards are the larger); shards are empty when rows < parts."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    bounds = np.linspace(0, rows, parts + 1).astype(int)
    return [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]
