"""The processes a run spans: which one is the main one (rank 0 prints and writes the
files), evaluation work shared out among the ranks and their replicas, and how the run
spread over the machine (for metrics.json)."""
from __future__ import annotations

import os
import platform
from collections.abc import Callable, Sequence

from .. import backend, parallel
from ..parallel.shards import shard_bounds
from ..train import progress


def is_main() -> bool:
    """False on MPI ranks other than 0: they compute, rank 0 writes the files."""
    return parallel.current().is_main


def map_batches(fn: Callable, items: Sequence, replicas: int, phase: str | None = None) -> list:
    """[fn(item) for item in items] for evaluation and decoding: across ``replicas``
    threads, and across the MPI ranks when there are several (every rank gets all).
    ``phase`` names the pass in the progress shown (:func:`npformer.train.progress.phase`, a
    step per item: rank 0 shows its own share, the ranks' shares being alike)."""
    ranks, items = parallel.current(), list(items)
    if phase is None:
        return ranks.shard_map(fn, items, replicas)
    lo, hi = shard_bounds(len(items), ranks.size)[ranks.rank]
    with progress.phase(phase, hi - lo) as shown:
        return ranks.shard_map(progress.counted(shown, fn), items, replicas)


def machine_description(replicas: int | None = None) -> str:
    """The machine and how a run spread over it, for metrics.json: e.g. "x86_64, 2 CPU
    cores, backend numpy, 2 MPI ranks, 1 replica each" (processes started by mpiexec,
    and ``replicas`` data-parallel threads in each)."""
    ranks = parallel.current().size
    text = (f"{platform.machine()}, {os.cpu_count()} CPU cores, backend "
            f"{backend.backend_name()}, " + (f"{ranks} MPI ranks" if ranks > 1 else "1 process"))
    if replicas is not None:
        text += f", {replicas} replica{'' if replicas == 1 else 's'}"
        text += " each" if ranks > 1 else ""
    return text
