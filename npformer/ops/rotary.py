r"""Rotary position embeddings (Su et al., 2021, RoFormer), in the half-split layout of
Hugging Face's Llama (``rotate_half``, ``apply_rotary_pos_emb``).

A query or key row x of width E (even) at position t is cut into pairs
$(x_i, x_{i + E/2})$, $i < E/2$, and pair i is turned by the angle $t\,\omega_i$ in its plane:
    $\omega_i = \Theta^{-2i/E}$         (the inverse frequencies, ``omega``; $\Theta$ = rope_theta)
    $x'_i = x_i \cos t\omega_i - x_{i+E/2} \sin t\omega_i$
    $x'_{i+E/2} = x_{i+E/2} \cos t\omega_i + x_i \sin t\omega_i$
With the tables $\cos$ and $\sin$ of width E, each angle written twice (columns i and
i + E/2), and $\mathrm{rotate\_half}([x_1, x_2]) = [-x_2, x_1]$ (halves of width E/2):
    $x' = x \odot \cos + \mathrm{rotate\_half}(x) \odot \sin$

Why the score depends only on the distance.  Write pair i of a row x as the complex
number $x^{\mathbb C}_i = x_i + \mathrm{i}\, x_{i+E/2}$; the rotation at position t is
$x^{\mathbb C}_i \mapsto x^{\mathbb C}_i e^{\mathrm{i} t \omega_i}$, and a real dot product of two
rows is $\mathrm{Re} \sum_i x^{\mathbb C}_i \overline{y^{\mathbb C}_i}$.  A query row at position t
and a key row at position s give
    $Q'_{t,:} \cdot K'_{s,:} = \mathrm{Re} \sum_i Q^{\mathbb C}_{t,i} e^{\mathrm{i} t \omega_i}\,
     \overline{K^{\mathbb C}_{s,i} e^{\mathrm{i} s \omega_i}}
     = \mathrm{Re} \sum_i Q^{\mathbb C}_{t,i} \overline{K^{\mathbb C}_{s,i}}\,
       e^{\mathrm{i} (t - s) \omega_i}$:
the positions enter only as $t - s$.  (In matrices: $\mathcal R_t \mathcal R_s^\top =
\mathcal R_{t - s}$, each $\mathcal R$ orthogonal.)  Attention scores so see relative
positions, whatever the offset: a left-padded row (positions starting later) or a KV
cache (positions continuing) rotates each query and key by its own position and the
scores are those of the unpadded, uncached sequence.

Backward.  The forward is linear in the row x: $x' = x\,\mathcal R_t$ with
$\mathcal R_t = \mathrm{diag}(\cos) + \mathcal H\, \mathrm{diag}(\sin)$, where $\mathcal H$ is
the matrix of rotate_half, $\mathrm{rotate\_half}(x) = x \mathcal H$
($\mathcal H = \begin{pmatrix} 0 & I \\ -I & 0 \end{pmatrix}$, so
$\mathcal H^\top = -\mathcal H$).  Then
    $\bar x = \bar x' \mathcal R_t^\top
     = \cos \odot \bar x' - \mathrm{rotate\_half}(\sin \odot \bar x')$.
Because the two halves of the sine table are equal, $\mathrm{rotate\_half}(\sin \odot v)
= \sin \odot \mathrm{rotate\_half}(v)$, and the backward is
    $\bar x = \bar x' \odot \cos + \mathrm{rotate\_half}(\bar x') \odot (-\sin)$:
the rotation by the negative angle.  That is the rotation's orthogonality: each pair,
the row $(x_i, x_{i+E/2})$, is multiplied by the 2x2 rotation
$\begin{pmatrix} \cos t\omega_i & \sin t\omega_i \\ -\sin t\omega_i & \cos t\omega_i \end{pmatrix}$,
whose transpose is its inverse, the turn by $-t\omega_i$.  (The code computes the product
with $\mathcal R_t^\top$ itself, which is also right for tables whose halves differ; its
comment writes it R^T dy.)

The ``llama3`` scaling of ``rope_scaling`` (Llama 3.1 and 3.2; ``_compute_llama3_parameters``
of transformers' modeling_rope_utils) stretches the long wavelengths to a longer context.
With $\Lambda_i = 2\pi / \omega_i$ the wavelength of pair i, $\text{context}$ =
original_max_position_embeddings, $\text{stretch}$ = factor, $\text{low}$ = low_freq_factor and
$\text{high}$ = high_freq_factor:
    $\Lambda_i < \text{context} / \text{high}$ (high frequencies): $\omega_i$ unchanged;
    $\Lambda_i > \text{context} / \text{low}$ (low frequencies): $\omega_i / \text{stretch}$;
    in between: $(1 - \text{smooth}_i)\, \omega_i / \text{stretch}
    + \text{smooth}_i\, \omega_i$ with
    $\text{smooth}_i = (\text{context} / \Lambda_i - \text{low}) / (\text{high} - \text{low})$
    (``smooth``, which the code's comment calls mu), from $\omega_i / \text{stretch}$ to $\omega_i$.

The tables are computed in float64 (the inverse frequencies, the angles and their
cosines and sines) and rounded to the dtype asked for.  transformers computes them in
float32 whatever the model's dtype, so its float64 tables are float32-accurate only.
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
    with_cache,
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
    """x (B, H, T, E), cos and sin (T, E) or (B, T, E) -> y (B, H, T, E), cache (cos, sin)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(rotary_forward, x, cos, sin)
    cos, sin = over_heads(cos), over_heads(sin)  # (1, T, E) or (B, 1, T, E)
    y = x * cos + rotate_half(x) * sin  # (B, H, T, E)
    return with_cache(rotary_forward, y, (cos, sin))


@backward_op(rotary_forward)
def rotary_backward(dy: Array, cache: Any) -> Array:
    """dy (B, H, T, E) -> dx (B, H, T, E): the transposed rotation, the turn by -angle."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(rotary_backward, dy, cache)
    saved = opened(rotary_forward, cache)
    cos, sin = saved
    dx = dy * cos - rotate_half(dy * sin)  # (B, H, T, E) = R^T dy
    return dx
