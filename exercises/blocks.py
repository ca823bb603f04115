# %% [markdown]
# # Exercise: the backward of the blocks: residual connections with layer norm
#
# Derivation: docs/derivations.md, §15 Residual connections with layer norm, and the blocks
#
# The forwards are given, built from the forwards of your earlier exercises (linear, ReLU,
# dropout, layer norm, multi-head attention):
#
# * `feedforward_forward`: the position-wise feed-forward network, D -> D_ff -> D:
#   linear, ReLU, dropout, linear;
# * `postnorm_block_forward`: an encoder block as the paper and BERT arrange it,
#   `x = LN(x + Drop(Attn(x)))`, then `y = LN(x + Drop(FFN(x)))`;
# * `prenorm_block_forward`: the same block as GPT-2 arranges it,
#   `x = x + Drop(Attn(LN(x)))`, then `y = x + Drop(FFN(LN(x)))`.
#
# Write the three backwards: the feed-forward's gradients `dx`, `dw1`, `db1`, `dw2`,
# `db2`; each block's `dx`, then the attention's eight parameters' gradients (`dwq`,
# `dbq`, `dwk`, `dbk`, `dwv`, `dbv`, `dwo`, `dbo`), the attention connection's norm
# (`dgamma1`, `dbeta1`), the feed-forward's four, the feed-forward connection's norm
# (`dgamma2`, `dbeta2`), in that order.  Your backwards of the earlier exercises are
# imported below (they must be done first).  Dropout draws its masks in the forward's
# order from npformer's seeded generator, as the textbook's layers do.
#
# Check it: `python exercises/check.py blocks` (from the repository's root),
# or run the last cell.

# %%
import sys
from pathlib import Path

import numpy as np  # noqa: F401  (yours to use)

_root = str(Path(globals().get("__file__", "blocks.py")).resolve().parents[1])
if _root not in sys.path:  # the earlier exercises: exercises/NAME.py, as it is now
    sys.path.insert(0, _root)
from exercises._earlier import earlier  # noqa: E402

dropout_forward, dropout_backward = earlier("dropout", "dropout_forward", "dropout_backward")
layernorm_forward, layernorm_backward = earlier(
    "layernorm", "layernorm_forward", "layernorm_backward")
linear_forward, linear_backward = earlier("linear", "linear_forward", "linear_backward")
multihead_forward, multihead_backward = earlier(
    "multihead", "multihead_forward", "multihead_backward")
relu_forward, relu_backward = earlier("relu", "relu_forward", "relu_backward")


# %%
def feedforward_forward(x, w1, b1, w2, b2, p, training=True):
    """x (B, T, D), w1 (D, D_ff), b1 (D_ff,), w2 (D_ff, D), b2 (D,), p the dropout
    probability -> y (B, T, D), saved."""
    h, first = linear_forward(x, w1, b1)  # (B, T, D_ff)
    a, activation = relu_forward(h)
    d, dropped = dropout_forward(a, p, training)
    y, second = linear_forward(d, w2, b2)  # (B, T, D)
    return y, (first, activation, dropped, second)


# %%
def feedforward_backward(dy, saved):
    """dy (B, T, D) -> dx (B, T, D), dw1 (D, D_ff), db1 (D_ff,), dw2 (D_ff, D), db2 (D,)."""
    first, activation, dropped, second = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
def postnorm_block_forward(x, wq, bq, wk, bk, wv, bv, wo, bo, gamma1, beta1,
                           w1, b1, w2, b2, gamma2, beta2, num_heads, p, mask=None,
                           training=True):
    """Post-norm: x (B, T, D), the attention's weights (multihead_forward's), the norms'
    gamma, beta (D,) and the feed-forward's weights -> y (B, T, D), saved."""
    s, attention = multihead_forward(x, wq, bq, wk, bk, wv, bv, wo, bo, num_heads, mask)
    s, attention_drop = dropout_forward(s, p, training)
    x, norm1 = layernorm_forward(x + s, gamma1, beta1)  # x = LN(x + Drop(Attn(x)))
    f, ffn = feedforward_forward(x, w1, b1, w2, b2, p, training)
    f, ffn_drop = dropout_forward(f, p, training)
    y, norm2 = layernorm_forward(x + f, gamma2, beta2)  # y = LN(x + Drop(FFN(x)))
    return y, (attention, attention_drop, norm1, ffn, ffn_drop, norm2)


# %%
def postnorm_block_backward(dy, saved):
    """dy (B, T, D) -> dx, dwq, dbq, dwk, dbk, dwv, dbv, dwo, dbo, dgamma1, dbeta1, dw1,
    db1, dw2, db2, dgamma2, dbeta2 (each the shape of what it is the gradient of)."""
    attention, attention_drop, norm1, ffn, ffn_drop, norm2 = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
def prenorm_block_forward(x, wq, bq, wk, bk, wv, bv, wo, bo, gamma1, beta1,
                          w1, b1, w2, b2, gamma2, beta2, num_heads, p, mask=None,
                          training=True):
    """Pre-norm: the same arguments as postnorm_block_forward -> y (B, T, D), saved."""
    n, norm1 = layernorm_forward(x, gamma1, beta1)
    s, attention = multihead_forward(n, wq, bq, wk, bk, wv, bv, wo, bo, num_heads, mask)
    s, attention_drop = dropout_forward(s, p, training)
    x = x + s  # x = x + Drop(Attn(LN(x)))
    n, norm2 = layernorm_forward(x, gamma2, beta2)
    f, ffn = feedforward_forward(n, w1, b1, w2, b2, p, training)
    f, ffn_drop = dropout_forward(f, p, training)
    return x + f, (norm1, attention, attention_drop, norm2, ffn, ffn_drop)  # x + Drop(FFN(LN(x)))


# %%
def prenorm_block_backward(dy, saved):
    """dy (B, T, D) -> the gradients postnorm_block_backward returns, in the same order."""
    norm1, attention, attention_drop, norm2, ffn, ffn_drop = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/blocks.py
    from exercises.check import check

    print(check("blocks", module=sys.modules[__name__]))
