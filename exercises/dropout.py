# %% [markdown]
# # Exercise: the backward of inverted dropout
#
# Derivation: docs/derivations.md, §5 Dropout
#
# The forward is given: in training each element is kept with probability 1 - p and the
# kept ones are scaled by 1 / (1 - p); in evaluation (or with p = 0) it is the identity,
# and the saved values are None.  Write `dropout_backward`: from the upstream gradient `dy` and
# the saved values, the gradient `dx`.  (The mask comes from npformer's seeded generator, so
# the checker can draw the same mask again.)
#
# Check it: `python exercises/check.py dropout` (from the repository's root),
# or run the last cell.

# %%
import numpy as np  # noqa: F401  (yours to use)

from npformer import backend


# %%
def dropout_forward(x, p, training=True):
    """x (...) -> y (...), saved (keep, p) with keep the boolean mask, or None (identity)."""
    if not training or p == 0.0:
        return x, None
    keep = backend.random_uniform(x.shape, dtype=x.dtype) >= p  # P(keep) = 1 - p
    return x * keep * (1.0 / (1.0 - p)), (keep, p)


# %%
def dropout_backward(dy, saved):
    """dy (...) -> dx (...)."""
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/dropout.py
    import sys
    from pathlib import Path

    here = Path(globals().get("__file__", "dropout.py")).resolve()  # a notebook: its folder
    sys.path.insert(0, str(here.parents[1]))
    from exercises.check import check

    print(check("dropout", module=sys.modules[__name__]))
