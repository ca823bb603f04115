r"""Rotary position embeddings (Su et al., 2021, RoFormer), in the half-split layout of
Hugging Face's Llama (``rotate_half``, ``apply_rotary_pos_emb``).  The derivation (why
the scores see only the distance t - s, the backward, the llama3 scaling):
docs/derivations.md §12.

Shapes: x (B, H, T, E), E even; positions (T,) or (B, T); cos, sin (T, E) or (B, T, E).

Tables (:func:`rotary_table`, in float64, rounded to the dtype asked for):
    $\omega_i = \Theta^{-2i/E}$, $i < E/2$        ``omega`` (E/2,), $\Theta$ = rope_theta
    angle $= t\,\omega_i$, written twice (columns i and i + E/2)       (..., T, E)
llama3 scaling (:func:`llama3_frequencies`), with $\Lambda_i = 2\pi / \omega_i$,
context = original_max_position_embeddings, stretch = factor, low, high = the freq factors:
    $\omega_i$ where $\Lambda_i < \text{context}/\text{high}$; $\omega_i / \text{stretch}$
    where $\Lambda_i > \text{context}/\text{low}$; between,
    $(1 - \mu_i)\,\omega_i / \text{stretch} + \mu_i\,\omega_i$ with
    $\mu_i = (\text{context}/\Lambda_i - \text{low}) / (\text{high} - \text{low})$  ``smooth``

Forward, with $\mathrm{rotate\_half}([x_1, x_2]) = [-x_2, x_1]$:
    $y = x \odot \cos + \mathrm{rotate\_half}(x) \odot \sin$
Backward, the transposed rotation (the turn by the negative angle):
    $\bar x = \bar y \odot \cos - \mathrm{rotate\_half}(\bar y \odot \sin)$
"""
from __future__ import annotations

import math
from typing import Any

from .. import backend
from ..backend import Array
from .contracts import (
    backward_op,
    checked_op,
    door,
    forward_op,
    opened,
    rotary_inputs,
    rotary_table_inputs,
    state,
    with_saved,
)

THETA = 10000.0  # LlamaConfig's rope_theta default (Llama 3: 500000.0)


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None = None,
                        like: Array | None = None) -> Array:
    """omega_i = theta^(-2i/E) for i < E/2 (E = head_dim), float64, llama3-scaled when
    ``scaling`` is a llama3 ``rope_scaling`` -> (E/2,), on ``like``'s library and device."""
    xp = backend.xp() if like is None else backend.namespace_of(like)
    dev = backend.device() if like is None else backend.device_of(like)
    two_i = xp.astype(xp.arange(0, head_dim, 2, device=dev), xp.float64)  # (E/2,)
    omega = 1.0 / (theta ** (two_i / head_dim))  # (E/2,)
    if scaling is None:
        return omega
    return llama3_frequencies(omega, scaling)


def llama3_frequencies(omega: Array, scaling: dict) -> Array:
    """The llama3 rescaling of the inverse frequencies omega (E/2,), step by step as
    transformers' ``_compute_llama3_parameters``."""
    xp = backend.namespace_of(omega)
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelength = 2.0 * math.pi / omega  # (E/2,)
    low_freq_wavelength, high_freq_wavelength = context / low, context / high
    scaled = xp.where(wavelength > low_freq_wavelength, omega / factor, omega)
    smooth = (context / wavelength - low) / (high - low)  # mu, from 0 to 1 across the band
    smoothed = (1.0 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return xp.where(medium, smoothed, scaled)


@checked_op(rotary_table_inputs)
def rotary_table(positions: Array, head_dim: int, theta: float = THETA,
                 scaling: dict | None = None, dtype: Any = None) -> tuple[Array, Array]:
    """positions (..., T) integers -> cos, sin (..., T, E) (E = head_dim), each angle
    p omega_i in columns i and i + E/2; ``dtype``: default the backend's float.

    positions (T,) give tables (T, E) shared by the batch; (B, T) one table per sequence
    (left padding, a KV cache's offset)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(rotary_table, positions, head_dim, theta, scaling, dtype)
    xp = backend.namespace_of(positions)
    dtype = dtype or backend.default_float()
    omega = inverse_frequencies(head_dim, theta, scaling, like=positions)  # (E/2,)
    angle = xp.astype(positions, xp.float64)[..., None] * omega  # (..., T, E/2)
    angle = xp.concat([angle, angle], axis=-1)  # (..., T, E)
    return xp.astype(xp.cos(angle), dtype), xp.astype(xp.sin(angle), dtype)


def rotate_half(x: Array) -> Array:
    """[x1, x2] -> [-x2, x1], the halves of the last axis: (..., E) -> (..., E)."""
    xp = backend.namespace_of(x)
    half = x.shape[-1] // 2
    return xp.concat([-x[..., half:], x[..., :half]], axis=-1)


def over_heads(table: Array) -> Array:
    """A table (T, E) or (B, T, E) as (1, T, E) or (B, 1, T, E): one table for every head."""
    xp = backend.namespace_of(table)
    return xp.expand_dims(table, axis=-3)


@forward_op(rotary_inputs)
def rotary_forward(x: Array, cos: Array, sin: Array) -> tuple[Array, Any]:
    """x (B, H, T, E), cos and sin (T, E) or (B, T, E) -> y (B, H, T, E), saved (cos, sin)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(rotary_forward, x, cos, sin)
    cos, sin = over_heads(cos), over_heads(sin)  # (1, T, E) or (B, 1, T, E)
    y = x * cos + rotate_half(x) * sin  # (B, H, T, E)
    return with_saved(rotary_forward, y, (cos, sin))


@backward_op(rotary_forward)
def rotary_backward(dy: Array, saved: Any) -> Array:
    """dy (B, H, T, E) -> dx (B, H, T, E): the transposed rotation, the turn by -angle."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(rotary_backward, dy, saved)
    values = opened(rotary_forward, saved)
    cos, sin = values
    dx = dy * cos - rotate_half(dy * sin)  # (B, H, T, E) = R^T dy
    return dx
