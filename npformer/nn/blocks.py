r"""Feed-forward network and the encoder/decoder blocks, residual connections written out.

Each sublayer F (attention, feed-forward) sits in a residual connection with layer
norm, in one of the two arrangements in use:

* post-norm (the paper, BERT):  $y = \text{LN}(x + \text{Dropout}(F(x)))$
* pre-norm (GPT-2):             $y = x + \text{Dropout}(F(\text{LN}(x)))$

Backward, post-norm: $\bar z = \text{LN}'(\bar y)$,
then $\bar x = \bar z + F'(\text{Dropout}'(\bar z))$.
Backward, pre-norm:  $\bar x = \bar y + \text{LN}'(F'(\text{Dropout}'(\bar y)))$.
The identity path adds the upstream gradient unchanged: the point of residuals.

The blocks match ``torch.nn.TransformerEncoderLayer`` / ``TransformerDecoderLayer``
(batch_first=True) computation for computation, so weights move between them
(:mod:`npformer.interop.pytorch`); the one difference is that npformer applies no
dropout to the attention probabilities.  Each residual connection's layer norm
and dropout live in a :class:`NormAndDropout` named after its sublayer
(``attn_residual.norm`` ...): the parameter names checkpoints use.

Options passed to the attention layers: ``narrow_heads`` and ``qk_norm``
(:class:`npformer.nn.MultiHeadAttention`); ``norm_eps``: every layer norm's epsilon.

Shapes: B batch, T positions, S memory (source) positions, D width, D_ff the
feed-forward width.  Every layer keeps what its own backward needs.
"""
from __future__ import annotations

from .. import ops
from ..backend import Array
from ..ops.contracts import check_flag, check_size
from .attention import MultiHeadAttention
from .cache import BlockCache
from .layers import Activation, Dropout, LayerNorm, Linear
from .module import Module


class FeedForward(Module):
    """Position-wise FFN: linear2(dropout(activation(linear1(x)))), D -> D_ff -> D."""

    Linear, Activation, Dropout = Linear, Activation, Dropout  # the layers it builds

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", dropout: float = 0.0):
        check_size(d_model, "d_model", 1)
        check_size(d_ff, "d_ff", 1)
        self.linear1 = self.Linear(d_model, d_ff)
        self.activation = self.Activation(activation)
        self.dropout = self.Dropout(dropout)
        self.linear2 = self.Linear(d_ff, d_model)

    def forward(self, x: Array) -> Array:
        """x (B, T, D) -> (B, T, D)."""
        h = self.activation(self.linear1(x))  # (B, T, D) -> (B, T, D_ff)
        return self.linear2(self.dropout(h))  # (B, T, D_ff) -> (B, T, D)

    def backward(self, dy: Array) -> Array:
        """dy (B, T, D) -> dx (B, T, D): the forward's four lines in reverse."""
        dh = self.dropout.backward(self.linear2.backward(dy))  # (B, T, D_ff)
        return self.linear1.backward(self.activation.backward(dh))  # (B, T, D)


class NormAndDropout(Module):
    """The layer norm and the dropout of one residual connection (the block writes the
    sum itself); a container, so the parameters keep their names (``.norm.weight``)."""

    LayerNorm, Dropout = LayerNorm, Dropout  # the layers it builds

    def __init__(self, d_model: int, dropout: float = 0.0, eps: float = ops.layernorm.EPS):
        self.norm = self.LayerNorm(d_model, eps)
        self.dropout = self.Dropout(dropout)


def _self_cache(kv_cache: BlockCache | None):
    return None if kv_cache is None else kv_cache.self_attn


def _cross_cache(kv_cache: BlockCache | None):
    return None if kv_cache is None else kv_cache.cross_attn


class EncoderBlock(Module):
    """Self-attention then feed-forward, each inside a residual connection.  (With a causal
    mask, the GPT block.)"""

    # the layers it builds; the fast tier's block names its own
    MultiHeadAttention, NormAndDropout, FeedForward = \
        MultiHeadAttention, NormAndDropout, FeedForward

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False,
                 head_dim: int | None = None, *, norm_eps: float = ops.layernorm.EPS,
                 narrow_heads: bool = False, qk_norm: bool = False):
        self.norm_first = check_flag(norm_first, "norm_first")
        self.self_attn = self.MultiHeadAttention(d_model, num_heads, head_dim, norm_eps=norm_eps,
                                                 narrow_heads=narrow_heads, qk_norm=qk_norm)
        self.attn_residual = self.NormAndDropout(d_model, dropout, norm_eps)
        self.ffn = self.FeedForward(d_model, d_ff, activation, dropout)
        self.ffn_residual = self.NormAndDropout(d_model, dropout, norm_eps)

    def check_inputs(self, x: Array, mask: Array | None = None,
                     kv_cache: BlockCache | None = None) -> None:
        self.self_attn.check_inputs(x, mask=mask, kv_cache=_self_cache(kv_cache))

    def forward(self, x: Array, mask: Array | None = None,
                kv_cache: BlockCache | None = None) -> Array:
        """x (B, T, D), mask bool broadcasting to (B, H, T, T) -> (B, T, D).  ``kv_cache``
        (decoding, under ``no_grad``): the block's :class:`BlockCache`; x are then the T
        positions after those cached, and the mask broadcasts to (B, H, T, S) over all S."""
        a, f, kv = self.attn_residual, self.ffn_residual, _self_cache(kv_cache)
        if self.norm_first:  # pre-norm: x + Dropout(F(LN(x)))
            x = x + a.dropout(self._attention(self.self_attn, a.norm(x), mask=mask, kv_cache=kv))
            return x + f.dropout(self.ffn(f.norm(x)))
        x = a.norm(x + a.dropout(self._attention(self.self_attn, x, mask=mask, kv_cache=kv)))
        return f.norm(x + f.dropout(self.ffn(x)))  # post-norm: LN(x + Dropout(F(x)))

    def _attention(self, layer: MultiHeadAttention, x: Array, *args, **kwargs) -> Array:
        """One of the block's attention layers on x (a step of its own: the fast tier's
        block runs it on packed rows)."""
        return layer(x, *args, **kwargs)

    def backward(self, dy: Array) -> Array:
        """dy (B, T, D) -> dx (B, T, D): the forward's lines in reverse."""
        a, f = self.attn_residual, self.ffn_residual
        if self.norm_first:
            dx = dy + f.norm.backward(self.ffn.backward(f.dropout.backward(dy)))
            return dx + a.norm.backward(self.self_attn.backward(a.dropout.backward(dx)))
        dz = f.norm.backward(dy)
        dx = dz + self.ffn.backward(f.dropout.backward(dz))
        dz = a.norm.backward(dx)
        return dz + self.self_attn.backward(a.dropout.backward(dz))


class DecoderBlock(Module):
    """Masked self-attention, cross-attention over the encoder memory, feed-forward."""

    MultiHeadAttention, NormAndDropout, FeedForward = \
        MultiHeadAttention, NormAndDropout, FeedForward

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False,
                 head_dim: int | None = None, *, norm_eps: float = ops.layernorm.EPS,
                 narrow_heads: bool = False, qk_norm: bool = False):
        self.norm_first = check_flag(norm_first, "norm_first")
        options = {"narrow_heads": narrow_heads, "qk_norm": qk_norm, "norm_eps": norm_eps}
        self.self_attn = self.MultiHeadAttention(d_model, num_heads, head_dim, **options)
        self.self_attn_residual = self.NormAndDropout(d_model, dropout, norm_eps)
        self.cross_attn = self.MultiHeadAttention(d_model, num_heads, head_dim, **options)
        self.cross_attn_residual = self.NormAndDropout(d_model, dropout, norm_eps)
        self.ffn = self.FeedForward(d_model, d_ff, activation, dropout)
        self.ffn_residual = self.NormAndDropout(d_model, dropout, norm_eps)

    def check_inputs(self, x: Array, memory: Array, self_mask: Array | None = None,
                     memory_mask: Array | None = None, kv_cache: BlockCache | None = None) -> None:
        self.self_attn.check_inputs(x, mask=self_mask, kv_cache=_self_cache(kv_cache))
        self.cross_attn.check_inputs(x, context=memory, mask=memory_mask,
                                     kv_cache=_cross_cache(kv_cache))

    def forward(self, x: Array, memory: Array, self_mask: Array | None = None,
                memory_mask: Array | None = None, kv_cache: BlockCache | None = None) -> Array:
        """x (B, T, D) targets, memory (B, S, D) encoder output; self_mask broadcasting
        to (B, H, T, T) (causal and padding), memory_mask to (B, H, T, S) -> (B, T, D).
        ``kv_cache`` (decoding, under ``no_grad``): as in :class:`EncoderBlock`; its
        cross-attention cache holds the memory's keys and values after the first call."""
        a, c, f = self.self_attn_residual, self.cross_attn_residual, self.ffn_residual
        kv, memory_kv = _self_cache(kv_cache), _cross_cache(kv_cache)
        if self.norm_first:  # pre-norm: x + Dropout(F(LN(x)))
            x = x + a.dropout(self._attention(self.self_attn, a.norm(x), mask=self_mask,
                                              kv_cache=kv))
            x = x + c.dropout(self._attention(self.cross_attn, c.norm(x), memory, memory_mask,
                                              kv_cache=memory_kv))
            return x + f.dropout(self.ffn(f.norm(x)))
        x = a.norm(x + a.dropout(self._attention(self.self_attn, x, mask=self_mask, kv_cache=kv)))
        x = c.norm(x + c.dropout(self._attention(self.cross_attn, x, memory, memory_mask,
                                                 kv_cache=memory_kv)))
        return f.norm(x + f.dropout(self.ffn(x)))  # post-norm: LN(x + Dropout(F(x)))

    _attention = EncoderBlock._attention

    def backward(self, dy: Array) -> tuple[Array, Array]:
        """dy (B, T, D) -> (dx (B, T, D), dmemory (B, S, D)): the forward's lines in reverse."""
        a, c, f = self.self_attn_residual, self.cross_attn_residual, self.ffn_residual
        if self.norm_first:
            dx = dy + f.norm.backward(self.ffn.backward(f.dropout.backward(dy)))
            dh, dmemory = self.cross_attn.backward(c.dropout.backward(dx))
            dx = dx + c.norm.backward(dh)
            return dx + a.norm.backward(self.self_attn.backward(a.dropout.backward(dx))), dmemory
        dz = f.norm.backward(dy)
        dx = dz + self.ffn.backward(f.dropout.backward(dz))
        dz = c.norm.backward(dx)
        dh, dmemory = self.cross_attn.backward(c.dropout.backward(dz))
        dz = a.norm.backward(dz + dh)
        return dz + self.self_attn.backward(a.dropout.backward(dz)), dmemory
