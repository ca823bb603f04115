"""The model-level backward (§16): the classifier from the loss back to its tables,
chaining the backwards of every earlier exercise."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import normal
from exercises.course._later import _built, dropout_bw, linear_bw
from exercises.course.blocks import ATTENTION, BLOCK_GRADS, _post
from npformer import ops
from npformer.models import ClassifierConfig, TransformerClassifier

GRADS = ("dtokens", "dpositions", *BLOCK_GRADS[1:], "dw_head", "db_head")


def _set(layer, w, b):
    layer.weight.data, layer.bias.data = w, b


def _textbook_forward(ids, valid_lens, labels, tokens, positions, wq, bq, wk, bk, wv, bv,
                      wo, bo, gamma1, beta1, w1, b1, w2, b2, gamma2, beta2, w_head, b_head,
                      num_heads, p, training=True):
    (v, d), (_, d_ff), classes = tokens.shape, w1.shape, w_head.shape[1]
    config = ClassifierConfig(vocab_size=v, num_classes=classes, d_model=d,
                              num_heads=num_heads, num_layers=1, d_ff=d_ff,
                              block_size=positions.shape[0], dropout=p, activation="relu",
                              head_dim=wq.shape[1] // num_heads, pooling="mean")
    model = _built(lambda: TransformerClassifier(config))
    model.embed.tokens.weight.data = tokens
    model.embed.positions.weight.data = positions
    block = model.blocks[0]
    for name, w, b in zip(ATTENTION, (wq, wk, wv, wo), (bq, bk, bv, bo)):
        _set(getattr(block.self_attn, name), w, b)
    _set(block.attn_residual.norm, gamma1, beta1)
    _set(block.ffn.linear1, w1, b1)
    _set(block.ffn.linear2, w2, b2)
    _set(block.ffn_residual.norm, gamma2, beta2)
    _set(model.head, w_head, b_head)
    model.train(training)
    model.zero_grad()
    loss, loss_cache = ops.cross_entropy_forward(model(ids, valid_lens), labels)
    return loss, (model, loss_cache)


def _textbook_backward(dloss, saved):
    model, loss_cache = saved
    model.backward(ops.cross_entropy_backward(dloss, loss_cache))
    block = model.blocks[0]
    grads = [model.embed.tokens.weight.grad, model.embed.positions.weight.grad]
    for name in ATTENTION:
        layer = getattr(block.self_attn, name)
        grads += [layer.weight.grad, layer.bias.grad]
    for layer in (block.attn_residual.norm, block.ffn.linear1, block.ffn.linear2,
                  block.ffn_residual.norm, model.head):
        grads += [layer.weight.grad, layer.bias.grad]
    return tuple(grads)


def make(rng, b, t, extra, v, c, d, h, e, d_ff, p, training):
    ids = rng.integers(0, v, size=(b, t))
    valid_lens = rng.integers(1, t + 1, size=b)
    order = rng.permutation(b)
    valid_lens[order[0]] = t  # one sequence fills the batch's T positions
    if b > 1:
        valid_lens[order[1]] = 1  # and another has one valid position
    labels = rng.integers(0, c, size=b)
    inner = h * e
    block = []
    for width_in, width_out in ((d, inner), (d, inner), (d, inner), (inner, d)):
        block += [normal(rng, width_in, width_out, scale=0.7), normal(rng, width_out)]
    block += [1.0 + 0.3 * normal(rng, d), 0.3 * normal(rng, d)]
    block += [normal(rng, d, d_ff, scale=0.7), normal(rng, d_ff), normal(rng, d_ff, d, scale=0.7),
              normal(rng, d)]
    block += [1.0 + 0.3 * normal(rng, d), 0.3 * normal(rng, d)]
    return Case([ids, valid_lens, labels, normal(rng, v, d), normal(rng, t + extra, d, scale=0.5),
                 *block, normal(rng, d, c), normal(rng, c), h, p], {"training": training},
                seed=int(rng.integers(2**31)))


SIZES = dict(b=st.integers(1, 3), t=st.integers(1, 3), extra=st.integers(0, 2),
             v=st.integers(2, 5), c=st.integers(2, 3), d=st.integers(3, 4), h=st.integers(1, 2),
             e=st.integers(1, 2), d_ff=st.integers(1, 3), p=st.sampled_from([0.0, 0.2]),
             training=st.booleans())
EDGES = [("a padded batch, dropout 0.2", dict(b=3, t=3, extra=1, v=4, c=2, d=4, h=2, e=2,
                                              d_ff=3, p=0.2, training=True)),
         ("one position", dict(b=2, t=1, extra=2, v=3, c=3, d=3, h=1, e=2, d_ff=2, p=0.0,
                               training=True)),
         ("evaluation", dict(b=2, t=3, extra=0, v=5, c=2, d=3, h=2, e=1, d_ff=2, p=0.3,
                             training=False))]
CHAIN = ("The classifier's backward is its forward's lines in reverse: cross-entropy's "
         "(§13, scaled by dloss), the head's (§2), pooling's (§14: the valid positions "
         "only), the block's (§15), the embedding's dropout (§5), then the sum x = "
         "E[ids] + P[:T] hands its gradient to both tables: ")
HINTS = {
    "dtokens": CHAIN + "dtokens by embedding's backward (§11: rows added, a repeated id "
                       "twice).",
    "dpositions": CHAIN + "dpositions by the positions' backward (§12: summed over the "
                          "batch, rows past T zero).",
    "dw_head": CHAIN + "dW_head = pooled^T dlogits.",
    "db_head": CHAIN + "db_head = the sum of dlogits over the batch.",
    "*": CHAIN + "the block's parameters come from postnorm_block_backward of dh.",
}
for _name in BLOCK_GRADS[1:]:
    HINTS[_name] = HINTS["*"]


# =========================================================================== the mistakes
def _ce_bw(dloss, saved, scale=True):
    p, t, ignore_index, smoothing, shape = saved
    counted = t != ignore_index
    dz = p.copy()
    dz[np.arange(len(t)), np.where(counted, t, 0)] -= 1.0
    dz *= (counted / max(counted.sum(), 1))[:, None]
    return (dz * (dloss if scale else 1.0)).reshape(shape)


def _pool_bw(dy, saved, all_positions=False):
    how, valid, winner, shape = saved
    if all_positions:  # the padding counted: every position gets 1/T
        return np.broadcast_to(dy[:, None, :] / shape[1], shape).copy()
    return valid[:, :, None] * dy[:, None, :] / valid.sum(1)[:, None, None]


def _model(scale=True, all_positions=False, dropout=True, positions_rows="sum"):
    def backward(dloss, saved):
        embedded, placed, dropped, block, pooling, head, loss_cache = saved
        dlogits = _ce_bw(dloss, loss_cache, scale)
        dpooled, dw_head, db_head = linear_bw(dlogits, head)
        dh = _pool_bw(dpooled, pooling, all_positions)
        dx, *dblock = _post()(dh, block)
        if dropout:
            dx = dropout_bw(dx, dropped)
        length, table_rows = placed
        dpositions = np.zeros((table_rows, dx.shape[-1]))
        if positions_rows == "sum":
            dpositions[:length] = dx.sum(axis=0)
        else:  # the batch averaged
            dpositions[:length] = dx.mean(axis=0)
        ids, vocab = embedded
        dtokens = np.zeros((vocab, dx.shape[-1]))
        np.add.at(dtokens, ids, dx)
        return (dtokens, dpositions, *dblock, dw_head, db_head)
    return backward


EXERCISE = Exercise(
    name="model", file="model.py", section="The model-level backward",
    parts=[Part(forward="classifier_forward", backward="classifier_backward",
                textbook=(_textbook_forward, _textbook_backward), grads=GRADS,
                wrt=tuple(range(3, 23)), make=make, sizes=SIZES, edge_cases=EDGES,
                hints=HINTS)],
    mistakes=[
        Mistake("the embedding's dropout backward forgotten", "dpositions", _model(dropout=False)),
        Mistake("pooling's backward over every position, the padding too", "dw2",
                _model(all_positions=True)),
        Mistake("the positions' gradient averaged over the batch", "dpositions",
                _model(positions_rows="mean")),
        Mistake("cross-entropy's backward not scaled by dloss", "dwk", _model(scale=False)),
    ],
)
