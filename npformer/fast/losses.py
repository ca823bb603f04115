r"""Cross-entropy, fast: log-softmax, the target pick and the backward fused, so no
one-hot or target distribution is built (docs/derivations.md §20).  The same function as
the textbook op (:mod:`npformer.ops.losses`), tested equal to it, NaN and inf included.

N rows over V classes, targets $y_n$ (ignore_index rows do not count), smoothing
$\varepsilon$, $q = (1 - \varepsilon)\,\text{onehot}(y) + \varepsilon / V$, $s = z - m$:
    $L_n = (1-\varepsilon)(\log Z_n - s_{n,y_n})
           + \varepsilon\,(\log Z_n - \tfrac1V \sum_v s_{n,v})$
    $L = \frac{1}{N_v} \sum_{n \text{ counted}} L_n$ (0 if no row counts)
    $\bar z_n = \bar L \, (p_n - q_n) / N_v$ on counted rows, 0 on the others
On NumPy arrays with numba, :func:`cross_entropy_rows` keeps the logits and each row's
$\lambda_n = m_n + \log Z_n$ (nothing of size (N, V)) and :func:`cross_entropy_grad`
recomputes $p = \exp(z - \lambda)$; elsewhere the array statements, p kept in s's buffer.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import numpy as np

from .. import backend
from ..backend import Array
from ..ops import losses as _textbook
from ..ops.contracts import (
    backward_op,
    check_loss_gradient,
    cross_entropy_inputs,
    door,
    forward_op,
    opened,
    state,
    with_saved,
)
from ..ops.losses import IGNORE_INDEX
from .compiler import compilable, jit
from .inplace import add_at_columns, exp_into
from .numerics import all_finite, exp, max8, sum4


@forward_op(cross_entropy_inputs)
def cross_entropy_forward(logits: Array, targets: Array, ignore_index: int = IGNORE_INDEX,
                          label_smoothing: float = 0.0) -> tuple[Array, Any]:
    """logits (..., V) floats, targets (...) integers -> loss (0-d array), saved."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(cross_entropy_forward, logits, targets, ignore_index, label_smoothing)
    xp = backend.namespace_of(logits, targets)
    vocab = logits.shape[-1]
    z = xp.reshape(logits, (-1, vocab))  # (N, V)
    t = xp.reshape(targets, (-1,))  # (N,)
    counted = t != ignore_index  # (N,) bool
    safe_t = xp.where(counted, t, xp.zeros_like(t))  # ignored rows point at class 0
    if compilable(z):  # one compiled pass a row: per-row losses and lse, no (N, V) array
        targets64 = xp.astype(safe_t, xp.int64)
        per_row, lse = cross_entropy_rows(z, targets64, float(label_smoothing))
        counted_f, denom, loss = _mean_over_counted(xp, per_row, counted, z.dtype)
        return with_saved(cross_entropy_forward, loss,
                          (_FromLogits(z, lse, targets64), safe_t, counted_f, denom,
                           label_smoothing, tuple(logits.shape)))
    shifted = z - xp.max(z, axis=-1, keepdims=True)  # s = z - m, (N, V)
    picked = xp.take_along_axis(shifted, safe_t[:, None], axis=-1)[:, 0]  # s at targets, (N,)
    if label_smoothing > 0.0:
        mean_shifted = xp.mean(shifted, axis=-1)  # (N,), read before exp overwrites s
    e = exp_into(shifted)  # (N, V), in s's buffer
    total = xp.sum(e, axis=-1, keepdims=True)  # Z, (N, 1)
    log_total = xp.log(total[:, 0])  # log Z, (N,)
    per_row = (1.0 - label_smoothing) * (log_total - picked)  # (1 - eps) * -log p_y
    if label_smoothing > 0.0:
        per_row = per_row + label_smoothing * (log_total - mean_shifted)  # eps * -mean log p
    counted_f, denom, loss = _mean_over_counted(xp, per_row, counted, z.dtype)
    p = e
    p /= total  # softmax, in place, (N, V)
    return with_saved(cross_entropy_forward, loss, (p, safe_t, counted_f, denom, label_smoothing,
                                                    tuple(logits.shape)))


class _FromLogits(NamedTuple):
    """The compiled path's stand-in for p: the logits (N, V), each row's lse (N,) and the
    targets (N,) as int64, from which the backward recomputes p = exp(z - lse) in its
    one pass."""

    logits: Array
    lse: Array
    targets: Array


def _mean_over_counted(xp, per_row, counted, dtype):
    """(counted as floats (N,), the divisor, the loss): the mean of the counted rows'
    losses (0 if none counts)."""
    counted_f = xp.astype(counted, dtype)
    n_counted = xp.sum(counted_f)
    denom = xp.where(n_counted > 0, n_counted, xp.ones_like(n_counted))
    loss = xp.sum(per_row * counted_f) / denom
    return counted_f, denom, loss


@backward_op(cross_entropy_forward, upstream=check_loss_gradient)
def cross_entropy_backward(dloss: Array, saved: Any, overwrite_logits: bool = False) -> Array:
    """dloss (scalar) -> dlogits (..., V) = dloss * (p - q) / N_counted on counted rows.

    ``overwrite_logits=True``: dlogits is written over the (N, V) array the forward kept
    (the logits on the compiled path, the softmax otherwise), for a caller that owns the
    logits and will not run this backward again: no second (N, V) array (read-only
    logits are not written: the gradient is then a new array).
    """
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(cross_entropy_backward, dloss, saved, overwrite_logits)
    values = opened(cross_entropy_forward, saved)
    p, safe_t, counted_f, denom, label_smoothing, logits_shape = values
    finite = math.isfinite(dloss) if isinstance(dloss, numbers.Real) else all_finite(dloss)
    if not finite:  # a NaN or infinite upstream gradient: what the textbook gives
        return _textbook_backward(dloss, values)
    if isinstance(p, _FromLogits):  # the compiled pass: p recomputed from z and lse
        dz = cross_entropy_grad(p.logits, p.lse, p.targets, counted_f * (dloss / denom),
                                float(label_smoothing),
                                out=p.logits if overwrite_logits else None)
        return dz.reshape(logits_shape)  # w (p - q), (N, V)
    xp = backend.namespace_of(p)
    vocab = p.shape[-1]
    weight = counted_f * (dloss / denom)  # w, (N,): 0 on ignored rows
    if overwrite_logits:
        dz = p
        dz -= label_smoothing / vocab
    else:
        dz = p - label_smoothing / vocab  # p minus the eps / V that q spreads over every class
    dz = add_at_columns(dz, safe_t, -(1.0 - label_smoothing))  # p - q, (N, V)
    dz *= weight[:, None]  # w (p - q)
    return xp.reshape(dz, logits_shape)


def _textbook_backward(dloss: Array, values: Any) -> Array:
    """The textbook op's backward (:func:`npformer.ops.cross_entropy_backward`), from the
    textbook's forward run again on the logits (the compiled path keeps them) or on
    log p, whose softmax is p."""
    p, safe_t, counted_f, denom, label_smoothing, logits_shape = values
    xp = backend.namespace_of(safe_t)
    if isinstance(p, _FromLogits):
        logits = p.logits
    else:
        with np.errstate(divide="ignore"):  # log 0 = -inf: softmax gives that p = 0 again
            logits = xp.log(p)
    targets = xp.where(counted_f > 0, safe_t, xp.full_like(safe_t, IGNORE_INDEX))
    _, textbook_saved = _textbook.cross_entropy_forward.unchecked(logits, targets, IGNORE_INDEX,
                                                                   label_smoothing)
    dz = _textbook.cross_entropy_backward.unchecked(dloss, textbook_saved)
    return xp.reshape(dz, logits_shape)


# =========================================================================== the kernels
# One row of V logits at a time: the forward reads each row twice (its max; then exp into
# a row of scratch and the sums) and writes nothing of size (N, V); the backward writes dz
# in one pass, recomputing p = exp(z - lse).  One kernel each for both dtypes.
@jit
def _cross_entropy_rows(z, targets, smoothing, per_row, lse):
    """z (N, V), targets (N,) in [0, V) -> per_row (N,) = (1 - eps)(log Z - s_y)
    + eps (log Z - mean s), s = z - max z, Z = sum exp(s); lse (N,) = max z + log Z."""
    dtype = z.dtype.type
    n, v = z.shape
    e = np.empty(v, dtype=z.dtype)  # one row of exp(s), reused
    for i in range(n):
        row = z[i]
        m = max8(row, dtype(-np.inf))
        for j in range(v):  # element-wise: vectorizes
            e[j] = exp(row[j] - m)
        log_total = np.log(dtype(sum4(e, e, 0)))
        picked = row[targets[i]] - m
        loss = dtype(1.0 - smoothing) * (log_total - picked)
        if smoothing > 0.0:
            mean_shifted = dtype(sum4(row, row, 0) / v) - m  # mean(z) - m = mean(s)
            loss = loss + dtype(smoothing) * (log_total - mean_shifted)
        per_row[i] = loss
        lse[i] = m + log_total
    return None


@jit
def _cross_entropy_grad(z, lse, targets, weight, smoothing, in_place, dz):
    """z (N, V), lse, targets, weight (N,) -> dz (N, V) = w (p - q), p = exp(z - lse),
    q = (1 - eps) onehot(y) + eps / V; rows of weight 0 (ignored) give 0.
    ``in_place``: dz is z itself, and the loop reads and writes it under the one name
    dz (under two names the compiler's overlap check finds them equal and runs scalar
    code; and z is never written, so it may be read-only); each row's target logit is
    read before the row is written."""
    dtype = z.dtype.type
    n, v = z.shape
    spread = dtype(smoothing / v)
    on_target = dtype(1.0 - smoothing)
    for i in range(n):
        row, out, shift, w = z[i], dz[i], lse[i], weight[i]
        t = targets[i]
        p_target = exp(row[t] - shift)
        if in_place:
            for j in range(v):  # one array: vectorizes
                out[j] = (exp(out[j] - shift) - spread) * w
        else:
            for j in range(v):  # element-wise: vectorizes
                out[j] = (exp(row[j] - shift) - spread) * w
        out[t] = ((p_target - spread) - on_target) * w
    return None


def cross_entropy_rows(z: np.ndarray, targets: np.ndarray,
                       smoothing: float) -> tuple[np.ndarray, np.ndarray]:
    """z (N, V) NumPy floats (any layout: a strided one is copied first), targets (N,)
    integers in [0, V) -> per-row losses (N,) and each row's log-sum-exp (N,),
    compiled; nothing of size (N, V) is written."""
    z = np.ascontiguousarray(z)
    per_row = np.empty(z.shape[0], dtype=z.dtype)
    lse = np.empty(z.shape[0], dtype=z.dtype)
    _cross_entropy_rows(z, np.ascontiguousarray(targets, dtype=np.int64), float(smoothing),
                        per_row, lse)
    return per_row, lse


def cross_entropy_grad(z: np.ndarray, lse: np.ndarray, targets: np.ndarray,
                       weight: np.ndarray, smoothing: float,
                       out: np.ndarray | None = None) -> np.ndarray:
    """z (N, V), lse, targets, weight (N,) -> dz = weight (softmax(z) - q) (N, V), compiled;
    written into ``out`` when it is z itself, C-contiguous and writable (the logits'
    buffer reused), else into a new array."""
    in_place = out is z and z.flags.c_contiguous and z.flags.writeable
    z = np.ascontiguousarray(z)
    dz = z if in_place else np.empty_like(z)
    _cross_entropy_grad(z, np.ascontiguousarray(lse, dtype=z.dtype),
                        np.ascontiguousarray(targets, dtype=np.int64),
                        np.ascontiguousarray(weight, dtype=z.dtype), float(smoothing),
                        in_place, dz)
    return dz


def cross_entropy_with_gradient(logits: Array, targets: Array, dloss: float = 1.0,
                                ignore_index: int = IGNORE_INDEX,
                                label_smoothing: float = 0.0) -> tuple[Array, Array]:
    """:func:`npformer.ops.cross_entropy_with_gradient`, the gradient written over the
    (N, V) array the forward kept (the caller hands over logits it no longer reads): the
    logits themselves where the compiled kernels run, the forward's softmax elsewhere."""
    loss, saved = cross_entropy_forward(logits, targets, ignore_index, label_smoothing)
    return loss, cross_entropy_backward(dloss, saved, overwrite_logits=True)
