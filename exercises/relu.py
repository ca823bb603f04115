# %% [markdown]
# # Exercise: the backward of ReLU
#
# Derivation: docs/derivations.md, §3 ReLU
#
# The forward is given.  Write `relu_backward`: from the upstream gradient `dy` and the
# saved, the gradient `dx`.
#
# Check it: `python exercises/check.py relu` (from the repository's root),
# or run the last cell.

# %%
import numpy as np


# %%
def relu_forward(x):
    """x (...) -> y = max(x, 0) (...), saved x."""
    y = np.where(x <= 0, 0.0, x)
    return y, x


# %%
def relu_backward(dy, x):
    """dy (...) -> dx (...)."""
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/relu.py
    import sys
    from pathlib import Path

    here = Path(globals().get("__file__", "relu.py")).resolve()  # a notebook: its folder
    sys.path.insert(0, str(here.parents[1]))
    from exercises.check import check

    print(check("relu", module=sys.modules[__name__]))
