# %% [markdown]
# # Exercise: Adam's update, with bias correction and decoupled weight decay (AdamW)
#
# Derivation: docs/derivations.md, §17 Adam, with bias correction
#
# Not a backward this time: the update that uses the gradients.  `adam_init` (given)
# makes the state before the first update, the moments m = v = 0.  Write `adam_step`:
# update number t (counted from 1) of one parameter with its gradient `grad`, returning
# the new parameter, m and v, in that order.  AdamW: the weight decay is decoupled (the
# subsection "AdamW: decoupled weight decay"): the weights shrink by (1 - lr
# weight_decay) before the Adam update, and the gradient is left alone.  The checker runs
# your step and npformer.optim.AdamW's side by side over several updates and compares
# the parameter, m and v after each.
#
# Check it: `python exercises/check.py adam` (from the repository's root),
# or run the last cell.

# %%
import numpy as np


# %%
def adam_init(param):
    """param (...) -> m, v (...): the moments before the first update, zeros."""
    return np.zeros_like(param), np.zeros_like(param)


# %%
def adam_step(param, grad, m, v, t, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
              weight_decay=0.01):
    """Update t (1, 2, ...) of param (...) with grad (...) and the moments m, v (...)
    -> param, m, v after the update (new arrays, or the ones given, updated)."""
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/adam.py
    import sys
    from pathlib import Path

    here = Path(globals().get("__file__", "adam.py")).resolve()  # a notebook: its folder
    sys.path.insert(0, str(here.parents[1]))
    from exercises.check import check

    print(check("adam", module=sys.modules[__name__]))
