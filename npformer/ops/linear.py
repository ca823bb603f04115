r"""Affine map: the building block of every projection in the Transformer.

Forward
    $y = x W + b$, with $x \in \mathbb{R}^{N \times D_{in}}$ (any leading shape
    stands for N rows), $W \in \mathbb{R}^{D_{in} \times D_{out}}$, $b \in \mathbb{R}^{D_{out}}$.

Backward, for an upstream gradient $\bar y = \partial L / \partial y$
    $\bar x = \bar y W^\top$                       (each input row feeds every output through W)
    $\bar W = x^\top \bar y = \sum_n x_n^\top \bar y_n$   (sum over every row that used W)
    $\bar b = \sum_n \bar y_n$                      (b is added to every row)

W is stored (D_in, D_out), the orientation of the math; PyTorch stores the
transpose, which :mod:`npformer.torch_interop` converts.
"""
from __future__ import annotations

from .. import backend
from ._checks import (check_cache, check_float, check_last_dim, check_rank, check_same_dtype,
                      check_upstream)


def linear_forward(x, w, b=None):
    """x (..., D_in), w (D_in, D_out), b (D_out,) or None -> y (..., D_out), cache."""
    check_linear_inputs(x, w, b)
    xp = backend.namespace_of(x, w)
    y = xp.matmul(x, w)  # (..., D_in) @ (D_in, D_out) -> (..., D_out)
    if b is not None:
        y = y + b  # (..., D_out) + (D_out,)
    return y, (x, w, b is not None)


def linear_backward(dy, cache):
    """dy (..., D_out) -> dx (..., D_in), dw (D_in, D_out), db (D_out,) or None."""
    check_cache(cache, 3, "linear_forward", "linear_backward")
    check_upstream(dy, linear_output_shape(cache[0], cache[1]), "linear_backward",
                   cache[0].dtype)  # of x and W
    x, w, has_bias = cache
    xp = backend.namespace_of(dy, w)
    d_in, d_out = w.shape
    dx = xp.matmul(dy, xp.matrix_transpose(w))  # (..., D_out) @ (D_out, D_in)
    x_rows = xp.reshape(x, (-1, d_in))  # (N, D_in): every row that used W
    dy_rows = xp.reshape(dy, (-1, d_out))  # (N, D_out)
    dw = xp.matmul(xp.matrix_transpose(x_rows), dy_rows)  # (D_in, N) @ (N, D_out)
    db = xp.sum(dy_rows, axis=0) if has_bias else None  # (D_out,)
    return dx, dw, db


def check_linear_inputs(x, w, b) -> None:
    """x (..., D_in) floats, W (D_in, D_out) floats with D_in, D_out >= 1, b None or
    (D_out,), all of one dtype (shared with the fast tier)."""
    check_float(x, "linear input")
    check_float(w, "linear weight")
    check_rank(w, 2, "linear weight (in_features, out_features)")
    if 0 in tuple(w.shape):
        raise ValueError(f"linear weight must have at least one input and one output feature, "
                         f"got shape {tuple(w.shape)}")
    if b is not None:
        check_float(b, "linear bias")
        if tuple(b.shape) != (w.shape[1],):
            raise ValueError(f"linear bias must have shape ({w.shape[1]},), got "
                             f"{tuple(b.shape)}")
    check_same_dtype("linear", input=x, weight=w, bias=b)
    check_last_dim(x, w.shape[0], "linear input")


def linear_output_shape(x, w) -> tuple:
    """(..., D_out): the shape of the forward's output, from its cache."""
    return tuple(x.shape[:-1]) + (w.shape[1],)
