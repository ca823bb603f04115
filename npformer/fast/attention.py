r"""Scaled dot-product attention, fast: blocked, with the log-sum-exp stored and P
recomputed in the backward.  The same function as the dense textbook op
(:mod:`npformer.ops.attention`), tested equal to it.

Shapes: B batch, H heads, T queries, S keys, E query/key width per head,
F value width per head.  Any leading shape works in place of (B, H).

Forward, with the scale $\alpha = 1/\sqrt{E}$
    $A = \alpha (Q K^\top) + M$                    scores, (..., T, S); M = 0 or -inf (mask)
    $m = \max_j A_{:j}$, $e = \exp(A - m)$, $l = \sum_j e_{:j}$   (stable softmax, §7)
    $O = (e V) / l$                              (..., T, F): $P V$ with $P = e / l$
    $\lambda = m + \log l$                         (..., T, 1): each row's log-sum-exp

Backward, from $\bar O$, recomputing $P = \exp(A - \lambda)$ instead of storing it
(the memory-efficient backward of FlashAttention, Dao et al., 2022)
    $\bar V = P^\top \bar O$        $\bar P = \bar O V^\top$
    $\bar A = P \odot (\bar P - \text{rowsum}(\bar P \odot P))$   (softmax backward, §7)
    $\bar S = \alpha \bar A$                       (the gradient of the unscaled $S = Q K^\top$)
    $\bar Q = \bar S K$      $\bar K = \bar S^\top Q$

The scale is applied to the scores, never to a copy of Q: the compiled kernels scale
each row on their way through it, so the cache keeps the queries the caller passed.

Blocks.  The (T, S) score matrices are never held for the whole batch: both
passes walk over blocks of about ``block_scores`` scores (an argument, default
``BLOCK_SCORES``: a few batch rows, or a range of queries), so each block's
element-wise passes run in the CPU cache and the backward keeps only $\lambda$, not
the (B, H, T, S) probabilities.  Within a block, keys after the last one any query
of the block may see are cut off (padding at the end of a sequence, the future of a
causal block): they would get probability 0 and gradient 0, so only work is saved;
and when the block's mask then allows every query every remaining key, the all-zero
bias is skipped.

Masks as in the textbook op: boolean, True where a query may attend to a key,
broadcasting to (B, H, T, S).  A query whose keys are all masked gets a zero
output and zero gradients.
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

from .. import backend
from ..backend import Array
from ..ops.softmax import mask_bias
from ..validation import attention_inputs, backward_op, forward_op
from . import kernels
from .inplace import exp_into
from .softmax import softmax_backward

BLOCK_SCORES = 1 << 19  # scores per block: 2 MiB in float32, about a CPU core's L2 cache
GPU_BLOCK_SCORES = 1 << 25  # on a GPU: 128 MiB in float32, blocks as large as memory allows
# (each block is a dozen kernel launches; the GPU's cache is not what a block must fit)


def default_block_scores(q: Array) -> int:
    """Scores per block for queries ``q``: a CPU core's cache, or a GPU's launch count."""
    return GPU_BLOCK_SCORES if type(q).__module__.startswith("cupy") else BLOCK_SCORES


@forward_op(attention_inputs)
def attention_forward(q: Array, k: Array, v: Array, mask: Array | None = None,
                      block_scores: int | None = None) -> tuple[Array, Any]:
    """q (..., T, E), k (..., S, E), v (..., S, F), mask (bool, broadcasts to (..., T, S))
    -> out (..., T, F), cache.  ``block_scores``: scores per block (the backward uses
    the same blocks); None: :func:`default_block_scores`."""
    xp = backend.namespace_of(q, k, v)
    block_scores = default_block_scores(q) if block_scores is None else block_scores
    scale = 1.0 / math.sqrt(q.shape[-1])
    mask = _align(mask, q.ndim)
    bias = None if mask is None else mask_bias(mask, q.dtype)  # mask's shape: 0 or -inf
    out = _empty(xp, q.shape[:-1] + (v.shape[-1],), q)  # (..., T, F)
    lse = _empty(xp, q.shape[:-1] + (1,), q)  # (..., T, 1)
    if k.shape[-2] == 0:  # no keys (no blocks): zero output, as for fully masked queries
        out, lse = xp.zeros_like(out), xp.zeros_like(lse)
    extents = _key_extents(mask)  # host integers: the block walk never waits on the device
    with one_blas_thread(q):  # the blocks' small products: see one_blas_thread
        for rows, keys, block_bias, row_keys in _blocks(q, k, extents, bias, block_scores):
            scores = q[rows] @ k[keys].mT  # S = Q K^T: (.., t, E) @ (.., E, s)
            if _compiled(scores):  # scale, masked softmax and lse: one compiled pass a row
                kernels.attention_softmax(scores, block_bias, scale, lse[rows], row_keys)  # P
                out[rows] = scores @ v[keys]  # (.., t, s) @ (.., s, F) -> (.., t, F)
                continue
            scores *= scale  # alpha S, in place
            e, m, total = _stable_exp(scores, block_bias)  # (.., t, s), (.., t, 1) twice
            out[rows] = (e @ v[keys]) / total  # (.., t, s) @ (.., s, F) -> (.., t, F)
            lse[rows] = m + xp.log(total)
    return out, (q, k, v, extents, bias, lse, scale, block_scores)


@backward_op(attention_forward)
def attention_backward(dout: Array, saved: Any) -> tuple[Array, Array, Array]:
    """dout (..., T, F) -> dq (..., T, E), dk (..., S, E), dv (..., S, F)."""
    q, k, v, extents, bias, lse, scale, block_scores = saved
    xp = backend.namespace_of(dout, q)
    dq = _empty(xp, q.shape, q)  # every query row belongs to exactly one block
    if k.shape[-2] == 0:  # no keys (no blocks): zero gradients
        dq = xp.zeros_like(q)
    dk = xp.zeros_like(k)  # keys are shared by query blocks, and cut-off keys get 0
    dv = xp.zeros_like(v)
    with one_blas_thread(q):  # the blocks' small products: see one_blas_thread
        for rows, keys, block_bias, row_keys in _blocks(q, k, extents, bias, block_scores):
            scores = q[rows] @ k[keys].mT  # S = Q K^T (.., t, s), recomputed
            compiled = _compiled(scores)
            if compiled:
                kernels.attention_probabilities(scores, block_bias, scale, lse[rows], row_keys)
                p = scores
            else:
                scores *= scale
                if block_bias is not None:
                    scores += block_bias
                scores -= lse[rows]
                p = exp_into(scores)  # P = exp(A - lse), (.., t, s)
            dv[keys] += p.mT @ dout[rows]  # (.., s, t) @ (.., t, F)
            dp = dout[rows] @ v[keys].mT  # (.., t, F) @ (.., F, s)
            if compiled:
                kernels.attention_softmax_backward(dp, p, scale, row_keys)  # alpha dA, in dp
                dscores = dp
            else:
                dscores = softmax_backward.unchecked(dp, (p, -1), overwrite_input=True)  # dA, in dp
                dscores *= scale  # alpha dA
            dq[rows] = dscores @ k[keys]  # (.., t, s) @ (.., s, E)
            dk[keys] += dscores.mT @ q[rows]  # (.., s, t) @ (.., t, E)
    return dq, dk, dv


_blas = None  # threadpoolctl's controller of the loaded BLAS: found once (it reads /proc)


def one_blas_thread(like: Array) -> Any:
    """A context in which NumPy's BLAS runs on one thread, for arrays like ``like``.

    A block's products are small (per head, a block of queries times its keys), and a
    multi-threaded BLAS makes its threads meet at every one of them: on 2 cores that
    costs more than it saves, and far more when other processes share the cores (a
    thread then waits for one that is not running).  A GPU library has no such threads."""
    global _blas
    if type(like).__module__.split(".")[0] != "numpy":
        return nullcontext()
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - threadpoolctl is a dependency
        return nullcontext()
    if _blas is None:
        _blas = ThreadpoolController()
    return _blas.limit(limits=1, user_api="blas")


def _compiled(scores) -> bool:
    """Whether a block's scores (A, H, t, s) go to the compiled softmax kernels
    (:mod:`.kernels`: NumPy, numba present; other ranks take the array statements)."""
    return scores.ndim == 4 and kernels.usable(scores)


def _empty(xp, shape, like):
    return xp.empty(tuple(shape), dtype=like.dtype, device=backend.device_of(like))


def _align(mask, ndim: int):
    """A mask that broadcasts to the scores, given the scores' number of axes (leading 1s)."""
    if mask is None or mask.ndim == ndim:
        return mask
    xp = backend.namespace_of(mask)
    return xp.reshape(mask, (1,) * (ndim - mask.ndim) + tuple(mask.shape))


def _stable_exp(scores, bias):
    """Masked, max-shifted exp of a block of scores, in the scores' buffer.

    -> e (.., t, s), m (.., t, 1), total (.., t, 1) with softmax = e / total.
    A row with every key masked has m = 0 (not -inf), e = 0 and total = 1, so its
    output is 0 and its log-sum-exp m + log(total) = 0: never NaN.
    """
    xp = backend.namespace_of(scores)
    if bias is not None:
        scores += bias
    m = xp.max(scores, axis=-1, keepdims=True)
    if bias is not None:
        m = xp.where(xp.isfinite(m), m, xp.zeros_like(m))
    scores -= m
    e = exp_into(scores)  # exp(-inf) = 0 at masked entries
    total = xp.sum(e, axis=-1, keepdims=True)
    if bias is not None:
        total = xp.where(total > 0, total, xp.ones_like(total))
    return e, m, total


def _blocks(q, k, extents, bias, block_scores: int):
    """Yield (rows, keys, block_bias, row_keys): index tuples into q (and out, lse) and
    into k, v, the bias block, and the compiled kernels' per-row key counts
    (:func:`_row_keys`, or None: all of the block's), covering the scores (..., T, S) in
    blocks of about block_scores.

    A block is a range of axis-0 rows (several batch rows if one fits) or, when one
    row's (..., T, S) scores are too many, a range of its queries.
    """
    if math.prod(q.shape[:-1]) * k.shape[-2] == 0:  # an empty axis: no scores, no blocks
        return
    num_rows = q.shape[0] if q.ndim > 2 else 1  # (T, E) queries: one row
    num_queries, num_keys = q.shape[-2], k.shape[-2]
    per_query = math.prod(q.shape[1:-2]) * num_keys  # scores per (row, query)
    queries = max(1, min(num_queries, block_scores // per_query))
    rows_per_block = (max(1, block_scores // (per_query * num_queries))
                      if queries == num_queries else 1)
    all_ = slice(None)
    for r in range(0, num_rows, rows_per_block):
        row = slice(r, min(r + rows_per_block, num_rows))
        for t in range(0, num_queries, queries):
            query = slice(t, min(t + queries, num_queries))
            seen, block_bias, row_keys = num_keys, None, None
            if extents is not None:
                seen, all_allowed = _visible_keys(extents, row, query, num_keys)
                if not all_allowed:
                    block_bias = bias[_mask_index(bias, row, query, slice(0, seen))]
                    row_keys = _row_keys(extents, row, query, seen)
            key = slice(0, seen)
            rows = (row, Ellipsis, query, all_) if q.ndim > 2 else (query, all_)
            keys = (row, Ellipsis, key, all_) if q.ndim > 2 else (key, all_)
            yield rows, keys, block_bias, row_keys


def _mask_index(mask, row, query, key):
    """Index of a block in a mask (or bias) that broadcasts: slice only axes of full size."""
    all_ = slice(None)
    pick = lambda axis, s: s if mask.shape[axis] > 1 else all_  # noqa: E731
    if mask.ndim == 2:
        return (pick(0, query), pick(1, key))
    return (pick(0, row), Ellipsis, pick(-2, query), pick(-1, key))


def _key_extents(mask):
    """-> None (no mask) or (last, prefix, width): host integer arrays (R, T_m), one row per
    mask row r (axis 0; 1 for a (T, S) mask) and mask query t, taken over the axes
    between (heads): last = 1 + the last key any of them may see (0 if none), prefix =
    the number of leading keys all of them may see; width = the mask's key axis.

    One copy from the device per call: the block walk then reads host integers.  (A read
    per block would stall a GPU once per block.)
    """
    if mask is None or math.prod(mask.shape) == 0:
        return None
    xp = backend.namespace_of(mask)
    m = mask if mask.ndim > 2 else xp.reshape(mask, (1,) + tuple(mask.shape))  # (R, .., T_m, S_m)
    width = m.shape[-1]
    position = xp.arange(1, width + 1, device=backend.device_of(mask))  # (S_m,): 1 + key index
    last = xp.max(xp.where(m, position, xp.zeros_like(position)), axis=-1)  # (R, .., T_m)
    width_ = xp.full_like(position, width)
    prefix = xp.min(xp.where(m, width_, position - 1), axis=-1)  # the first key not allowed
    middle = tuple(range(1, m.ndim - 2))  # heads
    if middle:
        last, prefix = xp.max(last, axis=middle), xp.min(prefix, axis=middle)
    last, prefix = backend.to_numpy(xp.stack([last, prefix]))  # (R, T_m) each: the one copy
    return last, prefix, width


def _row_keys(extents, row, query, seen: int):
    """-> the leading keys each (row, query) of a block computes, host int64 broadcasting
    to the block's (rows, queries), or None (the mask broadcasts along the keys).

    1 + the last key any head of the row may see for that query, rounded up to a
    multiple of 8 (or the block's ``seen``): every key from there on is masked, and the
    compiled kernels' running maxima and sums (8 and 4 lanes) then add the same elements
    in the same order as over the whole row.  A causal row of T keys computes about
    T / 2 of them.
    """
    last, _, width = extents
    if width == 1:
        return None
    block_last = last[_extents_index(extents, row, query)]  # (r or 1, t or 1)
    return ((block_last + 7) // 8 * 8).clip(max=seen).astype("int64", copy=False)  # host


def _extents_index(extents, row, query) -> tuple:
    """Index of a block's rows and queries in the (R, T_m) tables of :func:`_key_extents`:
    slice only axes of full size (an axis of 1 broadcasts)."""
    last = extents[0]
    pick = lambda size, s: s if size > 1 else slice(None)  # noqa: E731
    return (pick(last.shape[0], row), pick(last.shape[1], query))


def _visible_keys(extents, row, query, num_keys: int) -> tuple[int, bool]:
    """-> (seen, all_allowed) for a block: seen = 1 + the last key any of its queries may see
    (at least 1), and whether its mask allows every query every key before that.

    Keys from ``seen`` on are cut; when all_allowed, the bias is all zeros and is skipped
    (a padding mask on a block of one sequence).
    """
    last, prefix, width = extents
    block = _extents_index(extents, row, query)
    if width == 1:  # the mask broadcasts along the keys: nothing to cut
        return num_keys, int(prefix[block].min()) >= 1
    seen = max(1, int(last[block].max()))
    return seen, int(prefix[block].min()) >= seen
