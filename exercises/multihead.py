# %% [markdown]
# # Exercise: the backward of a multi-head attention layer
#
# Derivation: docs/derivations.md, §10 Multi-head attention: split and merge
#
# The forward is given, built from the forwards of your earlier exercises: three
# projections of the same input x (§2), each cut into H heads (split), attention over
# every head (§9), the heads merged back and the output projection.  Self-attention: x
# gives the queries, the keys and the values.  Write `multihead_backward`: from the
# upstream gradient `dy` and the saved values, the gradients `dx`, `dwq`, `dbq`, `dwk`, `dbk`,
# `dwv`, `dbv`, `dwo`, `dbo`, in that order (the subsection "Backward of the whole
# layer").  Your backwards of those exercises are imported below: use them (they must be
# done first), or write the steps out.
#
# Check it: `python exercises/check.py multihead` (from the repository's root),
# or run the last cell.

# %%
import sys
from pathlib import Path

import numpy as np  # noqa: F401  (yours to use)

_root = str(Path(globals().get("__file__", "multihead.py")).resolve().parents[1])
if _root not in sys.path:  # the earlier exercises: exercises/NAME.py, as it is now
    sys.path.insert(0, _root)
from exercises._earlier import earlier  # noqa: E402

attention_forward, attention_backward = earlier(
    "attention", "attention_forward", "attention_backward")
split_heads_forward, split_heads_backward = earlier(
    "heads", "split_heads_forward", "split_heads_backward")
merge_heads_forward, merge_heads_backward = earlier(
    "heads", "merge_heads_forward", "merge_heads_backward")
linear_forward, linear_backward = earlier("linear", "linear_forward", "linear_backward")


# %%
def multihead_forward(x, wq, bq, wk, bk, wv, bv, wo, bo, num_heads, mask=None):
    """x (B, T, D); wq, wk, wv (D, H*E); bq, bk, bv (H*E,); wo (H*E, D); bo (D,); mask
    (bool, broadcasts to (B, H, T, T), True = may attend) -> y (B, T, D), saved."""
    q, q_cache = linear_forward(x, wq, bq)  # (B, T, H*E)
    k, k_cache = linear_forward(x, wk, bk)
    v, v_cache = linear_forward(x, wv, bv)
    qh, _ = split_heads_forward(q, num_heads)  # (B, H, T, E)
    kh, _ = split_heads_forward(k, num_heads)
    vh, _ = split_heads_forward(v, num_heads)
    heads, attention_saved = attention_forward(qh, kh, vh, mask)  # (B, H, T, E)
    merged, _ = merge_heads_forward(heads)  # (B, T, H*E)
    y, out_cache = linear_forward(merged, wo, bo)  # (B, T, D)
    return y, (q_cache, k_cache, v_cache, attention_saved, out_cache, num_heads)


# %%
def multihead_backward(dy, saved):
    """dy (B, T, D) -> dx (B, T, D), dwq (D, H*E), dbq (H*E,), dwk, dbk, dwv, dbv (the
    same shapes), dwo (H*E, D), dbo (D,)."""
    q_cache, k_cache, v_cache, attention_saved, out_cache, num_heads = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/multihead.py
    from exercises.check import check

    print(check("multihead", module=sys.modules[__name__]))
