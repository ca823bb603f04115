"""Outputs computed again from a forward's saved values, for a next layer that did not
keep them (``keep_input=False``; docs/derivations.md §21): each function runs the
forward's own statement on the saved values the norm or activation keeps anyway, so the
numbers are the forward's, bit for bit.
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
