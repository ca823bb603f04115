r"""Cross-entropy over logits, with padding ignored and optional label smoothing.  The
derivation: docs/derivations.md §13.

Rows: N predictions over V classes (V >= 1; any leading shape flattens to N).
Targets $y_n$; rows with $y_n$ = ignore_index do not count.  With smoothing
$\varepsilon$, $q_n = (1 - \varepsilon)\,\text{onehot}(y_n) + \varepsilon / V$, and
$N_v$ counted rows:

Forward
    $\ell = \log\text{softmax}(z)$                      (N, V), along the classes (§8)
    $L_n = -(1 - \varepsilon)\,\ell_{n,y_n} - \varepsilon\,\text{mean}_v\, \ell_{n,v}$
         (the second term only for $\varepsilon > 0$)
    $L = \sum_n w_n L_n$, with $w_n = [n \text{ counted}] / N_v$   (0 if no row counts)

Backward
    $\bar\ell_n = -\bar L\, w_n\, q_n$,  then $\bar z = $ log-softmax backward of $\bar\ell$
    (the fast tier, :mod:`npformer.fast.losses`, computes $\bar z_n = \bar L\, w_n (p_n - q_n)$
    directly, $p = \text{softmax}(z)$).
"""
from __future__ import annotations

from typing import Any

from .. import backend
from ..backend import Array
from .contracts import (
    backward_op,
    check_loss_gradient,
    cross_entropy_inputs,
    door,
    forward_op,
    opened,
    state,
    with_saved,
)
from .softmax import log_softmax_backward, log_softmax_forward

IGNORE_INDEX = -100  # PyTorch's default


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
    log_p, log_softmax_saved = log_softmax_forward(z, axis=-1)  # l, (N, V)
    q = target_distribution(t, vocab, ignore_index, label_smoothing, z.dtype)  # (N, V)
    counted = xp.astype(t != ignore_index, z.dtype)  # (N,) 1 or 0
    n_counted = xp.sum(counted)
    weight = counted / xp.where(n_counted > 0, n_counted, xp.ones_like(n_counted))  # w, (N,)
    safe = xp.where(t != ignore_index, t, xp.zeros_like(t))  # ignored rows: class 0
    picked = xp.take_along_axis(log_p, safe[:, None], axis=-1)[:, 0]  # l at the targets, (N,)
    per_row = -(1.0 - label_smoothing) * picked  # L_n, (N,), as its two terms
    if label_smoothing > 0.0:
        per_row = per_row - label_smoothing * xp.mean(log_p, axis=-1)
    loss = xp.sum(weight * per_row)
    return with_saved(cross_entropy_forward, loss,
                      (q, weight, log_softmax_saved, tuple(logits.shape)))


@backward_op(cross_entropy_forward, upstream=check_loss_gradient)
def cross_entropy_backward(dloss: Array, saved: Any) -> Array:
    """dloss (scalar) -> dlogits (..., V)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(cross_entropy_backward, dloss, saved)
    values = opened(cross_entropy_forward, saved)
    q, weight, log_softmax_saved, logits_shape = values
    xp = backend.namespace_of(q)
    dlog_p = (-dloss * weight)[:, None] * q  # (N, V): 0 on ignored rows
    dz = log_softmax_backward(dlog_p, log_softmax_saved)  # (N, V)
    return xp.reshape(dz, logits_shape)


def target_distribution(targets: Array, vocab: int, ignore_index: int, label_smoothing: float,
                        dtype: Any) -> Array:
    """targets (N,) -> q (N, V) = (1 - eps) onehot(y) + eps / V (ignored rows: class 0)."""
    xp = backend.namespace_of(targets)
    safe = xp.where(targets != ignore_index, targets, xp.zeros_like(targets))
    classes = xp.arange(vocab, dtype=targets.dtype, device=backend.device_of(targets))
    onehot = xp.astype(classes[None, :] == safe[:, None], dtype)  # (N, V)
    return (1.0 - label_smoothing) * onehot + label_smoothing / vocab



def cross_entropy_with_gradient(logits: Array, targets: Array, dloss: float = 1.0,
                                ignore_index: int = IGNORE_INDEX,
                                label_smoothing: float = 0.0) -> tuple[Array, Array]:
    """A training step's end: the loss (0-d array) and ``dloss`` times its gradient over
    the logits (..., V), the forward and the backward above run one after the other."""
    loss, saved = cross_entropy_forward(logits, targets, ignore_index, label_smoothing)
    return loss, cross_entropy_backward(dloss, saved)
