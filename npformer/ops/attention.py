r"""Scaled dot-product attention (Vaswani et al., 2017, eq. 1), dense: it forms P.

Shapes: B batch, H heads, T queries, S keys, E query/key width per head,
F value width per head.  Any leading shape works in place of (B, H).

Forward, with the scale $\alpha = 1/\sqrt{E}$ and the mask bias M (0 where a query
may attend to a key, $-\infty$ where not)
    $A = \alpha\, Q K^\top$                     scores, (..., T, S)
    $P = \text{softmax}(A + M)$ along the keys      (..., T, S), each row sums to 1
    $O = P V$                                  (..., T, F)

Backward, from $\bar O$, through the three lines in reverse
    $\bar V = P^\top \bar O$        $\bar P = \bar O V^\top$
    $\bar A = P \odot (\bar P - \text{rowsum}(\bar P \odot P))$   (softmax backward, §7)
    $\bar Q = \alpha\, \bar A K$      $\bar K = \alpha\, \bar A^\top Q$

Masks are boolean, True where a query may attend to a key, and broadcast to
(B, H, T, S) (the convention of ``torch.nn.functional.scaled_dot_product_attention``;
note ``nn.MultiheadAttention``'s masks mean the opposite).  A query whose keys
are all masked gets a zero output and zero gradients.

Empty axes: no queries (T = 0) or an empty batch give the empty output (..., 0, F) or
(0, ..., T, F); no keys (S = 0) give every query a zero output and zero gradients, as
when all its keys are masked.  The query/key width E must be at least 1.

The fast tier (:mod:`npformer.fast.attention`) computes the same in blocks and
never stores P; it is tested equal to this one.
"""
from __future__ import annotations

import math

from .. import backend
from ._checks import check_array, check_cache, check_same_dtype, check_float, check_mask, check_upstream
from .softmax import softmax_backward, softmax_forward


def attention_forward(q, k, v, mask=None):
    """q (..., T, E), k (..., S, E), v (..., S, F), mask (bool, broadcasts to (..., T, S))
    -> out (..., T, F), cache."""
    check_attention_arrays(q, k, v)
    check_attention_inputs(q, k, v, mask)
    xp = backend.namespace_of(q, k, v)
    p = attention_weights(q, k, mask)  # P, (..., T, S)
    out = xp.matmul(p, v)  # (..., T, S) @ (..., S, F) -> (..., T, F)
    return out, (q, k, v, p)


def attention_backward(dout, cache):
    """dout (..., T, F) -> dq (..., T, E), dk (..., S, E), dv (..., S, F)."""
    check_cache(cache, 4, "attention_forward", "attention_backward")
    check_upstream(dout, attention_output_shape(cache[0], cache[2]), "attention_backward",
                   cache[0].dtype)  # of q and v
    q, k, v, p = cache
    xp = backend.namespace_of(dout, q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    dv = xp.matmul(xp.matrix_transpose(p), dout)  # P^T dO: (..., S, T) @ (..., T, F)
    dp = xp.matmul(dout, xp.matrix_transpose(v))  # dO V^T: (..., T, F) @ (..., F, S)
    dscores = softmax_backward(dp, (p, -1))  # dA, (..., T, S); 0 at masked entries
    dq = xp.matmul(dscores, k) * scale  # (..., T, S) @ (..., S, E)
    dk = xp.matmul(xp.matrix_transpose(dscores), q) * scale  # (..., S, T) @ (..., T, E)
    return dq, dk, dv


def attention_weights(q, k, mask=None):
    """The probabilities P = softmax(alpha Q K^T + M) (..., T, S) that attention applies."""
    check_attention_arrays(q, k, k)
    check_attention_inputs(q, k, k, mask)
    xp = backend.namespace_of(q, k)
    scores = xp.matmul(q, xp.matrix_transpose(k)) * (1.0 / math.sqrt(q.shape[-1]))  # A
    return softmax_forward(scores, axis=-1, mask=mask)[0]


def check_attention_arrays(q, k, v) -> None:
    """Queries, keys and values are arrays (before their namespace is asked for)."""
    for name, a in (("queries", q), ("keys", k), ("values", v)):
        check_array(a, f"attention {name}")


def check_attention_inputs(q, k, v, mask) -> None:
    """Queries, keys, values and mask fit together (shared with the fast tier)."""
    for name, a in (("queries", q), ("keys", k), ("values", v)):
        check_float(a, f"attention {name}")
        if a.ndim < 2:
            raise ValueError(f"attention {name} must have at least 2 dimensions (positions, "
                             f"width), got shape {tuple(a.shape)}")
    if q.shape[-1] == 0:
        raise ValueError(f"attention queries and keys must have a width (last axis) of at "
                         f"least 1, got queries of shape {tuple(q.shape)}")
    check_same_dtype("attention", queries=q, keys=k, values=v)
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"attention keys {tuple(k.shape)} and values {tuple(v.shape)} "
                         "must agree on every axis but the last")
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention queries {tuple(q.shape)} and keys {tuple(k.shape)} "
                         "must agree on the leading axes and the last (width) axis")
    if mask is not None:  # named as the caller knows it, before any work is done
        check_mask(mask, tuple(q.shape[:-1]) + (k.shape[-2],), "attention mask")


def attention_output_shape(q, v) -> tuple:
    """(..., T, F): the shape of the forward's output, from its cache."""
    return tuple(q.shape[:-1]) + (v.shape[-1],)
