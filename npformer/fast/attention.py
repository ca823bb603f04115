r"""Scaled dot-product attention, fast: blocked, with the log-sum-exp stored and P
recomputed in the backward (docs/derivations.md §18; its kernels §19).  The same function
as the dense textbook op (:mod:`npformer.ops.attention`), tested equal to it.  Shapes:
B batch, H heads (any leading shape works in place of (B, H)), T queries, S keys, E
query/key width, F value width.

Forward, $\alpha = 1/\sqrt{E}$, M = 0 or -inf (the mask), per row t:
    $A = \alpha (Q K^\top) + M$, $m = \max_s A_{t,s}$, $e = \exp(A - m)$, $l = \sum_s e_{t,s}$
    $O = (e V) / l$, $\text{lse} = m + \log l$
Backward, $P = \exp(A - \text{lse})$ recomputed:
    $\bar V = P^\top \bar O$, $\bar P = \bar O V^\top$,
    $\bar A = P \odot (\bar P - \text{rowsum}(\bar P \odot P))$,
    $\bar Q = \alpha \bar A K$, $\bar K = \alpha \bar A^\top Q$

Both passes walk blocks of about ``block_scores`` scores (batch rows, or a range of
queries), cut each block's keys after the last one its queries may see, and skip an
all-zero bias.  A fully masked query gets zero output and gradients.  Inputs holding NaN or
inf get the textbook's dense statements (the blocks would skip the keys that carry them).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from .. import backend
from ..backend import Array
from ..gpu import attention as captured
from ..gpu.gemm import capturing
from ..ops import attention as _textbook
from ..ops.contracts import backward_op, door, forward_op, opened, state, with_saved
from ..ops.masks import align_mask
from ..ops.softmax import mask_bias
from .compiler import compilable, jit
from .contracts import attention_inputs
from .inplace import exp_into
from .numerics import all_finite, exp, max8, sum4
from .softmax import softmax_backward

BLOCK_SCORES = 1 << 19  # scores per block: 2 MiB in float32, about a CPU core's L2 cache
GPU_BLOCK_SCORES = 1 << 25  # on a GPU: 128 MiB in float32, blocks as large as memory allows
# (each block is a dozen kernel launches; the GPU's cache is not what a block must fit)


def default_block_scores(q: Array) -> int:
    """Scores per block for queries ``q``: a CPU core's saved values, or a GPU's launch count."""
    return GPU_BLOCK_SCORES if type(q).__module__.startswith("cupy") else BLOCK_SCORES


@forward_op(attention_inputs)
def attention_forward(q: Array, k: Array, v: Array, mask: Array | None = None,
                      block_scores: int | None = None) -> tuple[Array, Any]:
    """q (..., T, E), k (..., S, E), v (..., S, F), mask (bool, broadcasts to (..., T, S))
    -> out (..., T, F), saved.  ``block_scores``: scores per block (the backward uses
    the same blocks); None: :func:`default_block_scores`."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(attention_forward, q, k, v, mask, block_scores)
    if capturing():  # a step captured as a CUDA graph: the GPU tier's dense statements
        return with_saved(attention_forward, *captured.capture_forward(q, k, v, mask))
    if not all_finite(q, k, v):  # NaN or inf: what the textbook's dense statements give
        out, values = _textbook.attention_forward.unchecked(q, k, v, mask)
        return with_saved(attention_forward, out, _Dense(values))
    xp = backend.namespace_of(q, k, v)
    block_scores = default_block_scores(q) if block_scores is None else block_scores
    scale = 1.0 / math.sqrt(q.shape[-1])
    mask = align_mask(mask, q.ndim)
    bias = None if mask is None else mask_bias(mask, q.dtype)  # mask's shape: 0 or -inf
    out = _empty(xp, q.shape[:-1] + (v.shape[-1],), q)  # (..., T, F)
    lse = _empty(xp, q.shape[:-1] + (1,), q)  # (..., T, 1)
    if k.shape[-2] == 0:  # no keys (no blocks): zero output, as for fully masked queries
        out, lse = xp.zeros_like(out), xp.zeros_like(lse)
    extents = _key_extents(mask)  # host integers: the block walk never waits on the device
    for rows, keys, block_bias, row_keys in _blocks(q, k, extents, bias, block_scores):
        scores = q[rows] @ k[keys].mT  # S = Q K^T: (.., t, E) @ (.., E, s)
        if _compiled(scores):  # scale, masked softmax and lse: one compiled pass a row
            attention_softmax(scores, block_bias, scale, lse[rows], row_keys)  # P
            out[rows] = scores @ v[keys]  # (.., t, s) @ (.., s, F) -> (.., t, F)
            continue
        scores *= scale  # alpha S, in place
        e, m, total = _stable_exp(scores, block_bias)  # (.., t, s), (.., t, 1) twice
        out[rows] = (e @ v[keys]) / total  # (.., t, s) @ (.., s, F) -> (.., t, F)
        lse[rows] = m + xp.log(total)
    return with_saved(attention_forward, out,
                      (q, k, v, mask, extents, bias, lse, scale, block_scores))


class _Dense(NamedTuple):
    """The saved values of a forward whose inputs held NaN or inf: the textbook op's own."""

    values: Any


@backward_op(attention_forward)
def attention_backward(dout: Array, saved: Any) -> tuple[Array, Array, Array]:
    """dout (..., T, F) -> dq (..., T, E), dk (..., S, E), dv (..., S, F)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(attention_backward, dout, saved)
    values = opened(attention_forward, saved)
    if isinstance(values, captured.Fused):
        return captured.fused_backward(dout, values.values)
    if isinstance(values, captured.Captured):
        return captured.capture_backward(dout, values.values)
    if isinstance(values, _Dense):
        return _textbook.attention_backward.unchecked(dout, values.values)
    q, k, v, mask, extents, bias, lse, scale, block_scores = values
    if not all_finite(dout):  # NaN or inf: the textbook's dense statements, P formed again
        _, dense = _textbook.attention_forward.unchecked(q, k, v, mask)
        return _textbook.attention_backward.unchecked(dout, dense)
    xp = backend.namespace_of(dout, q)
    dq = _empty(xp, q.shape, q)  # every query row belongs to exactly one block
    if k.shape[-2] == 0:  # no keys (no blocks): zero gradients
        dq = xp.zeros_like(q)
    dk = xp.zeros_like(k)  # keys are shared by query blocks, and cut-off keys get 0
    dv = xp.zeros_like(v)
    for rows, keys, block_bias, row_keys in _blocks(q, k, extents, bias, block_scores):
        scores = q[rows] @ k[keys].mT  # S = Q K^T (.., t, s), recomputed
        compiled = _compiled(scores)
        if compiled:
            attention_probabilities(scores, block_bias, scale, lse[rows], row_keys)
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
            attention_softmax_backward(dp, p, scale, row_keys)  # alpha dA, in dp
            dscores = dp
        else:
            dscores = softmax_backward.unchecked(dp, (p, -1), overwrite_input=True)  # dA, in dp
            dscores *= scale  # alpha dA
        dq[rows] = dscores @ k[keys]  # (.., t, s) @ (.., s, E)
        dk[keys] += dscores.mT @ q[rows]  # (.., s, t) @ (.., t, E)
    return dq, dk, dv


def _compiled(scores) -> bool:
    """Whether a block's scores (A, H, t, s) go to the compiled softmax kernels (NumPy,
    numba present; other ranks take the array statements)."""
    return scores.ndim == 4 and compilable(scores)


def _empty(xp, shape, like):
    return xp.empty(tuple(shape), dtype=like.dtype, device=backend.device_of(like))


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
    to the block's (rows, queries), or None (the mask broadcasts along the keys): 1 + the
    last key any head may see, rounded up to a multiple of 8 (or ``seen``), so that the
    kernels' 8 and 4 running lanes add what they add over the whole row (§19)."""
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


# =========================================================================== the kernels
# The masked softmax of a block of scores Q K^T (A, H, t, s), in place, a row at a time,
# the scale and the bias (a broadcast view; not read where ``has_bias`` is False) applied
# on the way, the row sums in float64.  Row (a, ., t) computes its first keys[a, t] keys
# (a multiple of 8 or s, every later key masked: the same bits as the whole row) and
# writes 0 over the rest (docs/derivations.md §19).
@jit(inline="always")
def _scale_add_into(row, scale, bias, has_bias):
    """row = scale row (+ bias where has_bias), element by element (the bias row may be
    a strided view)."""
    if has_bias:
        for j in range(row.size):
            row[j] = row[j] * scale + bias[j]
    else:
        for j in range(row.size):
            row[j] = row[j] * scale


@jit
def _softmax_lse(scores, bias, has_bias, scale, lse, keys):
    """scores (A, H, t, s) -> P = softmax(scale scores + bias) in place; lse (A, H, t)
    = max + log(sum exp(. - max)); a row with every key masked: P = 0, lse = 0."""
    zero, neg_inf = scores.dtype.type(0.0), scores.dtype.type(-np.inf)
    na, nh, nt, _ = scores.shape
    for a in range(na):
        for h in range(nh):
            for t in range(nt):
                n = keys[a, t]
                row = scores[a, h, t, :n]
                scores[a, h, t, n:] = zero  # masked: probability 0
                _scale_add_into(row, scale, bias[a, h, t, :n], has_bias)
                m = max8(row, neg_inf)
                if m == neg_inf:  # every key masked: e = 0, total = 1 (textbook)
                    for j in range(n):
                        row[j] = zero
                    lse[a, h, t] = zero
                    continue
                for j in range(n):  # element-wise: vectorizes
                    row[j] = exp(row[j] - m)
                total = scores.dtype.type(sum4(row, row, 0))
                for j in range(n):
                    row[j] = row[j] / total
                lse[a, h, t] = m + np.log(total)
    return None


@jit
def _probabilities(scores, bias, has_bias, scale, lse, keys):
    """scores (A, H, t, s) -> P = exp((scale scores + bias) - lse) in place, lse
    (A, H, t) from the forward: the backward's recomputed probabilities."""
    zero = scores.dtype.type(0.0)
    na, nh, nt, _ = scores.shape
    for a in range(na):
        for h in range(nh):
            for t in range(nt):
                n = keys[a, t]
                row = scores[a, h, t, :n]
                scores[a, h, t, n:] = zero
                shift = lse[a, h, t]
                _scale_add_into(row, scale, bias[a, h, t, :n], has_bias)
                for j in range(n):  # contiguous, element-wise: vectorizes
                    row[j] = exp(row[j] - shift)
    return None


@jit
def _softmax_backward(dp, p, scale, keys):
    """dp, p (A, H, t, s) -> scale dA, dA = (dp - <dp, p>) p, in dp's buffer, row by
    row: the gradient of the unscaled scores Q K^T (0 where p was cut off to 0)."""
    zero = dp.dtype.type(0.0)
    na, nh, nt, _ = dp.shape
    for a in range(na):
        for h in range(nh):
            for t in range(nt):
                n = keys[a, t]
                row, prow = dp[a, h, t, :n], p[a, h, t, :n]
                dp[a, h, t, n:] = zero
                inner = dp.dtype.type(sum4(row, prow, 1))
                for j in range(n):
                    row[j] = ((row[j] - inner) * prow[j]) * scale
    return None


def _broadcast_bias(bias: np.ndarray | None, scores: np.ndarray) -> tuple[np.ndarray, bool]:
    """(the bias as a view of the scores' shape, whether there is one)."""
    if bias is None:
        return np.broadcast_to(np.zeros((1,) * scores.ndim, dtype=scores.dtype),
                               scores.shape), False
    return np.broadcast_to(bias, scores.shape), True


def _all_keys(keys: np.ndarray | None, scores: np.ndarray) -> np.ndarray:
    """The kernels' per-row key counts as an (A, t) view: ``keys`` broadcast, or every
    key s of the block where None."""
    counts = np.full((1, 1), scores.shape[-1], dtype=np.int64) if keys is None else keys
    return np.broadcast_to(counts, (scores.shape[0], scores.shape[2]))


def attention_softmax(scores: np.ndarray, bias: np.ndarray | None, scale: float,
                      lse: np.ndarray, keys: np.ndarray | None = None) -> None:
    """scores Q K^T (A, H, t, s), C-contiguous and writable -> P = softmax(scale scores +
    bias) in place (fully masked rows 0), lse (A, H, t, 1) written.  ``keys``: int64,
    broadcasting to (A, t), the leading keys each row computes (:func:`_row_keys`); None: all."""
    view, has_bias = _broadcast_bias(bias, scores)
    _softmax_lse(scores, view, has_bias, scores.dtype.type(scale), lse[..., 0],
                 _all_keys(keys, scores))


def attention_probabilities(scores: np.ndarray, bias: np.ndarray | None, scale: float,
                            lse: np.ndarray, keys: np.ndarray | None = None) -> None:
    """scores Q K^T (A, H, t, s) -> P = exp(scale scores + bias - lse) in place, lse
    (A, H, t, 1); ``keys`` as for :func:`attention_softmax`."""
    view, has_bias = _broadcast_bias(bias, scores)
    _probabilities(scores, view, has_bias, scores.dtype.type(scale), lse[..., 0],
                   _all_keys(keys, scores))


def attention_softmax_backward(dp: np.ndarray, p: np.ndarray, scale: float,
                               keys: np.ndarray | None = None) -> None:
    """dp, p (A, H, t, s) -> scale dA, dA = (dp - <dp, p>) p, written into dp; ``keys``
    as for :func:`attention_softmax` (0 from there on)."""
    _softmax_backward(dp, p, dp.dtype.type(scale), _all_keys(keys, dp))
