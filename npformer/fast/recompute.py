"""Outputs computed again from a forward's saved values, for a next layer that did not keep them.

A fast block keeps no copy of a layer norm's or an activation's output: the layer after
it (a linear map, the feed-forward's second linear) keeps no input (``keep_input=False``)
and is handed the output again in its backward, recomputed here from the saved values the norm
or the activation keeps for its own backward anyway.  Each function runs the forward's
own statement on those saved values, so the numbers are the forward's, bit for bit.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..backend import Array
from ..ops.contracts import activation_choice, checked_op, door, state
from .activations import gelu_forward


def layernorm_output(values: Any, beta: Array) -> Array:
    """The layer norm's y = gamma x_hat + beta, from its saved values (x_hat, r, gamma) and beta."""
    x_hat, _, gamma = values
    return x_hat * gamma + beta  # (..., D)


def _relu_output(y: Array) -> Array:
    """The fast ReLU keeps its output y."""
    return y


def _gelu_output(x: Array) -> Array:
    """The fast GELU keeps x: y = x Phi(x), by the forward itself (one compiled pass)."""
    y, _ = gelu_forward.unchecked(x)
    return y


def _gelu_tanh_output(values: Any) -> Array:
    """The tanh GELU keeps (x, t): y = x (1 + t) / 2, as its forward computes it."""
    x, t = values
    return 0.5 * x * (1.0 + t)


OUTPUTS = {"relu": _relu_output, "gelu": _gelu_output, "gelu_tanh": _gelu_tanh_output}


@checked_op(activation_choice)
def activation_output(name: str) -> Callable[[Any], Array]:
    """The function ``values -> y`` of the fast activation called ``name``."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(activation_output, name)
    return OUTPUTS[name]
