"""ReLU: y = max(x, 0)."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import away_from_zero
from npformer import ops


def make(rng, shape):
    return Case([away_from_zero(rng, shape)])  # |x| > h: central differences skip the kink


EXERCISE = Exercise(
    name="relu", file="relu.py", section="ReLU",
    parts=[Part(
        forward="relu_forward", backward="relu_backward",
        textbook=(ops.relu_forward, ops.relu_backward),
        grads=("dx",), wrt=(0,), make=make,
        sizes=dict(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3)),
        edge_cases=[("one element", dict(shape=[1])), ("a batch of rows", dict(shape=[3, 4]))],
        hints={"dx": "Backward: dx = dy [x > 0], the upstream gradient where the input was "
                     "positive and 0 elsewhere (the derivative of max(x, 0) is a step)."},
    )],
    mistakes=[
        Mistake("the step without dy", "dx", lambda dy, x: (x > 0).astype(dy.dtype)),
        Mistake("dy times the output, not the step", "dx", lambda dy, x: dy * np.maximum(x, 0)),
        Mistake("the step inverted", "dx", lambda dy, x: dy * (x < 0)),
        Mistake("relu of the gradient", "dx", lambda dy, x: np.maximum(dy, 0.0)),
    ],
)
