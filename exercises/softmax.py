# %% [markdown]
# # Exercise: the backward of softmax, plain and masked
#
# Derivation: docs/derivations.md, §7 Softmax, plain and masked
#
# The forward is given: softmax along `axis`; where a boolean `mask` (broadcasting to x,
# True = keep) is given, the masked entries get probability 0, and a row with no entry
# kept (a fully masked row) is all zeros.  Write `softmax_backward`: from the upstream
# gradient `dp` and the saved values, the gradient `dx`.  The axis is not always the last.
#
# Check it: `python exercises/check.py softmax` (from the repository's root),
# or run the last cell.

# %%
import numpy as np


# %%
def softmax_forward(x, axis=-1, mask=None):
    """x (...) -> p (...), saved (p, axis).  mask: boolean, broadcasts to x, True = keep."""
    if mask is not None:
        x = x + np.where(mask, 0.0, -np.inf)  # masked entries become -inf
    m = x.max(axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)  # a fully masked row has max -inf
    e = np.exp(x - m)  # exp(-inf) = 0 at masked entries
    total = e.sum(axis=axis, keepdims=True)
    p = e / np.where(total > 0, total, 1.0)  # 0 / 1 on fully masked rows
    return p, (p, axis)


# %%
def softmax_backward(dp, saved):
    """dp (...) -> dx (...)."""
    p, axis = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/softmax.py
    import sys
    from pathlib import Path

    here = Path(globals().get("__file__", "softmax.py")).resolve()  # a notebook: its folder
    sys.path.insert(0, str(here.parents[1]))
    from exercises.check import check

    print(check("softmax", module=sys.modules[__name__]))
