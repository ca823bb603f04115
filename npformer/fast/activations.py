r"""Activations, fast: ReLU computed from its output, and the exact GELU's erfc in one
compiled pass.

ReLU, the textbook op (:mod:`npformer.ops.activations`) computed from its output:

    forward  $y = \max(x, 0)$
    backward $\bar x = \bar y \cdot [x > 0] = \bar y \cdot \text{sign}(y)$
             (the derivative is 1 where x > 0, else 0; y >= 0, and y > 0 exactly where
             x > 0, so sign(y) is that derivative: no mask needs storing, and no
             branch per element, which makes a ``where`` slow on random signs)

The cache is y, which the next linear layer keeps anyway, and the product is taken in
the buffer of sign(y): one new array, not two.

GELU (exact): the same $y = x \Phi(x)$, $\Phi(x) = \text{erfc}(-x/\sqrt 2)/2$ and the
same backward, each one compiled pass over the array, with only x cached (the backward
computes Phi(x) again, as the forward did, in the same pass as its product): on
NumPy arrays the numba kernels of :mod:`.kernels` (a branch-free, vectorized erfc; the
backward fused); without numba, and on CuPy, erfc from the array library's own special
functions (SciPy's, ``cupyx.scipy.special``'s), one pass for erfc instead of the
dozens of the textbook's array-API rational approximation (all accurate to a few
ulps).  Elsewhere (the strict namespace) it is the textbook op.

GELU (tanh form, GPT-2's): the textbook's statements, $y = x (1 + t)/2$ with
$t = \tanh(c (x + a x^3))$, and its cache (x, t), in one compiled pass each way on
NumPy arrays (the textbook's ten array passes elsewhere).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .. import backend
from ..backend import Array
from ..ops import activations as _textbook
from ..validation import activation_choice, activation_input, backward_op, checked_op, forward_op
from . import kernels


@forward_op(activation_input("relu"))
def relu_forward(x: Array) -> tuple[Array, Any]:
    """x (...) -> y (...), cache = y (which the next linear layer keeps anyway)."""
    xp = backend.namespace_of(x)
    y = xp.maximum(x, 0.0)
    return y, y


@backward_op(relu_forward)
def relu_backward(dy: Array, y: Array) -> Array:
    """dy (...) -> dx = dy sign(y) (...)."""
    xp = backend.namespace_of(dy)
    dx = xp.sign(y)  # [x > 0]
    dx *= dy  # in place: one new array, not two
    return dx


def _special_functions(x):
    """The array library's scipy.special (SciPy for NumPy arrays, cupyx.scipy.special
    for CuPy arrays), or None (no such library for this namespace, or not installed)."""
    library = type(x).__module__.split(".")[0]
    name = {"numpy": "scipy.special", "cupy": "cupyx.scipy.special"}.get(library)
    try:
        return importlib.import_module(name) if name else None
    except ImportError:
        return None


def _phi_cdf(x: Array, special) -> Array:
    """Phi(x) = erfc(-x / sqrt 2) / 2 from the array library's erfc, in x's dtype."""
    phi_cdf = special.erfc(-_textbook.SQRT1_2 * x)     # 2 Phi(x), in x's dtype
    phi_cdf *= 0.5                                      # Phi(x), the normal CDF, in place
    return phi_cdf


@forward_op(activation_input("gelu"))
def gelu_forward(x: Array) -> tuple[Array, Any]:
    """x (...) -> y = x Phi(x) (...), cache x: the textbook op, erfc compiled.  Only x is
    kept (the textbook keeps (x, Phi(x))): the backward recomputes Phi(x) in its own pass,
    so a GELU holds one hidden-width array for its backward instead of two."""
    if kernels.usable(x):
        return kernels.gelu_forward(x), x               # one compiled pass: y
    special = _special_functions(x)
    if special is None:
        y, _ = _textbook.gelu_forward.unchecked(x)
        return y, x
    return x * _phi_cdf(x, special), x


@backward_op(gelu_forward)
def gelu_backward(dy: Array, x: Array) -> Array:
    """dy (...) -> dx = dy (Phi(x) + x phi(x)): the textbook op, Phi(x) recomputed and
    fused into one compiled pass (elsewhere the textbook statements, on (x, Phi(x)) with
    Phi(x) computed again as the forward computed it)."""
    if kernels.usable(dy, x):
        return kernels.gelu_backward(dy, x)
    special = _special_functions(x)
    if special is None:
        _, saved = _textbook.gelu_forward.unchecked(x)
    else:
        saved = (x, _phi_cdf(x, special))
    return _textbook.gelu_backward.unchecked(dy, saved)

@forward_op(activation_input("gelu_tanh"))
def gelu_tanh_forward(x: Array) -> tuple[Array, Any]:
    """x (...) -> y (...), cache (x, t), t = tanh(c (x + a x^3)): the textbook op, one
    compiled pass on NumPy arrays (:func:`.kernels.gelu_tanh_forward`; its statements
    elsewhere)."""
    if kernels.usable(x):
        y, t = kernels.gelu_tanh_forward(x)
        return y, (x, t)
    return _textbook.gelu_tanh_forward.unchecked(x)


@backward_op(gelu_tanh_forward)
def gelu_tanh_backward(dy: Array, saved: Any) -> Array:
    """dy (...) -> dx (...): the textbook op, one compiled pass on NumPy arrays."""
    x, t = saved
    if kernels.usable(dy, x, t):
        return kernels.gelu_tanh_backward(dy, x, t)
    return _textbook.gelu_tanh_backward.unchecked(dy, saved)


ACTIVATIONS = {**_textbook.ACTIVATIONS, "relu": (relu_forward, relu_backward),
               "gelu": (gelu_forward, gelu_backward),
               "gelu_tanh": (gelu_tanh_forward, gelu_tanh_backward)}


@checked_op(activation_choice)
def activation(name: str) -> tuple[Callable, Callable]:
    """(forward, backward) of the activation called ``name``, this tier's ReLU."""
    return ACTIVATIONS[name]
