# %% [markdown]
# # Exercise: the backward of a low-rank adapter (LoRA)
#
# Derivation: docs/derivations.md, §2 Low-rank adapters (LoRA)
#
# The forward is given: a frozen linear map W, b plus a trained update of rank r,
# `y = x W + b + scale * dropout(x) A B`, with A (D_in, r), B (r, D_out) and
# scale = alpha / r; the adapter reads its own dropout of x (your dropout exercise's
# forward, drawing its mask from npformer's seeded generator).  Write `lora_backward`:
# from the upstream gradient `dy` and the saved values, the gradients `dx`, `dA` and `dB`, in
# that order.  W and b are frozen: their gradients are not computed (nor returned).
# Your dropout backward is imported below.
#
# Check it: `python exercises/check.py lora` (from the repository's root),
# or run the last cell.

# %%
import sys
from pathlib import Path

import numpy as np  # noqa: F401  (yours to use)

_root = str(Path(globals().get("__file__", "lora.py")).resolve().parents[1])
if _root not in sys.path:  # the earlier exercises: exercises/NAME.py, as it is now
    sys.path.insert(0, _root)
from exercises._earlier import earlier  # noqa: E402

dropout_forward, dropout_backward = earlier("dropout", "dropout_forward", "dropout_backward")


# %%
def lora_forward(x, w, b, lora_a, lora_b, scale, p=0.0, training=True):
    """x (..., D_in), w (D_in, D_out), b (D_out,), lora_a (D_in, r), lora_b (r, D_out),
    scale = alpha / r, p the adapter's dropout -> y (..., D_out), saved."""
    x_dropped, dropped = dropout_forward(x, p, training)  # (..., D_in)
    u = x_dropped @ lora_a  # (..., r): the input brought down to rank r
    y = x @ w + scale * (u @ lora_b) + b  # (..., D_out)
    return y, (x_dropped, u, w, lora_a, lora_b, scale, dropped)


# %%
def lora_backward(dy, saved):
    """dy (..., D_out) -> dx (..., D_in), dA (D_in, r), dB (r, D_out)."""
    x_dropped, u, w, lora_a, lora_b, scale, dropped = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/lora.py
    from exercises.check import check

    print(check("lora", module=sys.modules[__name__]))
