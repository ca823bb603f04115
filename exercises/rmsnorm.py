# %% [markdown]
# # Exercise: the backward of RMSNorm
#
# Derivation: docs/derivations.md, §6 RMSNorm: layer norm without the centring
#
# The forward is given: each row (the last axis, of width D) divided by its root mean
# square, then scaled by `weight`, shared by every row.  Write `rmsnorm_backward`: from
# the upstream gradient `dy` and the saved values, the gradients `dx` and `dweight`.
#
# Check it: `python exercises/check.py rmsnorm` (from the repository's root),
# or run the last cell.

# %%
import numpy as np

EPS = 1e-6


# %%
def rmsnorm_forward(x, weight, eps=EPS):
    """x (..., D), weight (D,) -> y (..., D), saved (x_hat, r, weight)."""
    mean_square = (x * x).mean(axis=-1, keepdims=True)  # (..., 1)
    r = 1.0 / np.sqrt(mean_square + eps)  # (..., 1)
    x_hat = x * r  # (..., D)
    return weight * x_hat, (x_hat, r, weight)


# %%
def rmsnorm_backward(dy, saved):
    """dy (..., D) -> dx (..., D), dweight (D,)."""
    x_hat, r, weight = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/rmsnorm.py
    import sys
    from pathlib import Path

    here = Path(globals().get("__file__", "rmsnorm.py")).resolve()  # a notebook: its folder
    sys.path.insert(0, str(here.parents[1]))
    from exercises.check import check

    print(check("rmsnorm", module=sys.modules[__name__]))
