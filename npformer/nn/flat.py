"""One flat buffer for a model's parameters, one for their gradients (llm.c's layout).

Each parameter's ``data`` and ``grad`` become views of its slice of two contiguous
buffers (P,), laid end to end in the model's order (:func:`npformer.nn.module.flat_layout`):
the optimizer then updates every parameter in one pass (:mod:`npformer.fast.optim`),
zeroing the gradients is one fill, and data parallelism's all-reduce sends ``grad`` as it
is.  The fast models put their weights here when built; the fast optimizers adopt the
buffer that holds exactly their parameters, or make one.  It lives below both tiers so
that :mod:`npformer.parallel` can sum either tier's buffer.  NumPy arrays of one floating
dtype only (:meth:`FlatParameters.supports`).

A rebound ``p.data`` or ``p.grad`` (the textbook layers' ``p.grad = p.grad + g``, a
loader's) is no longer a view: :meth:`FlatParameters.sync` copies it back and binds the
view again, and whatever reads the buffers calls it first (:func:`flat_buffer_of` does).
The fast layers accumulate in place (:func:`accumulate`): nothing is rebound.

The rows written, for data parallelism's row-sparse sum (:mod:`npformer.parallel.sparse`),
which then need not read a lookup table's whole gradient to find its rows: a buffer keeps,
of each parameter, the record of the rows (along the first axis) of its gradient view that
may hold anything but +0.0.  A tuple of int64 arrays, the ids of each lookup that wrote
into the view since :meth:`FlatParameters.zero_grad` emptied it (``()``); None: not known
(any row may hold anything).  :func:`accumulate` given a lookup's ``rows`` adds them;
every other write makes it None: :func:`accumulate` without rows (a tied projection's
share), a gradient found rebound by :meth:`~FlatParameters.sync`, the sums of data
parallelism (or they keep it right: :func:`add_rows_written`).  A write into a view in
place that the buffer cannot see (``p.grad += g`` on a fast model's parameter) must do
the same (:func:`forget_rows_written`).  :func:`rows_written` reads it: None for a
parameter whose gradient is no live buffer's view (the textbook tier's, a rebound one).
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import numpy as np

from .. import backend
from ..backend import Array
from .module import Parameter, flat_layout

# id(parameter) -> the buffer holding it, while that buffer lives (its owner, a fast model
# or optimizer, keeps it; it keeps its parameters, so their ids are not reused meanwhile)
_holding: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
# id(parameter) -> the record of the rows written into its gradient view, in the last
# buffer (whole or gradients only) made to hold its gradient, while that buffer lives
_records: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

MAX_WRITES_KEPT = 16  # a record of more writes than this is merged into one array of rows


class RowsWritten:
    """One parameter's gradient view in a buffer (``view``) and the record of the rows
    written into it (``rows``: see the module docstring)."""

    __slots__ = ("view", "rows", "__weakref__")

    def __init__(self, view: np.ndarray):
        self.view, self.rows = view, None  # what the view holds when bound: not known


class FlatParameters:
    """The data of a list of parameters in one flat buffer, their gradients in another.

    ``data`` (P,), ``grad`` (P,): the buffers, in the list's order; ``slices[i]`` = (lo, hi)
    of parameter i; ``decay_segments`` (K, 2): the (lo, hi) of the parameters with
    ``decay`` (AdamW's weight decay); ``records[i]``: parameter i's :class:`RowsWritten`
    (the module docstring).

    ``gradients_only=True``: only the gradients are flat (``data`` is None, the parameters'
    data stay bound as they are): a thread replica's, whose data are the model's own
    arrays.  Such a buffer is not registered as a whole: :func:`flat_buffer_of` finds only
    whole ones (its records are, for :func:`rows_written`).
    """

    def __init__(self, params: Sequence[Parameter], gradients_only: bool = False):
        self.params = list(params)
        if not self.supports(self.params):
            raise ValueError("FlatParameters holds NumPy parameters of one floating dtype")
        dtype = self.params[0].data.dtype
        self.slices, total = flat_layout([p.shape for p in self.params])
        self.data = None if gradients_only else np.empty(total, dtype=dtype)  # (P,)
        self.grad = np.zeros(total, dtype=dtype)  # (P,)
        self.data_views = [] if gradients_only else [
            self.data[lo:hi].reshape(p.shape) for p, (lo, hi) in zip(self.params, self.slices)]
        self.grad_views = [self.grad[lo:hi].reshape(p.shape)
                           for p, (lo, hi) in zip(self.params, self.slices)]
        for i, p in enumerate(self.params):
            self.grad_views[i][...] = p.grad
            p.grad = self.grad_views[i]
            if not gradients_only:
                self.data_views[i][...] = p.data
                p.data = self.data_views[i]
                _holding[id(p)] = self
        self.records = [RowsWritten(view) for view in self.grad_views]
        _records.update((id(p), record) for p, record in zip(self.params, self.records))
        decayed = [s for p, s in zip(self.params, self.slices) if p.decay and s[1] > s[0]]
        self.decay_segments = np.array(decayed, dtype=np.int64).reshape(-1, 2)  # (K, 2)

    @staticmethod
    def supports(params: Sequence[Parameter]) -> bool:
        """Whether ``params`` can share flat buffers: NumPy arrays of one floating dtype."""
        params = list(params)
        return bool(params) and all(
            type(p.data) is np.ndarray and p.data.dtype == params[0].data.dtype
            and p.data.dtype in (np.float32, np.float64) for p in params)

    def sync(self) -> None:
        """Every parameter's data and gradient back in its view (copied in where code
        rebound them, a rebound gradient's record of the rows written then None; a
        different shape is refused, naming the parameter)."""
        for i, p in enumerate(self.params):
            if self.data is not None and p.data is not self.data_views[i]:
                p.data = self._copied_in(i, "data", p.data, self.data_views[i])
            if p.grad is not self.grad_views[i] and not p.frozen:  # frozen: no gradient
                self.bind_gradients(i, i + 1)

    def bind_gradients(self, first: int = 0, end: int | None = None) -> None:
        """params[first:end]'s gradients in their views: one that code rebound is copied in
        and the view bound, its record of the rows written None (who wrote it, and where,
        is not known)."""
        for i in range(first, len(self.params) if end is None else end):
            p, view = self.params[i], self.grad_views[i]
            if p.grad is not view:
                p.grad = self._copied_in(i, "grad", p.grad, view)
                self.records[i].rows = None

    def _copied_in(self, i: int, name: str, value: Array | None, view: np.ndarray) -> np.ndarray:
        """``view`` holding ``value`` (params[i]'s ``name``), or a RuntimeError naming it."""
        if value is None or tuple(value.shape) != view.shape:
            got = None if value is None else tuple(value.shape)
            raise RuntimeError(f"params[{i}]: {name} of shape {got} cannot go back "
                               f"into the flat buffer (shape {view.shape})")
        view[...] = backend.to_numpy(value)
        return view

    def holds(self, params: Sequence[Parameter]) -> bool:
        """Whether ``params`` are exactly this buffer's parameters, in order."""
        return len(params) == len(self.params) and all(
            p is q for p, q in zip(params, self.params))

    def zero_grad(self) -> None:
        """Every gradient zero: one fill of the flat buffer, the views bound, no row
        written; a frozen parameter's gradient stays None (its view is not read)."""
        self.grad[...] = 0
        for p, view, record in zip(self.params, self.grad_views, self.records):
            p.grad = None if p.frozen else view
            record.rows = ()

    def __deepcopy__(self, memo):
        return None  # a copied parameter owns its arrays: a copy is not flat


def flat_buffer_of(params: Iterable[Parameter]) -> FlatParameters | None:
    """The :class:`FlatParameters` holding exactly ``params`` (the same parameters, in
    order), synced (:meth:`FlatParameters.sync`), or None."""
    params = list(params)
    flat = _holding.get(id(params[0])) if params and isinstance(params[0], Parameter) else None
    if flat is None or not flat.holds(params):
        return None
    flat.sync()
    return flat


def flat_buffer(params: Sequence[Parameter]) -> FlatParameters | None:
    """The buffer that holds exactly ``params``, else a new one; None where they cannot
    share one (not NumPy, or mixed dtypes)."""
    params = list(params)
    if not FlatParameters.supports(params):
        return None
    return flat_buffer_of(params) or FlatParameters(params)


def accumulate(p: Parameter, grad: Array, rows: Array | None = None) -> None:
    """``p.grad += grad`` in place where the library writes in place (NumPy, CuPy), so a
    flat buffer's view stays bound; else rebound, as the textbook parameter does.
    ``rows``: a lookup's ids, outside whose rows ``grad`` is +0.0, added to the record of
    the rows written of the buffer holding ``p``'s gradient; None: the record is None."""
    if type(p.grad).__module__.split(".")[0] in ("numpy", "cupy"):
        p.grad += grad
        record = _records.get(id(p))
        if record is not None:
            known = record.view is p.grad  # else the gradient was rebound: rows not known
            record.rows = with_rows(record.rows, rows, grad) if known else None
    else:
        p.accumulate(grad)


def rows_written(p: Parameter) -> tuple | None:
    """``p``'s record of the rows written (the module docstring): the rows of its gradient
    that may hold anything but +0.0, or None where not known (no buffer holds its
    gradient, or it was rebound since)."""
    record = _records.get(id(p))
    return None if record is None or record.view is not p.grad else record.rows


def forget_rows_written(params: Iterable[Parameter]) -> None:
    """After code wrote ``params``' gradient views in place anywhere (a sum across ranks):
    their records None."""
    for p in params:
        record = _records.get(id(p))
        if record is not None:
            record.rows = None


def add_rows_written(own: Sequence[Parameter], theirs: Sequence[Parameter]) -> None:
    """After ``theirs``' gradients were added into ``own``'s in place (a thread replica's
    flat buffer into the model's, paired in order): each of ``own``'s records takes
    ``theirs``' rows too, or becomes None where either is not known."""
    for p, q in zip(own, theirs, strict=True):
        record = _records.get(id(p))
        if record is not None:
            record.rows = merged_rows(rows_written(p), rows_written(q))


def with_rows(written: tuple | None, rows: Array | None, grad: Array) -> tuple | None:
    """The record ``written``, after a gradient ``grad`` that is +0.0 outside ``rows`` was
    added: ``rows`` copied in (the caller may reuse its array of ids).  None if either is
    not known, or not on NumPy (a record is read on the host only, and another backend's
    scatter-add may leave -0.0 or NaN outside the rows)."""
    if rows is None or type(grad) is not np.ndarray or type(rows) is not np.ndarray:
        return None
    return merged_rows(written, (np.array(rows, dtype=np.int64).reshape(-1),))


def merged_rows(written: tuple | None, more: tuple | None) -> tuple | None:
    """Two records as one: after a gradient recorded as ``more`` was added into one
    recorded as ``written``.  None if either is."""
    if written is None or more is None:
        return None
    written = written + more
    if len(written) > MAX_WRITES_KEPT:  # many writes without a zeroing: kept bounded
        written = (np.unique(np.concatenate(written)),)
    return written
