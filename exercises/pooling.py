# %% [markdown]
# # Exercise: the backward of pooling: mean, max, first token
#
# Derivation: docs/derivations.md, §14 Pooling: mean, max, first token
#
# The forward is given: each sequence of h (B, T, D) pooled into one vector (B, D) over
# its valid positions t < valid_lens[b] (the rest is padding): their mean, their maximum
# per feature, or the first token.  Write `pool_backward`: from the upstream gradient `dy`
# and the saved values, the gradient `dh`, for each of the three.
#
# Check it: `python exercises/check.py pooling` (from the repository's root),
# or run the last cell.

# %%
import numpy as np


# %%
def pool_forward(h, valid_lens, how="mean"):
    """h (B, T, D), valid_lens (B,) integers in [1, T] -> y (B, D), saved
    (how, valid (B, T) booleans, winner, h.shape): winner (B, D) the position of each
    maximum (how == "max"), else None."""
    batch, length, width = h.shape
    valid = np.arange(length)[None, :] < valid_lens[:, None]  # (B, T)
    winner = None
    if how == "first":
        y = h[:, 0, :]
    elif how == "mean":
        y = (h * valid[:, :, None]).sum(axis=1) / valid_lens[:, None]
    else:
        masked = np.where(valid[:, :, None], h, -np.inf)
        winner = masked.argmax(axis=1)  # (B, D)
        y = masked.max(axis=1)
    return y, (how, valid, winner, h.shape)


# %%
def pool_backward(dy, saved):
    """dy (B, D) -> dh (B, T, D)."""
    how, valid, winner, shape = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/pooling.py
    import sys
    from pathlib import Path

    here = Path(globals().get("__file__", "pooling.py")).resolve()  # a notebook: its folder
    sys.path.insert(0, str(here.parents[1]))
    from exercises.check import check

    print(check("pooling", module=sys.modules[__name__]))
