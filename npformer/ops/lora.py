r"""Low-rank adaptation (Hu et al., 2021, "LoRA: Low-rank adaptation of large language
models"): a frozen affine map plus a trained update of rank $D_r$ (``r`` in the code).
The derivation: LoRA (§2) of docs/derivations.md.

Shapes: x, $x_{\text{drop}}$ = dropout(x) (``x_dropped``) (..., D_in); the frozen
$W$ (D_in, D_out) and b (D_out,); $W^A$ (``lora_a``, D_in, D_r); $W^B$ (``lora_b``,
D_r, D_out); scale $= \alpha_{\text{lora}} / D_r$.

Forward
    $x^A = x_{\text{drop}} W^A$                          (..., D_r)    ``u``
    $y = x W + \mathrm b + \text{scale}\; x^A W^B$        (..., D_out)

Backward (W and b are frozen: no gradient for them)
    $\bar x^A = \text{scale}\; \bar y (W^B)^\top$         (..., D_r)    ``du``
    $\bar W^A = x_{\text{drop}}^\top \bar x^A$            (D_in, D_r)   ``da``
    $\bar W^B = \text{scale}\; (x^A)^\top \bar y$         (D_r, D_out)  ``db``
    $\bar x_{\text{drop}} = \bar x^A (W^A)^\top$          (..., D_in)   ``dx_dropped``
    $\bar x = \bar y W^\top$                              (..., D_in)   ``dx``
"""
from __future__ import annotations

from typing import Any

from .. import backend
from ..backend import Array
from .contracts import backward_op, door, forward_op, lora_inputs, opened, state, with_saved


@forward_op(lora_inputs)
def lora_forward(x: Array, x_dropped: Array, w: Array, b: Array | None, lora_a: Array,
                 lora_b: Array, scale: float) -> tuple[Array, Any]:
    """x (..., D_in), its dropout x_dropped (..., D_in), w (D_in, D_out), b (D_out,) or
    None, lora_a (D_in, r), lora_b (r, D_out), scale alpha / r -> y (..., D_out), saved."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(lora_forward, x, x_dropped, w, b, lora_a, lora_b, scale)
    u = x_dropped @ lora_a  # (..., D_in) @ (D_in, r) -> (..., r)
    y = x @ w + scale * (u @ lora_b)  # (..., D_out)
    if b is not None:
        y = y + b  # (..., D_out) + (D_out,)
    return with_saved(lora_forward, y, (x_dropped, u, w, lora_a, lora_b, scale))


@backward_op(lora_forward)
def lora_backward(dy: Array, saved: Any) -> tuple[Array, Array, Array, Array]:
    """dy (..., D_out) -> dx (..., D_in) through W, dx_dropped (..., D_in) through the
    adapter, dA (D_in, r), dB (r, D_out)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(lora_backward, dy, saved)
    values = opened(lora_forward, saved)
    x_dropped, u, w, lora_a, lora_b, scale = values
    xp = backend.namespace_of(dy, w)
    d_in, r = lora_a.shape
    du = scale * (dy @ lora_b.mT)  # (..., D_out) @ (D_out, r) -> (..., r)
    x_rows = xp.reshape(x_dropped, (-1, d_in))  # (N, D_in)
    du_rows = xp.reshape(du, (-1, r))  # (N, r)
    u_rows = xp.reshape(u, (-1, r))  # (N, r)
    dy_rows = xp.reshape(dy, (-1, w.shape[1]))  # (N, D_out)
    da = x_rows.mT @ du_rows  # (D_in, N) @ (N, r)
    db = scale * (u_rows.mT @ dy_rows)  # (r, N) @ (N, D_out)
    dx_dropped = du @ lora_a.mT  # (..., r) @ (r, D_in)
    dx = dy @ w.mT  # (..., D_out) @ (D_out, D_in)
    return dx, dx_dropped, da, db
