# %% [markdown]
# # Exercise: the backward of a linear map
#
# Derivation: docs/derivations.md, §2 Linear
#
# The forward is given.  Write `linear_backward`: from the upstream gradient `dy` and
# the saved values the forward returned, the gradients `dx`, `dw` and `db`, in that order.
# `x` may have any leading shape (a batch, or a batch of sequences): every row of it
# used the same `w` and `b`.
#
# Check it: `python exercises/check.py linear` (from the repository's root), or run
# the last cell.

# %%
import numpy as np  # noqa: F401  (yours to use)


# %%
def linear_forward(x, w, b):
    """x (..., D_in), w (D_in, D_out), b (D_out,) -> y (..., D_out), saved (x, w)."""
    y = x @ w + b
    return y, (x, w)


# %%
def linear_backward(dy, saved):
    """dy (..., D_out) -> dx (..., D_in), dw (D_in, D_out), db (D_out,)."""
    x, w = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/linear.py
    import sys
    from pathlib import Path

    here = Path(globals().get("__file__", "linear.py")).resolve()  # a notebook: its folder
    sys.path.insert(0, str(here.parents[1]))
    from exercises.check import check

    print(check("linear", module=sys.modules[__name__]))
