r"""ReLU, fast: the textbook op (:mod:`npformer.ops.activations`) computed from its output.

    forward  $y = \max(x, 0)$
    backward $\bar x = \bar y \cdot [x > 0] = \bar y \cdot \text{sign}(y)$
             (the derivative is 1 where x > 0, else 0; y >= 0, and y > 0 exactly where
             x > 0, so sign(y) is that derivative: no mask needs storing, and no
             branch per element, which makes a ``where`` slow on random signs)

The cache is y, which the next linear layer keeps anyway, and the product is taken in
the buffer of sign(y): one new array, not two.  Every other activation is the
textbook one.
"""
from __future__ import annotations

from .. import backend
from ..ops import activations as _textbook
from ..ops._checks import check_cache, check_float, check_upstream


def relu_forward(x):
    """x (...) -> y (...), cache = y (which the next linear layer keeps anyway)."""
    check_float(x, "relu input")
    xp = backend.namespace_of(x)
    y = xp.maximum(x, 0.0)
    return y, y


def relu_backward(dy, cache):
    check_cache(cache, None, "relu_forward", "relu_backward")
    check_upstream(dy, tuple(cache.shape), "relu_backward", cache.dtype)
    xp = backend.namespace_of(dy)
    y = cache
    dx = xp.sign(y)  # [x > 0]
    dx *= dy  # in place: one new array, not two
    return dx


ACTIVATIONS = {**_textbook.ACTIVATIONS, "relu": (relu_forward, relu_backward)}


def activation(name: str):
    """(forward, backward) of the activation called ``name``, this tier's ReLU."""
    return _textbook.activation(name, ACTIVATIONS)
