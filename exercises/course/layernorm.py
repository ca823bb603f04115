"""Layer norm: each row centred, scaled to unit variance, then gamma * x_hat + beta."""
from __future__ import annotations

from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import normal, rows_to_normalise, width
from npformer import ops


def make(rng, lead, d):
    return Case([rows_to_normalise(rng, lead, d), normal(rng, d), normal(rng, d)])


EXERCISE = Exercise(
    name="layernorm", file="layernorm.py", section="Layer norm",
    parts=[Part(
        forward="layernorm_forward", backward="layernorm_backward",
        textbook=(ops.layernorm_forward, ops.layernorm_backward),
        grads=("dx", "dgamma", "dbeta"), wrt=(0, 1, 2), make=make,
        sizes=dict(lead=st.lists(st.integers(1, 3), min_size=1, max_size=2), d=width),
        edge_cases=[("one row", dict(lead=[1], d=4)),
                    ("a batch of sequences", dict(lead=[2, 3], d=5))],
        hints={
            "dx": "Backward, Step 4 (the vector-Jacobian product): dx = r (g - mean(g) - "
                  "x_hat mean(g x_hat)) with g = dy gamma and the means over each row; "
                  "mean(g) comes from mu, which every x_j moves, and the x_hat term from the "
                  "variance.",
            "dgamma": "Backward, Step 1: dgamma = the sum over every row of dy * x_hat "
                      "(gamma scales x_hat in every row).",
            "dbeta": "Backward, Step 1: dbeta = the sum of dy over every row.",
        },
    )],
)


# =========================================================================== the mistakes
def _with(dx_of, dgamma_of=lambda dy, x_hat: dy * x_hat):
    def backward(dy, saved):
        x_hat, r, gamma = saved
        d = x_hat.shape[-1]
        return (dx_of(dy * gamma, x_hat, r, dy),
                dgamma_of(dy, x_hat).reshape(-1, d).sum(0), dy.reshape(-1, d).sum(0))
    return backward


def _mean(a):
    return a.mean(axis=-1, keepdims=True)


EXERCISE.mistakes += [
    Mistake("layer norm's mean term forgotten", "dx",
            _with(lambda g, x_hat, r, dy: r * (g - x_hat * _mean(g * x_hat)))),
    Mistake("the variance term forgotten", "dx",
            _with(lambda g, x_hat, r, dy: r * (g - _mean(g)))),
    Mistake("g = dy: gamma forgotten", "dx",
            _with(lambda g, x_hat, r, dy: r * (dy - _mean(dy) - x_hat * _mean(dy * x_hat)))),
    Mistake("dgamma without x_hat", "dgamma",
            _with(lambda g, x_hat, r, dy: r * (g - _mean(g) - x_hat * _mean(g * x_hat)),
                  lambda dy, x_hat: dy)),
]
