"""RMSNorm: each row divided by its root mean square, then scaled by weight."""
from __future__ import annotations

from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import normal, width
from npformer import ops


def make(rng, lead, d, scale):
    # Rows of rms in [0.5, 2] * scale, never near sqrt(eps): there r bends on a scale near h.
    z = rng.standard_normal(tuple(lead) + (d,))
    z = z / (z * z).mean(axis=-1, keepdims=True) ** 0.5
    x = z * rng.uniform(0.5, 2.0, size=tuple(lead) + (1,)) * scale
    return Case([x, normal(rng, d)])


def _with(dx_of, dweight_of=lambda dy, x_hat: (dy * x_hat).reshape(-1, x_hat.shape[-1]).sum(0)):
    def backward(dy, saved):
        x_hat, r, weight = saved
        return dx_of(dy * weight, x_hat, r), dweight_of(dy, x_hat)
    return backward


def _mean(a):
    return a.mean(axis=-1, keepdims=True)


def _right_dx(g, x_hat, r):
    return r * (g - x_hat * _mean(g * x_hat))


EXERCISE = Exercise(
    name="rmsnorm", file="rmsnorm.py", section="RMSNorm", order=1,
    parts=[Part(
        forward="rmsnorm_forward", backward="rmsnorm_backward",
        textbook=(ops.rmsnorm_forward, ops.rmsnorm_backward),
        grads=("dx", "dweight"), wrt=(0, 1), make=make,
        sizes=dict(lead=st.lists(st.integers(1, 3), min_size=1, max_size=2), d=width,
                   scale=st.sampled_from([0.3, 1.0, 5.0])),
        edge_cases=[("one row", dict(lead=[1], d=4, scale=1.0)),
                    ("a batch of sequences", dict(lead=[2, 3], d=5, scale=5.0))],
        hints={
            "dx": "Backward: layer norm's Step 3 without the centring: with g = dy weight, "
                  "dx = r (g - x_hat mean(g x_hat)), the mean over each row; no mean(g) "
                  "term, since no mean was subtracted.",
            "dweight": "Backward, Step 1: dweight = the sum over every row of dy * x_hat.",
        },
    )],
    mistakes=[
        Mistake("layer norm's mean term kept", "dx",
                _with(lambda g, x_hat, r: r * (g - _mean(g) - x_hat * _mean(g * x_hat)))),
        Mistake("the x_hat term forgotten", "dx", _with(lambda g, x_hat, r: r * g)),
        Mistake("dweight summed over the features", "dweight",
                _with(_right_dx, lambda dy, x_hat: (dy * x_hat).sum(axis=-1))),
        Mistake("dweight without x_hat", "dweight",
                _with(_right_dx, lambda dy, x_hat: dy.reshape(-1, x_hat.shape[-1]).sum(0))),
    ],
)
