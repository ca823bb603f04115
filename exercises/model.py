# %% [markdown]
# # Exercise: the model-level backward of the classifier
#
# Derivation: docs/derivations.md, §16 The model-level backward
#
# The forward is given: npformer's TransformerClassifier (the IMDB model) with one
# post-norm encoder block, written with the forwards of your earlier exercises, from the
# token ids to the loss:
#
#     ids (B, T) -> token embeddings (§11) + learned positions (§12) -> dropout (§5)
#     -> encoder block (§15; padding keys masked) -> mean over the valid positions (§14)
#     -> linear head (§2) -> logits (B, C) -> cross-entropy with the labels (§13)
#
# Write `classifier_backward`: from the upstream gradient `dloss` (a scalar) and the
# saved, the gradients of every parameter, in the forward's order: `dtokens`,
# `dpositions`, the block's sixteen (as `postnorm_block_backward` returns them, without
# its dx), `dw_head`, `db_head`.  The token ids are not differentiable: the chain ends in
# the tables.  Your backwards of the earlier exercises are imported below.
#
# Check it: `python exercises/check.py model` (from the repository's root),
# or run the last cell.

# %%
import sys
from pathlib import Path

import numpy as np

_root = str(Path(globals().get("__file__", "model.py")).resolve().parents[1])
if _root not in sys.path:  # the earlier exercises: exercises/NAME.py, as it is now
    sys.path.insert(0, _root)
from exercises._earlier import earlier  # noqa: E402

postnorm_block_forward, postnorm_block_backward = earlier(
    "blocks", "postnorm_block_forward", "postnorm_block_backward")
cross_entropy_forward, cross_entropy_backward = earlier(
    "cross_entropy", "cross_entropy_forward", "cross_entropy_backward")
dropout_forward, dropout_backward = earlier("dropout", "dropout_forward", "dropout_backward")
embedding_forward, embedding_backward = earlier(
    "embedding", "embedding_forward", "embedding_backward")
linear_forward, linear_backward = earlier("linear", "linear_forward", "linear_backward")
pool_forward, pool_backward = earlier("pooling", "pool_forward", "pool_backward")
add_positions_forward, add_positions_backward = earlier(
    "positions", "add_positions_forward", "add_positions_backward")


# %%
def classifier_forward(ids, valid_lens, labels, tokens, positions,
                       wq, bq, wk, bk, wv, bv, wo, bo, gamma1, beta1,
                       w1, b1, w2, b2, gamma2, beta2, w_head, b_head,
                       num_heads, p, training=True):
    """ids (B, T) integers in [0, V), valid_lens (B,) in [1, T], labels (B,) in [0, C);
    tokens (V, D), positions (L, D) with L >= T; the block's weights
    (postnorm_block_forward's); w_head (D, C), b_head (C,) -> loss (a scalar), saved."""
    length = ids.shape[1]
    mask = (np.arange(length)[None, :] < valid_lens[:, None])[:, None, None, :]  # (B,1,1,T)
    x, embedded = embedding_forward(ids, tokens)  # (B, T, D)
    x, placed = add_positions_forward(x, positions)
    x, dropped = dropout_forward(x, p, training)
    h, block = postnorm_block_forward(x, wq, bq, wk, bk, wv, bv, wo, bo, gamma1, beta1,
                                      w1, b1, w2, b2, gamma2, beta2, num_heads, p, mask,
                                      training)
    pooled, pooling = pool_forward(h, valid_lens, "mean")  # (B, D)
    logits, head = linear_forward(pooled, w_head, b_head)  # (B, C)
    loss, loss_cache = cross_entropy_forward(logits, labels)
    return loss, (embedded, placed, dropped, block, pooling, head, loss_cache)


# %%
def classifier_backward(dloss, saved):
    """dloss (a scalar) -> dtokens (V, D), dpositions (L, D), dwq, dbq, dwk, dbk, dwv,
    dbv, dwo, dbo, dgamma1, dbeta1, dw1, db1, dw2, db2, dgamma2, dbeta2, dw_head (D, C),
    db_head (C,)."""
    embedded, placed, dropped, block, pooling, head, loss_cache = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/model.py
    from exercises.check import check

    print(check("model", module=sys.modules[__name__]))
