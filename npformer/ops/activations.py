r"""Element-wise non-linearities of the position-wise feed-forward network.

ReLU
    forward  $y = \max(x, 0)$
    backward $\bar x = \bar y \cdot [x > 0] = \bar y \cdot \text{sign}(y)$
             (the derivative is 1 where x > 0, else 0; y >= 0, and y > 0 exactly where
             x > 0, so sign(y) is that derivative: no mask needs storing, and no
             branch per element, which makes a ``where`` slow on random signs)

GELU, tanh approximation (GPT-2, ``torch.nn.GELU(approximate="tanh")``)
    forward  $u = c\,(x + a x^3)$, $t = \tanh u$, $y = \tfrac12 x (1 + t)$,
             with $c = \sqrt{2/\pi}$ and $a = 0.044715$
    backward by the product and chain rules,
             $\frac{dy}{dx} = \tfrac12 (1 + t) + \tfrac12 x\,(1 - t^2)\,c\,(1 + 3 a x^2)$,
             since $\frac{dt}{du} = 1 - t^2$ and $\frac{du}{dx} = c (1 + 3 a x^2)$;
             $\bar x = \bar y \cdot \frac{dy}{dx}$.
"""
from __future__ import annotations

import math

from .. import backend

GELU_C = math.sqrt(2.0 / math.pi)  # Python floats keep float32 arrays float32
GELU_A = 0.044715


def relu_forward(x):
    """x (...) -> y (...), cache = y (which the next linear layer keeps anyway)."""
    xp = backend.namespace_of(x)
    y = xp.maximum(x, 0.0)
    return y, y


def relu_backward(dy, cache):
    xp = backend.namespace_of(dy)
    y = cache
    dx = xp.sign(y)  # [x > 0]
    dx *= dy  # in place: one new array, not two
    return dx


def gelu_forward(x):
    """x (...) -> y (...), cache (x, t) with t = tanh(c (x + a x^3))."""
    xp = backend.namespace_of(x)
    u = GELU_C * (x + GELU_A * x * x * x)
    t = xp.tanh(u)
    y = 0.5 * x * (1.0 + t)
    return y, (x, t)


def gelu_backward(dy, cache):
    x, t = cache
    dy_dx = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_A * x * x)
    return dy * dy_dx


ACTIVATIONS = {
    "relu": (relu_forward, relu_backward),
    "gelu": (gelu_forward, gelu_backward),
}


def activation(name: str):
    """(forward, backward) of the activation called ``name`` ("relu" or "gelu")."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(
            f"unknown activation {name!r}; choose one of {sorted(ACTIVATIONS)}"
        ) from None
