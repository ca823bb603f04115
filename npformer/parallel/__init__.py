"""Processes: data parallelism over thread replicas and MPI ranks, and launching the ranks.

:mod:`.data_parallel` is the one data-parallel algorithm (broadcast, shard, weight by the
counted items, one all-reduce of one flat gradient buffer); :mod:`.replicas` runs it on
threads of one process; the rest of this package runs it across processes (and
machines) over MPI, through mpi4py, and :mod:`.relaunch` starts a demo on one rank per
core by itself.

``mpiexec -n N python train.py`` starts N copies of one program (ranks).  Each keeps a
whole model and trains it with :class:`npformer.parallel.DataParallel`, the one
data-parallel algorithm (broadcast, shard, weight by the counted items, one all-reduce
of one flat gradient buffer, the identical update), whose communicator across the
ranks is this package's :class:`Context`.  The one call a program makes, first thing::

    from npformer import parallel
    ctx = parallel.setup()         # size 1, rank 0 when not started by mpiexec
    ...                            # ctx.rank, ctx.size, ctx.is_main, ctx.shard_map(...)

after which :class:`npformer.train.Trainer` trains across the ranks by itself.

Only the main rank (0) prints, plots, writes metrics and checkpoints; checkpoints hold
no per-rank state, so a run resumes on any number of ranks.  Ranks started with
different configurations, data or model shapes are refused before the first step.

One small module per concern:

* :mod:`.context`: joining the ranks (:func:`setup`) and :class:`Context`, the
  communicator (rank, size, ``allreduce``, ``allgather``, ``from_main``, ``check_same``);
* :mod:`.launcher`: was this process started by an MPI launcher, as one of how many;
* :func:`setup` keeps freed activations in the process (:func:`npformer.backend.keep_freed_memory`);
* :mod:`.placement`: each rank's share of the cores, and its GPU;
* :mod:`.failure`: no rank waits for ever (a join timeout, abort-all on an exception);
* :mod:`.fingerprint`: rank comparison by hashing, for :meth:`Context.check_same`;
* :mod:`.shards`: which rows each rank (and thread replica) takes: one rule for all;
* :mod:`.sparse`: of each lookup table (an embedding), only the rows some rank changed are
  summed (equal to summing it whole);
* :mod:`.transports`: the in-place sum of a buffer on the host (MPI) or a GPU (NCCL,
  CUDA-aware MPI, or through the host; ``NPFORMER_GPU_ALLREDUCE=nccl|mpi|host``).
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
