"""SiLU and the gated feed-forward: h = silu(a) * b."""
from __future__ import annotations

from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import normal
from npformer import ops


def make(rng, shape, scale):
    return Case([normal(rng, *shape, scale=scale), normal(rng, *shape)])


def _with(da_of, db_of=lambda dh, a, b, s: dh * a * s):
    def backward(dh, saved):
        a, b, s = saved
        return da_of(dh, a, b, s), db_of(dh, a, b, s)
    return backward


EXERCISE = Exercise(
    name="swiglu", file="swiglu.py", section="SiLU", order=1,
    parts=[Part(
        forward="swiglu_forward", backward="swiglu_backward",
        textbook=(ops.swiglu_forward, ops.swiglu_backward),
        grads=("da", "db"), wrt=(0, 1), make=make,
        sizes=dict(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
                   scale=st.sampled_from([0.3, 1.0, 4.0, 40.0])),
        edge_cases=[("one element", dict(shape=[1], scale=1.0)),
                    ("gates far out, sigmoid 0 or 1", dict(shape=[2, 3], scale=40.0))],
        hints={
            "da": "Backward: da = dh b silu'(a), with silu'(a) = s + a s' and "
                  "s' = s (1 - s), so silu'(a) = s (1 + a (1 - s)).",
            "db": "Backward: db = dh silu(a) = dh a s (b multiplies silu(a)).",
        },
    )],
    mistakes=[
        Mistake("silu' as s alone: the a s' term forgotten", "da",
                _with(lambda dh, a, b, s: dh * b * s)),
        Mistake("the sigmoid's derivative as s (1 + s)", "da",
                _with(lambda dh, a, b, s: dh * b * s * (1 + a * (1 + s)))),
        Mistake("da without b", "da", _with(lambda dh, a, b, s: dh * s * (1 + a * (1 - s)))),
        Mistake("db = dh s: the a of silu forgotten", "db",
                _with(lambda dh, a, b, s: dh * b * s * (1 + a * (1 - s)),
                      lambda dh, a, b, s: dh * s)),
    ],
)
