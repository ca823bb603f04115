"""Linear: y = x W + b over any leading shape."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import batch, length, normal, width
from npformer import ops


def make(rng, b, t, d_in, d_out, rank):
    lead = (b, t) if rank == 3 else (b,)
    return Case([normal(rng, *lead, d_in), normal(rng, d_in, d_out), normal(rng, d_out)])


EXERCISE = Exercise(
    name="linear", file="linear.py", section="Linear",
    parts=[Part(
        forward="linear_forward", backward="linear_backward",
        textbook=(ops.linear_forward, ops.linear_backward),
        grads=("dx", "dw", "db"), wrt=(0, 1, 2), make=make,
        sizes=dict(b=batch, t=length, d_in=width, d_out=width, rank=st.sampled_from([2, 3])),
        edge_cases=[("one row", dict(b=1, t=1, d_in=3, d_out=2, rank=2)),
                    ("a batch of sequences, D_in != D_out",
                     dict(b=2, t=3, d_in=4, d_out=2, rank=3))],
        hints={
            "dx": "Backward, dx = dy W^T: each input row reaches every output through W, "
                  "so its gradient comes back through W's transpose (D_out, D_in).",
            "dw": "Backward, dW = x^T dy summed over every row that used W: flatten the "
                  "leading axes of x and dy to rows first; (D_in, N) @ (N, D_out).",
            "db": "Backward, db = the sum of dy over every row (every leading axis), "
                  "not over the output features.",
        },
    )],
)


# =========================================================================== the mistakes
def _rows(x, dy, w):
    return x.reshape(-1, w.shape[0]), dy.reshape(-1, w.shape[1])


def _no_transpose(dy, saved):
    x, w = saved
    dx = dy @ w
    rows, drows = _rows(x, dy, w)
    return dx, rows.T @ drows, drows.sum(0)


def _db_over_features(dy, saved):
    x, w = saved
    rows, drows = _rows(x, dy, w)
    db = dy.sum(axis=-1).sum() * np.ones(w.shape[1])
    return dy @ w.T, rows.T @ drows, db


def _dw_averaged(dy, saved):
    x, w = saved
    rows, drows = _rows(x, dy, w)
    return dy @ w.T, rows.T @ drows / rows.shape[0], drows.sum(0)


def _dw_reversed(dy, saved):
    x, w = saved
    rows, drows = _rows(x, dy, w)
    return dy @ w.T, drows.T @ rows, drows.sum(0)


EXERCISE.mistakes += [
    Mistake("dx = dy W, the transpose missing", "dx", _no_transpose),
    Mistake("db summed over the features", "db", _db_over_features),
    Mistake("dW averaged over the rows", "dw", _dw_averaged),
    Mistake("dW = dy^T x, transposed", "dw", _dw_reversed),
]
