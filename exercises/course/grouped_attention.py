"""Grouped-query attention, the whole layer: H query heads, H_kv key/value heads, each
repeated over its group of G = H / H_kv query heads; its backward sums each group."""
from __future__ import annotations

from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import normal
from exercises.course._later import attention_bw, linear_bw, merge_bw, self_mask, split_bw
from npformer import ops
from npformer.nn import merge_heads, split_heads

MASKS = ["none", "padding", "causal", "causal+padding"]


# The textbook: npformer's ops composed (nn/llama.py's layer also rotates its heads).
def _textbook_forward(x, wq, bq, wk, bk, wv, bv, wo, bo, num_heads, kv_heads, mask=None):
    q, q_cache = ops.linear_forward(x, wq, bq)
    k, k_cache = ops.linear_forward(x, wk, bk)
    v, v_cache = ops.linear_forward(x, wv, bv)
    heads, attention_saved = ops.grouped_attention_forward(
        split_heads(q, num_heads), split_heads(k, kv_heads), split_heads(v, kv_heads), mask)
    y, out_cache = ops.linear_forward(merge_heads(heads), wo, bo)
    return y, (q_cache, k_cache, v_cache, attention_saved, out_cache, num_heads, kv_heads)


def _textbook_backward(dy, saved):
    q_cache, k_cache, v_cache, attention_saved, out_cache, num_heads, kv_heads = saved
    dmerged, dwo, dbo = ops.linear_backward(dy, out_cache)
    dq, dk, dv = ops.grouped_attention_backward(split_heads(dmerged, num_heads),
                                                attention_saved)
    dxq, dwq, dbq = ops.linear_backward(merge_heads(dq), q_cache)
    dxk, dwk, dbk = ops.linear_backward(merge_heads(dk), k_cache)
    dxv, dwv, dbv = ops.linear_backward(merge_heads(dv), v_cache)
    return dxq + dxk + dxv, dwq, dbq, dwk, dbk, dwv, dbv, dwo, dbo


TEXTBOOK = (_textbook_forward, _textbook_backward)


def make(rng, b, t, d, kv, g, e, mask):
    h = kv * g
    weights = []
    for width_in, width_out in ((d, h * e), (d, kv * e), (d, kv * e), (h * e, d)):
        weights += [normal(rng, width_in, width_out, scale=0.7), normal(rng, width_out)]
    return Case([normal(rng, b, t, d), *weights, h, kv, self_mask(rng, b, t, mask)])


SIZES = dict(b=st.integers(1, 2), t=st.integers(1, 4), d=st.integers(1, 4),
             kv=st.integers(1, 2), g=st.integers(1, 3), e=st.integers(1, 3),
             mask=st.sampled_from(MASKS))
EDGES = [("two groups of three query heads", dict(b=2, t=3, d=4, kv=2, g=3, e=2, mask="none")),
         ("multi-query: one key/value head", dict(b=1, t=3, d=3, kv=1, g=3, e=2,
                                                  mask="causal")),
         ("a fully padded sequence", dict(b=2, t=3, d=3, kv=2, g=2, e=2, mask="padding")),
         ("one position", dict(b=1, t=1, d=3, kv=1, g=2, e=2, mask="none"))]
GRADS = ("dx", "dwq", "dbq", "dwk", "dbk", "dwv", "dbv", "dwo", "dbo")
SUM = ("Backward: the repetition's transpose sums: key/value "
       "head j receives the sum of the gradients of the G query heads of its group, "
       "j*G .. j*G + G - 1 (reshape (B, H_kv, G, S, E), sum over G), before its "
       "projection's backward")
HINTS = {
    "*": "Backward: the multi-head layer's steps in reverse (§10, Backward of the whole "
         "layer), with each key/value head's gradient summed over its group of query heads "
         "before its projection's backward.",
    "dwk": "attention's dK for the H query heads (§9: alpha dA^T Q, alpha = 1/sqrt(E)); "
           "then " + SUM + ": dW^K = x^T dK.",
    "dbk": SUM + ".",
    "dwv": "attention's dV for the H query heads (§9: P^T dO); then " + SUM
           + ": dW^V = x^T dV.",
    "dbv": SUM + ".",
    "dwq": "Backward of the whole layer, Steps 1 to 3 (§10): dConcat split into H heads, "
           "attention's dQ (§9, with its 1/sqrt(E)), merged back before W^Q's backward.",
    "dbq": "Backward of the whole layer: db^Q = the sum of dQ (merged) over rows.",
    "dx": "Backward of the whole layer, Step 4 (R1): x fed the queries, the keys and the "
          "values: dx = dx_q + dx_k + dx_v.",
    "dwo": "Backward of the whole layer, Step 1: dW^O = Concat^T dY (§2).",
    "dbo": "Backward of the whole layer, Step 1: db^O = the sum of dY over rows.",
}


# =========================================================================== the mistakes
def _summed(dx, groups):
    b, h, s, e = dx.shape
    return dx.reshape(b, h // groups, groups, s, e).sum(axis=2)


def _first_of_group(dx, groups):
    return dx[:, ::groups]  # one query head's gradient, the group's others dropped


def _averaged(dx, groups):
    return _summed(dx, groups) / groups


def _interleaved(dx, groups):  # heads j, j + H_kv, j + 2 H_kv... taken as a group
    b, h, s, e = dx.shape
    return dx.reshape(b, groups, h // groups, s, e).sum(axis=1)


def _backward(reduce=_summed, scale=True):
    def backward(dy, saved):
        q_cache, k_cache, v_cache, attention_saved, out_cache, num_heads, kv_heads = saved
        groups = num_heads // kv_heads
        dmerged, dwo, dbo = linear_bw(dy, out_cache)
        dq, dk, dv = attention_bw(merge_bw(dmerged, num_heads), attention_saved, scale=scale)
        dk, dv = reduce(dk, groups), reduce(dv, groups)
        dxq, dwq, dbq = linear_bw(split_bw(dq, num_heads), q_cache)
        dxk, dwk, dbk = linear_bw(split_bw(dk, kv_heads), k_cache)
        dxv, dwv, dbv = linear_bw(split_bw(dv, kv_heads), v_cache)
        return dxq + dxk + dxv, dwq, dbq, dwk, dbk, dwv, dbv, dwo, dbo
    return backward


EXERCISE = Exercise(
    name="grouped_attention", file="grouped_attention.py", section="Grouped-query attention",
    order=2,
    parts=[Part(forward="grouped_forward", backward="grouped_backward", textbook=TEXTBOOK,
                grads=GRADS, wrt=tuple(range(9)), make=make, sizes=SIZES, edge_cases=EDGES,
                hints=HINTS)],
    mistakes=[
        Mistake("the group's gradients not summed (the first query head's kept)", "dwv",
                _backward(reduce=_first_of_group)),
        Mistake("the group's gradients averaged, not summed", "dwv",
                _backward(reduce=_averaged)),
        Mistake("the groups taken as heads j, j + H_kv, ... (interleaved)", "dwv",
                _backward(reduce=_interleaved)),
        Mistake("the scale 1/sqrt(E) left out", "dwk", _backward(scale=False)),
    ],
)
