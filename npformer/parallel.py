"""Data parallelism inside one process: split a batch across model replicas run in threads.

NumPy runs element-wise work (softmax, layer norm, GELU...) on one core, and
only BLAS uses several.  Splitting each batch in two, running the halves in two
threads (NumPy and BLAS release the GIL) with single-threaded BLAS, keeps every
core busy for the whole step.

The replicas share the model's parameter arrays (no copies; they are re-pointed
after every optimizer step) and own their gradients and activation caches.
Shard i's loss is weighted by its share of the batch's counted items, so the
summed gradient equals that of the whole batch:

    L = sum_i (n_i / n) L_i      =>      dL/dw = sum_i (n_i / n) dL_i/dw

The same replica-and-sum-gradients idea extends across processes in
:mod:`npformer.distributed`: each MPI rank runs a :class:`DataParallel` of its own
on its rows of the global batch, and the sum becomes one all-reduce.  Both engines
answer the same three calls the :class:`npformer.train.Trainer` makes:
``loss_and_grad`` (per batch), ``reduce_step`` (once per optimizer step) and
``from_main`` (a decision every process must share), plus ``is_main``.
"""
from __future__ import annotations

import copy
import numbers
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np

from . import backend
from .nn import FlatParameters, Module, flat_parameters_of, grad_enabled, set_grad_enabled

if TYPE_CHECKING:  # annotations only: importing these here would be circular
    from .tasks import Task


def shard_bounds(rows: int, parts: int) -> list[tuple[int, int]]:
    """[(lo, hi)] of ``parts`` contiguous shards covering ``range(rows)``, sizes differing
    by at most one (the later shards are the larger); shards are empty when rows < parts."""
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    bounds = np.linspace(0, rows, parts + 1).astype(int)
    return [(int(lo), int(hi)) for lo, hi in zip(bounds[:-1], bounds[1:])]


def split_batch(batch: tuple, parts: int) -> list[tuple]:
    """Split every array of a batch tuple along its first axis into ``parts`` shards
    (never an empty one: fewer shards when the batch has fewer rows than ``parts``)."""
    return [tuple(a[lo:hi] for a in batch)
            for lo, hi in shard_bounds(batch[0].shape[0], parts) if hi > lo]


_blas_controller = None  # found once: looking up the loaded BLAS libraries reads /proc


def _single_threaded_blas():
    global _blas_controller
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - threadpoolctl is a dependency
        return nullcontext()
    if _blas_controller is None:
        _blas_controller = ThreadpoolController()
    return _blas_controller.limit(limits=1, user_api="blas")


def parallel_map(fn: Callable, items: Sequence, replicas: int) -> list:
    """[fn(item) for item in items], on ``replicas`` threads with single-threaded BLAS
    (inference over many batches: evaluation, decoding).  Order is kept."""
    items = list(items)
    if replicas <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    grad = grad_enabled()  # the caller's switch (it is per thread), for the workers too

    def run(item):
        with set_grad_enabled(grad):
            return fn(item)

    with ThreadPoolExecutor(max_workers=replicas) as pool, _single_threaded_blas():
        return list(pool.map(run, items))


class DataParallel:
    """Runs a :class:`npformer.tasks.Task` on ``replicas`` shards of a batch in threads.

    ``task.count(shard)`` weights each shard's loss (rows, tokens, or non-padding
    target tokens), so the summed gradient is the whole batch's.  Shard i draws its
    dropout masks from ``thread_generator(seed + i)``.
    """

    is_main = True  # the one process: it prints and saves

    def __init__(self, model: Module, replicas: int = 2):
        if isinstance(replicas, bool) or not isinstance(replicas, numbers.Integral) \
                or replicas < 1:
            raise ValueError(f"replicas must be an integer of at least 1, got {replicas!r}")
        replicas = int(replicas)
        self.model = model
        self.models = [model] + [copy.deepcopy(model) for _ in range(replicas - 1)]
        self.pool = ThreadPoolExecutor(max_workers=replicas) if replicas > 1 else None
        self._replica_flats: dict[int, FlatParameters] = {}

    def _replica_flat(self, i: int):
        """Replica i's own flat gradient buffer, where the model's gradients are flat
        (made on first use): the replicas' gradients are then summed in one pass."""
        if flat_parameters_of(self.model.parameters()) is None:
            return None
        if i not in self._replica_flats:
            self._replica_flats[i] = FlatParameters(self.models[i].parameters())
        return self._replica_flats[i]

    def _share_parameters(self) -> None:
        """Point every replica's parameters at the model's current arrays; zero their grads."""
        own = self.model.parameters()
        for i, replica in enumerate(self.models[1:], start=1):
            flat = self._replica_flat(i)
            for p, q in zip(own, replica.parameters()):
                q.data = p.data
                if flat is None:
                    q.zero_grad()
            if flat is not None:
                flat.zero_grad()  # one fill of the replica's gradient buffer
            replica.train(self.model.training)

    def _sum_gradients(self) -> None:
        own = self.model.parameters()
        flat = flat_parameters_of(own)
        for i, replica in enumerate(self.models[1:], start=1):
            theirs = self._replica_flats.get(i)
            if flat is not None and theirs is not None \
                    and theirs.grads_intact(replica.parameters()):
                flat.grad += theirs.grad  # every parameter's share in one pass
                continue
            for p, q in zip(own, replica.parameters()):
                p.accumulate(q.grad)

    def loss_and_grad(self, task: Task, batch: tuple, grad_scale: float,
                      seed: int) -> tuple[float, int]:
        """Forward + backward of ``batch`` split across the replicas -> (mean loss, count)."""
        shards = split_batch(batch, len(self.models))
        if len(shards) == 1 or self.pool is None:
            with backend.thread_generator(seed):
                return task.loss_and_grad(self.model, batch, grad_scale), task.count(batch)
        counts = [task.count(shard) for shard in shards]
        total = sum(counts)
        self._share_parameters()

        def run(i):
            with backend.thread_generator(seed + i):
                return task.loss_and_grad(self.models[i], shards[i],
                                        grad_scale * counts[i] / total)

        with _single_threaded_blas():
            losses = list(self.pool.map(run, range(len(shards))))
        self._sum_gradients()
        return sum(loss * n for loss, n in zip(losses, counts)) / total, total

    def reduce_step(self, loss: float) -> float:
        """Once per optimizer step, after the batches: the gradients are already summed
        (in :meth:`loss_and_grad`), so the step's mean loss is returned as it is."""
        return loss

    def from_main(self, value: Any) -> Any:
        """A decision every process must share (stop on a time budget): one process, as is."""
        return value
