"""GELU, exact (x Phi(x)) and in GPT-2's tanh form."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from npformer import ops


def make(rng, shape, scale):
    # Clipped at -3.5: further out gelu'(x) is below what central differences resolve.
    return Case([np.maximum(rng.standard_normal(tuple(shape)) * scale, -3.5)])


SIZES = dict(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
             scale=st.sampled_from([0.3, 1.0, 3.0]))
EDGES = [("one element", dict(shape=[1], scale=1.0)),
         ("a batch of rows, wide values", dict(shape=[3, 4], scale=3.0))]
C, A = math.sqrt(2.0 / math.pi), 0.044715

EXERCISE = Exercise(
    name="gelu", file="gelu.py", section="GELU",
    parts=[
        Part(forward="gelu_forward", backward="gelu_backward",
             textbook=(ops.gelu_forward, ops.gelu_backward),
             grads=("dx",), wrt=(0,), make=make, sizes=SIZES, edge_cases=EDGES,
             hints={"dx": "Exact GELU: by the product rule dy/dx = Phi(x) + x phi(x), with "
                          "phi(x) = exp(-x^2/2) / sqrt(2 pi) the normal density (Phi' = phi); "
                          "dx = dy dy/dx."}),
        Part(forward="gelu_tanh_forward", backward="gelu_tanh_backward",
             textbook=ops.activation("gelu_tanh"),
             grads=("dx",), wrt=(0,), make=make, sizes=SIZES, edge_cases=EDGES,
             hints={"dx": "tanh form: dy/dx = (1 + t)/2 + x (1 - t^2) c (1 + 3 a x^2) / 2, "
                          "since dt/du = 1 - t^2 and du/dx = c (1 + 3 a x^2)."}),
    ],
    mistakes=[
        Mistake("the x phi(x) term of the product rule forgotten", "dx",
                lambda dy, saved: dy * saved[1]),
        Mistake("the normal density without 1/sqrt(2 pi)", "dx",
                lambda dy, saved: dy * (saved[1] + saved[0] * np.exp(-0.5 * saved[0] ** 2))),
        Mistake("tanh form: du/dx as c (1 + a x^2)", "dx",
                lambda dy, saved: dy * (0.5 * (1 + saved[1]) + 0.5 * saved[0]
                                        * (1 - saved[1] ** 2) * C * (1 + A * saved[0] ** 2)),
                part="gelu_tanh_backward"),
        Mistake("tanh form: dt/du as 1 - t", "dx",
                lambda dy, saved: dy * (0.5 * (1 + saved[1]) + 0.5 * saved[0]
                                        * (1 - saved[1]) * C * (1 + 3 * A * saved[0] ** 2)),
                part="gelu_tanh_backward"),
    ],
)
