# %% [markdown]
# # Exercise: the backward of layer norm
#
# Derivation: docs/derivations.md, §6 Layer norm
#
# The forward is given.  Write `layernorm_backward`: from the upstream gradient `dy`
# and the saved values, the gradients `dx`, `dgamma` and `dbeta`, in that order.  Each row
# (the last axis, of width D) is normalised on its own; gamma and beta are shared by
# every row.  Hint: name g = dy * gamma, the gradient of x_hat, and follow the
# derivation's steps from there.
#
# Check it: `python exercises/check.py layernorm` (from the repository's root), or
# run the last cell.

# %%
import numpy as np

EPS = 1e-5


# %%
def layernorm_forward(x, gamma, beta, eps=EPS):
    """x (..., D), gamma (D,), beta (D,) -> y (..., D), saved (x_hat, r, gamma)."""
    mu = x.mean(axis=-1, keepdims=True)  # (..., 1)
    centred = x - mu  # (..., D)
    var = (centred * centred).mean(axis=-1, keepdims=True)  # (..., 1)
    r = 1.0 / np.sqrt(var + eps)  # (..., 1)
    x_hat = centred * r  # (..., D)
    y = x_hat * gamma + beta  # (..., D)
    return y, (x_hat, r, gamma)


# %%
def layernorm_backward(dy, saved):
    """dy (..., D) -> dx (..., D), dgamma (D,), dbeta (D,)."""
    x_hat, r, gamma = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/layernorm.py
    import sys
    from pathlib import Path

    here = Path(globals().get("__file__", "layernorm.py")).resolve()  # a notebook: its folder
    sys.path.insert(0, str(here.parents[1]))
    from exercises.check import check

    print(check("layernorm", module=sys.modules[__name__]))
