r"""Low-rank adaptation (Hu et al., 2021, "LoRA: Low-rank adaptation of large language
models"): a frozen affine map plus a trained update of rank r.

With the frozen weight $W \in \mathbb{R}^{D_{in} \times D_{out}}$ and bias $b$ (npformer's
orientation, :mod:`.linear`), the adapter's $A \in \mathbb{R}^{D_{in} \times r}$ and
$B \in \mathbb{R}^{r \times D_{out}}$, the scale $s = \alpha / r$ and the adapter's input
$\tilde x$ = dropout(x) (the same x when there is no dropout):

Forward
    $u = \tilde x A$                               (..., r): the input brought down to rank r
    $y = x W + b + s\, u B$                         (..., D_out)

that is $y = x W + b + s\, \tilde x A B$: with $\tilde x = x$ the map $x (W + s A B) + b$, W
moved by a matrix of rank at most r.  PyTorch (and PEFT) store the transposes,
``lora_A.weight`` $= A^\top$ (r, D_in) and ``lora_B.weight`` $= B^\top$ (D_out, r), and
write the same map $y = x W^\top + b + s\, \tilde x A^\top B^\top$ in their orientation.

Backward, for an upstream gradient $\bar y = \partial L / \partial y$ (each term is
:mod:`.linear`'s rule applied to one product)
    $\bar u = s\, \bar y B^\top$                    (..., r)     (u feeds y through s B)
    $\bar A = \tilde x^\top \bar u = \sum_n \tilde x_n^\top \bar u_n$    (D_in, r)
    $\bar B = s\, u^\top \bar y = s \sum_n u_n^\top \bar y_n$          (r, D_out)
    $\bar{\tilde x} = \bar u A^\top$                 (..., D_in)  (the adapter's input)
    $\bar x = \bar y W^\top$                         (..., D_in)  (through the frozen map)

and the layer adds $\bar{\tilde x}$, through dropout's backward, to $\bar x$.  W and b are
frozen: their gradients $x^\top \bar y$ and $\sum_n \bar y_n$ are not computed, so the
backward costs the two thin products of the adapter and one product with W, against
the full layer's three.  B starts at zero, so at the first update $\bar A = \tilde x^\top
(s \bar y B^\top) = 0$ and only B moves: the adapted model starts as the base model.
"""
from __future__ import annotations

from typing import Any

from .. import backend
from ..backend import Array
from .contracts import backward_op, forward_op, lora_inputs


@forward_op(lora_inputs)
def lora_forward(x: Array, x_dropped: Array, w: Array, b: Array | None, lora_a: Array,
                 lora_b: Array, scale: float) -> tuple[Array, Any]:
    """x (..., D_in), its dropout x_dropped (..., D_in), w (D_in, D_out), b (D_out,) or
    None, lora_a (D_in, r), lora_b (r, D_out), scale alpha / r -> y (..., D_out), cache."""
    u = x_dropped @ lora_a  # (..., D_in) @ (D_in, r) -> (..., r)
    y = x @ w + scale * (u @ lora_b)  # (..., D_out)
    if b is not None:
        y = y + b  # (..., D_out) + (D_out,)
    return y, (x_dropped, u, w, lora_a, lora_b, scale)


@backward_op(lora_forward)
def lora_backward(dy: Array, saved: Any) -> tuple[Array, Array, Array, Array]:
    """dy (..., D_out) -> dx (..., D_in) through W, dx_dropped (..., D_in) through the
    adapter, dA (D_in, r), dB (r, D_out)."""
    x_dropped, u, w, lora_a, lora_b, scale = saved
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
