# %% [markdown]
# # Exercise: the backward of cross-entropy with ignore_index and label smoothing
#
# Derivation: docs/derivations.md, §13 Cross-entropy with ignore_index and label smoothing
#
# The forward is given: the mean over the counted rows (targets other than ignore_index;
# a loss of 0 if none is) of -sum_v q_v log p_v, with the target distribution
# q = (1 - eps) onehot(target) + eps / V (eps, label smoothing).  Write
# `cross_entropy_backward`: from the upstream gradient `dloss` (a scalar) and the saved values,
# the gradient `dlogits`.
#
# Check it: `python exercises/check.py cross_entropy` (from the repository's root),
# or run the last cell.

# %%
import numpy as np

IGNORE_INDEX = -100


# %%
def cross_entropy_forward(logits, targets, ignore_index=IGNORE_INDEX, label_smoothing=0.0):
    """logits (..., V), targets (...) integers -> loss (a scalar), saved
    (p, targets, ignore_index, label_smoothing, logits.shape); p = softmax(logits) (N, V)
    and targets (N,) as rows."""
    vocab = logits.shape[-1]
    z, t = logits.reshape(-1, vocab), targets.reshape(-1)  # (N, V), (N,)
    shifted = z - z.max(axis=-1, keepdims=True)
    total = np.exp(shifted).sum(axis=-1, keepdims=True)
    log_p = shifted - np.log(total)  # (N, V)
    counted = t != ignore_index  # (N,)
    n_counted = counted.sum()
    weight = counted / max(n_counted, 1)  # (N,): 1 / N_counted on counted rows, else 0
    picked = np.take_along_axis(log_p, np.where(counted, t, 0)[:, None], axis=-1)[:, 0]
    per_row = -(1.0 - label_smoothing) * picked
    if label_smoothing > 0.0:
        per_row = per_row - label_smoothing * log_p.mean(axis=-1)
    loss = np.sum(weight * per_row)
    return loss, (np.exp(log_p), t, ignore_index, label_smoothing, logits.shape)


# %%
def cross_entropy_backward(dloss, saved):
    """dloss (a scalar) -> dlogits (..., V)."""
    p, targets, ignore_index, label_smoothing, shape = saved
    # your code here
    raise NotImplementedError("your code here")


# %%
if __name__ == "__main__":  # this cell in a notebook, or python exercises/cross_entropy.py
    import sys
    from pathlib import Path

    here = Path(globals().get("__file__", "cross_entropy.py")).resolve()  # a notebook: its folder
    sys.path.insert(0, str(here.parents[1]))
    from exercises.check import check

    print(check("cross_entropy", module=sys.modules[__name__]))
