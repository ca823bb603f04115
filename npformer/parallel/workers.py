"""Data parallelism: one algorithm, for thread replicas and for MPI ranks.

W workers train one model: ``replicas`` threads in each of ``size`` processes (the MPI
ranks; a process alone is rank 0 of 1), W = size * replicas, worker g = rank * replicas
+ i.  Every optimizer step they agree on everything but which rows they compute:

1. **broadcast**: rank 0's parameters become every rank's (once, when the workers are made);
2. **shard**: every worker holds the same global batch (the same data generator, seeded
   the same: exactly the batch one process would see) and computes its shard g of
   ``shard_bounds(B, W)``, or, for a task whose rows cost differently (``task.costs``:
   translation's source and target tokens), of ``balanced_bounds(costs, W)``;
3. **weight**: shard g's mean loss L_g is weighted by its share of the counted items,
   n_g / n (rows, tokens or real target tokens: ``task.count``), so that

       L = sum_g (n_g / n) L_g      =>      dL/dw = sum_g (n_g / n) dL_g/dw

   the *sum* of the workers' gradients is the one-process gradient of the global batch
   (every worker holds the global batch, so n is known everywhere without a message);
4. **sum**: once per optimizer step, one flat gradient buffer is summed: the model's
   own where its parameters live in one (the fast tier's
   :class:`npformer.nn.flat.FlatParameters`), sent as it is, else every gradient packed
   into one (:class:`PackedGradients`).  It is summed in buckets, the last parameters
   first, each started (non-blocking) as soon as the backward has finished its
   gradients, and all waited on before the update (:mod:`.buckets`: PyTorch DDP's
   overlap); of each lookup table (an embedding) only the rows some rank wrote travel
   (:mod:`.sparse`: equal to summing it whole), after the backward;
5. **update**: clipping and the optimizer step then run identically everywhere, so the
   parameters stay equal without being sent again.

Dropout masks: worker g draws from ``thread_generator(seed + g)``, ``seed`` drawn by the
trainer from its data generator every batch: a run repeats exactly, and 2 ranks of 1
replica draw the masks of 1 process of 2 replicas (2 ranks of 2, those of 1 of 4).

Threads and ranks differ only in how step 4's sum happens, through the *communicator*:

* threads: :class:`npformer.parallel.replicas.ThreadReplicas` adds each replica's gradient
  buffer into the model's, after every batch;
* ranks: a :class:`Communicator` (``rank``, ``size``, ``allreduce(buffer)`` in place,
  ``allgather``, ``from_main``, ``check_same``; ``start_allreduce`` where it can sum
  without waiting) sums the processes' buffers once per step:
  :class:`npformer.parallel.Context`, over MPI; a process alone is rank 0 of 1, whose
  collectives return their input.

The trainer's step calls :meth:`DataParallel.loss_and_grad` per batch and
:meth:`DataParallel.reduce_step` per update; :func:`data_parallel` makes the workers, across
the MPI ranks when a launcher started several, else in this process, and none at all for
one process of one replica, whose step needs no data parallelism.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np

from .. import backend
from ..nn import Module, Parameter
from ..nn.flat import flat_buffer_of, forget_rows_written
from ..nn.module import flat_layout
from .buckets import BUCKET_BYTES, DONE, BucketedSum, plan_buckets, tail_of
from .context import SINGLE, join_if_launched
from .replicas import ThreadReplicas, parallel_map
from .shards import ShardTask, balanced_bounds, shard_bounds
from .sparse import RowSparseSum, lookup_tables

__all__ = ["Communicator", "DataParallel", "PackedGradients", "data_parallel",
           "gradient_buckets", "parallel_map", "shard_bounds", "shard_weights", "split_batch"]


class Communicator(Protocol):
    """The processes that train together: this one's place, and their collective calls."""

    rank: int
    size: int

    def allreduce(self, buffer: Any) -> None:
        """``buffer`` (one flat array) becomes the sum of every process's, in place."""

    # optional: ``start_allreduce(buffer) -> handle``, the same sum started without
    # waiting (``handle.test()`` progresses it, ``handle.wait()`` ends it)

    def allgather(self, value: Any) -> list:
        """[every process's ``value``], in rank order, on every process."""

    def from_main(self, value: Any) -> Any:
        """Rank 0's ``value``, on every process."""

    def check_same(self, **values: Any) -> None:
        """Raise, on every process, if a named value differs between processes."""


# --------------------------------------------------------------------------- the algorithm
class DataParallel:
    """The data-parallel workers: ``replicas`` threads in this process, on each of the
    ranks of ``ranks`` (None: this process alone).  ``same``: values every rank must
    share, checked before the first step (as are the model and the first batch)."""

    def __init__(self, model: Module, replicas: int = 1, ranks: Communicator | None = None,
                 row_sparse: bool = True, bucket_bytes: int = BUCKET_BYTES, **same: Any):
        self.model, self.ranks = model, ranks if ranks is not None else SINGLE
        self.replicas = ThreadReplicas(model, replicas, row_sparse)
        self.ranks.check_same(model=model_signature(model), replicas=replicas, **same)
        broadcast_parameters(model, self.ranks)                             # 1. broadcast
        self.allreduce = self.ranks.allreduce
        self.start_allreduce = getattr(self.ranks, "start_allreduce", None) or self._summed_now
        self.row_sparse = row_sparse  # False: every table summed whole (the dense sum)
        self.bucket_bytes = bucket_bytes
        self.reduced_bytes = 0  # what the last step's gradient sum carried
        self._packed: PackedGradients | None = None
        self._sparse: RowSparseSum | None = None  # the tail's (the lookup tables') sum
        self._buckets: list[tuple[int, int]] | None = None  # plan_buckets', made once
        self._tail = 0  # the parameters [0, tail) the buckets leave to the row-sparse sum
        self._summing: BucketedSum | None = None  # this step's, once started
        self._data_checked = False

    @property
    def is_main(self) -> bool:
        return self.ranks.rank == 0

    def loss_and_grad(self, task: ShardTask, batch: tuple, grad_scale: float,
                      seed: int, ends_step: bool = False) -> tuple[float, int]:
        """This process's shards of ``batch`` (the global batch, the same everywhere):
        forward and backward of each shard's loss weighted by n_g / n ->
        (the sum of this process's n_g / n * L_g, n).  ``ends_step``: the step's last
        batch, :meth:`reduce_step` next: its backward starts the gradient sum (the
        trainer's step says so; gradient accumulation's other batches do not)."""
        if not self._data_checked:
            self.ranks.check_same(data=batch)
            self._data_checked = True
        per_rank = len(self.replicas)
        costs = getattr(task, "costs", None)  # 2. shard (by cost where rows differ)
        shards = split_batch(batch, self.ranks.size * per_rank, keep_empty=True,
                             costs=None if costs is None else costs(batch))
        weights, total = shard_weights(task, shards)                          # 3. weight
        first = self.ranks.rank * per_rank
        mine = [g for g in range(first, first + per_rank) if weights[g] > 0]
        jobs = [(shards[g], grad_scale * weights[g], seed + g) for g in mine]
        # 4. sum: threads, into the model's after their backward; ranks, started during
        # the model's own backward where it runs alone in this thread (one job)
        with self._summing_during_backward(ends_step and len(jobs) == 1):
            losses = self.replicas.run(task, jobs)
        return sum((weights[g] * loss for g, loss in zip(mine, losses)), 0.0), total

    def reduce_step(self, loss_share: float) -> float:
        """Once per optimizer step, after its batches: every process's gradients and loss
        shares summed (the replicas' were summed by each batch) -> the step's mean loss."""
        if self.ranks.size == 1:
            return loss_share
        self.reduce_gradients()                                         # 4. sum, ranks
        return sum(self.ranks.allgather(loss_share))  # in rank order: equal everywhere

    def reduce_gradients(self) -> None:
        """Every process's gradients summed, in place: the buckets the backward did not
        start are started, the lookup tables summed by rows, every bucket waited on
        (:class:`~.buckets.BucketedSum`).  Frozen parameters have no gradient: they are
        not summed."""
        summing = self._summing or self._start_sum()
        self._summing = None
        summing.finish()
        params = self.model.trainable_parameters()
        # each gradient is now every rank's sum, in place: the rows this rank's lookups
        # wrote are no longer all it holds
        forget_rows_written(params)
        if self._packed is not None and summing.buffer is self._packed.buffer:
            self._packed.unpack(params)
        dense = sum(hi - lo for lo, hi in summing.bounds) * summing.buffer.itemsize
        self.reduced_bytes = dense + (self._sparse.last_bytes if self._tail else 0)

    @contextlib.contextmanager
    def _summing_during_backward(self, on: bool) -> Iterator[None]:
        """While the block runs (the step's last backward), the model's backward starts
        each gradient bucket it completes (``model._gradients_final``); nothing without
        other ranks, or when not ``on``."""
        if not on or self.ranks.size == 1:
            yield
            return
        if self._summing is not None:
            raise RuntimeError("the last batch's gradient sum has started: call reduce_step "
                               "before the next batch that ends a step")
        summing = self._start_sum()
        self.model._on_gradients_final = summing.ready
        try:
            yield
        finally:
            del self.model._on_gradients_final
        self._summing = summing  # (a backward that raised leaves none: the run ends)

    def _start_sum(self) -> BucketedSum:
        """This step's bucketed sum, nothing started yet: over the model's flat gradient
        buffer as it is (no copy), else every gradient packed into one
        (:class:`PackedGradients`), bucket by bucket as each is started."""
        params = self.model.trainable_parameters()
        flat = flat_buffer_of(params)
        if flat is not None:
            buffer, slices = flat.grad, flat.slices
            fill = flat.bind_gradients  # rebound gradients copied in, their records None
        else:
            self._packed = self._packed or PackedGradients(params)
            buffer, slices = self._packed.buffer, self._packed.slices
            fill = functools.partial(self._packed.pack, params)
        if self._buckets is None:  # once: the trainable parameters stay the same
            self._plan(params, buffer)
        return BucketedSum(params, slices, self._buckets, buffer, fill, self.start_allreduce,
                           functools.partial(self._sum_tail, buffer, fill, params))

    def _plan(self, params: Sequence[Parameter], buffer: Any) -> None:
        """The buckets and the tail (:func:`gradient_buckets`), and the tail's sum."""
        sparse = self.row_sparse and type(buffer) is np.ndarray
        self._buckets, self._tail = gradient_buckets(self.model, params, buffer.itemsize,
                                                     sparse, self.bucket_bytes)
        if self._tail:
            tables = lookup_tables(self.model)
            slices, total = flat_layout([p.shape for p in params[:self._tail]])
            self._sparse = RowSparseSum(params[:self._tail], slices, tables, total)

    def _sum_tail(self, buffer: Any, fill: Callable[[int, int], None],
                  params: Sequence[Parameter]) -> None:
        """The tail, the start of ``buffer``, summed: of each lookup table only the rows
        some rank wrote (:mod:`.sparse`; ``buffer`` holds ``params``' gradients, whose
        records of the rows written say which)."""
        if not self._tail:
            return
        fill(0, self._tail)
        self._sparse(buffer[:self._sparse.total], self.allreduce, self.ranks.allgather,
                     params[:self._tail])

    def _summed_now(self, buffer: Any) -> Any:
        """A communicator that cannot start a sum without waiting: summed at once."""
        self.allreduce(buffer)
        return DONE

    def from_main(self, value: Any) -> Any:
        return self.ranks.from_main(value)


def data_parallel(model: Module, replicas: int = 1, **same: Any) -> DataParallel | None:
    """The trainer's workers: :class:`DataParallel` across the MPI ranks when an MPI
    launcher started this process as one of several (joining them if the program has
    not), else in this process, ``replicas`` threads in each; None for one process of
    one replica (the trainer's step then runs its task itself)."""
    ranks = join_if_launched()
    if ranks.size == 1 and replicas == 1:
        return None
    return DataParallel(model, replicas, ranks, **same)


# --------------------------------------------------------------------------- its steps
def gradient_buckets(model: Module, params: Sequence[Parameter], itemsize: int,
                     row_sparse: bool = True, bucket_bytes: int = BUCKET_BYTES
                     ) -> tuple[list[tuple[int, int]], int]:
    """(the buckets of ``params``' gradients, as :func:`~.buckets.plan_buckets` gives
    them, the tail's parameter count): where ``row_sparse``, the tail is ``model``'s
    lookup tables and what lies before them (summed by rows), else empty."""
    tail = tail_of(params, lookup_tables(model)) if row_sparse else 0
    sizes = [int(np.prod(p.shape)) for p in params]
    return plan_buckets(sizes, itemsize, tail, bucket_bytes), tail


def split_batch(batch: tuple, parts: int, keep_empty: bool = False,
                costs: Any = None) -> list[tuple]:
    """Every array of a batch tuple split along its first axis into the ``parts`` shards
    of :func:`shard_bounds`, or of :func:`balanced_bounds` given each row's ``costs`` (B,)
    (without the empty ones, unless ``keep_empty``)."""
    rows = batch[0].shape[0]
    bounds = shard_bounds(rows, parts) if costs is None else balanced_bounds(costs, parts)
    return [tuple(a[lo:hi] for a in batch) for lo, hi in bounds if keep_empty or hi > lo]


def shard_weights(task: ShardTask, shards: Sequence[tuple]) -> tuple[list[float], int]:
    """([n_g / n for every shard], n): n_g = ``task.count`` of shard g (0 when it has no
    rows), n their sum.  A batch with nothing counted weighs nothing (every weight 0)."""
    counts = [task.count(shard) if shard[0].shape[0] else 0 for shard in shards]
    total = sum(counts)
    return [n / total if total else 0.0 for n in counts], total


def model_signature(model: Module) -> dict:
    """What must be equal on every rank before parameters are broadcast: the model's
    configuration and every parameter's name, shape and dtype."""
    return {"class": type(model).__name__, "config": getattr(model, "config", None),
            "parameters": [(name, tuple(p.shape), str(p.data.dtype))
                           for name, p in model.named_parameters()]}


def broadcast_parameters(model: Module, ranks: Communicator) -> None:
    """Every rank's parameters become rank 0's (one message, once; nothing when alone)."""
    if ranks.size == 1:
        return
    params = model.parameters()
    values = ranks.from_main([backend.to_numpy(p.data) for p in params])
    for p, value in zip(params, values):
        p.data = backend.asarray(value, dtype=p.data.dtype)  # a flat buffer takes it at its sync


class PackedGradients:
    """Every parameter's gradient copied into one flat buffer (P,), for gradients held as
    separate arrays (the textbook tier, CuPy, the strict backend).

    ``pack`` copies them in (they are rebound, never written in place, by the layers, so
    they cannot live in the buffer while the backward pass runs; the copy is one pass
    over the parameters' size, a bucket at a time as the backward finishes them);
    ``unpack`` makes each gradient a view of its slice (no copy back).  The buffer lives
    where the parameters do, CuPy on a GPU, NumPy otherwise (the strict backend's arrays
    are copied to the host and back); it is allocated once and reused every step.
    """

    def __init__(self, params: Sequence[Parameter]):
        self.xp = _buffer_namespace()
        self.shapes = [tuple(p.shape) for p in params]
        self.slices, total = flat_layout(self.shapes)  # as FlatParameters lays them out
        self.buffer = self.xp.zeros(total, dtype=params[0].data.dtype)  # (P,)

    def pack(self, params: Sequence[Parameter], first: int = 0, end: int | None = None) -> Any:
        """The buffer, every gradient copied in (of params[first:end] only: a bucket's)."""
        host = self.xp is np  # NumPy, or the strict backend's arrays copied to the host
        for p, (lo, hi) in zip(params[first:end], self.slices[first:end]):
            grad = backend.to_numpy(p.grad) if host else p.grad
            self.buffer[lo:hi] = self.xp.reshape(grad, (-1,))
        return self.buffer

    def unpack(self, params: Sequence[Parameter]) -> None:
        """Every gradient a view of its slice of the buffer (on the strict backend, a
        strict array made from it)."""
        strict = backend.backend_name() == "strict"
        for p, (lo, hi), shape in zip(params, self.slices, self.shapes):
            grad = self.xp.reshape(self.buffer[lo:hi], shape)
            p.grad = backend.asarray(grad) if strict else grad


def _buffer_namespace() -> Any:
    """CuPy on a GPU, NumPy otherwise (where MPI and NCCL can read a buffer)."""
    if backend.backend_name() == "cupy":
        import cupy

        return cupy
    return np

