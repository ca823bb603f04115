r"""Low-rank adaptation (Hu et al., 2021, "LoRA: Low-rank adaptation of large language
models"): a frozen affine map plus a trained update of rank $D_r$ (``r`` in the code).

With the frozen weight $W \in \mathbb{R}^{D_{in} \times D_{out}}$ and bias $\mathrm b$
(npformer's orientation, :mod:`.linear`), the adapter's down and up maps
$W^A \in \mathbb{R}^{D_{in} \times D_r}$ (``lora_a``) and $W^B \in \mathbb{R}^{D_r \times D_{out}}$
(``lora_b``), the scale $\text{scale} = \alpha_{\text{lora}} / D_r$ and the adapter's input
$x_{\text{drop}}$ = dropout(x) (``x_dropped``; the same x when there is no dropout):

Forward
    $x^A = x_{\text{drop}} W^A$         (..., D_r), ``u``: the input brought down to rank D_r
    $y = x W + \mathrm b + \text{scale}\; x^A W^B$       (..., D_out)

that is $y = x W + \mathrm b + \text{scale}\; x_{\text{drop}} W^A W^B$: with
$x_{\text{drop}} = x$ the map $x (W + \text{scale}\, W^A W^B) + \mathrm b$, W moved by a
matrix of rank at most D_r.
PyTorch (and PEFT) store the transposes, ``weight`` $= W^\top$ (D_out, D_in),
``lora_A.weight`` $= (W^A)^\top$ (D_r, D_in) and ``lora_B.weight`` $= (W^B)^\top$
(D_out, D_r), and write the same map with each stored matrix transposed back:
$y = x\, \text{weight}^\top + \mathrm b
+ \text{scale}\; x_{\text{drop}}\, \text{lora\_A.weight}^\top
\text{lora\_B.weight}^\top$.

Backward, for an upstream gradient $\bar y = \partial \mathcal L / \partial y$ (each term is
:mod:`.linear`'s rule applied to one product; the rows n of the flattened batch)
    $\bar x^A = \text{scale}\; \bar y (W^B)^\top$                  (..., D_r)   ``du``
    $\bar W^A = x_{\text{drop}}^\top \bar x^A = \sum_n x_{\text{drop},n}^\top \bar x^A_n$
                                                     (D_in, D_r)  ``da``
    $\bar W^B = \text{scale}\; (x^A)^\top \bar y = \text{scale} \sum_n (x^A_n)^\top \bar y_n$
                                                     (D_r, D_out)  ``db``
    $\bar x_{\text{drop}} = \bar x^A (W^A)^\top$                     (..., D_in)  ``dx_dropped``
    $\bar x = \bar y W^\top$                             (..., D_in)  ``dx``, through the frozen map

and the layer adds $\bar x_{\text{drop}}$, through dropout's backward, to $\bar x$.  W and b are
frozen: their gradients $x^\top \bar y$ and $\sum_n \bar y_n$ are not computed.  The backward
is five products: four through the rank ($\bar x^A$, $\bar W^A$, $\bar W^B$,
$\bar x_{\text{drop}}$: $2 N D_r (D_{in} + D_{out})$ multiply-adds for N rows) and one with W
($N D_{in} D_{out}$), against the full layer's two with W's shape ($\bar x$ and $\bar W$).
$W^B$ starts at zero, so the adapted model starts as the base model, and at the first
update $\bar W^A = x_{\text{drop}}^\top (\text{scale}\; \bar y (W^B)^\top) = 0$: $W^A$ then moves
only by its weight decay (AdamW's shrinking, or the L2 gradient $\lambda W^A$), and with no
decay only $W^B$ moves.
"""
from __future__ import annotations

from typing import Any

from .. import backend
from ..backend import Array
from .contracts import backward_op, door, forward_op, lora_inputs, opened, state, with_cache


@forward_op(lora_inputs)
def lora_forward(x: Array, x_dropped: Array, w: Array, b: Array | None, lora_a: Array,
                 lora_b: Array, scale: float) -> tuple[Array, Any]:
    """x (..., D_in), its dropout x_dropped (..., D_in), w (D_in, D_out), b (D_out,) or
    None, lora_a (D_in, r), lora_b (r, D_out), scale alpha / r -> y (..., D_out), cache."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(lora_forward, x, x_dropped, w, b, lora_a, lora_b, scale)
    u = x_dropped @ lora_a  # (..., D_in) @ (D_in, r) -> (..., r)
    y = x @ w + scale * (u @ lora_b)  # (..., D_out)
    if b is not None:
        y = y + b  # (..., D_out) + (D_out,)
    return with_cache(lora_forward, y, (x_dropped, u, w, lora_a, lora_b, scale))


@backward_op(lora_forward)
def lora_backward(dy: Array, cache: Any) -> tuple[Array, Array, Array, Array]:
    """dy (..., D_out) -> dx (..., D_in) through W, dx_dropped (..., D_in) through the
    adapter, dA (D_in, r), dB (r, D_out)."""
    if not state.trusted:  # a call from outside a door: its contract, then this op trusted
        return door(lora_backward, dy, cache)
    saved = opened(lora_forward, cache)
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
