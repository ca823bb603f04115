# %% [markdown]
# # Exercise: the backward of log-softmax
#
# Derivation: docs/derivations.md, §8 Log-softmax
#
# The forward is given: y = log softmax(x) along `axis`.  Write `log_softmax_backward`:
# from the upstream gradient `dy` and the saved values, the gradient `dx`.
#
# Check it: `python exercises/check.py log_softmax` (from the repository's root),
# or run the last cell.

# %%
import numpy as np


# %%
def log_softmax_forward(x, axis=-1):
    """x (...) -> y = log softmax(x) (...), saved (p = exp(y), axis)."""
    shifted = x - x.max(axis=axis, keepdims=True)
    e = np.exp(shifted)
    total = e.sum(axis=axis, keepdims=True)
    return shifted - np.log(total), (e / total, axis)


# %%
def log_softmax_backward(dy, saved):
    """dy (...) -> dx (...)."""
    p, axis = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/log_softmax.py
    import sys
    from pathlib import Path

    here = Path(globals().get("__file__", "log_softmax.py")).resolve()  # a notebook: its folder
    sys.path.insert(0, str(here.parents[1]))
    from exercises.check import check

    print(check("log_softmax", module=sys.modules[__name__]))
