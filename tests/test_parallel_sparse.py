"""Row-sparse gradient sums (npformer.parallel.sparse) equal whole sums.

Without MPI: ranks stand in as threads of this process (:class:`ThreadRanks`, whose
all-reduce adds every rank's buffer in rank order, as one would by hand), so each rank
holds its own gradients.  The 2- and 3-rank MPI runs of the same sums are in
tests/test_distributed.py.

The rows a sum sends come from each gradient's record of the rows written where it is
known: a flat buffer keeps it, of each gradient view (``npformer.nn.flat.rows_written``),
and only the fast tier's lookups add to it; the textbook tier has none (its tables are
read).  The tests of "the rows written" check that every way of writing a gradient keeps
the record true (no row outside it holds anything but +0.0) or makes it None, and that
the sums then equal the whole sums, without reading the tables where it is known.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from npformer import ops, optim
from npformer.fast import optim as fast_optim
from npformer.nn import Parameter
from npformer.nn.flat import (
    MAX_WRITES_KEPT,
    FlatParameters,
    accumulate,
    add_rows_written,
    flat_buffer_of,
    rows_written,
)
from npformer.parallel import DataParallel, sparse
from npformer.parallel.sparse import RowSparseSum, changed_rows, dense_runs, recorded_rows
from tests import parallel_cases as cases
from tests.conftest import using_backend
from tests.helpers import tiered, using_tier


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


# --------------------------------------------------------------------------- the rows written
def recorded(p: Parameter) -> np.ndarray | None:
    """``p``'s record of the rows written as (V,) bool, or None (not known)."""
    record = rows_written(p)
    return None if record is None else recorded_rows(record, p.shape[0])


def assert_record_holds(p: Parameter, name: str = "") -> None:
    """No row of ``p``'s gradient outside its record holds anything but +0.0 (a record of
    None claims nothing)."""
    mask = recorded(p)
    if mask is not None:
        missed = changed_rows(np.asarray(p.grad).reshape(p.shape[0], -1)) & ~mask
        assert not missed.any(), f"{name}: rows {np.flatnonzero(missed)} written, not recorded"


def looked_up(table, ids, dy_values=None):
    """``table`` (an Embedding) looks ``ids`` up and takes the backward of ``dy_values``
    (random where None) -> dy."""
    y = table(ids)
    dy = np.random.default_rng(7).standard_normal(y.shape) if dy_values is None else dy_values
    table.backward(dy.astype(y.dtype))
    return dy


def in_a_buffer(module) -> FlatParameters:
    """``module``'s parameters put in a flat buffer of their own (as a fast model's are
    when built), zeroed: every record empty."""
    flat = FlatParameters(module.parameters())
    flat.zero_grad()
    return flat


def zeroed(model) -> None:
    """``model``'s gradients zero as the Trainer's optimizer zeroes them: through its flat
    buffer where it has one (the records emptied), else each parameter's."""
    flat = flat_buffer_of(model.parameters())
    (model if flat is None else flat).zero_grad()


TIERS = ["fast", "textbook"]


def test_the_textbook_parameter_keeps_no_record():
    """A Parameter is an array and its gradient: no record, no rows to accumulate with."""
    assert Parameter.__slots__ == ("data", "grad", "decay", "frozen")
    p = Parameter(np.zeros((3, 2)))
    assert not hasattr(p, "rows_written") and not hasattr(p, "rebind_grad")
    with pytest.raises(TypeError):
        p.accumulate(np.ones((3, 2)), np.array([0]))
    assert rows_written(p) is None  # no buffer holds its gradient


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_lookup_records_the_rows_it_looked_up(tier, dtype):
    """The fast tier: a lookup's backward records its ids (repeats and all) in the flat
    buffer and nothing else: every other row is +0.0; a row whose gradient is -0.0 (added
    to +0.0: +0.0) or NaN is recorded.  The textbook's rebinds the gradient: no record,
    before or after the buffer's sync (the rows are found by reading the table)."""
    with using_backend("numpy", dtype), using_tier(tier):
        table = tiered.Embedding(50, 4)
        ids = np.array([[3, 7, 3], [49, 0, 11]])
        dy = np.random.default_rng(1).standard_normal((2, 3, 4))
        dy[1, 1] = -0.0  # row 0: only a -0.0, which leaves it +0.0
        dy[1, 2, 2] = np.nan  # row 11: a NaN
        looked_up(table, ids, dy)
        assert rows_written(table.weight) is None  # in no buffer: no record
        table.zero_grad()
        flat = in_a_buffer(table)
        assert rows_written(table.weight) == ()
        looked_up(table, ids, dy)
        changed = changed_rows(table.weight.grad)
        assert np.flatnonzero(changed).tolist() == [3, 7, 11, 49]
        if tier == "textbook":
            assert rows_written(table.weight) is None
            flat.sync()
            assert rows_written(table.weight) is None and table.weight.grad.base is flat.grad
            return
        mask = recorded(table.weight)
        assert np.flatnonzero(mask).tolist() == [0, 3, 7, 11, 49]
        assert_record_holds(table.weight)
        assert changed.tolist() == (mask & (np.arange(50) != 0)).tolist()
        ids[...] = 20  # the caller reusing its array of ids: the record kept its own
        assert np.flatnonzero(recorded(table.weight)).tolist() == [0, 3, 7, 11, 49]


@pytest.mark.parametrize("tier", TIERS)
def test_lookups_of_several_batches_record_every_row(tier):
    """Gradient accumulation: the lookups of two batches (no zeroing between) record the
    rows of both; the buffer's zeroing empties the record; a record of many writes stays
    bounded.  The textbook's: none, each time."""
    with using_backend("numpy", "float64"), using_tier(tier):
        table = tiered.Embedding(50, 4)
        flat = in_a_buffer(table)
        looked_up(table, np.array([[1, 2]]))
        looked_up(table, np.array([[2, 30]]))
        if tier == "textbook":
            assert rows_written(table.weight) is None
        else:
            assert np.flatnonzero(recorded(table.weight)).tolist() == [1, 2, 30]
            assert_record_holds(table.weight)
        flat.zero_grad()
        assert rows_written(table.weight) == () and not np.any(table.weight.grad)
        for i in range(MAX_WRITES_KEPT + 5):
            looked_up(table, np.array([[i]]))
            if tier == "fast":
                assert len(rows_written(table.weight)) <= MAX_WRITES_KEPT
        if tier == "textbook":
            assert rows_written(table.weight) is None
            return
        assert np.flatnonzero(recorded(table.weight)).tolist() == list(range(MAX_WRITES_KEPT + 5))
        assert_record_holds(table.weight)


@pytest.mark.parametrize("tier", TIERS)
def test_zeroing_through_the_buffer_empties_the_record_and_rebinding_zeros_do_not(tier):
    """The buffer's zeroing and the fast optimizer's (which zeroes its buffer) bind the
    views and empty the record; the textbook's zeroings (the parameter's, the module's,
    the textbook optimizer's, unfreeze) bind fresh zeros, which the buffer does not know:
    None, and still None once the sync has copied them in (the sum then reads the table)."""
    with using_backend("numpy", "float64"), using_tier(tier):
        table = tiered.Embedding(20, 4)
        flat = in_a_buffer(table)
        p = table.weight
        for zero in (flat.zero_grad, fast_optim.Adam([p], lr=1e-3).zero_grad):
            looked_up(table, np.array([[1]]))
            zero()
            assert rows_written(p) == () and p.grad.base is flat.grad and not np.any(p.grad)
        for zero in (p.zero_grad, table.zero_grad, optim.Adam([p], lr=1e-3).zero_grad,
                     lambda: (p.freeze(), p.unfreeze())):
            flat.zero_grad()
            zero()
            assert rows_written(p) is None and not np.any(p.grad), zero
            looked_up(table, np.array([[1]]))  # (the fast tier's added in the fresh zeros)
            flat.sync()
            assert rows_written(p) is None and p.grad.base is flat.grad, zero


@pytest.mark.parametrize("tier", TIERS)
def test_a_models_zero_grad_empties_the_record_on_the_fast_tier(tier):
    """``model.zero_grad()``: the fast model zeroes through its flat buffer (the tables'
    records empty, the views bound, a frozen parameter's gradient still None); the
    textbook's binds fresh zeros, whose rows are not known (None)."""
    with using_backend("numpy", "float64"), using_tier(tier):
        model, task, batch = cases.build("sparse", 6)
        zeroed(model)
        task.loss_and_grad(model, batch, 1.0)
        table, frozen = model.embed.tokens.weight, model.bigrams.weight
        assert tier == "textbook" or rows_written(table) != ()  # the lookups recorded
        frozen.freeze()
        model.zero_grad()
        assert frozen.grad is None
        for name, p in model.named_parameters():
            if p is frozen:
                continue
            assert not np.any(p.grad), name
            if tier == "fast":
                assert rows_written(p) == () and p.grad.base is not None, name
            else:
                assert rows_written(p) is None, name


@pytest.mark.parametrize("tier", TIERS)
def test_a_tied_projection_makes_the_record_unknown(tier):
    """A table that is also an output projection has its gradient in every row: after
    the projection's backward, before or after the lookup's, the record is None (the
    sum reads the table); the tied language model's table likewise."""
    with using_backend("numpy", "float64"), using_tier(tier):
        table = tiered.Embedding(20, 4)
        flat = in_a_buffer(table)
        h = np.random.default_rng(2).standard_normal((3, 4))
        table.project(h)
        table.project_backward(np.ones((3, 20)))
        assert rows_written(table.weight) is None
        looked_up(table, np.array([[1]]))  # a lookup after it does not make it known
        assert rows_written(table.weight) is None
        flat.zero_grad()
        looked_up(table, np.array([[1]]))
        assert (rows_written(table.weight) is None) == (tier == "textbook")
        table.project(h)
        table.project_backward(np.ones((3, 20)))
        flat.sync()
        assert rows_written(table.weight) is None
        model, task, batch = cases.build("lm", 5)
        assert model.config.tie_weights
        zeroed(model)
        task.loss_and_grad(model, batch, 1.0)
        assert rows_written(model.embed.tokens.weight) is None
        flat_buffer_of(model.parameters())  # synced, where there is a buffer
        assert rows_written(model.embed.tokens.weight) is None


def assigned(p):
    p.grad = p.grad + 1.0


def assigned_then_looked_up(table):
    """A gradient rebound, then a lookup added into the rebound array (the fast tier's
    adds in place, into whichever array is bound)."""
    assigned(table.weight)
    looked_up(table, np.array([[2]]))


@pytest.mark.parametrize("tier", TIERS)
def test_any_other_write_of_a_gradient_makes_the_record_unknown(tier):
    """Rebinding ``grad`` in any way (assigned, accumulated by the textbook parameter,
    clipped by the textbook's clip, freed by freeze; with a lookup after it) makes the
    record None, before the buffer's sync and after it; so does the fast tier's in-place
    addition without rows.  The textbook tier's lookup has left none to lose."""
    writes = [lambda t: assigned(t.weight), assigned_then_looked_up,
              lambda t: t.weight.accumulate(np.ones(t.weight.shape)),
              lambda t: optim.clip_grad_norm([t.weight], 1e-3),
              lambda t: t.weight.freeze(),
              lambda t: accumulate(t.weight, np.ones(t.weight.shape)),
              lambda t: accumulate(t.weight, np.ones(t.weight.shape), None)]
    with using_backend("numpy", "float64"), using_tier(tier):
        for write in writes:
            table = tiered.Embedding(20, 4)
            flat = in_a_buffer(table)
            looked_up(table, np.array([[1, 5]]))
            assert (rows_written(table.weight) is None) == (tier == "textbook")
            write(table)
            assert rows_written(table.weight) is None, write
            flat.sync()
            assert rows_written(table.weight) is None, write


def test_a_flat_buffer_keeps_the_record_with_the_values():
    """A fast model's buffer: its zeroing empties the records; a sync with nothing rebound
    keeps them; the fast tier's clipping scales in place by a positive number (+0.0 stays
    +0.0: the records stay true); a replica's gradients-only buffer keeps records too, and
    added in, the model's records take its rows (add_rows_written)."""
    with using_backend("numpy", "float64"), using_tier("fast"):
        model, task, batch = cases.build("sparse", 6)
        params = model.parameters()
        flat = flat_buffer_of(params)
        flat.zero_grad()
        assert all(rows_written(p) == () for p in params)
        task.loss_and_grad(model, batch, 1.0)
        tables = sparse.lookup_tables(model)
        before = [recorded(t) for t in tables]
        assert all(mask is not None and mask.any() for mask in before)
        assert flat_buffer_of(params) is flat  # synced
        for t, mask in zip(tables, before):
            assert np.array_equal(recorded(t), mask)
            assert_record_holds(t)
        fast_optim.clip_grad_norm(params, 1e-3)
        for t, mask in zip(tables, before):
            assert np.array_equal(recorded(t), mask)
            assert_record_holds(t)
        replica = [Parameter(np.zeros(p.shape)) for p in params]
        theirs = FlatParameters(replica, gradients_only=True)
        theirs.zero_grad()
        at = params.index(tables[0])
        one_row = np.zeros(tables[0].shape)
        one_row[399] = 1.0
        accumulate(replica[at], one_row, np.array([399]))
        accumulate(replica[-1], np.ones(replica[-1].shape))
        assert np.flatnonzero(recorded(replica[at])).tolist() == [399]
        assert rows_written(replica[-1]) is None
        flat.grad += theirs.grad
        add_rows_written(params, replica)
        assert np.flatnonzero(recorded(tables[0])).tolist() == \
            sorted(set(np.flatnonzero(before[0])) | {399})
        assert rows_written(params[-1]) is None
        for p in params:
            assert_record_holds(p)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_models_records_hold_and_are_its_lookups(tier, dtype):
    """The sparse case's backward: every parameter's record holds; on the fast tier the
    tables' are exactly the ids they looked up (tokens, hashed word pairs), a superset of
    the rows a scan finds (a row looked up only where the gradient is zero is recorded
    too); the textbook's has none, and a scan finds only looked-up rows."""
    with using_backend("numpy", dtype), using_tier(tier):
        model, task, batch = cases.build("sparse", 6)
        zeroed(model)
        task.loss_and_grad(model, batch, 1.0)
        for name, p in model.named_parameters():
            assert_record_holds(p, name)
        ids = batch[0]
        pairs = ops.hashed_bigrams(ids, model.config.bigram_buckets)
        for table, looked in ((model.embed.tokens.weight, ids), (model.bigrams.weight, pairs)):
            looked = np.zeros(table.shape[0], dtype=bool)
            looked[np.unique(ids if table is model.embed.tokens.weight else pairs)] = True
            if tier == "textbook":
                assert rows_written(table) is None
            else:
                assert np.array_equal(recorded(table), looked)
            assert changed_rows(table.grad).any()
            assert not np.any(changed_rows(table.grad) & ~looked)


def counting_scans(monkeypatch) -> list:
    """Every call of sparse.changed_rows (a table read to find its rows) appended."""
    calls, scan = [], sparse.changed_rows

    def counted(table):
        calls.append(table.shape)
        return scan(table)

    monkeypatch.setattr(sparse, "changed_rows", counted)
    return calls


@pytest.mark.parametrize("tier", TIERS)
def test_thread_replicas_add_the_rows_their_records_name(monkeypatch, tier):
    """Two thread replicas: on the fast tier (flat buffers, the replica's of gradients
    only) the replica's tables are added by the rows of its records (no table read), and
    the model's records then name both replicas' rows; on the textbook's, each gradient
    is accumulated, no record.  Every record holds, and the gradients equal those added
    whole, bit for bit."""
    with using_backend("numpy", "float64"), using_tier(tier):
        whole, _ = cases.reduced_gradients(None, 2, row_sparse=False)
        scans = counting_scans(monkeypatch)
        model, task, batch = cases.build("sparse", 6)
        engine = DataParallel(model, 2)
        zeroed(model)
        engine.loss_and_grad(task, batch, 1.0, seed=0)
    assert scans == []
    for name, p in model.named_parameters():
        assert np.array_equal(p.grad, whole[name]), name
        assert_record_holds(p, name)
    if tier == "fast":
        assert np.flatnonzero(recorded(model.embed.tokens.weight)).tolist() == \
            np.unique(batch[0]).tolist()  # both shards' ids
    else:
        assert rows_written(model.embed.tokens.weight) is None


def ranks_gradients(kind: str, rows: int, size: int, replicas: int, row_sparse: bool,
                    micro_batches: int = 1, edit=None) -> list[tuple[dict, list, int]]:
    """[each rank's ({name: grad}, its parameters' records, bytes sent)] after one step of
    ``micro_batches`` batches (the same batch again) summed across ``size`` thread ranks
    (tests/test_buckets.py's SnapshotRanks), the gradients zeroed as the Trainer zeroes
    them (:func:`zeroed`); ``edit(model, rank)``, where given, before the sum."""
    from tests.test_buckets import SnapshotRanks, each_rank

    built = [cases.build(kind, rows) for _ in range(size)]

    def step(ranks, rank):
        model, task, batch = built[rank]
        engine = DataParallel(model, replicas, SnapshotRanks(ranks, rank), row_sparse=row_sparse)
        zeroed(model)
        share = 0.0
        for i in range(micro_batches):
            share += engine.loss_and_grad(task, batch, 1.0, seed=i,
                                          ends_step=i == micro_batches - 1)[0]
        if edit is not None:
            edit(model, rank)
        engine.reduce_step(share)
        return ({n: np.asarray(p.grad).copy() for n, p in model.named_parameters()},
                [rows_written(p) for p in model.parameters()], engine.reduced_bytes)

    return each_rank(size, step)


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_the_ranks_sum_the_rows_their_records_name(monkeypatch, tier, size, replicas,
                                                   micro_batches):
    """Ranks (threads standing in) of 1 or 2 replicas, one or two batches a step: on the
    fast tier the sum by the records' rows reads no table; the textbook tier's has no
    record and reads each table once a rank.  Either sends less than the whole sum and
    equals it bit for bit; after the sum no record claims anything (the gradients are
    every rank's)."""
    with using_backend("numpy", "float64"), using_tier(tier):
        whole = ranks_gradients("sparse", 6, size, replicas, False, micro_batches)
        scans = counting_scans(monkeypatch)
        by_rows = ranks_gradients("sparse", 6, size, replicas, True, micro_batches)
    assert len(scans) == (2 * size if tier == "textbook" else 0)  # two tables a rank
    for (grads, records, sent), (expected, _, whole_sent) in zip(by_rows, whole):
        assert sent < whole_sent / 2
        for name, g in expected.items():
            assert np.array_equal(grads[name].view(np.uint64), g.view(np.uint64)), name
        assert records and all(record is None for record in records)


@pytest.mark.parametrize("tier", TIERS)
def test_a_gradient_rebound_before_the_sum_is_read_by_it(monkeypatch, tier):
    """Rank 1 rebinds its token table's gradient with a row no lookup wrote (as a user's
    or a loader's write would) after its backward: the buffer finds it rebound, so the
    sum reads that table (and no other on the fast tier) and sends the row: equal to
    the whole sum."""
    _, _, batch = cases.build("sparse", 6)
    row = int(np.setdiff1d(np.arange(400), batch[0])[0])  # looked up by no rank

    def rebound(model, rank):
        if rank == 1:
            table = model.embed.tokens.weight
            bump = np.zeros(table.shape)
            bump[row] = 0.5
            table.grad = table.grad + bump

    with using_backend("numpy", "float64"), using_tier(tier):
        whole = ranks_gradients("sparse", 6, 2, 1, False, edit=rebound)
        scans = counting_scans(monkeypatch)
        by_rows = ranks_gradients("sparse", 6, 2, 1, True, edit=rebound)
    assert len(scans) == (4 if tier == "textbook" else 1)  # (fast) rank 1's token table
    for (grads, _, _), (expected, _, _) in zip(by_rows, whole):
        assert np.all(grads["embed.tokens.weight"][row] == 0.5)
        for name, g in expected.items():
            assert np.array_equal(grads[name].view(np.uint64), g.view(np.uint64)), name


@pytest.mark.parametrize("tier", TIERS)
def test_a_tied_table_is_read_by_the_sum(monkeypatch, tier):
    """The tied language model: its table's record is None, so the sum reads it (and, its
    gradient in every row, sends it whole): equal to the whole sum."""
    with using_backend("numpy", "float64"), using_tier(tier):
        whole = ranks_gradients("lm", 5, 2, 1, False)
        scans = counting_scans(monkeypatch)
        by_rows = ranks_gradients("lm", 5, 2, 1, True)
    assert len(scans) == 2  # the one table, on each rank
    for (grads, _, _), (expected, _, _) in zip(by_rows, whole):
        for name, g in expected.items():
            assert np.array_equal(grads[name], g), name


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seed", range(3))
def test_sums_by_records_equal_the_whole_sum_and_a_missing_row_would_not(dtype, seed):
    """RowSparseSum given each rank's records (a row of -0.0 and one of NaN recorded
    among them) equals the whole sum bit for bit, as it does reading the tables; a record
    missing one written row (what an unrecorded write would leave) gives another sum: the
    tests above, which check that no write escapes the record, are what keeps it right."""
    params, slices, tables, total = layout(dtype)
    grads = [rank_gradients(seed, r, slices, dtype, crowded=False) for r in range(2)]
    for g in grads:
        g[slices[1][0] + 3 * 7 + 1] = np.nan  # the first table's row 7
    whole = grads[0] + grads[1]
    lo, hi = slices[1]
    nan_row = changed_rows(grads[0][lo:hi].reshape(40, 3)).nonzero()[0]

    def records(g, drop=None):
        """(parameters of the layout, the flat buffer keeping their records): each
        table's gradient in g added with a record of the rows it holds (a -0.0 row too),
        less ``drop``."""
        held = [Parameter(np.zeros(p.shape, dtype=dtype)) for p in params]
        flat = FlatParameters(held, gradients_only=True)
        flat.zero_grad()
        for p, q, (a, b) in zip(params, held, slices):
            if p in tables:
                rows = np.flatnonzero(changed_rows(g[a:b].reshape(p.shape)))
                accumulate(q, g[a:b].reshape(p.shape), rows[rows != drop])
        return held, flat

    def summed(drop):
        def reduce(comm, rank):
            summer = RowSparseSum(params, slices, tables, total)
            buffer = grads[rank].copy()
            holding, _flat = records(grads[rank], drop if rank == 1 else None)
            summer(buffer, comm.allreduce, comm.allgather, holding)
            assert summer.last_scanned == 0
            return buffer
        return ThreadRanks(2).run(reduce)

    for buffer in summed(drop=None):
        assert np.array_equal(buffer.view(f"u{buffer.itemsize}"), whole.view(f"u{whole.itemsize}"))
    rank1_only = np.flatnonzero(np.any(grads[1][lo:hi].reshape(40, 3) != 0, axis=1)
                                & ~changed_rows(grads[0][lo:hi].reshape(40, 3)))
    assert rank1_only.size and nan_row.size
    missing = summed(drop=rank1_only[0])  # rank 1's record misses a row only it wrote
    assert not np.array_equal(missing[0].view(f"u{whole.itemsize}"),
                              whole.view(f"u{whole.itemsize}"))


def test_records_of_a_layout_not_this_ones_are_refused():
    params, slices, tables, total = layout(np.float64)
    wrong = [Parameter(np.zeros((3,))) for _ in params]
    flat = FlatParameters(wrong)  # kept: it keeps their records, empty, of (3,) gradients
    flat.zero_grad()
    with pytest.raises(ValueError, match="not this layout's"):
        RowSparseSum(params, slices, tables, total).written(np.zeros(total), wrong)
