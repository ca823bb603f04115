"""Adding positions: x + table[:T], a learned table or the fixed sinusoidal one."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import batch, length, normal, width
from npformer import backend, ops


def make(rng, b, t, d, extra, table):
    x = normal(rng, b, t, d)
    if table == "sinusoidal":
        positions = backend.to_numpy(ops.sinusoidal_table(t + extra, d))
    else:
        positions = normal(rng, t + extra, d, scale=0.02)
    return Case([x, positions])


def _with(dx_of=lambda dy: dy, dtable_of=None):
    def backward(dy, saved):
        length, table_length = saved
        used = dtable_of(dy) if dtable_of else dy.sum(axis=0)
        dtable = np.concatenate([used, np.zeros((table_length - used.shape[0],
                                                 dy.shape[-1]))])
        return dx_of(dy), dtable
    return backward


def _unpadded(dy, saved):
    dtable = dy.sum(axis=0)
    return dy, dtable


EXERCISE = Exercise(
    name="positions", file="positions.py", section="Positional encodings",
    parts=[Part(
        forward="add_positions_forward", backward="add_positions_backward",
        textbook=(ops.add_positions_forward, ops.add_positions_backward),
        grads=("dx", "dtable"), wrt=(0, 1), make=make,
        sizes=dict(b=batch, t=length, d=width, extra=st.integers(0, 3),
                   table=st.sampled_from(["learned", "sinusoidal"])),
        edge_cases=[("T < L: rows no position used", dict(b=2, t=2, d=3, extra=2,
                                                          table="learned")),
                    ("one position", dict(b=3, t=1, d=2, extra=0, table="sinusoidal"))],
        hints={
            "dx": "Backward: y = x + P, so dx = dy.",
            "dtable": "Backward: row t < T of the table was added to every sequence: its "
                      "gradient is dy summed over the batch; rows t >= T were not used and "
                      "get 0, so dtable has the table's shape (L, D).",
        },
    )],
    mistakes=[
        Mistake("dtable of the rows used only, (T, D)", "dtable", _unpadded),
        Mistake("dtable from the first sequence only", "dtable",
                _with(dtable_of=lambda dy: dy[0])),
        Mistake("dtable averaged over the batch", "dtable",
                _with(dtable_of=lambda dy: dy.mean(axis=0))),
        Mistake("dx summed over the batch like dtable", "dx",
                _with(dx_of=lambda dy: dy.sum(axis=0, keepdims=True))),
    ],
)
