"""The later exercises' shared pieces (multi-head and grouped attention, the blocks, the
model, LoRA, Adam): reference backwards written against the exercise files' caches
(tuples), from which the specs build the wrong backwards learners write, and small
adapters that turn npformer's layers into (forward, backward) pairs.

These are the op exercises' answers: a reader who wants to find them out alone should
not read this file."""
from __future__ import annotations

import math

import numpy as np

from npformer import backend


def _built(make_layer):
    """A layer built without drawing from npformer's generator (its seeded dropout masks
    must be the exercise's): the generator's state restored after the initial weights."""
    state = backend.get_rng_state()
    layer = make_layer()
    backend.set_rng_state(state)
    return layer


def mT(a):
    return np.swapaxes(a, -1, -2)


# --------------------------------------------------------------------------- the ops
def linear_bw(dy, saved):
    """The linear exercise's saved values (x, w) -> dx, dw, db."""
    x, w = saved
    rows, drows = x.reshape(-1, w.shape[0]), dy.reshape(-1, w.shape[1])
    return dy @ w.T, rows.T @ drows, drows.sum(0)


def split_bw(dy, num_heads):
    """split_heads' backward: merge."""
    b, h, t, e = dy.shape
    return dy.transpose(0, 2, 1, 3).reshape(b, t, h * e)


def merge_bw(dy, num_heads):
    """merge_heads' backward: split."""
    b, t, d = dy.shape
    return dy.reshape(b, t, num_heads, d // num_heads).transpose(0, 2, 1, 3)


def attention_bw(dout, saved, scale=True):
    """The attention exercise's saved values (q, k, v, p) -> dq, dk, dv."""
    q, k, v, p = saved
    alpha = 1.0 / math.sqrt(q.shape[-1]) if scale else 1.0
    dv = mT(p) @ dout
    dp = dout @ mT(v)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    return ds @ k * alpha, mT(ds) @ q * alpha, dv


def layernorm_bw(dy, saved):
    """The layer norm exercise's saved values (x_hat, r, gamma) -> dx, dgamma, dbeta."""
    x_hat, r, gamma = saved
    g = dy * gamma
    dx = r * (g - g.mean(-1, keepdims=True) - x_hat * (g * x_hat).mean(-1, keepdims=True))
    lead = tuple(range(dy.ndim - 1))
    return dx, (dy * x_hat).sum(lead), dy.sum(lead)


def relu_bw(dy, x):
    return dy * (x > 0)


def dropout_bw(dy, saved):
    if saved is None:
        return dy
    keep, p = saved
    return dy * keep / (1.0 - p)


# --------------------------------------------------------------------------- masks
def self_mask(rng, b, t, kind):
    """A boolean mask for self-attention over (B, H, T, T): none, padding (B, 1, 1, T)
    with one sequence fully padded, causal (T, T), or causal and padding."""
    if kind == "none":
        return None
    causal = np.tril(np.ones((t, t), bool))
    if kind == "causal":
        return causal
    valid = rng.integers(1, t + 1, size=b)
    valid[rng.integers(b)] = 0  # a sequence with no valid position: its rows are zeros
    padding = (np.arange(t)[None, :] < valid[:, None])[:, None, None, :]
    return padding if kind == "padding" else padding & causal
