"""Thread replicas: copies of one model run side by side in threads, on shards of a batch.

NumPy runs element-wise work (softmax, layer norm, GELU...) on one core, and only BLAS
uses several.  Running the shards of a batch in threads (NumPy, BLAS and the fast
tier's compiled kernels release the GIL) with single-threaded BLAS keeps every core
busy for the whole step.

The replicas share the model's parameter arrays (no copies; they are re-pointed before
every batch, so they see the optimizer's last step) and own their gradients and
activation caches.  After the shards, every replica's gradient is added into the
model's (of each lookup table, only the rows the replica wrote: :mod:`.sparse`): this is
how threads sum.  What each shard is, and its weight, is decided by
:class:`npformer.parallel.DataParallel`.
"""
from __future__ import annotations

import copy
import numbers
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

from .. import backend
from ..backend import single_threaded_blas
from ..nn import Module, grad_enabled, set_grad_enabled
from ..nn.flat import FlatParameters, add_rows_written, flat_buffer_of
from .shards import ShardTask
from .sparse import RowSparseSum, lookup_tables


def parallel_map(fn: Callable, items: Sequence, replicas: int) -> list:
    """[fn(item) for item in items], on ``replicas`` threads with single-threaded BLAS
    (inference over many batches: evaluation, decoding).  Order is kept.

    The caller's thread is one of them (it takes items 0, replicas, 2 replicas, ...), the
    others are kept from call to call (:func:`_helpers`): starting threads for every call
    cost more than a small model's forward gains.  Called from one of those threads (fn
    itself mapping), it runs in that thread alone."""
    items = list(items)
    if replicas <= 1 or len(items) <= 1 or getattr(_in_helper, "running", False):
        return [fn(item) for item in items]
    grad = grad_enabled()  # the caller's switch (it is per thread), for the helpers too
    count = min(replicas, len(items))

    def run(k: int) -> list:  # thread k's items: k, k + count, k + 2 count, ...
        with set_grad_enabled(grad):
            return [fn(item) for item in items[k::count]]

    def run_in_helper(k: int) -> list:
        _in_helper.running = True
        try:
            return run(k)
        finally:
            _in_helper.running = False

    with single_threaded_blas():
        started = [_helpers(count - 1).submit(run_in_helper, k) for k in range(1, count)]
        try:
            mine = run(0)
        finally:  # the helpers' work done before this returns or raises
            wait(started)
        theirs = [future.result() for future in started]
    results = [None] * len(items)
    for k, values in enumerate([mine, *theirs]):
        results[k::count] = values
    return results


_pool: ThreadPoolExecutor | None = None  # parallel_map's helper threads, kept
_pool_size = 0
_pool_lock = threading.Lock()
_in_helper = threading.local()  # whether this thread is one of them, running a map


def _helpers(count: int) -> ThreadPoolExecutor:
    """At least ``count`` kept helper threads (a larger pool replaces a smaller one)."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool_size < count:
            if _pool is not None:
                _pool.shutdown(wait=False)  # its threads end once their work is done
            _pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="parallel_map")
            _pool_size = count
        return _pool


class ThreadReplicas:
    """``count`` replicas of ``model`` (the first is the model itself) and a thread each."""

    def __init__(self, model: Module, count: int, row_sparse: bool = True):
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 1:
            raise ValueError(f"replicas must be an integer of at least 1, got {count!r}")
        self.model, self.row_sparse = model, row_sparse
        self.models = [model] + [_replica_of(model) for _ in range(int(count) - 1)]
        # Each model's parameters, listed once: the replicas are copies of the model as it
        # was here, so the lists stay paired (and no step walks the modules again).
        self.parameter_lists = [m.parameters() for m in self.models]
        # replica k > 0 always runs in thread k (its own, kept), replica 0 in the caller's:
        # each thread's allocator then serves the same replica's arrays every step, whose
        # shards differ in size from step to step (shared out by tokens)
        self.threads = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"replica-{k}")
                        for k in range(1, len(self.models))]
        self._replica_flats: dict[int, FlatParameters] = {}
        self._rows: RowSparseSum | None = None  # the tables' layout in the flat buffers

    def __len__(self) -> int:
        return len(self.models)

    def run(self, task: ShardTask, jobs: Sequence[tuple[tuple, float, int]]) -> list[float]:
        """Job k, ``(shard, grad_scale, seed)``, runs on replica k: the forward and backward
        of ``task``'s loss times ``grad_scale``, its dropout masks drawn from
        ``thread_generator(seed)``.  Afterwards the model's gradients hold their own plus
        every replica's.  Returns the jobs' mean losses.  Job 0 (the model's) runs in this
        thread, job k > 0 in replica k's own thread, the same every step."""
        if len(jobs) > len(self.models):
            raise ValueError(f"{len(jobs)} jobs for {len(self.models)} replicas")
        if len(jobs) <= 1:  # none (nothing counted here), or one: the model itself
            return [self._run_on(0, task, job) for job in jobs]
        self._share_parameters()
        self._prepare_flat_gradients(len(jobs))
        grad = grad_enabled()  # the caller's switch (it is per thread), for the replicas too
        with single_threaded_blas():
            started = [self.threads[k - 1].submit(self._run_on, k, task, jobs[k], grad)
                       for k in range(1, len(jobs))]
            try:
                mine = self._run_on(0, task, jobs[0], grad)
            finally:  # every replica's work done before this returns or raises
                wait(started)
        losses = [mine] + [future.result() for future in started]
        self._sum_gradients(len(jobs))
        return losses

    def _run_on(self, k: int, task: ShardTask, job: tuple[tuple, float, int],
                grad: bool = True) -> float:
        shard, grad_scale, seed = job
        if k > 0:  # a replica's own state, set up in its own thread (the model's: the caller's)
            self._reset_replica(k)
        with set_grad_enabled(grad), backend.thread_generator(seed):
            return task.loss_and_grad(self.models[k], shard, grad_scale)

    def _prepare_flat_gradients(self, used: int) -> None:
        """Where the model's gradients are flat: its buffer synced, and replicas 1 .. used - 1
        given their own flat gradient buffers (made on first use; their data stay the
        model's arrays), so that the replicas' gradients are summed in one pass.

        Run in the caller's thread before any replica starts: a sync copies into the buffer
        a gradient that code rebound (``model.zero_grad()`` binds fresh zeros), and made
        from a replica's thread it could copy the model's gradient while the model's own
        thread is still adding into it, losing that addition."""
        if flat_buffer_of(self.parameter_lists[0]) is None:
            return
        for i in range(1, used):
            if i not in self._replica_flats:
                self._replica_flats[i] = FlatParameters(self.parameter_lists[i],
                                                        gradients_only=True)

    def _share_parameters(self) -> None:
        """Point every replica's parameters at the model's current arrays."""
        own = self.parameter_lists[0]
        for theirs in self.parameter_lists[1:]:
            for p, q in zip(own, theirs):
                q.data = p.data

    def _reset_replica(self, k: int) -> None:
        """Replica k's gradients zero and its mode the model's (run in replica k's thread,
        beside the other replicas' work)."""
        replica, flat = self.models[k], self._replica_flats.get(k)
        if flat is not None:
            flat.zero_grad()  # one fill of the replica's gradient buffer
        else:
            replica.zero_grad()
        replica.train(self.model.training)

    def _sum_gradients(self, used: int) -> None:
        """The model's gradients += those of replicas 1 .. used - 1."""
        own = self.parameter_lists[0]
        flat = flat_buffer_of(own)
        for i in range(1, used):
            theirs, their_flat = self.parameter_lists[i], self._replica_flats.get(i)
            if flat is not None and their_flat is not None:
                their_flat.sync()
                self._add_flat(flat, their_flat)
                continue
            for p, q in zip(own, theirs):
                p.accumulate(q.grad)

    def _add_flat(self, flat: FlatParameters, theirs: FlatParameters) -> None:
        """The model's flat gradient buffer += a replica's: of each lookup table only the
        rows the replica wrote (:class:`RowSparseSum`, where ``row_sparse``; its buffer's
        records say which), the rest in one pass; the model's buffer's records of the rows
        written take the replica's (:func:`npformer.nn.flat.add_rows_written`)."""
        if not self.row_sparse:
            flat.grad += theirs.grad
        else:
            if self._rows is None:
                self._rows = RowSparseSum(flat.params, flat.slices, lookup_tables(self.model),
                                          flat.grad.size)
            self._rows.add(flat.grad, theirs.grad, theirs.params)
        add_rows_written(flat.params, theirs.params)


def _replica_of(model: Module) -> Module:
    """A deep copy of ``model`` whose parameters' data are the model's own arrays (not
    copies: every replica reads the same weights) and whose gradients are its own, made
    before its first shard (its flat buffer, or zeros): not copies of the model's, which
    would be freed at once and stay resident (the model's size, in the step's peak)."""
    params = model.parameters()
    memo = {id(p.data): p.data for p in params}
    memo.update({id(p.grad): None for p in params if p.grad is not None})
    return copy.deepcopy(model, memo=memo)
