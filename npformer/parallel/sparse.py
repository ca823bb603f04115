"""Row-sparse gradients: the sum across ranks of a flat gradient buffer that carries, of each
lookup table, only the rows some rank wrote.

A lookup table's gradient (V, D) (an :class:`npformer.nn.Embedding`'s weight: token
embeddings, hashed word pairs) is zero outside the rows of the ids a batch looked up, and
a batch looks up few of them: a shard of 16 reviews of at most 256 tokens touches at most
4,096 of imdb's 131,072 word-pair rows.  Summing such a table whole sends every zero
row.  Here, once per step:

1. **written rows**: each rank takes, of each table, the rows its gradient may hold
   anything but +0.0 in (:meth:`RowSparseSum.written`).  Where the gradient's record is
   known, they are the ids its lookups looked up: the fast tier's Embedding adds them
   to the record its flat buffer keeps of the table's gradient view
   (:func:`npformer.nn.flat.rows_written`, emptied when the buffer is zeroed), and a
   (V,) mask is made of them, no pass over the table.  The record is None (not known)
   once anything else wrote the gradient (a tied output projection, whose gradient
   fills every row; code binding ``p.grad``; an accumulation that did not say its rows)
   and for a gradient in no flat buffer (the textbook tier's).  Then the rank reads the
   table instead, one pass (:func:`changed_rows`: the rows holding any bit that is not
   +0.0's);
2. **union**: the ranks exchange those row sets (a bit per row, one ``allgather``) and
   OR them: the rows written on *some* rank, the same on every rank;
3. **sum**: the union's rows of every table are gathered into one buffer and summed across
   the ranks (one ``allreduce``), then written back.  The rest of the buffer (every other
   parameter, and a table whose union is more than :data:`WHOLE_TABLE_SHARE` of its rows)
   lies in contiguous runs between the tables: a run of at most :data:`PACKED_RUN_BYTES`
   travels in the rows' message, a larger one is summed in place by an ``allreduce`` of
   its own.  So imdb's step makes two collective calls (the bits, then one message).

Thread replicas sum in the process the same way (:meth:`RowSparseSum.add`): of each
table, only the rows a replica wrote (its own records) are added into the model's
gradient, and the model's records take the replica's rows
(:func:`npformer.nn.flat.add_rows_written`).  After the sum across ranks every gradient
holds the ranks' sum, so data parallelism makes every record None
(:meth:`npformer.parallel.DataParallel.reduce_gradients`).

The result is the dense sum's, bit for bit where the ranks add in the same order: a row
outside the union is +0.0 on every rank, whose sum is +0.0, which every rank already
holds; a row inside it is summed as the dense all-reduce would sum it.  A recorded row
may hold only +0.0 (a lookup whose gradient was zero there, a padding position's):
it is summed though it need not be, to the same +0.0.  A scanned row whose only change
is a -0.0, a NaN or a subnormal is changed (its bits are not +0.0's).  The records must
never miss a row, so everything that writes a gradient either says which rows it wrote
or makes the record None, and a gradient rebound in any way has none
(``tests/test_parallel_sparse.py`` checks each way of writing one).

Any table works whose gradient is row-sparse; one that is not (a table tied to an output
projection, whose gradient fills every row) is read, has every row changed and goes
whole.  Host (NumPy) buffers only: a buffer on a GPU is summed whole.

The scan of step 1 is compiled by numba where the process has already loaded it (the fast
tier's compiler does, :mod:`npformer.fast.compiler`), and is NumPy's ``any`` elsewhere:
a run of the textbook tier loads no compiler.  Both give the same rows.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..nn import Embedding, Module, Parameter
from ..nn.flat import rows_written

WHOLE_TABLE_SHARE = 0.5  # beyond this share of a table's rows, gathering them costs more
#                          than summing the table in place
PACKED_RUN_BYTES = 2 ** 20  # the other parameters' runs up to this size travel with the rows
#                             (one message, one wait for the slowest rank); larger ones are
#                             summed in place (no copy)


def lookup_tables(model: Module) -> list[Parameter]:
    """The weights of ``model``'s lookup tables (its :class:`npformer.nn.Embedding` layers,
    each once), whose gradients are row-sparse where nothing else uses them."""
    seen, tables = set(), []
    for module in model.modules():
        if isinstance(module, Embedding) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            tables.append(module.weight)
    return tables


def changed_rows(table: np.ndarray) -> np.ndarray:
    """table (V, D) float -> (V,) bool: whether row v holds any value whose bits are not
    +0.0's (so -0.0, NaN and subnormals count as changes; only +0.0 does not)."""
    table = np.ascontiguousarray(table)
    bits = table.view(np.dtype(f"u{table.dtype.itemsize}")).reshape(table.shape)
    if table.size == 0 or not _compiled_scan():
        return np.any(bits, axis=1)
    out = np.empty(table.shape[0], dtype=np.bool_)
    _rows_with_bits(bits, out)
    return out


_compiled = False  # whether _rows_with_bits is numba's compilation of the loop below


def _compiled_scan() -> bool:
    """Whether the scan runs compiled: on the first call where numba is loaded (by the
    fast tier; this module never imports it) and not switched off (``NUMBA_DISABLE_JIT``),
    :func:`_rows_with_bits` becomes its compilation, with the fast tier's kernel options
    (no fastmath, the GIL released, kept in numba's on-disk cache)."""
    global _compiled, _rows_with_bits
    if not _compiled:
        numba = sys.modules.get("numba")
        if numba is None or numba.config.DISABLE_JIT:
            return False
        _rows_with_bits = numba.njit(fastmath=False, nogil=True, error_model="numpy",
                                     cache=True)(_rows_with_bits)
        _compiled = True
    return True


def _rows_with_bits(bits, out):
    """out[v] = any bit set in row v: bits (V, D) unsigned integers, out (V,) bool.  The
    row's OR, without an early exit, so that LLVM vectorizes it (one read of the table)."""
    for v in range(bits.shape[0]):
        row = bits[v]
        acc = row[0] ^ row[0]  # zero of the row's type
        for j in range(row.size):
            acc |= row[j]
        out[v] = acc != 0
    return None


def recorded_rows(record: tuple, rows: int) -> np.ndarray:
    """A record of written rows (:func:`npformer.nn.flat.rows_written`: arrays of row
    ids) -> (rows,) bool, True at every id in it."""
    out = np.zeros(rows, dtype=np.bool_)
    for ids in record:
        out[ids] = True
    return out


def written_rows(table: np.ndarray, record: tuple | None) -> np.ndarray:
    """table (V, D), a lookup table's gradient, and its record of the rows written
    (:func:`npformer.nn.flat.rows_written`) -> (V,) bool: the recorded rows, or where the
    record is None (not known) the rows a pass over the table finds changed."""
    return changed_rows(table) if record is None else recorded_rows(record, table.shape[0])


class TableSlot:
    """Where a (rows, cols) table lies in a flat buffer: elements [lo, lo + rows * cols)."""

    def __init__(self, lo: int, rows: int, cols: int):
        self.lo, self.rows, self.cols = lo, rows, cols
        self.hi = lo + rows * cols

    def view(self, buffer: np.ndarray) -> np.ndarray:
        """The table's (rows, cols) view of ``buffer``."""
        return buffer[self.lo:self.hi].reshape(self.rows, self.cols)


class RowSparseSum:
    """The in-place sum across ranks of one flat host gradient buffer laid out as
    ``slices`` (the (lo, hi) of each of ``params``), sending of each of ``tables`` (a
    subset of ``params``, 2-D) only the union of the rows the ranks wrote (see the
    module's docstring).  ``last_bytes``: what the last sum's ``allreduce`` calls carried."""

    def __init__(self, params: Sequence[Parameter], slices: Sequence[tuple[int, int]],
                 tables: Sequence[Parameter], total: int):
        wanted = {id(t) for t in tables}
        # which of params each table is, and where it lies
        self.table_index = [i for i, p in enumerate(params)
                            if id(p) in wanted and len(p.shape) == 2]
        self.tables = [TableSlot(slices[i][0], *params[i].shape) for i in self.table_index]
        self.total = total
        self.last_bytes = 0
        self.last_scanned = 0  # how many tables the last sum had to read to find their rows

    def __call__(self, buffer: np.ndarray, allreduce: Callable[[Any], None],
                 allgather: Callable[[Any], list],
                 holding: Sequence[Parameter] | None = None) -> None:
        """``buffer`` (the layout's (P,)) becomes the sum of every rank's, in place;
        ``allreduce`` sums an array in place, ``allgather`` gives every rank's value.
        ``holding``: the parameters whose gradients ``buffer`` holds, in the layout's
        order, whose records say which rows were written (:meth:`written`); None: the
        tables are read to find them."""
        unions = self._unions(self.written(buffer, holding), allgather)
        sparse = [(slot, rows) for slot, rows in zip(self.tables, unions)
                  if rows.size <= WHOLE_TABLE_SHARE * slot.rows]
        if not sparse:  # no table, or every one written in more than that share of its rows
            allreduce(buffer)
            self.last_bytes = buffer.nbytes
            return
        runs = dense_runs(self.total, [(slot.lo, slot.hi) for slot, _ in sparse])
        large = [(lo, hi) for lo, hi in runs if (hi - lo) * buffer.itemsize > PACKED_RUN_BYTES]
        small = [run for run in runs if run not in large]
        for lo, hi in large:
            allreduce(buffer[lo:hi])  # a contiguous view: summed in place
        message = np.concatenate([buffer[lo:hi] for lo, hi in small]
                                 + [slot.view(buffer)[ids].reshape(-1) for slot, ids in sparse])
        allreduce(message)  # the small runs and the union's rows of every table, together
        self.last_bytes = message.nbytes + sum(hi - lo for lo, hi in large) * buffer.itemsize
        offset = 0
        for lo, hi in small:
            buffer[lo:hi] = message[offset:offset + hi - lo]
            offset += hi - lo
        for slot, ids in sparse:
            size = ids.size * slot.cols
            slot.view(buffer)[ids] = message[offset:offset + size].reshape(ids.size, slot.cols)
            offset += size

    def add(self, into: np.ndarray, buffer: np.ndarray,
            holding: Sequence[Parameter] | None = None) -> None:
        """``into += buffer`` (two buffers of the layout, in this process: a thread
        replica's gradients into the model's), adding of each table only the rows written
        in ``buffer`` (``holding``: as :meth:`__call__`'s, the replica's parameters); equal
        to the whole sum (a row of +0.0 adds nothing; only a -0.0 in ``into`` stays -0.0
        where the whole sum would make it +0.0, an equal value).  The records of the
        rows written of ``into``'s parameters are the caller's to update
        (:func:`npformer.nn.flat.add_rows_written`)."""
        holes = []
        for slot, written in zip(self.tables, self.written(buffer, holding)):
            ids = np.flatnonzero(written)
            if ids.size <= WHOLE_TABLE_SHARE * slot.rows:
                slot.view(into)[ids] += slot.view(buffer)[ids]
                holes.append((slot.lo, slot.hi))
        for lo, hi in dense_runs(self.total, holes):
            into[lo:hi] += buffer[lo:hi]

    def written(self, buffer: np.ndarray,
                holding: Sequence[Parameter] | None = None) -> list[np.ndarray]:
        """[(V,) bool for each table: the rows of its gradient in ``buffer`` that may hold
        anything but +0.0].  Where ``holding`` (the parameters whose gradients ``buffer``
        holds, in the layout's order) has the table's record
        (:func:`npformer.nn.flat.rows_written`: the ids its lookups' backward added at
        since its buffer was zeroed), those rows, without reading the table; else the
        rows found by reading it (:func:`changed_rows`).  A recorded row may hold +0.0
        only (a lookup whose gradient was zero there): it is then summed though it need
        not be, to the same value."""
        rows, self.last_scanned = [], 0
        for i, slot in zip(self.table_index, self.tables):
            record = None if holding is None else rows_written(holding[i])
            if record is not None and tuple(holding[i].shape) != (slot.rows, slot.cols):
                raise ValueError(f"holding[{i}] is of shape {holding[i].shape}, not the "
                                 f"table's {(slot.rows, slot.cols)}: not this layout's")
            rows.append(written_rows(slot.view(buffer), record))
            self.last_scanned += record is None
        return rows

    def _unions(self, written: list[np.ndarray],
                allgather: Callable[[Any], list]) -> list[np.ndarray]:
        """[the sorted row ids written on some rank, for each table]: every rank's written
        rows (:meth:`written`), a bit each, gathered in one message and OR-ed."""
        if not self.tables:
            return []
        mine = np.concatenate(written)
        everyone = np.bitwise_or.reduce(allgather(np.packbits(mine)))
        changed = np.unpackbits(everyone, count=mine.size).astype(bool)
        bounds = np.cumsum([0] + [slot.rows for slot in self.tables])
        return [np.flatnonzero(changed[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def dense_runs(total: int, holes: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The non-empty (lo, hi) runs of range(total) outside ``holes`` (disjoint (lo, hi))."""
    runs, at = [], 0
    for lo, hi in sorted(holes):
        if lo > at:
            runs.append((at, lo))
        at = max(at, hi)
    if total > at:
        runs.append((at, total))
    return runs
