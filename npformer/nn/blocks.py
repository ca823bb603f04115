r"""Feed-forward network, residual connections and the encoder/decoder blocks.

Residual connection with layer norm, in the two arrangements in use:

* post-norm (the paper, BERT):  $y = \text{LN}(x + \text{Dropout}(F(x)))$
* pre-norm (GPT-2):             $y = x + \text{Dropout}(F(\text{LN}(x)))$

Backward, post-norm: $\bar z = \text{LN}'(\bar y)$, then $\bar x = \bar z + F'(\text{Dropout}'(\bar z))$.
Backward, pre-norm:  $\bar x = \bar y + \text{LN}'(F'(\text{Dropout}'(\bar y)))$.
The identity path adds the upstream gradient unchanged: the point of residuals.

The blocks match ``torch.nn.TransformerEncoderLayer`` / ``TransformerDecoderLayer``
(batch_first=True) computation for computation, so weights move between them
(:mod:`npformer.torch_interop`); the one difference is that npformer applies no
dropout to the attention probabilities.
"""
from __future__ import annotations

from .attention import MultiHeadAttention
from .layers import Activation, Dropout, LayerNorm, Linear
from .module import Module


class FeedForward(Module):
    """Position-wise FFN: linear2(dropout(activation(linear1(x)))), D -> D_ff -> D."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", dropout: float = 0.0):
        self.linear1 = Linear(d_model, d_ff)
        self.activation = Activation(activation)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(d_ff, d_model)

    def forward(self, x):
        h = self.activation(self.linear1(x))  # (B, T, D) -> (B, T, D_ff)
        return self.linear2(self.dropout(h))  # (B, T, D_ff) -> (B, T, D)

    def backward(self, dy):
        dh = self.dropout.backward(self.linear2.backward(dy))  # (B, T, D_ff)
        return self.linear1.backward(self.activation.backward(dh))  # (B, T, D)


class Residual(Module):
    """x -> x + sublayer(x) with layer norm after (post-norm) or before (pre-norm).

    ``forward(x, sublayer, *args, **kwargs)`` runs ``sublayer.forward(x', *args, **kwargs)``;
    extra gradients the sublayer returns (cross-attention's memory) are passed on.
    """

    def __init__(self, d_model: int, dropout: float = 0.0, norm_first: bool = False):
        self.norm_first = norm_first
        self.norm = LayerNorm(d_model)
        self.dropout = Dropout(dropout)

    def forward(self, x, sublayer, *args, **kwargs):
        self._save(sublayer)
        return self.apply(x, lambda h: sublayer.forward(h, *args, **kwargs))

    def apply(self, x, fn):
        """The residual arrangement around any function ``fn`` (also used by cached decoding)."""
        if self.norm_first:
            return x + self.dropout(fn(self.norm(x)))
        return self.norm(x + self.dropout(fn(x)))

    def backward(self, dy):
        """dy -> dx, or (dx, *extra) when the sublayer returns extra gradients."""
        sublayer = self._pop_saved()
        if self.norm_first:
            dsub, extra = _split(sublayer.backward(self.dropout.backward(dy)))
            dx = dy + self.norm.backward(dsub)
        else:
            dz = self.norm.backward(dy)
            dsub, extra = _split(sublayer.backward(self.dropout.backward(dz)))
            dx = dz + dsub
        return (dx, *extra) if extra else dx


def _split(grads):
    """(first gradient, tuple of the rest) of what a sublayer's backward returned."""
    if isinstance(grads, tuple):
        return grads[0], grads[1:]
    return grads, ()


class EncoderBlock(Module):
    """Self-attention then feed-forward, each inside a residual connection."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False,
                 head_dim: int | None = None):
        self.self_attn = MultiHeadAttention(d_model, num_heads, head_dim)
        self.attn_residual = Residual(d_model, dropout, norm_first)
        self.ffn = FeedForward(d_model, d_ff, activation, dropout)
        self.ffn_residual = Residual(d_model, dropout, norm_first)

    def forward(self, x, mask=None, packing=None):
        """x (B, T, D), mask bool broadcasting to (B, H, T, T) -> (B, T, D).
        With ``packing`` (:class:`npformer.ops.Packing`), x and the output are the valid
        positions as rows (N, D): every layer but attention runs on those rows only."""
        x = self.attn_residual(x, self.self_attn, mask=mask, packing=packing)
        return self.ffn_residual(x, self.ffn)

    def backward(self, dy):
        return self.attn_residual.backward(self.ffn_residual.backward(dy))

    def step(self, x, state: dict, mask=None):
        """Inference with a key/value cache: x (B, T_new, D) are the next positions;
        ``state`` holds this block's cached keys and values (see MultiHeadAttention.step)."""
        x = self.attn_residual.apply(x, lambda h: self.self_attn.step(h, state, mask=mask))
        return self.ffn_residual.apply(x, self.ffn.forward)


class DecoderBlock(Module):
    """Masked self-attention, cross-attention over the encoder memory, feed-forward."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False,
                 head_dim: int | None = None):
        self.self_attn = MultiHeadAttention(d_model, num_heads, head_dim)
        self.self_attn_residual = Residual(d_model, dropout, norm_first)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, head_dim)
        self.cross_attn_residual = Residual(d_model, dropout, norm_first)
        self.ffn = FeedForward(d_model, d_ff, activation, dropout)
        self.ffn_residual = Residual(d_model, dropout, norm_first)

    def forward(self, x, memory, self_mask=None, memory_mask=None, packing=None):
        """x (B, T, D) targets, memory (B, S, D) encoder output; self_mask broadcasting
        to (B, H, T, T) (causal and padding), memory_mask to (B, H, T, S) -> (B, T, D).
        With ``packing``, x and the output are the valid target positions as rows (N, D)."""
        x = self.self_attn_residual(x, self.self_attn, mask=self_mask, packing=packing)
        x = self.cross_attn_residual(x, self.cross_attn, context=memory, mask=memory_mask,
                                     packing=packing)
        return self.ffn_residual(x, self.ffn)

    def backward(self, dy):
        """dy (B, T, D) -> (dx (B, T, D), dmemory (B, S, D))."""
        dx = self.ffn_residual.backward(dy)
        dx, dmemory = self.cross_attn_residual.backward(dx)
        dx = self.self_attn_residual.backward(dx)
        return dx, dmemory

    def step(self, x, memory, state: dict, self_mask=None, memory_mask=None):
        """Inference with caches: x (B, T_new, D) are the next target positions.
        ``state["self"]`` grows by T_new positions; ``state["cross"]`` holds the memory's
        keys and values, computed on the first call only."""
        self_state = state.setdefault("self", {})
        cross_state = state.setdefault("cross", {})
        x = self.self_attn_residual.apply(
            x, lambda h: self.self_attn.step(h, self_state, mask=self_mask))
        x = self.cross_attn_residual.apply(
            x, lambda h: self.cross_attn.step(h, cross_state, context=memory, mask=memory_mask))
        return self.ffn_residual.apply(x, self.ffn.forward)
