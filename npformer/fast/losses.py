r"""Cross-entropy, fast: log-softmax, the target pick and the backward fused, so no
one-hot or target distribution is built.  The same function as the textbook op
(:mod:`npformer.ops.losses`), tested equal to it.

On NumPy arrays with numba (:func:`npformer.fast.kernels.cross_entropy_rows` and
``cross_entropy_grad``): the forward reads each row of logits twice (its max, then the
exps and sums) and keeps the logits and each row's log-sum-exp $\lambda_n = m_n + \log
Z_n$, writing nothing of size (N, V); the backward writes $\bar z$ in one pass, with
$p = \exp(z - \lambda)$ recomputed.  Elsewhere (no numba, CuPy, the strict namespace)
the array statements below, which keep p = softmax(z) in s's buffer.

Rows: N predictions over V classes (any leading shape flattens to N).
Targets $y_n$; rows with $y_n$ = ignore_index do not count.  With smoothing
$\varepsilon$, the target distribution is
$q = (1 - \varepsilon)\,\text{onehot}(y) + \varepsilon / V$ (PyTorch's definition), and
the loss is averaged over the $N_v$ counted rows:

Forward (log-softmax and the target pick fused: only p = softmax(z) is stored)
    $m_n = \max_v z_{n,v}$,  $s = z - m$,  $\log Z_n = \log \sum_v e^{s_{n,v}}$
    $\ell_{n,v} = \log\text{softmax}(z)_{n,v} = s_{n,v} - \log Z_n$       (never built whole)
    $L_n = -\sum_v q_{n,v}\, \ell_{n,v}
         = (1-\varepsilon)(\log Z_n - s_{n,y_n})
           + \varepsilon\,(\log Z_n - \tfrac1V \sum_v s_{n,v})$
    $L = \frac{1}{N_v} \sum_{n \text{ counted}} L_n$     (0 if no row counts)
    $p = e^{s} / Z$, computed in s's buffer

Backward (softmax and log cancel into one subtraction)
    $\bar z_n = \bar L \, (p_n - q_n) / N_v$ for counted rows, 0 for ignored rows,
    where $p = \text{softmax}(z)$: since $\sum_v q_{n,v} = 1$,
    $\partial L_n/\partial z_{n,j} = -\sum_v q_{n,v} (\delta_{vj} - p_{n,j}) = p_{n,j} - q_{n,j}$.
    $p - q$ is built as $p - \varepsilon / V$, then $1 - \varepsilon$ subtracted at each row's
    target, then scaled by the row weight $w_n = \bar L\,[n \text{ counted}] / N_v$:
    one (N, V) array, no one-hot matrix.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from .. import backend
from ..backend import Array
from ..ops.contracts import backward_op, check_loss_gradient, cross_entropy_inputs, forward_op
from ..ops.losses import IGNORE_INDEX
from . import kernels
from .inplace import add_at_columns, exp_into


@forward_op(cross_entropy_inputs)
def cross_entropy_forward(logits: Array, targets: Array, ignore_index: int = IGNORE_INDEX,
                          label_smoothing: float = 0.0) -> tuple[Array, Any]:
    """logits (..., V) floats, targets (...) integers -> loss (0-d array), cache."""
    xp = backend.namespace_of(logits, targets)
    vocab = logits.shape[-1]
    z = xp.reshape(logits, (-1, vocab))  # (N, V)
    t = xp.reshape(targets, (-1,))  # (N,)
    counted = t != ignore_index  # (N,) bool
    safe_t = xp.where(counted, t, xp.zeros_like(t))  # ignored rows point at class 0
    if kernels.usable(z):  # one compiled pass a row: per-row losses and lse, no (N, V) array
        targets64 = xp.astype(safe_t, xp.int64)
        per_row, lse = kernels.cross_entropy_rows(z, targets64, float(label_smoothing))
        counted_f, denom, loss = _mean_over_counted(xp, per_row, counted, z.dtype)
        return loss, (_FromLogits(z, lse, targets64), safe_t, counted_f, denom,
                      label_smoothing, tuple(logits.shape))
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
    return loss, (p, safe_t, counted_f, denom, label_smoothing, tuple(logits.shape))


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
    logits and will not run this backward again: no second (N, V) array.
    """
    p, safe_t, counted_f, denom, label_smoothing, logits_shape = saved
    if isinstance(p, _FromLogits):  # the compiled pass: p recomputed from z and lse
        dz = kernels.cross_entropy_grad(p.logits, p.lse, p.targets, counted_f * (dloss / denom),
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
