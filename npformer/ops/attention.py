r"""Scaled dot-product attention (Vaswani et al., 2017, eq. 1), dense: it forms P.  The
derivation: docs/derivations.md §9.

Shapes: B batch, H heads, T queries, S keys, E query/key width per head (E >= 1),
F value width per head.  Any leading shape works in place of (B, H).

Forward, with $\alpha = 1/\sqrt{E}$ and the mask bias M (0 where a query may attend to a
key, $-\infty$ where not)
    $A = \alpha\, Q K^\top + M$                     (..., T, S)
    $P = \text{softmax}(A)$ along the keys          (..., T, S)
    $O = P V$                                       (..., T, F)

Backward
    $\bar V = P^\top \bar O$        $\bar P = \bar O V^\top$
    $\bar A = P \odot (\bar P - \text{rowsum}(\bar P \odot P))$   (softmax backward, §7)
    $\bar Q = \alpha\, \bar A K$      $\bar K = \alpha\, \bar A^\top Q$

Masks are boolean, True where a query may attend to a key, and broadcast to
(B, H, T, S) (``torch.nn.functional.scaled_dot_product_attention``'s convention).  A
query whose keys are all masked, or that has no keys (S = 0), gets a zero output and
zero gradients; no queries or an empty batch give an empty output.

The fast tier (:mod:`npformer.fast.attention`) computes the same in blocks and
never stores P; it is tested equal to this one.
"""
from __future__ import annotations

import math
from typing import Any

from ..backend import Array
from .contracts import (
    attention_inputs,
    attention_weights_inputs,
    backward_op,
    checked_op,
    door,
    forward_op,
    opened,
    state,
    with_saved,
)
from .softmax import softmax_backward, softmax_forward


@forward_op(attention_inputs)
def attention_forward(q: Array, k: Array, v: Array, mask: Array | None = None) -> tuple[Array, Any]:
    """q (..., T, E), k (..., S, E), v (..., S, F), mask (bool, broadcasts to (..., T, S))
    -> out (..., T, F), saved."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(attention_forward, q, k, v, mask)
    p, softmax_saved = softmax_forward(scaled_scores(q, k), axis=-1, mask=mask)  # P, (..., T, S)
    out = p @ v  # (..., T, S) @ (..., S, F) -> (..., T, F)
    return with_saved(attention_forward, out, (q, k, v, p, softmax_saved))


@backward_op(attention_forward)
def attention_backward(dout: Array, saved: Any) -> tuple[Array, Array, Array]:
    """dout (..., T, F) -> dq (..., T, E), dk (..., S, E), dv (..., S, F)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(attention_backward, dout, saved)
    values = opened(attention_forward, saved)
    q, k, v, p, softmax_saved = values
    scale = 1.0 / math.sqrt(q.shape[-1])
    dv = p.mT @ dout  # P^T dO: (..., S, T) @ (..., T, F)
    dp = dout @ v.mT  # dO V^T: (..., T, F) @ (..., F, S)
    dscores = softmax_backward(dp, softmax_saved)  # dA, (..., T, S); 0 at masked entries
    dq = (dscores @ k) * scale  # (..., T, S) @ (..., S, E)
    dk = (dscores.mT @ q) * scale  # (..., S, T) @ (..., T, E)
    return dq, dk, dv


def scaled_scores(q: Array, k: Array) -> Array:
    """A = alpha Q K^T: (..., T, E) @ (..., E, S) -> (..., T, S), alpha = 1 / sqrt(E)."""
    return (q @ k.mT) * (1.0 / math.sqrt(q.shape[-1]))


@checked_op(attention_weights_inputs)
def attention_weights(q: Array, k: Array, mask: Array | None = None) -> Array:
    """The probabilities P = softmax(alpha Q K^T + M) (..., T, S) that attention applies."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(attention_weights, q, k, mask)
    return softmax_forward(scaled_scores(q, k), axis=-1, mask=mask)[0]
