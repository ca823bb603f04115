"""Multi-head attention, the whole layer: projections, split, attention, merge, output
projection; self-attention, so x's gradient has three terms."""
from __future__ import annotations

from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import normal
from exercises.course._later import attention_bw, linear_bw, merge_bw, self_mask, split_bw
from npformer.nn import MultiHeadAttention

MASKS = ["none", "padding", "causal", "causal+padding"]
LAYERS = ("q_proj", "k_proj", "v_proj", "out_proj")


def _textbook_forward(x, wq, bq, wk, bk, wv, bv, wo, bo, num_heads, mask=None):
    layer = MultiHeadAttention(x.shape[-1], num_heads, head_dim=wq.shape[1] // num_heads)
    for name, w, b in zip(LAYERS, (wq, wk, wv, wo), (bq, bk, bv, bo)):
        getattr(layer, name).weight.data, getattr(layer, name).bias.data = w, b
    layer.zero_grad()
    return layer(x, mask=mask), layer


def _textbook_backward(dy, layer):
    dx = layer.backward(dy)
    grads = [dx]
    for name in LAYERS:
        grads += [getattr(layer, name).weight.grad, getattr(layer, name).bias.grad]
    return tuple(grads)


TEXTBOOK = (_textbook_forward, _textbook_backward)


def make(rng, b, t, d, h, e, mask):
    inner = h * e
    weights = []
    for width_in, width_out in ((d, inner), (d, inner), (d, inner), (inner, d)):
        weights += [normal(rng, width_in, width_out, scale=0.7), normal(rng, width_out)]
    return Case([normal(rng, b, t, d), *weights, h, self_mask(rng, b, t, mask)])


SIZES = dict(b=st.integers(1, 2), t=st.integers(1, 4), d=st.integers(1, 5),
             h=st.integers(1, 3), e=st.integers(1, 3), mask=st.sampled_from(MASKS))
EDGES = [("several heads and positions", dict(b=2, t=3, d=4, h=2, e=3, mask="none")),
         ("a fully padded sequence", dict(b=2, t=3, d=3, h=2, e=2, mask="padding")),
         ("one position", dict(b=1, t=1, d=3, h=2, e=2, mask="none")),
         ("causal", dict(b=1, t=4, d=2, h=3, e=1, mask="causal"))]
GRADS = ("dx", "dwq", "dbq", "dwk", "dbk", "dwv", "dbv", "dwo", "dbo")
HINTS = {
    "*": "Backward of the whole layer: the forward's steps in reverse: W^O's backward, "
         "split into heads, attention's backward (§9), each of dQ, dK, dV merged and through "
         "its projection's backward, and x's three gradients added (R1).",
    "dwo": "Backward of the whole layer, Step 1: dConcat = dY W^O^T, dW^O = Concat^T dY "
           "(§2), with Concat the merged heads.",
    "dbo": "Backward of the whole layer, Step 1: db^O = the sum of dY over every row.",
    "dx": "Backward of the whole layer, Step 4 (R1): x fed the queries, the keys and the "
          "values, so dx = dx_q + dx_k + dx_v, each through its projection's backward.",
    "dwq": "Backward of the whole layer, Steps 1 to 3: dConcat split into heads (the "
           "backward of merge: the transpose undone), attention's dQ (§9, with its "
           "1/sqrt(E)), merged back to (B, T, H*E) before W^Q's backward: dW^Q = x^T dQ.",
    "dwk": "Backward of the whole layer, Steps 2 and 3: attention's dK = alpha dA^T Q, "
           "alpha = 1/sqrt(E) (§9), merged back to (B, T, H*E), then dW^K = x^T dK.",
    "dwv": "Backward of the whole layer, Steps 2 and 3: attention's dV = P^T dO (§9), "
           "merged back to (B, T, H*E), then dW^V = x^T dV.",
    "dbq": "Backward of the whole layer, Step 3: db^Q = the sum of dQ (merged) over rows.",
    "dbk": "Backward of the whole layer: db^K = the sum of dK over rows (zero up to "
           "rounding: the key bias shifts a whole row of scores).",
    "dbv": "Backward of the whole layer, Step 3: db^V = the sum of dV (merged) over rows.",
}


# =========================================================================== the mistakes
def _backward(merge_dheads=split_bw, split_dconcat=merge_bw, scale=True, paths="qkv"):
    """The layer's backward with one step replaced: merge_dheads (B, H, T, E) -> (B, T, H*E)
    before a projection's backward, split_dconcat the other way after W^O's."""
    def backward(dy, saved):
        q_cache, k_cache, v_cache, attention_saved, out_cache, num_heads = saved
        dmerged, dwo, dbo = linear_bw(dy, out_cache)
        dheads = split_dconcat(dmerged, num_heads)
        dq, dk, dv = attention_bw(dheads, attention_saved, scale=scale)
        dxq, dwq, dbq = linear_bw(merge_dheads(dq, num_heads), q_cache)
        dxk, dwk, dbk = linear_bw(merge_dheads(dk, num_heads), k_cache)
        dxv, dwv, dbv = linear_bw(merge_dheads(dv, num_heads), v_cache)
        dx = sum(d for p, d in zip("qkv", (dxq, dxk, dxv)) if p in paths)
        return dx, dwq, dbq, dwk, dbk, dwv, dbv, dwo, dbo
    return backward


def _merged_as_reshape(dheads, num_heads):
    b, h, t, e = dheads.shape
    return dheads.reshape(b, t, h * e)  # the heads' gradients merged in the wrong order


def _split_as_reshape(dmerged, num_heads):
    b, t, d = dmerged.shape
    return dmerged.reshape(b, num_heads, t, d // num_heads)


EXERCISE = Exercise(
    name="multihead", file="multihead.py", section="Multi-head attention", order=1,
    parts=[Part(forward="multihead_forward", backward="multihead_backward", textbook=TEXTBOOK,
                grads=GRADS, wrt=tuple(range(9)), make=make, sizes=SIZES, edge_cases=EDGES,
                hints=HINTS)],
    mistakes=[
        Mistake("only the queries' path into dx (the keys' and values' left out)", "dx",
                _backward(paths="q")),
        Mistake("the heads' gradients merged in the wrong order (a plain reshape)", "dwk",
                _backward(merge_dheads=_merged_as_reshape)),
        Mistake("dConcat split into heads by a plain reshape", "dwq",
                _backward(split_dconcat=_split_as_reshape)),
        Mistake("the scale 1/sqrt(E) left out of dQ and dK", "dwk", _backward(scale=False)),
    ],
)
