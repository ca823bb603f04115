r"""Inverted dropout.

Training
    draw $m_i \sim \text{Bernoulli}(1 - p)$ once per element, then
    forward  $y = x \odot m / (1 - p)$       (scaled so that $E[y] = x$)
    backward $\bar x = \bar y \odot m / (1 - p)$   (the same mask: y is linear in x)
Evaluation
    $y = x$ and $\bar x = \bar y$.

The mask comes from the backend's seeded generator (:func:`npformer.backend.seed`),
so a run repeats exactly.
"""
from __future__ import annotations

import numbers

from .. import backend
from ._checks import check_float, check_upstream


def dropout_forward(x, p: float, training: bool = True):
    """x (...) -> y (...), cache = the scaled keep mask m / (1 - p), or None (identity)."""
    check_float(x, "dropout input")
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"dropout probability must be a number in [0, 1), got {p!r}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x, None
    xp = backend.namespace_of(x)
    keep = backend.random_uniform(x.shape, dtype=x.dtype) >= p  # P(keep) = 1 - p
    scaled_mask = xp.astype(keep, x.dtype) * (1.0 / (1.0 - p))
    return x * scaled_mask, scaled_mask


def dropout_backward(dy, cache):
    if cache is None:  # the identity: any floating-point gradient passes through
        check_float(dy, "the upstream gradient of dropout_backward")
    else:  # the cache is the scaled mask, of the input's shape and dtype
        check_upstream(dy, tuple(cache.shape), "dropout_backward", cache.dtype)
    scaled_mask = cache
    return dy if scaled_mask is None else dy * scaled_mask
