"""Pooling over the valid positions: mean, max per feature, or the first token."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import batch, distinct_values, length, width
from npformer import ops


def make(rng, b, t, d, how):
    valid = rng.integers(1, t + 1, size=b)  # 1 (a single token) up to t (no padding)
    valid[-1] = 1 if b > 1 else valid[-1]
    return Case([distinct_values(rng, (b, t, d)), valid], {"how": how})


def _with(mean=None, largest=None, first=None):
    def backward(dy, saved):
        how, valid, winner, shape = saved
        batch_size, length, _ = shape
        if how == "mean":
            if mean:
                return mean(dy, valid)
            return dy[:, None, :] * valid[:, :, None] / valid.sum(axis=1)[:, None, None]
        if how == "max":
            if largest:
                return largest(dy, valid, winner)
            return (np.arange(length)[None, :, None] == winner[:, None, :]) * dy[:, None, :]
        dh = np.zeros(shape)
        dh[:, -1 if first else 0, :] = dy
        return dh
    return backward


EXERCISE = Exercise(
    name="pooling", file="pooling.py", section="Pooling",
    parts=[Part(
        forward="pool_forward", backward="pool_backward",
        textbook=(ops.pool_forward, ops.pool_backward),
        grads=("dh",), wrt=(0,), make=make,
        sizes=dict(b=batch, t=length, d=width, how=st.sampled_from(["mean", "max", "first"])),
        edge_cases=[("mean, with padding", dict(b=2, t=3, d=2, how="mean")),
                    ("max, with padding", dict(b=2, t=3, d=2, how="max")),
                    ("first token", dict(b=2, t=3, d=2, how="first")),
                    ("one position", dict(b=1, t=1, d=3, how="mean"))],
        hints={"dh": "Backward: mean: dh[b, t] = dy[b] / n_b at valid positions, 0 at "
                     "padding; max: dy[b, d] to the position that won, 0 elsewhere; "
                     "first: dy[b] to position 0, 0 elsewhere."},
    )],
    mistakes=[
        Mistake("mean: divided by T, the padding counted", "dh",
                _with(mean=lambda dy, valid: dy[:, None, :] * valid[:, :, None]
                      / valid.shape[1])),
        Mistake("mean: the gradient reaches the padding", "dh",
                _with(mean=lambda dy, valid: np.repeat(dy[:, None, :], valid.shape[1], axis=1)
                      / valid.sum(axis=1)[:, None, None])),
        Mistake("max: the gradient to every valid position", "dh",
                _with(largest=lambda dy, valid, winner: dy[:, None, :] * valid[:, :, None])),
        Mistake("first: the gradient to the last position", "dh", _with(first=True)),
    ],
)
