"""The blocks (§15): the feed-forward sublayer, and an encoder block's two residual
connections, post-norm (LN(x + Drop(Sub(x)))) and pre-norm (x + Drop(Sub(LN(x))))."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import normal
from exercises.course._later import _built, dropout_bw, layernorm_bw, linear_bw, relu_bw, self_mask
from exercises.course.multihead import _backward as _multihead_backward
from npformer.nn import EncoderBlock, FeedForward

ATTENTION = ("q_proj", "k_proj", "v_proj", "out_proj")
MASKS = ["none", "padding", "causal"]


def _set(linear, w, b):
    linear.weight.data, linear.bias.data = w, b


def _ffn_forward(x, w1, b1, w2, b2, p, training=True):
    layer = _built(lambda: FeedForward(w1.shape[0], w1.shape[1], "relu", p))
    _set(layer.linear1, w1, b1)
    _set(layer.linear2, w2, b2)
    layer.train(training)
    layer.zero_grad()
    return layer(x), layer


def _ffn_backward(dy, layer):
    dx = layer.backward(dy)
    return (dx, layer.linear1.weight.grad, layer.linear1.bias.grad, layer.linear2.weight.grad,
            layer.linear2.bias.grad)


def _block_textbook(norm_first):
    def forward(x, wq, bq, wk, bk, wv, bv, wo, bo, gamma1, beta1, w1, b1, w2, b2,
                gamma2, beta2, num_heads, p, mask=None, training=True):
        d, d_ff = w1.shape
        block = _built(lambda: EncoderBlock(d, num_heads, d_ff, p, "relu", norm_first,
                                            head_dim=wq.shape[1] // num_heads))
        for name, w, b in zip(ATTENTION, (wq, wk, wv, wo), (bq, bk, bv, bo)):
            _set(getattr(block.self_attn, name), w, b)
        _set(block.attn_residual.norm, gamma1, beta1)
        _set(block.ffn.linear1, w1, b1)
        _set(block.ffn.linear2, w2, b2)
        _set(block.ffn_residual.norm, gamma2, beta2)
        block.train(training)
        block.zero_grad()
        return block(x, mask=mask), block

    def backward(dy, block):
        grads = [block.backward(dy)]
        for name in ATTENTION:
            layer = getattr(block.self_attn, name)
            grads += [layer.weight.grad, layer.bias.grad]
        for layer in (block.attn_residual.norm, block.ffn.linear1, block.ffn.linear2,
                      block.ffn_residual.norm):
            grads += [layer.weight.grad, layer.bias.grad]
        return tuple(grads)
    return forward, backward


def make_ffn(rng, b, t, d, d_ff, p, training):
    return Case([normal(rng, b, t, d), normal(rng, d, d_ff, scale=0.7), normal(rng, d_ff),
                 normal(rng, d_ff, d, scale=0.7), normal(rng, d), p], {"training": training},
                seed=int(rng.integers(2**31)))


def make_block(rng, b, t, d, h, e, d_ff, p, training, mask):
    inner = h * e
    weights = []
    for width_in, width_out in ((d, inner), (d, inner), (d, inner), (inner, d)):
        weights += [normal(rng, width_in, width_out, scale=0.7), normal(rng, width_out)]
    norm1 = [1.0 + 0.3 * normal(rng, d), 0.3 * normal(rng, d)]
    ffn = [normal(rng, d, d_ff, scale=0.7), normal(rng, d_ff), normal(rng, d_ff, d, scale=0.7),
           normal(rng, d)]
    norm2 = [1.0 + 0.3 * normal(rng, d), 0.3 * normal(rng, d)]
    return Case([normal(rng, b, t, d), *weights, *norm1, *ffn, *norm2, h, p,
                 self_mask(rng, b, t, mask)], {"training": training},
                seed=int(rng.integers(2**31)))


FFN_SIZES = dict(b=st.integers(1, 2), t=st.integers(1, 3), d=st.integers(1, 4),
                 d_ff=st.integers(1, 5), p=st.sampled_from([0.0, 0.25, 0.5]),
                 training=st.booleans())
FFN_EDGES = [("training, p = 0.3", dict(b=2, t=3, d=3, d_ff=5, p=0.3, training=True)),
             ("evaluation: no dropout", dict(b=1, t=2, d=2, d_ff=3, p=0.3, training=False)),
             ("one position", dict(b=1, t=1, d=3, d_ff=2, p=0.3, training=True))]
BLOCK_SIZES = dict(b=st.integers(1, 2), t=st.integers(1, 3), d=st.integers(3, 4),
                   h=st.integers(1, 2), e=st.integers(1, 2), d_ff=st.integers(1, 4),
                   p=st.sampled_from([0.0, 0.25]), training=st.booleans(),
                   mask=st.sampled_from(MASKS))
BLOCK_EDGES = [("training, p = 0.3", dict(b=2, t=3, d=4, h=2, e=2, d_ff=5, p=0.3,
                                          training=True, mask="none")),
               ("a fully padded sequence", dict(b=2, t=3, d=3, h=2, e=1, d_ff=3, p=0.2,
                                                training=True, mask="padding")),
               ("one position, evaluation", dict(b=1, t=1, d=3, h=1, e=2, d_ff=2, p=0.3,
                                                 training=False, mask="none"))]
FFN_GRADS = ("dx", "dw1", "db1", "dw2", "db2")
ATTENTION_GRADS = ("dwq", "dbq", "dwk", "dbk", "dwv", "dbv", "dwo", "dbo")
BLOCK_GRADS = ("dx", *ATTENTION_GRADS, "dgamma1", "dbeta1", *FFN_GRADS[1:], "dgamma2", "dbeta2")

FFN_HINTS = {
    "dw2": "The feed-forward sublayer: its four backwards in reverse; dW2 = Drop(f(h))^T dY "
           "(§2), with the second linear map's own input, after the dropout.",
    "db2": "The feed-forward sublayer: db2 = the sum of dY over every row.",
    "dw1": "The feed-forward sublayer: dY through W2^T, then dropout's backward (§5, its "
           "mask and 1/(1 - p)), then ReLU's (§3, the mask of its input h > 0), then "
           "dW1 = x^T dh.",
    "db1": "The feed-forward sublayer: db1 = the sum over rows of dh, after dropout's and "
           "ReLU's backwards.",
    "dx": "The feed-forward sublayer: dx = dh W1^T, dh after linear2's, dropout's and "
          "ReLU's backwards (in that order, the reverse of the forward).",
}


def _block_hints(post):
    if post:
        residual = ("Post-norm, Step 1 then Step 2: the norm comes last, so dz = LN*(dy) "
                    "first; then dx = dz + Sub*(Drop*(dz)): the identity path's dz is added "
                    "to the branch's, for each connection (the feed-forward's, then the "
                    "attention's).")
        norm = "Post-norm, Step 1: the connection's norm is LN(x + Drop(Sub(x))): its "
    else:
        residual = ("Pre-norm: dx = dy + LN*(Sub*(Drop*(dy))): the identity path passes dy "
                    "on unchanged (Step 1), the branch goes through dropout, the sublayer, "
                    "then the norm (Step 2); the attention connection receives the "
                    "feed-forward connection's dx.")
        norm = "Pre-norm, Step 2: the connection's norm is on the branch, LN(x) feeds Sub: its "
    hints = {"dx": residual, "*": residual}
    for g in ("dgamma1", "dbeta1", "dgamma2", "dbeta2"):
        hints[g] = norm + ("dgamma, dbeta come from LN*'s backward (§6) with the gradient "
                           "that reaches the norm's output.")
    for g in ATTENTION_GRADS:
        hints[g] = residual + " The attention's gradients: multihead's backward (§10) of "
        hints[g] += "Drop*(the gradient reaching the connection's branch)."
    for g in FFN_GRADS[1:]:
        hints[g] = residual + " The feed-forward's: its backward of Drop*(that gradient)."
    return hints


# =========================================================================== the mistakes
def _ffn_backward_with(dropout=True, dw2_before_dropout=False):
    def backward(dy, saved):
        first, activation, dropped, second = saved
        dd, dw2, db2 = linear_bw(dy, second)
        if dw2_before_dropout:  # W2's input taken as ReLU's output, not the dropped one
            _, dw2, _ = linear_bw(dy, (np.maximum(activation, 0.0), second[1]))
        da = dropout_bw(dd, dropped) if dropout else dd
        dh = relu_bw(da, activation)
        dx, dw1, db1 = linear_bw(dh, first)
        return dx, dw1, db1, dw2, db2
    return backward


def _ffn_correct(dy, saved):
    return _ffn_backward_with()(dy, saved)


def _attention_correct(ds, saved):
    return _multihead_backward()(ds, saved)


def _post(residual=True, wrong_branch=False, dropout=True, attention=_attention_correct):
    """The post-norm block's backward with one step wrong."""
    def connection(dy, norm, sub_backward, sub_cache, drop):
        if wrong_branch:  # the pre-norm rule on a post-norm block: LN* on the branch
            dsub = sub_backward(dropout_bw(dy, drop) if dropout else dy, sub_cache)
            dn = layernorm_bw(dsub[0], norm)
            return (dy + dn[0], dsub[1:], dn[1:])
        dz, dgamma, dbeta = layernorm_bw(dy, norm)
        dsub = sub_backward(dropout_bw(dz, drop) if dropout else dz, sub_cache)
        return ((dz if residual else 0.0) + dsub[0], dsub[1:], (dgamma, dbeta))

    def backward(dy, saved):
        attention_saved, attention_drop, norm1, ffn, ffn_drop, norm2 = saved
        dx, dffn, dnorm2 = connection(dy, norm2, _ffn_correct, ffn, ffn_drop)
        dx, dattention, dnorm1 = connection(dx, norm1, attention, attention_saved,
                                            attention_drop)
        return (dx, *dattention, *dnorm1, *dffn, *dnorm2)
    return backward


def _pre(residual=True, wrong_branch=False, dropout=True, attention=_attention_correct):
    """The pre-norm block's backward with one step wrong."""
    def connection(dy, norm, sub_backward, sub_cache, drop):
        if wrong_branch:  # the post-norm rule on a pre-norm block: LN* on the main path
            dz, dgamma, dbeta = layernorm_bw(dy, norm)
            dsub = sub_backward(dropout_bw(dz, drop) if dropout else dz, sub_cache)
            return dz + dsub[0], dsub[1:], (dgamma, dbeta)
        dsub = sub_backward(dropout_bw(dy, drop) if dropout else dy, sub_cache)
        dn, dgamma, dbeta = layernorm_bw(dsub[0], norm)
        return (dy if residual else 0.0) + dn, dsub[1:], (dgamma, dbeta)

    def backward(dy, saved):
        norm1, attention_saved, attention_drop, norm2, ffn, ffn_drop = saved
        dx, dffn, dnorm2 = connection(dy, norm2, _ffn_correct, ffn, ffn_drop)
        dx, dattention, dnorm1 = connection(dx, norm1, attention, attention_saved,
                                            attention_drop)
        return (dx, *dattention, *dnorm1, *dffn, *dnorm2)
    return backward


POST, PRE = _block_textbook(False), _block_textbook(True)
EXERCISE = Exercise(
    name="blocks", file="blocks.py", section="Residual connections",
    parts=[
        Part(forward="feedforward_forward", backward="feedforward_backward",
             textbook=(_ffn_forward, _ffn_backward), grads=FFN_GRADS, wrt=tuple(range(5)),
             make=make_ffn, sizes=FFN_SIZES, edge_cases=FFN_EDGES, hints=FFN_HINTS),
        Part(forward="postnorm_block_forward", backward="postnorm_block_backward",
             textbook=POST, grads=BLOCK_GRADS, wrt=tuple(range(17)), make=make_block,
             sizes=BLOCK_SIZES, edge_cases=BLOCK_EDGES, hints=_block_hints(True)),
        Part(forward="prenorm_block_forward", backward="prenorm_block_backward",
             textbook=PRE, grads=BLOCK_GRADS, wrt=tuple(range(17)), make=make_block,
             sizes=BLOCK_SIZES, edge_cases=BLOCK_EDGES, hints=_block_hints(False)),
    ],
    mistakes=[
        Mistake("the feed-forward's dropout backward forgotten", "dw1",
                _ffn_backward_with(dropout=False)),
        Mistake("dW2 from ReLU's output, before the dropout", "dw2",
                _ffn_backward_with(dw2_before_dropout=True)),
        Mistake("post-norm: the residual's gradient dz missing (dx = the branch's only)",
                "dbv", _post(residual=False), part="postnorm_block_backward"),
        Mistake("post-norm: the norm's gradient on the branch (the pre-norm rule)", "dx",
                _post(wrong_branch=True), part="postnorm_block_backward"),
        Mistake("pre-norm: the residual's gradient missing", "dx",
                _pre(residual=False), part="prenorm_block_backward"),
        Mistake("pre-norm: the norm's gradient on the main path (the post-norm rule)", "dw1",
                _pre(wrong_branch=True), part="prenorm_block_backward"),
        Mistake("pre-norm: the connection's dropout backward forgotten", "dwq",
                _pre(dropout=False), part="prenorm_block_backward"),
    ],
)
