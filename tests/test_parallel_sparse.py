"""Row-sparse gradient sums (npformer.parallel.sparse) equal whole sums.

Without MPI: ranks stand in as threads of this process (:class:`ThreadRanks`, whose
all-reduce adds every rank's buffer in rank order, as one would by hand), so each rank
holds its own gradients.  The 2- and 3-rank MPI runs of the same sums are in
tests/test_distributed.py.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from npformer.nn import Parameter
from npformer.parallel import DataParallel, sparse
from npformer.parallel.sparse import RowSparseSum, changed_rows, dense_runs
from tests import parallel_cases as cases
from tests.conftest import using_backend
from tests.helpers import using_tier


class ThreadRanks:
    """``size`` ranks that are threads of this process: rank r's communicator is
    ``ranks.of(r)``; ``allgather`` and ``allreduce`` (the buffers added in rank order)
    wait for every rank, as MPI's collectives do."""

    def __init__(self, size: int):
        self.size, self.barrier, self.slots = size, threading.Barrier(size), [None] * size

    def gather(self, rank: int, value):
        self.slots[rank] = value
        self.barrier.wait()
        everyone = list(self.slots)
        self.barrier.wait()  # every rank has read the slots before they are written again
        return everyone

    def of(self, rank: int):
        ranks = self

        class Rank:
            def allgather(self, value):
                return ranks.gather(rank, value)

            def allreduce(self, buffer):
                values = ranks.gather(rank, buffer.copy())
                total = values[0].copy()
                for value in values[1:]:
                    total += value
                buffer[...] = total

        return Rank()

    def run(self, fn):
        """[fn(rank's communicator, rank) for every rank], each rank in its thread."""
        results, errors = [None] * self.size, []

        def one(rank):
            try:
                results[rank] = fn(self.of(rank), rank)
            except BaseException as e:  # pragma: no cover - reported below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


# --------------------------------------------------------------------------- changed rows
@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_changed_rows_are_those_with_any_bit_but_plus_zeros(monkeypatch, compiled, dtype):
    """A row is changed by any value whose bits are not +0.0's, wherever it sits in the
    row: the last column alone, -0.0, NaN, a subnormal, inf."""
    if compiled:
        pytest.importorskip("numba")  # loaded: the scan compiles (as in the fast tier)
        assert sparse._compiled_scan()
    else:
        monkeypatch.setattr(sparse, "_compiled_scan", lambda: False)  # NumPy's any instead
    table = np.zeros((8, 5), dtype=dtype)
    table[1, 4] = 1e-3                                  # the last column only
    table[2, 0] = -0.0
    table[3, 2] = np.nan
    table[4, 1] = np.finfo(dtype).smallest_subnormal
    table[5, 3] = -np.inf
    table[7, :] = 2.0
    assert changed_rows(table).tolist() == [False, True, True, True, True, True, False, True]
    assert changed_rows(np.zeros((3, 0), dtype=dtype)).tolist() == [False] * 3


def test_dense_runs_are_the_gaps_between_the_tables():
    assert dense_runs(10, []) == [(0, 10)]
    assert dense_runs(10, [(2, 4), (6, 10)]) == [(0, 2), (4, 6)]
    assert dense_runs(10, [(0, 3), (3, 5)]) == [(5, 10)]


# --------------------------------------------------------------------------- the sum
def layout(dtype):
    """(params, slices, tables, total): a vector, a (40, 3) table, a matrix, a (50, 2)
    table, a vector, laid end to end as a flat buffer lays them."""
    shapes = [(4,), (40, 3), (2, 3), (50, 2), (5,)]
    params = [Parameter(np.zeros(s, dtype=dtype)) for s in shapes]
    slices, at = [], 0
    for s in shapes:
        slices.append((at, at + int(np.prod(s))))
        at += int(np.prod(s))
    return params, slices, [params[1], params[3]], at


def rank_gradients(seed: int, rank: int, slices, dtype, crowded: bool) -> np.ndarray:
    """Rank ``rank``'s flat gradient: every dense value random; a few rows of each table
    changed (one of them only in its last column, one only by a -0.0); ``crowded``:
    the second table changed in most of its rows."""
    rng = np.random.default_rng([seed, rank])
    buffer = rng.standard_normal(slices[-1][1]).astype(dtype)
    for (lo, hi), cols, share in ((slices[1], 3, 0.1), (slices[3], 2, 0.9 if crowded else 0.1)):
        table = buffer[lo:hi].reshape(-1, cols)
        table[rng.random(table.shape[0]) >= share] = 0.0
        last, negative = rng.integers(0, table.shape[0], 2)
        table[last] = 0.0
        table[last, -1] = 1.5 + rank  # changed only in its last column, on this rank only
        table[negative] = 0.0
        table[negative, 0] = -0.0
    return buffer


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("crowded", [False, True])
@pytest.mark.parametrize("packed_run_bytes", [2 ** 20, 40])
@pytest.mark.parametrize("seed", range(4))
def test_the_row_sparse_sum_equals_the_whole_sum_bit_for_bit(monkeypatch, ranks, dtype,
                                                             crowded, packed_run_bytes, seed):
    """Every rank ends with the buffer the whole sum gives (the same additions in the same
    order: bit for bit), a row changed on one rank only in its last column included;
    the tables' unchanged rows are not sent (a table changed in most rows goes whole).
    The other parameters' runs travel with the rows, or (over 40 bytes) in place."""
    monkeypatch.setattr(sparse, "PACKED_RUN_BYTES", packed_run_bytes)
    params, slices, tables, total = layout(dtype)
    grads = [rank_gradients(seed, r, slices, dtype, crowded) for r in range(ranks)]
    whole = grads[0].copy()
    for g in grads[1:]:
        whole += g
    lo, hi = slices[3]
    second_whole = np.any([changed_rows(g[lo:hi].reshape(50, 2)) for g in grads],
                          axis=0).sum() > 25
    assert second_whole or not crowded

    def reduce(comm, rank):
        summer = RowSparseSum(params, slices, tables, total)
        buffer, calls = grads[rank].copy(), []

        def allreduce(b):
            calls.append(b.size)
            comm.allreduce(b)

        summer(buffer, allreduce, comm.allgather)
        return buffer, summer.last_bytes, calls

    for buffer, sent, calls in ThreadRanks(ranks).run(reduce):
        # the runs between the sparse tables (a second table changed in over half its
        # rows joins its neighbours) over 40 bytes (5 float64 or 10 float32 values) in
        # place, then one message
        runs = (4, 6 + 100 + 5) if second_whole else (4, 6, 5)
        large = [n for n in runs if n * np.dtype(dtype).itemsize > packed_run_bytes]
        assert calls[:-1] == large and len(calls) == len(large) + 1, calls
        assert np.array_equal(buffer.view(f"u{buffer.itemsize}"),
                              whole.view(f"u{whole.itemsize}"))
        itemsize = np.dtype(dtype).itemsize
        assert sent < (total - 40 * 3 // 2) * itemsize  # the first table's rows did not all go
        assert (sent >= (total - 40 * 3) * itemsize) if crowded else (sent < total * itemsize)


def test_a_model_without_lookup_tables_sums_its_buffer_as_it_is():
    params, slices, _, total = layout(np.float64)
    given = []

    def reduce(comm, rank):
        buffer = np.full(total, rank + 1.0)

        def allreduce(b):
            given.append(b is buffer)
            comm.allreduce(b)

        RowSparseSum(params, slices, [], total)(buffer, allreduce, comm.allgather)
        return buffer

    for buffer in ThreadRanks(2).run(reduce):
        assert np.array_equal(buffer, np.full(total, 3.0))
    assert given == [True, True]  # one all-reduce a rank, of the buffer itself


# --------------------------------------------------------------------------- thread replicas
def test_thread_replicas_adding_changed_rows_equal_adding_whole():
    """Two thread replicas of the sparse case on the fast tier (a flat gradient buffer;
    token and word-pair tables touched in few rows): the model's gradients after the
    replicas' are added by row equal those added whole, and one process's."""
    with using_backend("numpy", "float64"), using_tier("fast"):
        by_rows, _ = cases.reduced_gradients(None, 2, row_sparse=True)
        whole, _ = cases.reduced_gradients(None, 2, row_sparse=False)
        model, task, batch = cases.build("sparse", 6)
        model.zero_grad()
        task.loss_and_grad(model, batch, 1.0)
        alone = {name: p.grad for name, p in model.named_parameters()}
    for name in ("embed.tokens.weight", "bigrams.weight"):  # few rows: the sparse branch ran
        assert changed_rows(whole[name]).mean() < sparse.WHOLE_TABLE_SHARE, name
    for name, g in whole.items():
        assert np.array_equal(by_rows[name], g), name
        assert np.allclose(g, alone[name], rtol=1e-12, atol=1e-15), name


def test_data_parallel_passes_row_sparse_to_its_replicas():
    with using_backend("numpy", "float64"), using_tier("fast"):
        model, _, _ = cases.build("sparse", 6)
        assert DataParallel(model, 2, row_sparse=False).replicas.row_sparse is False
        assert DataParallel(model, 2).replicas.row_sparse is True
