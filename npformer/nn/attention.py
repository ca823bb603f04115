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

    def forward(self, x, context=None, mask=None):
        """x (B, T, D), context (B, S, D) or None (self-attention), mask bool
        broadcasting to (B, H, T, S), True = may attend -> (B, T, D)."""
        check_sequence_input(x, self.d_model, "attention input")
        is_self = context is None
        if is_self:
            context = x
        else:
            check_sequence_input(context, self.d_model, "attention context")
            if context.shape[0] != x.shape[0]:
                raise ValueError(f"attention context has batch {context.shape[0]} but the "
                                 f"queries have batch {x.shape[0]}")
        h = self.num_heads
        q = split_heads(self.q_proj(x), h)  # (B, T, H*E) -> (B, H, T, E)
        k = split_heads(self.k_proj(context), h)  # (B, S, H*E) -> (B, H, S, E)
        v = split_heads(self.v_proj(context), h)  # (B, S, H*E) -> (B, H, S, E)
        heads, attn_cache = ops.attention_forward(q, k, v, mask)  # (B, H, T, E)
        y = self.out_proj(merge_heads(heads))  # (B, T, H*E) -> (B, T, D)
        self._save((attn_cache, is_self))
        self.last_attention = ops.attention_weights(q, k, mask) if self.keep_attention else None
        return y

    def backward(self, dy):
        """dy (B, T, D) -> dx (B, T, D) for self-attention, (dx, dcontext) for cross."""
        attn_cache, is_self = self._pop_saved()
        h = self.num_heads
        dheads = split_heads(self.out_proj.backward(dy), h)  # (B, H, T, E)
        dq, dk, dv = ops.attention_backward(dheads, attn_cache)
        dx = self.q_proj.backward(merge_heads(dq))  # (B, T, D)
        dcontext = self.k_proj.backward(merge_heads(dk)) + self.v_proj.backward(merge_heads(dv))
        if is_self:
            return dx + dcontext  # x fed queries, keys and values
        return dx, dcontext

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
