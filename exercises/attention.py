# %% [markdown]
# # Exercise: the backward of scaled dot-product attention
#
# Derivation: docs/derivations.md, §9 Scaled dot-product attention
#
# The forward is given: P = softmax(Q K^T / sqrt(E) + M) over the keys, out = P V, with a
# boolean mask (True = keep) that may leave a query row with no key at all (its P row and
# output are zeros).  Write `attention_backward`: from the upstream gradient `dout` and the
# saved, the gradients `dq`, `dk` and `dv`, in that order.
#
# Check it: `python exercises/check.py attention` (from the repository's root),
# or run the last cell.

# %%
import math

import numpy as np


# %%
def attention_forward(q, k, v, mask=None):
    """q (..., T, E), k (..., S, E), v (..., S, F), mask (bool, broadcasts to (..., T, S))
    -> out (..., T, F), saved (q, k, v, p)."""
    scores = (q @ np.swapaxes(k, -1, -2)) / math.sqrt(q.shape[-1])  # (..., T, S)
    if mask is not None:
        scores = scores + np.where(mask, 0.0, -np.inf)
    m = scores.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)  # a fully masked row
    e = np.exp(scores - m)
    total = e.sum(axis=-1, keepdims=True)
    p = e / np.where(total > 0, total, 1.0)  # (..., T, S)
    return p @ v, (q, k, v, p)


# %%
def attention_backward(dout, saved):
    """dout (..., T, F) -> dq (..., T, E), dk (..., S, E), dv (..., S, F)."""
    q, k, v, p = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/attention.py
    import sys
    from pathlib import Path

    here = Path(globals().get("__file__", "attention.py")).resolve()  # a notebook: its folder
    sys.path.insert(0, str(here.parents[1]))
    from exercises.check import check

    print(check("attention", module=sys.modules[__name__]))
