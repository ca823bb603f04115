"""Gradient buckets (npformer.parallel.buckets): the sum across the ranks, started bucket by
bucket while the backward pass runs, equals one process's gradients.

Without MPI: ranks stand in as threads of this process (tests/test_parallel_sparse.py's
:class:`ThreadRanks`), each with its own model and shard.  A bucket's sum is read at its
start and written at its wait (:class:`SnapshotRanks`: MPI may read a started buffer at
any moment before the wait, so a bucket started before its gradients are final would sum
the values of that moment).  The MPI runs of the same sums (2 and 3 ranks, a real
``MPI_Iallreduce``) are in tests/test_distributed.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from npformer import backend
from npformer.parallel import DataParallel
from npformer.parallel.buckets import plan_buckets, tail_of
from npformer.parallel.shards import balanced_bounds, shard_bounds
from npformer.train.tasks import Translation
from tests import parallel_cases as cases
from tests.conftest import using_backend
from tests.helpers import using_tier
from tests.test_parallel_sparse import ThreadRanks

GRAD_RTOL = 1e-12


class SnapshotRanks:
    """Rank ``rank``'s communicator over :class:`ThreadRanks`: its blocking collectives
    theirs; ``start_allreduce`` copies the buffer at the start and sums that copy at the
    ``wait`` (into the buffer), recording each start as (buffer size, whether the
    backward had finished: ``finished()``)."""

    def __init__(self, ranks: ThreadRanks, rank: int, finished=lambda: None):
        self.ranks, self.rank, self.size = ranks, rank, ranks.size
        self.comm, self.finished, self.starts = ranks.of(rank), finished, []

    def allreduce(self, buffer) -> None:
        self.comm.allreduce(buffer)

    def allgather(self, value) -> list:
        return self.comm.allgather(value)

    def from_main(self, value):
        return self.comm.allgather(value)[0]

    def check_same(self, **values) -> None:
        pass

    def start_allreduce(self, buffer):
        self.starts.append((buffer.size, self.finished()))
        snapshot, comm = buffer.copy(), self.comm

        class Started:
            def test(self) -> bool:
                return False

            def wait(self) -> None:
                comm.allreduce(snapshot)
                buffer[...] = snapshot

        return Started()


def each_rank(size: int, step) -> list:
    """[step(ranks, rank) for every rank of ``size`` :class:`ThreadRanks`], each rank in its
    thread."""
    ranks = ThreadRanks(size)
    return ranks.run(lambda _, rank: step(ranks, rank))


def bucketed_gradients(name: str, rows: int, size: int, bucket_bytes: int) -> list[dict]:
    """[rank's {name: grad} after the step's sum] of ``size`` thread ranks on the global
    batch of gradient case ``name``, each rank a model of its own."""
    built = [cases.build(name, rows) for _ in range(size)]  # the same weights, seeded

    def step(ranks, rank):
        model, task, batch = built[rank]
        engine = DataParallel(model, 1, SnapshotRanks(ranks, rank), bucket_bytes=bucket_bytes)
        model.zero_grad()
        engine.reduce_step(engine.loss_and_grad(task, batch, 1.0, seed=0, ends_step=True)[0])
        return {n: backend.to_numpy(p.grad).copy() for n, p in model.named_parameters()}

    return each_rank(size, step)


@pytest.mark.parametrize("tier", ["fast", "textbook"])
@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("bucket_bytes", [64, 2 ** 20])
@pytest.mark.parametrize("name", list(cases.GRADIENT_CASES))
def test_the_bucketed_sum_equals_the_single_process_gradients(tier, ranks, bucket_bytes,
                                                              name):
    """Every rank's summed gradients, bucket by bucket (buckets of 64 bytes: many; of
    1 MiB: one, beside the lookup tables' row-sparse sum), equal one process's gradients
    of the whole batch (float64, 1e-12 of the largest), on both tiers."""
    rows = cases.GRADIENT_CASES[name]
    with using_backend("numpy", "float64"), using_tier(tier):
        everyone = bucketed_gradients(name, rows, ranks, bucket_bytes)
        _, expected = cases.whole_batch_gradients(name, rows)
    scale = max(float(np.max(np.abs(g))) for g in expected.values())
    for grads in everyone:
        for param, g in expected.items():
            diff = float(np.max(np.abs(grads[param] - g)))
            assert diff <= GRAD_RTOL * scale, (param, diff, scale)


@pytest.mark.parametrize("tier", ["fast", "textbook"])
def test_buckets_start_while_the_backward_runs_the_last_parameters_first(tier):
    """A rank's first buckets start before its backward has reached the lookup tables
    (their gradients still zero), the buckets sized from the buffer's end; the later
    ones, and the tables, after it."""
    with using_backend("numpy", "float64"), using_tier(tier):
        built = [cases.build("classifier", 7) for _ in range(2)]

        def step(ranks, rank):
            model, task, batch = built[rank]
            table = model.embed.tokens.weight
            comm = SnapshotRanks(ranks, rank,
                                 finished=lambda: bool(np.any(backend.to_numpy(table.grad))))
            engine = DataParallel(model, 1, comm, bucket_bytes=64)
            model.zero_grad()
            engine.reduce_step(engine.loss_and_grad(task, batch, 1.0, seed=0,
                                                    ends_step=True)[0])
            return comm.starts, len(engine._buckets)

        for starts, buckets in each_rank(2, step):
            finished = [done for _, done in starts]
            assert len(starts) == buckets > 2
            assert not finished[0], "the first bucket started after the backward"
            assert finished == sorted(finished)  # before the tables' backward, then after


def test_buckets_are_cut_from_the_end_and_leave_the_tail_alone():
    """Parameters of 10, 30, 5, 20, 40 elements (8 bytes each), the first two the tail:
    buckets of at least 200 bytes from the end, the last one whatever is left."""
    assert plan_buckets([10, 30, 5, 20, 40], 8, tail=2, bucket_bytes=200) == [(4, 5), (2, 4)]
    assert plan_buckets([10, 30, 5, 20, 40], 8, tail=0, bucket_bytes=200) == \
        [(4, 5), (2, 4), (1, 2), (0, 1)]
    assert plan_buckets([10, 30, 5, 20, 40], 8, tail=0, bucket_bytes=10 ** 6) == [(0, 5)]
    assert plan_buckets([10, 30], 8, tail=2) == []
    assert tail_of(["a", "b", "c", "d"], ["b"]) == 2 and tail_of(["a", "b"], []) == 0


def test_a_step_that_starts_its_sum_twice_is_refused():
    """The buckets of a started sum are summed once: a second batch that ends a step before
    reduce_step is refused, naming what to call."""
    with using_backend("numpy", "float64"), using_tier("fast"):
        model, task, batch = cases.build("lm", 5)
        engine = DataParallel(model, 1, SnapshotRanks(ThreadRanks(1), 0))
        engine.ranks.size = 2  # a second rank, which this test never needs to reach
        model.zero_grad()
        engine.loss_and_grad(task, batch, 1.0, seed=0, ends_step=True)
        with pytest.raises(RuntimeError, match="call reduce_step"):
            engine.loss_and_grad(task, batch, 1.0, seed=0, ends_step=True)


# --------------------------------------------------------------------------- shards by cost
def test_balanced_shards_cost_within_a_row_of_their_share():
    rng = np.random.default_rng(0)
    for _ in range(200):
        costs = rng.integers(0, 30, rng.integers(0, 40))
        parts = int(rng.integers(1, 6))
        bounds = balanced_bounds(costs, parts)
        assert bounds[0][0] == 0 and bounds[-1][1] == costs.size
        assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(bounds, bounds[1:]))
        share = costs.sum() / parts
        biggest = costs.max(initial=0)
        for lo, hi in bounds:
            assert abs(costs[lo:hi].sum() - share) <= biggest, (costs, parts, bounds)


def test_rows_of_equal_cost_are_shared_out_as_rows():
    """Equal costs: shard sizes differ by at most one, as :func:`shard_bounds`'; rows that
    cost nothing are shared out by :func:`shard_bounds` itself."""
    for rows in range(12):
        for parts in range(1, 5):
            sizes = [hi - lo for lo, hi in balanced_bounds(np.full(rows, 3), parts)]
            assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1, (rows, parts)
            assert balanced_bounds(np.zeros(rows), parts) == shard_bounds(rows, parts)


def test_translation_rows_cost_their_source_and_target_tokens():
    """Short sentences first, long ones last (a length-sorted batch): by rows the second
    rank would compute twice the tokens; by cost both compute about as many."""
    src_lens = np.array([2, 2, 2, 2, 2, 2, 8, 8, 8])
    tgt_lens = src_lens + 1
    batch = (np.zeros((9, 8)), src_lens, np.zeros((9, 9)), np.zeros((9, 9)), tgt_lens)
    costs = Translation().costs(batch)
    assert costs.tolist() == (src_lens + tgt_lens).tolist()
    for lo, hi in balanced_bounds(costs, 2):
        assert abs(costs[lo:hi].sum() - costs.sum() / 2) <= costs.max() / 2
    (a, b), (c, d) = shard_bounds(9, 2)
    assert costs[c:d].sum() > 2 * costs[a:b].sum()
