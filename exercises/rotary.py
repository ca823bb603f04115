# %% [markdown]
# # Exercise: the backward of rotary positions
#
# Derivation: docs/derivations.md, §12 Rotary positions (Llama, Qwen)
#
# The forward is given: each query or key (B, H, T, E) is turned pair by pair, pair
# (i, i + E/2) by the angle of its position, with the tables cos and sin (T, E) or
# (B, T, E) of `npformer.ops.rotary_table`.  Write `rotary_backward`: from the upstream
# gradient `dy` and the saved values, the gradient `dx`.
#
# Check it: `python exercises/check.py rotary` (from the repository's root),
# or run the last cell.

# %%
import numpy as np


# %%
def rotate_half(x):
    """[x1, x2] -> [-x2, x1], the halves of the last axis."""
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rotary_forward(x, cos, sin):
    """x (B, H, T, E), cos and sin (T, E) or (B, T, E) -> y (B, H, T, E), saved (cos, sin)
    as (1, T, E) or (B, 1, T, E): one table for every head."""
    cos, sin = np.expand_dims(cos, -3), np.expand_dims(sin, -3)
    return x * cos + rotate_half(x) * sin, (cos, sin)


# %%
def rotary_backward(dy, saved):
    """dy (B, H, T, E) -> dx (B, H, T, E)."""
    cos, sin = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/rotary.py
    import sys
    from pathlib import Path

    here = Path(globals().get("__file__", "rotary.py")).resolve()  # a notebook: its folder
    sys.path.insert(0, str(here.parents[1]))
    from exercises.check import check

    print(check("rotary", module=sys.modules[__name__]))
