r"""Affine map, fast: the textbook op (:mod:`npformer.ops.linear`) with the rows
flattened before the product and the bias added in place.

Forward
    $y = x W + b$, with $x \in \mathbb{R}^{N \times D_{in}}$ (any leading shape
    flattens to N rows), $W \in \mathbb{R}^{D_{in} \times D_{out}}$, $b \in \mathbb{R}^{D_{out}}$.
    The rows are flattened before the product: one (N, D_in) @ (D_in, D_out) product
    is one BLAS call, where NumPy would make one per leading index of (B, T, D_in).

Backward, for an upstream gradient $\bar y = \partial L / \partial y$
    $\bar x = \bar y W^\top$                       (each input row feeds every output through W)
    $\bar W = x^\top \bar y = \sum_n x_n^\top \bar y_n$   (sum over every row that used W)
    $\bar b = \sum_n \bar y_n$                      (b is added to every row)

W is stored (D_in, D_out), the orientation of the math; PyTorch stores the
transpose, which :mod:`npformer.interop.pytorch` converts.  ``matmul`` is ``@``, except
on CuPy while a step is captured as a CUDA graph (:mod:`npformer.gpu.gemm`), and, with
``STREAM_FEW_ROWS``, except for a few rows (1 to 16, a decoding step's): their product
streams W from memory once for all of them (:mod:`.streaming`), equal to ``@`` to rounding.
"""
from __future__ import annotations

from typing import Any

from .. import backend
from ..backend import Array
from ..gpu.gemm import column_sum, matmul
from ..ops.contracts import backward_op, door, forward_op, opened, state, with_saved
from .contracts import forward_input, linear_inputs
from .streaming import streamed_product, takes


@forward_op(linear_inputs)
def linear_forward(x: Array, w: Array, b: Array | None = None,
                   keep_input: bool = True) -> tuple[Array, Any]:
    """x (..., D_in), w (D_in, D_out), b (D_out,) or None -> y (..., D_out), saved
    (x, or None with keep_input=False: the backward is then given x again)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(linear_forward, x, w, b, keep_input)
    xp = backend.namespace_of(x, w)
    x_rows = xp.reshape(x, (-1, w.shape[0]))  # (N, D_in): one matrix product, not one per row
    y = _product(x_rows, w)  # (N, D_in) @ (D_in, D_out) -> (N, D_out)
    if b is not None:
        y += b  # (N, D_out) + (D_out,), in place: y is fresh
    y = xp.reshape(y, tuple(x.shape[:-1]) + (w.shape[1],))
    return with_saved(linear_forward, y, (x if keep_input else None, w, b is not None))


# Off: on an idle 2-vCPU machine `python bench/decode.py` measured GPT-2's decoding steps
# slower streamed than with the library's product (the all-core path 2x slower than one
# thread, one thread 8-16% slower than the library: issue 59's note); True streams them.
STREAM_FEW_ROWS = False


def _product(x_rows: Array, w: Array) -> Array:
    """x_rows (N, D_in) @ w (D_in, D_out): the library's product, or with STREAM_FEW_ROWS a
    few rows (a decoding step's) with W streamed from memory once for all of them
    (:mod:`.streaming`)."""
    if STREAM_FEW_ROWS and takes(x_rows, w):
        return streamed_product(x_rows, w)
    return matmul(x_rows, w)


@backward_op(linear_forward)
def linear_backward(dy: Array, saved: Any, x: Array | None = None, weights: bool = True
                    ) -> tuple[Array, Array | None, Array | None]:
    """dy (..., D_out) -> dx (..., D_in), dw (D_in, D_out), db (D_out,) or None; ``x``
    the forward's input, passed again where the forward did not keep it; without
    ``weights`` (a frozen map) dx alone, dw and db None."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(linear_backward, dy, saved, x, weights)
    values = opened(linear_forward, saved)
    x, w, has_bias = forward_input(values, x)
    xp = backend.namespace_of(dy, w)
    d_in, d_out = w.shape
    x_rows = xp.reshape(x, (-1, d_in))  # (N, D_in)
    dy_rows = xp.reshape(dy, (-1, d_out))  # (N, D_out)
    dx = matmul(dy_rows, w.mT)  # (N, D_out) @ (D_out, D_in) -> (N, D_in)
    if not weights:
        return xp.reshape(dx, tuple(x.shape)), None, None
    dw = matmul(x_rows.mT, dy_rows)  # (D_in, N) @ (N, D_out)
    db = column_sum(dy_rows) if has_bias else None  # (D_out,): sum over the rows
    return xp.reshape(dx, tuple(x.shape)), dw, db
