# %% [markdown]
# # Exercise: the backward of splitting and merging heads
#
# Derivation: docs/derivations.md, §10 Multi-head attention: split and merge
#
# The forwards are given: `split_heads_forward` cuts the width D = H E of (B, T, D) into H
# heads, (B, H, T, E), column block h becoming head h; `merge_heads_forward` puts them
# back.  Write both backwards: from the upstream gradient `dy` and the saved values, the gradient
# `dx` of each.
#
# Check it: `python exercises/check.py heads` (from the repository's root),
# or run the last cell.

# %%
import numpy as np  # noqa: F401  (yours to use)


# %%
def split_heads_forward(x, num_heads):
    """x (B, T, H*E) -> y (B, H, T, E), saved num_heads."""
    batch, length, width = x.shape
    y = x.reshape(batch, length, num_heads, width // num_heads).transpose(0, 2, 1, 3)
    return y, num_heads


# %%
def split_heads_backward(dy, num_heads):
    """dy (B, H, T, E) -> dx (B, T, H*E)."""
    # your code here
    raise NotImplementedError("your code here")


# %%
def merge_heads_forward(x):
    """x (B, H, T, E) -> y (B, T, H*E), saved the number of heads."""
    batch, heads, length, width = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch, length, heads * width), heads


# %%
def merge_heads_backward(dy, num_heads):
    """dy (B, T, H*E) -> dx (B, H, T, E)."""
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/heads.py
    import sys
    from pathlib import Path

    here = Path(globals().get("__file__", "heads.py")).resolve()  # a notebook: its folder
    sys.path.insert(0, str(here.parents[1]))
    from exercises.check import check

    print(check("heads", module=sys.modules[__name__]))
