r"""Scaled dot-product attention (Vaswani et al., 2017, eq. 1) and its masks.

Shapes: B batch, H heads, T queries, S keys, E query/key width per head,
F value width per head.  Any leading shape works in place of (B, H).

Forward
    $A = Q K^\top / \sqrt{E}$                    scores, (..., T, S)
    $P = \text{softmax}(A)$ over keys, masked      (..., T, S)   see :mod:`.softmax`
    $O = P V$                                    (..., T, F)

Backward, from $\bar O$
    $\bar P = \bar O V^\top$        $\bar V = P^\top \bar O$
    $\bar A = P \odot (\bar P - \text{rowsum}(\bar P \odot P))$   (softmax backward)
    $\bar Q = \bar A K / \sqrt{E}$     $\bar K = \bar A^\top Q / \sqrt{E}$

Masks are boolean, True where a query may attend to a key, and broadcast to
(B, H, T, S) (the convention of ``torch.nn.functional.scaled_dot_product_attention``;
note ``nn.MultiheadAttention``'s masks mean the opposite).  A query whose keys
are all masked gets a zero output and zero gradients.
"""
from __future__ import annotations

import math

from .. import backend
from ._checks import check_float, check_mask, check_rank
from .softmax import softmax_backward, softmax_forward


def attention_forward(q, k, v, mask=None):
    """q (..., T, E), k (..., S, E), v (..., S, F), mask (bool, broadcasts to (..., T, S))
    -> out (..., T, F), cache."""
    xp = backend.namespace_of(q, k, v)
    for name, a in (("queries", q), ("keys", k), ("values", v)):
        check_float(a, f"attention {name}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"attention keys {tuple(k.shape)} and values {tuple(v.shape)} "
                         "must agree on every axis but the last")
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention queries {tuple(q.shape)} and keys {tuple(k.shape)} "
                         "must agree on the leading axes and the last (width) axis")
    if mask is not None:  # named as the caller knows it, before any work is done
        check_mask(mask, tuple(q.shape[:-1]) + (k.shape[-2],), "attention mask")
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = xp.matmul(q, xp.matrix_transpose(k))  # (..., T, E) @ (..., E, S) -> (..., T, S)
    scores *= scale  # in place: the scores are ours
    p, _ = softmax_forward(scores, axis=-1, mask=mask, overwrite_input=True)  # (..., T, S)
    out = xp.matmul(p, v)  # (..., T, S) @ (..., S, F) -> (..., T, F)
    return out, (q, k, v, p, scale)


def attention_backward(dout, cache):
    """dout (..., T, F) -> dq (..., T, E), dk (..., S, E), dv (..., S, F)."""
    q, k, v, p, scale = cache
    xp = backend.namespace_of(dout, p)
    dp = xp.matmul(dout, xp.matrix_transpose(v))  # (..., T, F) @ (..., F, S) -> (..., T, S)
    dv = xp.matmul(xp.matrix_transpose(p), dout)  # (..., S, T) @ (..., T, F) -> (..., S, F)
    dscores = softmax_backward(dp, (p, -1), overwrite_input=True)  # (..., T, S), in dp's buffer
    dscores *= scale  # the scale, folded in once
    dq = xp.matmul(dscores, k)  # (..., T, S) @ (..., S, E) -> (..., T, E)
    dk = xp.matmul(xp.matrix_transpose(dscores), q)  # (..., S, T) @ (..., T, E) -> (..., S, E)
    return dq, dk, dv


# --------------------------------------------------------------------------- masks
def padding_mask(valid_lens, num_keys: int):
    """valid_lens (B,) integers -> (B, 1, 1, S) bool, True at the first valid_lens[b] keys."""
    xp = backend.namespace_of(valid_lens)
    check_rank(valid_lens, 1, "valid lengths")
    if not backend.is_integer_array(valid_lens):
        raise TypeError(f"valid lengths must be integers, got dtype {valid_lens.dtype}")
    positions = xp.arange(num_keys, dtype=valid_lens.dtype, device=backend.device_of(valid_lens))
    keep = positions[None, :] < valid_lens[:, None]  # (B, S)
    return keep[:, None, None, :]  # (B, 1, 1, S)


def causal_mask(num_queries: int, num_keys: int | None = None, like=None):
    """(T, S) bool: query i may see keys j <= i + (S - T).

    With S == T this is the lower triangle; with S > T (a decoder continuing a
    cached prefix of S - T tokens) the queries are the last T positions.
    ``like``: any array of the target namespace/device (default: the current backend).
    """
    num_keys = num_queries if num_keys is None else num_keys
    if num_keys < num_queries:
        raise ValueError(f"causal mask needs at least as many keys ({num_keys}) "
                         f"as queries ({num_queries})")
    xp = backend.xp() if like is None else backend.namespace_of(like)
    dev = backend.device() if like is None else backend.device_of(like)
    i = xp.arange(num_queries, device=dev)[:, None]  # (T, 1)
    j = xp.arange(num_keys, device=dev)[None, :]  # (1, S)
    return j <= i + (num_keys - num_queries)  # (T, S)
