# %% [markdown]
# # Exercise: the backward of SiLU and the gated feed-forward (SwiGLU)
#
# Derivation: docs/derivations.md, §4 SiLU and the gated feed-forward (SwiGLU)
#
# The forward is given: h = silu(a) * b, with the gate a and the up projection b of
# Llama's feed-forward network, and silu(a) = a sigmoid(a).  Write `swiglu_backward`:
# from the upstream gradient `dh` and the saved values, the gradients `da` and `db`.
#
# Check it: `python exercises/check.py swiglu` (from the repository's root),
# or run the last cell.

# %%
import numpy as np


# %%
def sigmoid(a):
    """1 / (1 + exp(-a)), computed from exp(-|a|) (no overflow)."""
    e = np.exp(-np.abs(a))
    return np.where(a >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def swiglu_forward(a, b):
    """a (...) the gate, b (...) -> h = a sigmoid(a) b (...), saved (a, b, s = sigmoid(a))."""
    s = sigmoid(a)
    return a * s * b, (a, b, s)


# %%
def swiglu_backward(dh, saved):
    """dh (...) -> da (...), db (...)."""
    a, b, s = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/swiglu.py
    import sys
    from pathlib import Path

    here = Path(globals().get("__file__", "swiglu.py")).resolve()  # a notebook: its folder
    sys.path.insert(0, str(here.parents[1]))
    from exercises.check import check

    print(check("swiglu", module=sys.modules[__name__]))
