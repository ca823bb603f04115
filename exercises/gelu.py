# %% [markdown]
# # Exercise: the backward of GELU, exact and tanh form
#
# Derivation: docs/derivations.md, §4 GELU: exact and tanh form
#
# The forwards are given.  Write `gelu_backward` (the exact GELU, y = x Phi(x)) and
# `gelu_tanh_backward` (GPT-2's tanh form): from the upstream gradient `dy` and the
# saved, the gradient `dx` of each.
#
# Check it: `python exercises/check.py gelu` (from the repository's root),
# or run the last cell.

# %%
import math

import numpy as np
from scipy.special import erf

GELU_C = math.sqrt(2.0 / math.pi)
GELU_A = 0.044715


# %%
def gelu_forward(x):
    """x (...) -> y = x Phi(x) (...), saved (x, Phi(x)); Phi is the normal CDF."""
    phi_cdf = 0.5 * (1.0 + erf(x / math.sqrt(2.0)))
    return x * phi_cdf, (x, phi_cdf)


# %%
def gelu_backward(dy, saved):
    """dy (...) -> dx (...)."""
    x, phi_cdf = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
def gelu_tanh_forward(x):
    """x (...) -> y = x (1 + tanh(c (x + a x^3))) / 2 (...), saved (x, t) with t the tanh."""
    t = np.tanh(GELU_C * (x + GELU_A * x**3))
    return 0.5 * x * (1.0 + t), (x, t)


# %%
def gelu_tanh_backward(dy, saved):
    """dy (...) -> dx (...)."""
    x, t = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/gelu.py
    import sys
    from pathlib import Path

    here = Path(globals().get("__file__", "gelu.py")).resolve()  # a notebook: its folder
    sys.path.insert(0, str(here.parents[1]))
    from exercises.check import check

    print(check("gelu", module=sys.modules[__name__]))
