"""Linear: y = x W + b over any leading shape."""
from __future__ import annotations

from hypothesis import strategies as st

from exercises.check import Case, Exercise, Part
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
