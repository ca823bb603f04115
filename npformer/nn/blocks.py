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
(:mod:`npformer.torch_interop`); the one difference is that npformer applies no
dropout to the attention probabilities.  Each residual connection's layer norm
and dropout live in a :class:`ResidualNorm` named after its sublayer
(``attn_residual.norm`` ...): the parameter names checkpoints use.
"""
from __future__ import annotations

from ..backend import Array
from ..validation import check_size, linear_inputs
from .attention import MultiHeadAttention
from .cache import BlockCache
from .layers import Activation, Dropout, LayerNorm, Linear
from .module import Module
from .padding import Padding


class FeedForward(Module):
    """Position-wise FFN: linear2(dropout(activation(linear1(x)))), D -> D_ff -> D.

    Memory: linear2's input, (N, D_ff), the widest activation of a block, is not kept.
    The backward computes it again from what the activation and the dropout keep anyway
    (the activation's input or output, the dropout's mask): one element-wise pass (a
    GELU, or nothing for ReLU without dropout) instead of N x D_ff kept numbers.
    """

    def __init__(self, d_model: int, d_ff: int, activation: str = "relu", dropout: float = 0.0):
        check_size(d_model, "d_model", 1)
        check_size(d_ff, "d_ff", 1)
        self.linear1 = Linear(d_model, d_ff)
        self.activation = Activation(activation)
        self.dropout = Dropout(dropout)
        self.linear2 = Linear(d_ff, d_model)

    def check_inputs(self, x: Array, keep_input: bool = True) -> None:
        """x (..., D), the first linear map's input."""
        bias = None if self.linear1.bias is None else self.linear1.bias.data
        linear_inputs(x, self.linear1.weight.data, bias, keep_input)

    def forward(self, x: Array, keep_input: bool = True) -> Array:
        """x (B, T, D) -> (B, T, D); ``keep_input=False``: x is not kept (the caller
        passes it to :meth:`backward` again)."""
        h = self.activation(self.linear1(x, keep_input))  # (B, T, D) -> (B, T, D_ff)
        return self.linear2(self.dropout(h), keep_input=False)  # (B, T, D_ff) -> (B, T, D)

    def backward(self, dy: Array, x: Array | None = None) -> Array:
        """dy (B, T, D) -> dx (B, T, D); ``x``: the forward's input, where it was not kept."""
        dh = self.dropout.backward(self.linear2.backward(dy, self._hidden_again()))  # (B, T, D_ff)
        return self.linear1.backward(self.activation.backward(dh), x)  # (B, T, D)

    def _hidden_again(self) -> Array:
        """linear2's input dropout(activation(linear1(x))) (B, T, D_ff), computed again
        from the activation's and the dropout's caches (a temporary: linear2's backward
        is its only reader)."""
        return self.dropout.again(self.activation.output_again())


class ResidualNorm(Module):
    """The layer norm and the dropout of one residual connection (the block writes the
    sum itself); a container, so the parameters keep their names (``.norm.weight``)."""

    def __init__(self, d_model: int, dropout: float = 0.0):
        self.norm = LayerNorm(d_model)
        self.dropout = Dropout(dropout)


class EncoderBlock(Module):
    """Self-attention then feed-forward, each inside a residual connection."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False,
                 head_dim: int | None = None):
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, num_heads, head_dim)
        self.attn_residual = ResidualNorm(d_model, dropout)
        self.ffn = FeedForward(d_model, d_ff, activation, dropout)
        self.ffn_residual = ResidualNorm(d_model, dropout)

    def check_inputs(self, x: Array, mask: Array | None = None,
                     padding: Padding | None = None) -> None:
        self.self_attn.check_inputs(x, mask=mask, padding=padding)

    def forward(self, x: Array, mask: Array | None = None, padding: Padding | None = None) -> Array:
        """x (B, T, D), mask bool broadcasting to (B, H, T, T) -> (B, T, D).  With a
        ``padding`` (:class:`npformer.nn.Padding`), x and the output are that batch in the
        position-wise layers' form (rows (N, D) in the fast tier)."""
        return self._layers(x, lambda h, keep: self.self_attn(h, mask=mask, padding=padding,
                                                              keep_input=keep))

    def forward_cached(self, x: Array, cache: BlockCache, mask: Array | None = None) -> Array:
        """Cached decoding (under ``no_grad``): x (B, T_new, D) are the next positions;
        ``cache.self_attn`` grows by T_new (see MultiHeadAttention.forward_cached)."""
        return self._layers(  # nothing is kept under no_grad: keep is moot
            x, lambda h, keep: self.self_attn.forward_cached(h, cache.self_attn, mask=mask))

    def _layers(self, x, self_attention):
        """``self_attention(h, keep)``: the sublayer on h, keeping h for its backward or not."""
        a, f = self.attn_residual, self.ffn_residual
        if self.norm_first:  # pre-norm: x + Dropout(F(LN(x))); LN(x) recomputed in backward
            x = x + a.dropout(self_attention(a.norm(x), False))
            return x + f.dropout(self.ffn(f.norm(x), keep_input=False))
        x = a.norm(x + a.dropout(self_attention(x, True)))  # post-norm: LN(x + Dropout(F(x)))
        return f.norm(x + f.dropout(self.ffn(x)))

    def backward(self, dy: Array) -> Array:
        """dy -> dx, in the form of forward's x.  Pre-norm: each sublayer's input LN(x) was
        not kept; the norm computes it again from its own cache (one element-wise pass)."""
        a, f = self.attn_residual, self.ffn_residual
        if self.norm_first:
            dh = self.ffn.backward(f.dropout.backward(dy), f.norm.output_again())
            dx = dy + f.norm.backward(dh)
            dh = self.self_attn.backward(a.dropout.backward(dx), a.norm.output_again())
            return dx + a.norm.backward(dh)
        dz = f.norm.backward(dy)
        dx = dz + self.ffn.backward(f.dropout.backward(dz))
        dz = a.norm.backward(dx)
        return dz + self.self_attn.backward(a.dropout.backward(dz))


class DecoderBlock(Module):
    """Masked self-attention, cross-attention over the encoder memory, feed-forward."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, dropout: float = 0.1,
                 activation: str = "relu", norm_first: bool = False,
                 head_dim: int | None = None):
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(d_model, num_heads, head_dim)
        self.self_attn_residual = ResidualNorm(d_model, dropout)
        self.cross_attn = MultiHeadAttention(d_model, num_heads, head_dim)
        self.cross_attn_residual = ResidualNorm(d_model, dropout)
        self.ffn = FeedForward(d_model, d_ff, activation, dropout)
        self.ffn_residual = ResidualNorm(d_model, dropout)

    def check_inputs(self, x: Array, memory: Array, self_mask: Array | None = None,
                     memory_mask: Array | None = None, padding: Padding | None = None) -> None:
        self.self_attn.check_inputs(x, mask=self_mask, padding=padding)
        self.cross_attn.check_inputs(x, context=memory, mask=memory_mask, padding=padding)

    def forward(self, x: Array, memory: Array, self_mask: Array | None = None,
                memory_mask: Array | None = None, padding: Padding | None = None) -> Array:
        """x (B, T, D) targets, memory (B, S, D) encoder output; self_mask broadcasting
        to (B, H, T, T) (causal and padding), memory_mask to (B, H, T, S) -> (B, T, D).
        With a ``padding``, x and the output are the target batch in the position-wise
        layers' form (rows (N, D) in the fast tier); memory stays (B, S, D)."""
        return self._layers(
            x, lambda h, keep: self.self_attn(h, mask=self_mask, padding=padding, keep_input=keep),
            lambda h, keep: self.cross_attn(h, context=memory, mask=memory_mask, padding=padding,
                                            keep_input=keep))

    def forward_cached(self, x: Array, memory: Array, cache: BlockCache,
                       self_mask: Array | None = None, memory_mask: Array | None = None) -> Array:
        """Cached decoding (under ``no_grad``): x (B, T_new, D) are the next target
        positions.  ``cache.self_attn`` grows by T_new; ``cache.cross_attn`` holds the
        memory's keys and values, computed on the first call only."""
        return self._layers(  # nothing is kept under no_grad: keep is moot
            x, lambda h, keep: self.self_attn.forward_cached(h, cache.self_attn, mask=self_mask),
            lambda h, keep: self.cross_attn.forward_cached(h, cache.cross_attn, context=memory,
                                                           mask=memory_mask))

    def _layers(self, x, self_attention, cross_attention):
        """``self_attention(h, keep)``, ``cross_attention(h, keep)``: the sublayers on h,
        keeping h for their backward or not."""
        a, c, f = self.self_attn_residual, self.cross_attn_residual, self.ffn_residual
        if self.norm_first:  # pre-norm: x + Dropout(F(LN(x))); LN(x) recomputed in backward
            x = x + a.dropout(self_attention(a.norm(x), False))
            x = x + c.dropout(cross_attention(c.norm(x), False))
            return x + f.dropout(self.ffn(f.norm(x), keep_input=False))
        x = a.norm(x + a.dropout(self_attention(x, True)))  # post-norm: LN(x + Dropout(F(x)))
        x = c.norm(x + c.dropout(cross_attention(x, True)))
        return f.norm(x + f.dropout(self.ffn(x)))

    def backward(self, dy: Array) -> tuple[Array, Array]:
        """dy -> (dx, dmemory (B, S, D)); dx in the form of forward's x.  Pre-norm: each
        sublayer's input LN(x) is computed again from the norm's cache (see EncoderBlock)."""
        a, c, f = self.self_attn_residual, self.cross_attn_residual, self.ffn_residual
        if self.norm_first:
            dh = self.ffn.backward(f.dropout.backward(dy), f.norm.output_again())
            dx = dy + f.norm.backward(dh)
            dh, dmemory = self.cross_attn.backward(c.dropout.backward(dx), c.norm.output_again())
            dx = dx + c.norm.backward(dh)
            dh = self.self_attn.backward(a.dropout.backward(dx), a.norm.output_again())
            return dx + a.norm.backward(dh), dmemory
        dz = f.norm.backward(dy)
        dx = dz + self.ffn.backward(f.dropout.backward(dz))
        dz = c.norm.backward(dx)
        dh, dmemory = self.cross_attn.backward(c.dropout.backward(dz))
        dz = a.norm.backward(dz + dh)
        return dz + self.self_attn.backward(a.dropout.backward(dz)), dmemory
