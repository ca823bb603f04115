"""Cross-entropy over logits, with ignore_index and label smoothing."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import batch, length, normal
from npformer import ops


def make(rng, b, t, v, rank, smoothing, ignore_index, ignored):
    lead = (b, t) if rank == 3 else (b * t,)
    targets = rng.integers(0, v, size=lead)
    flat = targets.reshape(-1)
    flat[rng.permutation(flat.size)[:min(ignored, flat.size)]] = ignore_index
    return Case([normal(rng, *lead, v, scale=2.0), targets],
                {"ignore_index": ignore_index, "label_smoothing": smoothing})


def _with(counted_rows=True, uniform=True, upstream=True, guard=True):
    def backward(dloss, saved):
        p, targets, ignore_index, eps, shape = saved
        vocab = p.shape[-1]
        counted = targets != ignore_index
        n = counted.sum() if counted_rows else targets.size
        weight = counted / (max(n, 1) if guard else n)
        onehot = np.eye(vocab)[np.where(counted, targets, 0)]
        q = (1 - eps) * onehot + (eps / vocab if uniform else 0.0)
        dz = (dloss if upstream else 1.0) * weight[:, None] * (p - q)
        return dz.reshape(shape)
    return backward


EXERCISE = Exercise(
    name="cross_entropy", file="cross_entropy.py", section="Cross-entropy",
    parts=[Part(
        forward="cross_entropy_forward", backward="cross_entropy_backward",
        textbook=(ops.cross_entropy_forward, ops.cross_entropy_backward),
        grads=("dlogits",), wrt=(0,), make=make,
        sizes=dict(b=batch, t=length, v=st.integers(1, 5), rank=st.sampled_from([2, 3]),
                   smoothing=st.sampled_from([0.0, 0.1, 0.5]),
                   ignore_index=st.sampled_from([ops.IGNORE_INDEX, -1]),
                   ignored=st.integers(0, 12)),
        edge_cases=[
            ("label smoothing 0.1 and one ignored row",
             dict(b=2, t=3, v=4, rank=3, smoothing=0.1, ignore_index=-100, ignored=1)),
            ("every target ignored",
             dict(b=2, t=2, v=3, rank=3, smoothing=0.1, ignore_index=-100, ignored=12)),
            ("one row", dict(b=1, t=1, v=3, rank=2, smoothing=0.0, ignore_index=-100,
                             ignored=0)),
        ],
        hints={"dlogits": "Backward: dz_n = dloss w_n (p_n - q_n), where w_n = 1/N_counted on "
                          "the counted rows and 0 on ignored ones (0 everywhere if none "
                          "counts), and q_n = (1 - eps) onehot(y_n) + eps / V: softmax's and "
                          "log's derivatives cancel into p - q."},
    )],
    mistakes=[
        Mistake("ignore_index targets counted in the mean", "dlogits",
                _with(counted_rows=False)),
        Mistake("label smoothing's uniform term forgotten", "dlogits", _with(uniform=False)),
        Mistake("the upstream dloss forgotten", "dlogits", _with(upstream=False)),
        Mistake("every target ignored: divided by zero", "dlogits", _with(guard=False)),
    ],
)
