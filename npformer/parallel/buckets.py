"""Gradient buckets: the sum across the ranks starts while the backward pass runs
(PyTorch DDP's buckets).

The trainable parameters lie end to end in one flat gradient buffer (P,): the fast
tier's own (:class:`npformer.nn.flat.FlatParameters`), or the textbook tier's gradients
copied into one (:class:`npformer.parallel.workers.PackedGradients`).  A model's backward
finishes them in about the reverse of that order: the output layer first, the last block,
..., the first block, the lookup tables last.  So, once per step:

1. **plan** (once, :func:`plan_buckets`): from the buffer's end, consecutive parameters
   make a bucket until it holds ``bucket_bytes``.  Where the lookup tables are summed by
   the rows the ranks wrote (:mod:`.sparse`), the tables and everything before them
   (the *tail*: the embeddings, at the start of every model's buffer) are no bucket;
   elsewhere the tail is empty;
2. **ready** (:meth:`BucketedSum.ready`): the model's backward names the modules whose
   gradients are final (``model._gradients_final(block)`` after each block's backward:
   nothing later adds to them); a bucket all of whose parameters are final starts at
   once, a non-blocking all-reduce of its slice in place (``MPI_Iallreduce``).  Buckets
   start in their order on every rank, a bucket waiting for those before it (MPI sums
   the collective calls of every rank in the order they were started);
3. **finish** (:meth:`BucketedSum.finish`, before the optimizer's step): the buckets not
   started yet start (all of them in a step whose backward named nothing: a model without
   the callback, gradient accumulation's earlier batches, thread replicas, whose
   gradients are added up after their backward); the tail is summed, by rows; then
   every bucket is waited on.

Each element is summed once, by one all-reduce of the same values as the whole buffer's:
the result is the one all-reduce's (equal to the sum of every rank's gradient).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

BUCKET_BYTES = 2 ** 20  # a bucket's size: the first starts after the output layer's
#                         backward (PyTorch DDP: 25 MiB; these models are a few MiB)


def plan_buckets(sizes: Sequence[int], itemsize: int, tail: int,
                 bucket_bytes: int = BUCKET_BYTES) -> list[tuple[int, int]]:
    """[(first, end)] parameter indices of each bucket, the last parameters first:
    ``sizes[i]`` the elements of parameter i (laid end to end), parameters ``[0, tail)``
    in no bucket; a bucket takes parameters from its end until it holds ``bucket_bytes``."""
    buckets, end, held = [], len(sizes), 0
    for i in range(len(sizes) - 1, tail - 1, -1):
        held += sizes[i] * itemsize
        if held >= bucket_bytes or i == tail:
            buckets.append((i, end))
            end, held = i, 0
    return buckets


def tail_of(params: Sequence[Any], tables: Iterable[Any]) -> int:
    """The parameters ``[0, tail)`` up to the last lookup table of ``tables`` (0: none)."""
    wanted = {id(t) for t in tables}
    return max((i + 1 for i, p in enumerate(params) if id(p) in wanted), default=0)


class Done:
    """A sum already made (a blocking transport, a process alone)."""

    def test(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE = Done()


class BucketedSum:
    """One step's sum of a flat gradient buffer across the ranks, bucket by bucket.

    ``params`` (in the buffer's order) and ``slices`` (their (lo, hi)); ``buckets``:
    :func:`plan_buckets`'s; ``fill(first, end)``: the gradients of params[first:end] put
    in the buffer where they are not already (the textbook's are copied in); ``start(view)``:
    a non-blocking all-reduce of a slice in place, returning a handle with ``test()`` and
    ``wait()``; ``sum_tail()``: the sum of the tail, ``buffer[:slices[tail][0]]`` (blocking).
    """

    def __init__(self, params: Sequence[Any], slices: Sequence[tuple[int, int]],
                 buckets: Sequence[tuple[int, int]], buffer: Any,
                 fill: Callable[[int, int], None], start: Callable[[Any], Any],
                 sum_tail: Callable[[], None]):
        self.buckets, self.buffer = list(buckets), buffer
        self.fill, self.start, self.sum_tail = fill, start, sum_tail
        self.bounds = [(slices[first][0], slices[end - 1][1]) for first, end in self.buckets]
        self.bucket_of = {id(params[i]): k for k, (first, end) in enumerate(self.buckets)
                          for i in range(first, end)}
        self.missing = [end - first for first, end in self.buckets]  # not final yet
        self.final: set[int] = set()
        self.pending: list = []  # the started buckets' handles, in order

    @property
    def started(self) -> int:
        """How many buckets have started (always the first ones)."""
        return len(self.pending)

    def ready(self, modules: Iterable[Any]) -> None:
        """``modules``' gradients are final (None entries ignored): each bucket they
        complete starts, in order; the started sums progress (MPI progresses a
        non-blocking call only inside MPI calls)."""
        for module in modules:
            for p in () if module is None else module.parameters():
                k = self.bucket_of.get(id(p))
                if k is not None and id(p) not in self.final:
                    self.final.add(id(p))
                    self.missing[k] -= 1
        while self.started < len(self.buckets) and self.missing[self.started] == 0:
            self._start_next()
        for handle in self.pending:
            handle.test()

    def finish(self) -> None:
        """Every bucket started (those not yet, in order), the tail summed, every bucket
        waited on: the buffer is the sum of every rank's."""
        while self.started < len(self.buckets):
            self._start_next()
        self.sum_tail()
        for handle in self.pending:
            handle.wait()

    def _start_next(self) -> None:
        first, end = self.buckets[self.started]
        lo, hi = self.bounds[self.started]
        self.fill(first, end)
        self.pending.append(self.start(self.buffer[lo:hi]))
