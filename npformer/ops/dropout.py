r"""Inverted dropout.  The derivation: docs/derivations.md §5.

Training
    draw $m_i \sim \text{Bernoulli}(1 - p)$ once per element, then
    forward  $y = x \odot m / (1 - p)$
    backward $\bar x = \bar y \odot m / (1 - p)$
Evaluation
    $y = x$ and $\bar x = \bar y$.

The mask comes from the backend's seeded generator (:func:`npformer.backend.seed`),
so a run repeats exactly.
"""
from __future__ import annotations

from typing import Any

from .. import backend
from ..backend import Array
from .contracts import backward_op, door, dropout_inputs, forward_op, opened, state, with_saved


@forward_op(dropout_inputs)
def dropout_forward(x: Array, p: float, training: bool = True) -> tuple[Array, Any]:
    """x (...) -> y (...), saved = the scaled keep mask m / (1 - p), or None (identity)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(dropout_forward, x, p, training)
    if not training or p == 0.0:
        return with_saved(dropout_forward, x, None)
    xp = backend.namespace_of(x)
    keep = backend.random_uniform(x.shape, dtype=x.dtype) >= p  # P(keep) = 1 - p
    scaled_mask = xp.astype(keep, x.dtype) * (1.0 / (1.0 - p))
    return with_saved(dropout_forward, x * scaled_mask, scaled_mask)


@backward_op(dropout_forward)
def dropout_backward(dy: Array, saved: Array | None) -> Array:
    """dy (...) -> dx = dy m / (1 - p) (...), or dy (the identity: no mask)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(dropout_backward, dy, saved)
    scaled_mask = opened(dropout_forward, saved)
    return dy if scaled_mask is None else dy * scaled_mask
