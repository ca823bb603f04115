"""Inverted dropout: y = x m / (1 - p) in training, y = x in evaluation."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import normal
from npformer import ops


def make(rng, shape, p, training):
    return Case([normal(rng, *shape), p], {"training": training},
                seed=int(rng.integers(2**31)))


def _training(dx_of):
    def backward(dy, saved):
        if saved is None:
            return dy
        keep, p = saved
        return dx_of(dy, keep, p)
    return backward


def _fresh_mask(dy, keep, p):
    fresh = np.random.default_rng().random(dy.shape) >= p
    return dy * fresh / (1.0 - p)


EXERCISE = Exercise(
    name="dropout", file="dropout.py", section="Dropout",
    parts=[Part(
        forward="dropout_forward", backward="dropout_backward",
        textbook=(ops.dropout_forward, ops.dropout_backward),
        grads=("dx",), wrt=(0,), make=make,
        sizes=dict(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3),
                   p=st.floats(0.05, 0.9), training=st.booleans()),
        edge_cases=[("training, p = 0.3", dict(shape=[3, 4], p=0.3, training=True)),
                    ("evaluation: the identity", dict(shape=[2, 3], p=0.5, training=False)),
                    ("training with p = 0: nothing dropped", dict(shape=[4], p=0.0,
                                                                  training=True))],
        hints={"dx": "Backward (training): y is linear in x, so dx = dy m / (1 - p) with the "
                     "forward's own mask m, scale included; in evaluation (saved None) "
                     "dx = dy."},
    )],
    mistakes=[
        Mistake("dropout's 1/(1 - p) forgotten", "dx",
                _training(lambda dy, keep, p: dy * keep)),
        Mistake("scaled by 1/p", "dx", _training(lambda dy, keep, p: dy * keep / p)),
        Mistake("a fresh mask drawn in the backward", "dx", _training(_fresh_mask)),
        Mistake("the mask inverted", "dx", _training(lambda dy, keep, p: dy * ~keep / (1 - p))),
    ],
)
