"""Rotary positions: each pair (i, i + E/2) turned by its position's angle."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import normal
from npformer import backend, ops


def make(rng, b, h, t, half, theta, per_sequence, offset):
    e = 2 * half
    positions = offset + rng.integers(0, 100, size=(b, t) if per_sequence else (t,))
    cos, sin = ops.rotary_table(backend.asarray(positions), e, theta,
                                dtype=backend.float_dtype("float64"))
    return Case([normal(rng, b, h, t, e), backend.to_numpy(cos), backend.to_numpy(sin)])


def _rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _with(dx_of):
    def backward(dy, saved):
        cos, sin = saved
        return dx_of(dy, cos, sin)
    return backward


EXERCISE = Exercise(
    name="rotary", file="rotary.py", section="Rotary positions", order=1,
    parts=[Part(
        forward="rotary_forward", backward="rotary_backward",
        textbook=(ops.rotary_forward, ops.rotary_backward),
        grads=("dx",), wrt=(0,), make=make,
        sizes=dict(b=st.integers(1, 3), h=st.integers(1, 3), t=st.integers(1, 4),
                   half=st.integers(1, 4), theta=st.sampled_from([10000.0, 500000.0, 7.0]),
                   per_sequence=st.booleans(), offset=st.integers(-5, 10_000)),
        edge_cases=[("positions per sequence", dict(b=2, h=2, t=3, half=2, theta=10000.0,
                                                    per_sequence=True, offset=3)),
                    ("one position", dict(b=1, h=1, t=1, half=1, theta=7.0,
                                          per_sequence=False, offset=5))],
        hints={"dx": "Backward: the forward is linear, x' = R x with R = C + S P (P: "
                     "rotate_half, P^T = -P), so dx = R^T dy = dy cos - rotate_half(dy sin): "
                     "the turn by the negative angle."},
    )],
    mistakes=[
        Mistake("rotary's sign: the forward's turn again", "dx",
                _with(lambda dy, cos, sin: dy * cos + _rotate_half(dy) * sin)),
        Mistake("the sin term forgotten", "dx", _with(lambda dy, cos, sin: dy * cos)),
        Mistake("cos and sin swapped", "dx",
                _with(lambda dy, cos, sin: dy * sin - _rotate_half(dy * cos))),
    ],
)
