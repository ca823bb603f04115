r"""Affine map: the building block of every projection in the Transformer.  The
derivation: docs/derivations.md §2.

Forward
    $y = x W + b$, with $x \in \mathbb{R}^{N \times D_{in}}$ (any leading shape
    stands for N rows), $W \in \mathbb{R}^{D_{in} \times D_{out}}$, $b \in \mathbb{R}^{D_{out}}$.

Backward, for an upstream gradient $\bar y = \partial L / \partial y$
    $\bar x = \bar y W^\top$
    $\bar W = x^\top \bar y = \sum_n x_n^\top \bar y_n$
    $\bar b = \sum_n \bar y_n$

W is stored (D_in, D_out), the orientation of the math; PyTorch stores the
transpose, which :mod:`npformer.interop.pytorch` converts.
$\bar W$ needs x, so the saved values keeps it.  A frozen map (LoRA's base weights,
:mod:`npformer.nn.lora`) asks for $\bar x$ alone (``weights=False``): $\bar W$ and $\bar b$,
which nothing would read, are not computed.
"""
from __future__ import annotations

from typing import Any

from .. import backend
from ..backend import Array
from .contracts import backward_op, door, forward_op, linear_inputs, opened, state, with_saved


@forward_op(linear_inputs)
def linear_forward(x: Array, w: Array, b: Array | None = None) -> tuple[Array, Any]:
    """x (..., D_in), w (D_in, D_out), b (D_out,) or None -> y (..., D_out), saved (x, w, b?)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(linear_forward, x, w, b)
    y = x @ w  # (..., D_in) @ (D_in, D_out) -> (..., D_out)
    if b is not None:
        y = y + b  # (..., D_out) + (D_out,)
    return with_saved(linear_forward, y, (x, w, b is not None))


@backward_op(linear_forward)
def linear_backward(dy: Array, saved: Any, weights: bool = True
                    ) -> tuple[Array, Array | None, Array | None]:
    """dy (..., D_out) -> dx (..., D_in), dw (D_in, D_out), db (D_out,) or None; without
    ``weights`` (a frozen map) dx alone, dw and db None."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(linear_backward, dy, saved, weights)
    values = opened(linear_forward, saved)
    x, w, has_bias = values
    xp = backend.namespace_of(dy, w)
    d_in, d_out = w.shape
    dx = dy @ w.mT  # (..., D_out) @ (D_out, D_in)
    if not weights:
        return dx, None, None
    x_rows = xp.reshape(x, (-1, d_in))  # (N, D_in): every row that used W
    dy_rows = xp.reshape(dy, (-1, d_out))  # (N, D_out)
    dw = x_rows.mT @ dy_rows  # (D_in, N) @ (N, D_out)
    db = xp.sum(dy_rows, axis=0) if has_bias else None  # (D_out,)
    return dx, dw, db

