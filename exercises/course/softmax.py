"""Softmax along an axis, plain and masked (fully masked rows give zeros)."""
from __future__ import annotations

from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import mask_with_dead_row, normal
from npformer import ops


def make(rng, shape, axis, masked, broadcast):
    shape = tuple(shape)
    kwargs = {"axis": axis}
    if masked:
        # The mask is full along the axis, of size 1 on the other axes ``broadcast`` picks.
        axis_ = axis % len(shape)
        mshape = [n if (i == axis_ or not b) else 1
                  for i, (n, b) in enumerate(zip(shape, broadcast))]
        kwargs["mask"] = mask_with_dead_row(rng, mshape, axis)
    return Case([normal(rng, *shape, scale=2.0)], kwargs)


def _with(dx_of):
    def backward(dp, saved):
        p, axis = saved
        return dx_of(dp, p, axis)
    return backward


EXERCISE = Exercise(
    name="softmax", file="softmax.py", section="Softmax",
    parts=[Part(
        forward="softmax_forward", backward="softmax_backward",
        textbook=(ops.softmax_forward, ops.softmax_backward),
        grads=("dx",), wrt=(0,), make=make,
        sizes=dict(shape=st.lists(st.integers(1, 4), min_size=2, max_size=3),
                   axis=st.sampled_from([-1, 0]), masked=st.booleans(),
                   broadcast=st.lists(st.booleans(), min_size=3, max_size=3)),
        edge_cases=[
            ("a fully masked row", dict(shape=[3, 4], axis=-1, masked=True,
                                        broadcast=[False] * 3)),
            ("along axis 0", dict(shape=[3, 2, 4], axis=0, masked=False,
                                  broadcast=[False] * 3)),
            ("one position", dict(shape=[2, 1], axis=-1, masked=False, broadcast=[False] * 3)),
        ],
        hints={"dx": "Backward: the Jacobian diag(p) - p p^T applied to dp gives "
                     "dx = p (dp - sum(dp p)), the sum along the softmax's own axis (keepdims); "
                     "masked entries have p = 0 and get nothing."},
    )],
    mistakes=[
        Mistake("the sum over the last axis, whatever the axis", "dx",
                _with(lambda dp, p, axis: p * (dp - (dp * p).sum(axis=-1, keepdims=True)))),
        Mistake("the - sum(dp p) term forgotten", "dx", _with(lambda dp, p, axis: p * dp)),
        Mistake("the diagonal of the Jacobian only", "dx",
                _with(lambda dp, p, axis: dp * p * (1 - p))),
        Mistake("dp - sum(dp p), the factor p forgotten", "dx",
                _with(lambda dp, p, axis: dp - (dp * p).sum(axis=axis, keepdims=True))),
    ],
)
