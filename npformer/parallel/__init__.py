"""Processes: data parallelism over thread replicas and MPI ranks, and launching the ranks.

:mod:`.workers` is the one data-parallel algorithm (:class:`DataParallel`: broadcast,
shard, weight by the counted items, sum one flat gradient buffer in buckets during the
backward); :mod:`.replicas` runs it on threads of one process, the rest of this package
across processes (and machines) over MPI through mpi4py, and :mod:`.relaunch` starts a
demo on one rank per core by itself.  ``mpiexec -n N python train.py`` starts N ranks;
each calls, first thing::

    from npformer import parallel
    ctx = parallel.setup()         # size 1, rank 0 when not started by mpiexec
    ...                            # ctx.rank, ctx.size, ctx.is_main, ctx.shard_map(...)

after which :class:`npformer.train.Trainer` trains across the ranks by itself.  Only the
main rank (0) prints, plots, writes metrics and checkpoints; checkpoints hold no per-rank
state, so a run resumes on any number of ranks; ranks started with different
configurations, data or model shapes are refused before the first step.

One small module per concern: :mod:`.context` (:func:`setup`, which also keeps freed
activations in the process, and :class:`Context`, the communicator), :mod:`.launcher`
(started by an MPI launcher, as one of how many), :mod:`.placement` (each rank's cores
and GPU), :mod:`.failure` (no rank waits for ever), :mod:`.fingerprint` (ranks compared
by hashing), :mod:`.shards` (which rows each worker takes), :mod:`.buckets` (the gradient
sum during the backward), :mod:`.sparse` (of a lookup table only the rows some rank
wrote), :mod:`.transports` (the in-place sum on the host or a GPU: NCCL, CUDA-aware
MPI or through the host; ``NPFORMER_GPU_ALLREDUCE=nccl|mpi|host``).
"""
from __future__ import annotations

from ..backend import keep_freed_memory
from .context import Context, RanksDiffer, current, join_if_launched, setup
from .failure import wait_until_read
from .fingerprint import batch_fingerprint
from .launcher import launched_by_mpi
from .replicas import ThreadReplicas, parallel_map
from .shards import shard_bounds
from .transports import gpu_allreduce_kind
from .workers import DataParallel, PackedGradients, data_parallel, split_batch

__all__ = ["Context", "DataParallel", "RanksDiffer", "ThreadReplicas", "batch_fingerprint",
           "current", "data_parallel", "gpu_allreduce_kind", "join_if_launched",
           "keep_freed_memory", "launched_by_mpi", "parallel_map", "setup", "shard_bounds",
           "split_batch", "wait_until_read", "PackedGradients"]
