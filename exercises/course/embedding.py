"""Embedding: each id picks its row of the table."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import batch, length, normal, width
from npformer import ops


def make(rng, vocab, b, t, d, rank):
    ids = rng.integers(0, vocab, size=(b, t) if rank == 2 else (b * t,))
    flat = ids.reshape(-1)
    if flat.size > 1:
        flat[-1] = flat[0]  # at least one repeated id
    return Case([ids, normal(rng, vocab, d)])


def _add_at(ids, rows, vocab_size):
    dtable = np.zeros((vocab_size, rows.shape[-1]))
    np.add.at(dtable, ids.reshape(-1), rows)
    return dtable


def _assigned(dy, saved):
    ids, vocab_size = saved
    dtable = np.zeros((vocab_size, dy.shape[-1]))
    dtable[ids.reshape(-1)] += dy.reshape(-1, dy.shape[-1])  # a repeated id: added once
    return dtable


def _averaged(dy, saved):
    ids, vocab_size = saved
    counts = np.bincount(ids.reshape(-1), minlength=vocab_size)
    dtable = _add_at(ids, dy.reshape(-1, dy.shape[-1]), vocab_size)
    return dtable / np.maximum(counts, 1)[:, None]


def _rows_returned(dy, saved):
    dtable = dy.reshape(-1, dy.shape[-1])
    return dtable


EXERCISE = Exercise(
    name="embedding", file="embedding.py", section="Embedding",
    parts=[Part(
        forward="embedding_forward", backward="embedding_backward",
        textbook=(ops.embedding_forward, ops.embedding_backward),
        grads=("dtable",), wrt=(1,), make=make,
        sizes=dict(vocab=st.integers(1, 5), b=batch, t=length, d=width,
                   rank=st.sampled_from([1, 2])),
        edge_cases=[("a repeated id", dict(vocab=4, b=2, t=3, d=2, rank=2)),
                    ("one token", dict(vocab=3, b=1, t=1, d=2, rank=1))],
        hints={"dtable": "Backward: row v of dtable is the sum of dy over every position "
                         "whose id is v (a repeated id adds each time: np.add.at, not "
                         "dtable[ids] += ...); rows no id picked get 0; shape (V, D)."},
    )],
    mistakes=[
        Mistake("dtable[ids] += dy: a repeated id counted once", "dtable", _assigned),
        Mistake("averaged over each id's uses", "dtable", _averaged),
        Mistake("dy's rows returned, not the table's", "dtable", _rows_returned),
    ],
)
