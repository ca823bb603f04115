r"""Rotary positions, fast: the textbook op (:mod:`npformer.ops.rotary`) as one compiled
pass each way on NumPy arrays (docs/derivations.md §12; the kernels §19), each pair
$(x_i, x_{i+E/2})$ turned as it is read, the textbook's products in its order:
    $x'_i = x_i \cos_i - x_{i+E/2} \sin_i$,
    $x'_{i+E/2} = x_{i+E/2} \cos_{i+E/2} + x_i \sin_{i+E/2}$,
and back by $\mathcal R_t^\top$:
    $\bar x_i = \bar x'_i \cos_i + \bar x'_{i+E/2} \sin_{i+E/2}$,
    $\bar x_{i+E/2} = \bar x'_{i+E/2} \cos_{i+E/2} - \bar x'_i \sin_i$.
x arrives as a (B, T, H, E) view read as (B, H, T, E), through its strides.  Without numba,
or on other arrays (CuPy, the strict namespace), the textbook op.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import Array
from ..ops import rotary as _textbook
from ..ops.contracts import backward_op, door, forward_op, opened, rotary_inputs, state, with_saved
from .compiler import COMPILED, jit


def _takes(*arrays: Array) -> bool:
    """Whether the kernels take these arrays: numba present, NumPy float arrays of one
    dtype (any strides: the kernels index them)."""
    return COMPILED and all(type(a) is np.ndarray and a.dtype == arrays[0].dtype
                            and a.dtype in (np.float32, np.float64) for a in arrays)


def _batched(table: np.ndarray) -> np.ndarray:
    """A table (T, E) or (B, T, E) as (1 or B, T, E)."""
    return table[None] if table.ndim == 2 else table


@forward_op(rotary_inputs)
def rotary_forward(x: Array, cos: Array, sin: Array) -> tuple[Array, Any]:
    """x (B, H, T, E), cos and sin (T, E) or (B, T, E) -> y (B, H, T, E), saved (cos, sin)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(rotary_forward, x, cos, sin)
    if not _takes(x, cos, sin):
        return with_saved(rotary_forward, *_textbook.rotary_forward.unchecked(x, cos, sin))
    y = np.empty(x.shape, dtype=x.dtype)  # (B, H, T, E), C order
    _rotate(x, _batched(cos), _batched(sin), y)
    return with_saved(rotary_forward, y, (_textbook.over_heads(cos), _textbook.over_heads(sin)))


@backward_op(rotary_forward)
def rotary_backward(dy: Array, saved: Any) -> Array:
    """dy (B, H, T, E) -> dx (B, H, T, E): the transposed rotation, the turn by -angle."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(rotary_backward, dy, saved)
    values = opened(rotary_forward, saved)
    cos, sin = values  # (1, T, E) or (B, 1, T, E)
    if not _takes(dy, cos, sin):
        return _textbook.rotary_backward.unchecked(dy, values)
    dx = np.empty(dy.shape, dtype=dy.dtype)
    _rotate_back(dy, _batched(cos[..., 0, :, :]), _batched(sin[..., 0, :, :]), dx)
    return dx


# =========================================================================== the kernels
@jit
def _rotate(x, cos, sin, y):
    """x (B, H, T, E) any strides, cos and sin (1 or B, T, E) -> y (B, H, T, E): each pair
    (i, i + E/2) turned by its angle, the textbook's products in its order."""
    batch, heads, length, width = x.shape
    half = width // 2
    for b in range(batch):
        tb = b if cos.shape[0] > 1 else 0
        for h in range(heads):
            for t in range(length):
                for i in range(half):
                    first, second = x[b, h, t, i], x[b, h, t, i + half]
                    y[b, h, t, i] = first * cos[tb, t, i] - second * sin[tb, t, i]
                    y[b, h, t, i + half] = (second * cos[tb, t, i + half]
                                            + first * sin[tb, t, i + half])
    return None


@jit
def _rotate_back(dy, cos, sin, dx):
    """dy (B, H, T, E) any strides, cos and sin (1 or B, T, E) -> dx = R^T dy (B, H, T, E):
    dy cos - rotate_half(dy sin), in the textbook's order."""
    batch, heads, length, width = dy.shape
    half = width // 2
    for b in range(batch):
        tb = b if cos.shape[0] > 1 else 0
        for h in range(heads):
            for t in range(length):
                for i in range(half):
                    first, second = dy[b, h, t, i], dy[b, h, t, i + half]
                    dx[b, h, t, i] = first * cos[tb, t, i] + second * sin[tb, t, i + half]
                    dx[b, h, t, i + half] = (second * cos[tb, t, i + half]
                                             - first * sin[tb, t, i])
    return None
