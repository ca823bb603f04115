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

Each parameter's record of the rows its gradient was written in
(:attr:`Parameter.rows_written`) follows the values: a sync copies them and keeps it,
:meth:`FlatParameters.zero_grad` empties it, and whatever else writes into the buffer in
place (the sums of data parallelism) updates it or makes it None.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence

import numpy as np

from .. import backend
from ..backend import Array
from .module import Parameter, flat_layout, merged_rows, with_rows

# id(parameter) -> the buffer holding it, while that buffer lives (its owner, a fast model
# or optimizer, keeps it; it keeps its parameters, so their ids are not reused meanwhile)
_holding: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class FlatParameters:
    """The data of a list of parameters in one flat buffer, their gradients in another.

    ``data`` (P,), ``grad`` (P,): the buffers, in the list's order; ``slices[i]`` = (lo, hi)
    of parameter i; ``decay_segments`` (K, 2): the (lo, hi) of the parameters with
    ``decay`` (AdamW's weight decay).

    ``gradients_only=True``: only the gradients are flat (``data`` is None, the parameters'
    data stay bound as they are): a thread replica's, whose data are the model's own
    arrays.  Such a buffer is not registered: :func:`flat_buffer_of` finds only whole ones.
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
        rebound them; a different shape is refused, naming the parameter)."""
        kept = (("grad", self.grad_views),) if self.data is None else \
            (("data", self.data_views), ("grad", self.grad_views))
        for i, p in enumerate(self.params):
            for name, views in kept:
                value, view = getattr(p, name), views[i]
                if value is view or (name == "grad" and p.frozen):  # frozen: no gradient
                    continue
                if value is None or tuple(value.shape) != view.shape:
                    got = None if value is None else tuple(value.shape)
                    raise RuntimeError(f"params[{i}]: {name} of shape {got} cannot go back "
                                       f"into the flat buffer (shape {view.shape})")
                view[...] = backend.to_numpy(value)
                if name == "grad":
                    p.rebind_grad(view)  # the same values: the same rows written
                else:
                    p.data = view

    def holds(self, params: Sequence[Parameter]) -> bool:
        """Whether ``params`` are exactly this buffer's parameters, in order."""
        return len(params) == len(self.params) and all(
            p is q for p, q in zip(params, self.params))

    def zero_grad(self) -> None:
        """Every gradient zero: one fill of the flat buffer, the views bound, no row
        written (:attr:`Parameter.rows_written`)."""
        self.grad[...] = 0
        for p, view in zip(self.params, self.grad_views):
            p.grad = view
            p.rows_written = ()

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
    ``rows``: a lookup's ids, outside whose rows ``grad`` is +0.0, recorded
    (:meth:`Parameter.accumulate`'s)."""
    if type(p.grad).__module__.split(".")[0] in ("numpy", "cupy"):
        written = p.rows_written
        p.grad += grad  # binds p.grad again: the record is made None, then set here
        p.rows_written = with_rows(written, rows, grad)
    else:
        p.accumulate(grad, rows)


def add_rows_written(own: Sequence[Parameter], theirs: Sequence[Parameter]) -> None:
    """After ``theirs``' gradients were added into ``own``'s in place (a thread replica's
    flat buffer into the model's, paired in order): each of ``own``'s records of the rows
    written (:attr:`Parameter.rows_written`) takes ``theirs``' rows too, or becomes None
    where either is None."""
    for p, q in zip(own, theirs, strict=True):
        p.rows_written = merged_rows(p.rows_written, q.rows_written)
