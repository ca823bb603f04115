"""Scaled dot-product attention: out = softmax(Q K^T / sqrt(E) + M) V."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from exercises.check import Case, Exercise, Mistake, Part
from exercises.course._draw import normal
from npformer import ops

MASKS = ["none", "padding", "causal", "random"]


def make(rng, b, h, t, s, e, f, mask):
    if mask == "causal":
        s = t + s - 1  # a causal mask needs S >= T (S > T: a cached prefix)
    q, k, v = normal(rng, b, h, t, e), normal(rng, b, h, s, e), normal(rng, b, h, s, f)
    if mask == "none":
        m = None
    elif mask == "padding":  # (B, 1, 1, S); a sequence with no valid key at all
        valid = rng.integers(0, s + 1, size=b)
        valid[rng.integers(b)] = 0
        m = (np.arange(s)[None, :] < valid[:, None])[:, None, None, :]
    elif mask == "causal":
        m = np.tril(np.ones((t, s), bool), k=s - t)
    else:  # (B, 1, T, S) with a fully masked query row
        m = rng.random((b, 1, t, s)) < 0.6
        m[..., rng.integers(t), :] = False
    return Case([q, k, v, m])


def _mT(a):
    return np.swapaxes(a, -1, -2)


def _with(scale=True, dv_of=None, dk_of=None, rows=-1):
    def backward(dout, saved):
        q, k, v, p = saved
        alpha = 1.0 / math.sqrt(q.shape[-1])
        dv = dv_of(p, dout) if dv_of else _mT(p) @ dout
        dp = dout @ _mT(v)
        ds = p * (dp - (dp * p).sum(axis=rows, keepdims=True))
        dq = ds @ k * (alpha if scale else 1.0)
        dk = dk_of(ds, q) * alpha if dk_of else _mT(ds) @ q * alpha
        return dq, dk, dv
    return backward


def _dv_untransposed(p, dout):
    dv = p @ dout
    return dv


def _dk_untransposed(ds, q):
    dk = ds @ q
    return dk


EXERCISE = Exercise(
    name="attention", file="attention.py", section="Scaled dot-product attention",
    parts=[Part(
        forward="attention_forward", backward="attention_backward",
        textbook=(ops.attention_forward, ops.attention_backward),
        grads=("dq", "dk", "dv"), wrt=(0, 1, 2), make=make,
        sizes=dict(b=st.integers(1, 2), h=st.integers(1, 3), t=st.integers(1, 4),
                   s=st.integers(1, 4), e=st.integers(1, 4), f=st.integers(1, 3),
                   mask=st.sampled_from(MASKS)),
        edge_cases=[
            ("a fully masked query row", dict(b=2, h=2, t=3, s=4, e=2, f=3, mask="random")),
            ("T != S, no mask", dict(b=1, h=2, t=2, s=3, e=4, f=2, mask="none")),
            ("one position", dict(b=1, h=1, t=1, s=1, e=3, f=2, mask="none")),
            ("causal, with a cached prefix", dict(b=2, h=1, t=3, s=2, e=2, f=2, mask="causal")),
        ],
        hints={
            "dv": "Backward: out = P V, so dV = P^T dO, (S, T) @ (T, F).",
            "dq": "Backward: dP = dO V^T, then softmax's backward along the keys, "
                  "dA = P (dP - sum(dP P)), then dQ = alpha dA K with alpha = 1/sqrt(E): "
                  "the scale of the forward's scores comes back.",
            "dk": "Backward: dK = alpha dA^T Q, (S, T) @ (T, E), with dA and "
                  "alpha = 1/sqrt(E) as for dQ (dA: softmax's backward of dP = dO V^T "
                  "along the keys, the last axis).",
        },
    )],
    mistakes=[
        Mistake("the scale 1/sqrt(E) left out of dQ", "dq", _with(scale=False)),
        Mistake("dV = P dO, the transpose missing", "dv", _with(dv_of=_dv_untransposed)),
        Mistake("dK = dA Q, the transpose missing", "dk", _with(dk_of=_dk_untransposed)),
        Mistake("softmax's sum over the queries, not the keys", "dk", _with(rows=-2)),
    ],
)
