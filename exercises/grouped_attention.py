# %% [markdown]
# # Exercise: the backward of a grouped-query attention layer
#
# Derivation: docs/derivations.md, §10 Grouped-query attention
#
# The forward is given: the multi-head layer of the previous exercise with fewer key/value
# heads than query heads (Llama 3, Qwen2): H query heads share H_kv key/value heads, each
# serving a group of G = H / H_kv consecutive query heads.  The keys and values are
# projected to H_kv heads (wk, wv are (D, H_kv*E)) and each head is repeated over its
# group before attention.  Write `grouped_backward`: from the upstream gradient `dy` and
# the saved values, the gradients `dx`, `dwq`, `dbq`, `dwk`, `dbk`, `dwv`, `dbv`, `dwo`, `dbo`,
# in that order.  Your backwards of the earlier exercises are imported below.
#
# Check it: `python exercises/check.py grouped_attention` (from the repository's root),
# or run the last cell.

# %%
import sys
from pathlib import Path

import numpy as np  # noqa: F401  (yours to use)

_root = str(Path(globals().get("__file__", "grouped_attention.py")).resolve().parents[1])
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
def repeat_heads(x, groups):
    """(B, H_kv, S, E) -> (B, H_kv*G, S, E): head j copied to heads j*G .. j*G + G - 1."""
    return np.repeat(x, groups, axis=1)


def grouped_forward(x, wq, bq, wk, bk, wv, bv, wo, bo, num_heads, kv_heads, mask=None):
    """x (B, T, D); wq (D, H*E), bq (H*E,); wk, wv (D, H_kv*E), bk, bv (H_kv*E,);
    wo (H*E, D), bo (D,); mask (bool, broadcasts to (B, H, T, T)) -> y (B, T, D), saved."""
    groups = num_heads // kv_heads  # G query heads per key/value head
    q, q_cache = linear_forward(x, wq, bq)  # (B, T, H*E)
    k, k_cache = linear_forward(x, wk, bk)  # (B, T, H_kv*E)
    v, v_cache = linear_forward(x, wv, bv)
    qh, _ = split_heads_forward(q, num_heads)  # (B, H, T, E)
    kh, _ = split_heads_forward(k, kv_heads)  # (B, H_kv, T, E)
    vh, _ = split_heads_forward(v, kv_heads)
    heads, attention_saved = attention_forward(
        qh, repeat_heads(kh, groups), repeat_heads(vh, groups), mask)  # (B, H, T, E)
    merged, _ = merge_heads_forward(heads)  # (B, T, H*E)
    y, out_cache = linear_forward(merged, wo, bo)  # (B, T, D)
    return y, (q_cache, k_cache, v_cache, attention_saved, out_cache, num_heads, kv_heads)


# %%
def grouped_backward(dy, saved):
    """dy (B, T, D) -> dx (B, T, D), dwq (D, H*E), dbq (H*E,), dwk (D, H_kv*E), dbk
    (H_kv*E,), dwv, dbv (the same), dwo (H*E, D), dbo (D,)."""
    q_cache, k_cache, v_cache, attention_saved, out_cache, num_heads, kv_heads = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/grouped_attention.py
    from exercises.check import check

    print(check("grouped_attention", module=sys.modules[__name__]))
