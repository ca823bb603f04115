"""In-place kernels of the fast tier: each writes into a buffer the caller owns where the
library allows it (NumPy, CuPy) and returns a new array elsewhere (the strict namespace).

They exist only for speed (no allocation, no page faults on large arrays); the textbook
ops in :mod:`npformer.ops` compute the same values with plain expressions.
"""
from __future__ import annotations

from .. import backend
from ..backend import Array


def exp_into(x: Array) -> Array:
    """exp(x), written over x's buffer where the library allows it (NumPy, CuPy), else new.

    Only for arrays the caller owns: large attention scores are 4 bytes x B x H x T x S,
    and writing in place spares an allocation and its page faults.
    """
    module = type(x).__module__
    if module.startswith("numpy") or module.startswith("cupy"):
        return backend.namespace_of(x).exp(x, out=x)
    return backend.namespace_of(x).exp(x)


def add_at_columns(x: Array, columns: Array, value: float) -> Array:
    """``x[n, columns[n]] += value`` for every row n: x (N, V), columns (N,) integers.
    In place where the library can index that way (NumPy, CuPy), else a new array.

    Cross-entropy's backward subtracts at each row's target class with it.
    """
    module = type(x).__module__
    if module.startswith("numpy") or module.startswith("cupy"):
        rows = backend.namespace_of(x).arange(x.shape[0])
        x[rows, columns] += value  # one entry per row: no index repeats
        return x
    xp_ = backend.namespace_of(x)
    classes = xp_.arange(x.shape[1], dtype=columns.dtype, device=backend.device_of(x))
    onehot = xp_.astype(classes[None, :] == columns[:, None], x.dtype)  # (N, V)
    return x + value * onehot


def scatter_rows(index: Array, values: Array, num_rows: int) -> Array:
    """``out[index[n], :] = values[n, :]``, zeros elsewhere: index (N,) distinct integers in
    [0, num_rows), values (N, D) -> (num_rows, D).  (With distinct indices, assigning and
    adding are the same; NumPy and CuPy assign directly.)"""
    module = type(values).__module__
    if module.startswith("numpy") or module.startswith("cupy"):
        out = backend.namespace_of(values).zeros((num_rows, values.shape[1]), dtype=values.dtype,
                                          device=backend.device_of(values))
        out[index] = values
        return out
    return backend.scatter_add_rows(index, values, num_rows)
