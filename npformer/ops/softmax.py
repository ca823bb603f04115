r"""Softmax and log-softmax over one axis, with an optional boolean mask.  The
derivations: docs/derivations.md §7 and §8.

Rows are row vectors (docs/derivations.md, §0).  Softmax of a row x, along the axis, for
entries allowed by the mask (True = keep)
    $x_j \leftarrow x_j + M_j$ with the mask bias $M_j = 0$ if allowed, $-\infty$ if not
    $m = \max_{j \in \text{allowed}} x_j$    (subtracted for stability; 0 if nothing is allowed)
    $e_j = \exp(x_j - m)$                  (= 0 where masked, since exp(-inf) = 0)
    $l = \sum_j e_j$, $p_j = e_j / l$        (0 for every j if nothing is allowed: l = 0 is
                                           replaced by 1)

Backward
    $\bar x = p \odot (\bar p - \langle \bar p, p \rangle)$
Masked entries have $p_j = 0$, so they receive exactly zero gradient, and a row
with nothing allowed gives zero output and zero gradient: never NaN.
An axis of length 0 has nothing to normalise: the result is the empty array of x's shape.

Log-softmax
    $y_j = x_j - m - \log \sum_{j'} \exp(x_{j'} - m)$
    backward: $\bar x = \bar y - p \, \sum_j \bar y_j$ with $p = \exp(y)$
"""
from __future__ import annotations

from typing import Any

from .. import backend
from ..backend import Array
from .contracts import (
    backward_op,
    door,
    forward_op,
    log_softmax_inputs,
    opened,
    softmax_inputs,
    state,
    with_saved,
)


@forward_op(softmax_inputs)
def softmax_forward(x: Array, axis: int = -1, mask: Array | None = None) -> tuple[Array, Any]:
    """x (...) -> p (...), saved (p, axis).  mask: boolean, broadcasts to x, True = keep."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(softmax_forward, x, axis, mask)
    xp = backend.namespace_of(x)
    if mask is not None:
        x = x + mask_bias(mask, x.dtype)  # masked entries become -inf
    if x.shape[axis] == 0:  # nothing to normalise over: p is as empty as x
        return with_saved(softmax_forward, *empty_like_input(x))
    m = xp.max(x, axis=axis, keepdims=True)
    if mask is not None:
        m = xp.where(xp.isfinite(m), m, xp.zeros_like(m))  # a fully masked row has max -inf
    e = xp.exp(x - m)  # exp(-inf) = 0 at masked entries
    total = xp.sum(e, axis=axis, keepdims=True)
    if mask is not None:
        total = xp.where(total > 0, total, xp.ones_like(total))  # 0 / 1 on fully masked rows
    p = e / total
    return with_saved(softmax_forward, p, (p, axis))


def mask_bias(mask: Array | None, dtype: Any) -> Array | None:
    """Boolean mask -> additive bias of the mask's own (small) shape: 0 where kept, -inf
    where not."""
    xp = backend.namespace_of(mask)
    dev = backend.device_of(mask)
    keep = xp.zeros(mask.shape, dtype=dtype, device=dev)
    drop = xp.full(mask.shape, -float("inf"), dtype=dtype, device=dev)
    return xp.where(mask, keep, drop)


@backward_op(softmax_forward)
def softmax_backward(dp: Array, saved: Any) -> Array:
    """dp (...) -> dx (...) = p * (dp - sum(dp * p))."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(softmax_backward, dp, saved)
    values = opened(softmax_forward, saved)
    p, axis = values
    xp = backend.namespace_of(dp, p)
    inner = xp.sum(dp * p, axis=axis, keepdims=True)  # <dp, p> per row
    return p * (dp - inner)


@forward_op(log_softmax_inputs)
def log_softmax_forward(x: Array, axis: int = -1) -> tuple[Array, Any]:
    """x (...) -> y = log softmax(x) (...), saved (p = exp(y), axis)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(log_softmax_forward, x, axis)
    xp = backend.namespace_of(x)
    if x.shape[axis] == 0:  # nothing to normalise over: y is as empty as x
        return with_saved(log_softmax_forward, *empty_like_input(x))
    shifted = x - xp.max(x, axis=axis, keepdims=True)
    e = xp.exp(shifted)
    total = xp.sum(e, axis=axis, keepdims=True)
    y = shifted - xp.log(total)
    p = e / total  # exp(y), kept for the backward
    return with_saved(log_softmax_forward, y, (p, axis))


@backward_op(log_softmax_forward)
def log_softmax_backward(dy: Array, saved: Any) -> Array:
    """dy (...) -> dx (...) = dy - p * sum(dy)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(log_softmax_backward, dy, saved)
    values = opened(log_softmax_forward, saved)
    p, axis = values
    xp = backend.namespace_of(dy, p)
    return dy - p * xp.sum(dy, axis=axis, keepdims=True)


def empty_like_input(x: Array) -> tuple[Array, Any]:
    """The (empty) result and saved of a softmax over an axis of length 0: shape of x."""
    p = backend.namespace_of(x).zeros_like(x)
    return p, (p, -1)
