r"""Multi-head attention (Vaswani et al., 2017, section 3.2.2).

    $\text{head}_h = \text{Attention}(X_q W^Q_h, X_{kv} W^K_h, X_{kv} W^V_h)$
    $\text{MHA} = \text{Concat}(\text{head}_1, \dots, \text{head}_H)\, W^O$

Shapes: B batch, T query positions, S key positions, D model width, H heads,
E per-head width.  The paper's narrow heads have E = D / H (the default);
Bloem's "wide" heads have E = D (pass ``head_dim=d_model``).  The projections
W^Q, W^K, W^V are (D, H*E) and W^O is (H*E, D); column block h of W^Q is head h.

Self-attention: ``forward(x, mask=mask)``; cross-attention:
``forward(x, context=memory, mask=mask)``, keys and values from ``memory``.
"""
from __future__ import annotations

from .. import backend, ops
from .layers import Linear, check_sequence_input
from .module import Module


def split_heads(x, num_heads: int):
    """(B, T, H*E) -> (B, H, T, E): column block h becomes head h."""
    xp = backend.namespace_of(x)
    batch, length, inner = x.shape
    x = xp.reshape(x, (batch, length, num_heads, inner // num_heads))  # (B, T, H, E)
    return xp.permute_dims(x, (0, 2, 1, 3))  # (B, H, T, E)


def merge_heads(x):
    """(B, H, T, E) -> (B, T, H*E), the inverse of :func:`split_heads`."""
    xp = backend.namespace_of(x)
    batch, heads, length, width = x.shape
    x = xp.permute_dims(x, (0, 2, 1, 3))  # (B, T, H, E)
    return xp.reshape(x, (batch, length, heads * width))  # (B, T, H*E)


def _same(x):
    return x


def _check_packed_input(x, width: int, packing) -> None:
    n = packing.index.shape[0]
    if x.ndim != 2 or x.shape[0] != n or x.shape[1] != width:
        raise ValueError(f"packed attention input must be (N, D) = ({n}, {width}), the valid "
                         f"positions of the batch, got shape {tuple(x.shape)}")


class MultiHeadAttention(Module):
    def __init__(self, d_model: int, num_heads: int, head_dim: int | None = None,
                 bias: bool = True):
        if num_heads < 1:
            raise ValueError(f"num_heads must be at least 1, got {num_heads}")
        if head_dim is None:
            if d_model % num_heads != 0:
                raise ValueError(
                    f"d_model {d_model} is not divisible by num_heads {num_heads}: "
                    "each head gets d_model / num_heads columns; choose a head count that "
                    "divides the width, or pass head_dim explicitly")
            head_dim = d_model // num_heads
        self.d_model, self.num_heads, self.head_dim = d_model, num_heads, head_dim
        inner = num_heads * head_dim
        self.q_proj = Linear(d_model, inner, bias)
        self.k_proj = Linear(d_model, inner, bias)
        self.v_proj = Linear(d_model, inner, bias)
        self.out_proj = Linear(inner, d_model, bias)
        self.keep_attention = False  # set True to keep the last probabilities, for plots
        self.last_attention = None  # (B, H, T, S) when keep_attention

    def forward(self, x, context=None, mask=None, packing=None):
        """x (B, T, D), context (B, S, D) or None (self-attention), mask bool
        broadcasting to (B, H, T, S), True = may attend -> (B, T, D).

        ``packing``: x holds just the valid positions of a padded batch, as rows (N, D)
        (see :class:`npformer.ops.Packing`); the projections run on those rows, attention
        on the unpacked (B, H, T, E), and the output is rows (N, D) again.  A context
        (cross-attention) stays (B, S, D).
        """
        is_self = context is None
        if packing is not None:
            _check_packed_input(x, self.d_model, packing)
        else:
            check_sequence_input(x, self.d_model, "attention input")
        batch = x.shape[0] if packing is None else packing.batch
        if not is_self:
            check_sequence_input(context, self.d_model, "attention context")
            if context.shape[0] != batch:
                raise ValueError(f"attention context has batch {context.shape[0]} but the "
                                 f"queries have batch {batch}")
        h = self.num_heads
        batched = packing.unpack if packing is not None else _same  # rows -> (B, T, ...)
        q = split_heads(batched(self.q_proj(x)), h)  # (B, T, H*E) -> (B, H, T, E)
        if is_self:
            k = split_heads(batched(self.k_proj(x)), h)  # (B, T, H*E) -> (B, H, T, E)
            v = split_heads(batched(self.v_proj(x)), h)
        else:
            k = split_heads(self.k_proj(context), h)  # (B, S, H*E) -> (B, H, S, E)
            v = split_heads(self.v_proj(context), h)
        heads, attn_cache = ops.attention_forward(q, k, v, mask)  # (B, H, T, E)
        merged = merge_heads(heads)  # (B, T, H*E)
        y = self.out_proj(packing.pack(merged) if packing is not None else merged)  # (.., D)
        self._save((attn_cache, is_self, packing))
        self.last_attention = ops.attention_weights(q, k, mask) if self.keep_attention else None
        return y

    def backward(self, dy):
        """dy (B, T, D) -> dx (B, T, D) for self-attention, (dx, dcontext) for cross.
        (Packed: dy and dx are rows (N, D); unpack and pack swap roles, each being the
        other's transpose.)"""
        attn_cache, is_self, packing = self._pop_saved()
        h = self.num_heads
        dmerged = self.out_proj.backward(dy)  # (B, T, H*E), or rows (N, H*E)
        if packing is not None:
            dmerged = packing.unpack(dmerged)  # the backward of pack
        dq, dk, dv = ops.attention_backward(split_heads(dmerged, h), attn_cache)
        rows = packing.pack if packing is not None else _same  # the backward of unpack
        dx = self.q_proj.backward(rows(merge_heads(dq)))  # (B, T, D) or (N, D)
        if not is_self:
            return dx, (self.k_proj.backward(merge_heads(dk))
                        + self.v_proj.backward(merge_heads(dv)))  # dcontext (B, S, D)
        dk_x = self.k_proj.backward(rows(merge_heads(dk)))
        return dx + dk_x + self.v_proj.backward(rows(merge_heads(dv)))  # x fed q, k and v

    def step(self, x, state: dict, context=None, mask=None):
        """Incremental inference (call under ``no_grad``): x (B, T_new, D) -> (B, T_new, D).

        Self-attention (context None): the keys and values of the new positions are
        appended to ``state["k"]``, ``state["v"]`` (B, H, S, E), so earlier positions
        are never recomputed.  Cross-attention: the context's keys and values are
        computed on the first call and reused after.  ``mask`` broadcasts to
        (B, H, T_new, S) with S the cached length after the update.
        """
        xp = backend.namespace_of(x)
        h = self.num_heads
        q = split_heads(self.q_proj(x), h)  # (B, H, T_new, E)
        if context is None:
            k_new = split_heads(self.k_proj(x), h)  # (B, H, T_new, E)
            v_new = split_heads(self.v_proj(x), h)
            if "k" in state:
                k_new = xp.concat([state["k"], k_new], axis=2)  # (B, H, S, E)
                v_new = xp.concat([state["v"], v_new], axis=2)
            state["k"], state["v"] = k_new, v_new
        elif "k" not in state:
            state["k"] = split_heads(self.k_proj(context), h)  # (B, H, S, E)
            state["v"] = split_heads(self.v_proj(context), h)
        heads, _ = ops.attention_forward(q, state["k"], state["v"], mask)  # (B, H, T_new, E)
        return self.out_proj(merge_heads(heads))  # (B, T_new, D)
