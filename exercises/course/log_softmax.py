"""Log-softmax along an axis."""
from __future__ import annotations

from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import normal
from npformer import ops


def make(rng, shape, axis):
    return Case([normal(rng, *shape, scale=2.0)], {"axis": axis})


def _with(dx_of):
    def backward(dy, saved):
        p, axis = saved
        return dx_of(dy, p, axis)
    return backward


EXERCISE = Exercise(
    name="log_softmax", file="log_softmax.py", section="Log-softmax",
    parts=[Part(
        forward="log_softmax_forward", backward="log_softmax_backward",
        textbook=(ops.log_softmax_forward, ops.log_softmax_backward),
        grads=("dx",), wrt=(0,), make=make,
        sizes=dict(shape=st.lists(st.integers(1, 4), min_size=2, max_size=3),
                   axis=st.sampled_from([-1, 1])),
        edge_cases=[("a batch of rows", dict(shape=[3, 4], axis=-1)),
                    ("along axis 1 of three", dict(shape=[2, 3, 2], axis=1)),
                    ("one position", dict(shape=[2, 1], axis=-1))],
        hints={"dx": "Backward: y_i = x_i - log sum_j exp(x_j), so dy_i/dx_j = "
                     "delta_ij - p_j and dx = dy - p sum(dy), the sum along the axis."},
    )],
    mistakes=[
        Mistake("dx = dy - p: the sum of dy forgotten", "dx", _with(lambda dy, p, axis: dy - p)),
        Mistake("softmax's backward instead", "dx",
                _with(lambda dy, p, axis: p * (dy - (dy * p).sum(axis=axis, keepdims=True)))),
        Mistake("the sum over the last axis, whatever the axis", "dx",
                _with(lambda dy, p, axis: dy - p * dy.sum(axis=-1, keepdims=True))),
        Mistake("the diagonal only: dy (1 - p)", "dx", _with(lambda dy, p, axis: dy * (1 - p))),
    ],
)
