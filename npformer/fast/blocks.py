"""The attention layer, the feed-forward network and the blocks of the fast tier.

Each is a subclass of its textbook class (:mod:`npformer.nn.attention`,
:mod:`npformer.nn.blocks`) that names this tier's layers and ops (blocked attention,
:mod:`npformer.fast.attention`): the same parameters and residual equations.  A method
of its own stands where the computation differs, for two memory savings and one saving
of work, each saying which:

* **Packed rows.**  Given a :class:`npformer.fast.Packing` (the fast models make one per
  padded batch), the position-wise layers (projections, layer norms, feed-forward,
  residual sums) run on the N valid positions as rows (N, D), skipping the padding.
  Attention, the one layer that mixes positions, unpacks its queries, keys and values
  to (B, H, T, E) and packs its output again.  Every valid position gets the textbook's
  value: padding keys are masked either way.
* **Recomputed hidden layer.**  :class:`FeedForward` keeps no copy of linear2's input
  Dropout(Act(h)) (N, D_ff), the widest activation of a block: its backward computes it
  again from what the activation and the dropout keep anyway.
* **Recomputed sublayer inputs.**  In a pre-norm block each sublayer keeps no copy of
  its input LN(x): its backward computes it again from the norm's saved values
  (:class:`InputAgain`; the block names the norm).

Tested equal to the textbook classes (outputs at every valid position, every gradient)
in ``tests/test_fast_layers.py``.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from .. import nn, ops
from ..backend import Array
from ..nn.attention import (
    merge_heads,
    slices,
    split_heads,
    through_norm,
    through_norm_backward,
    unslice,
)
from ..nn.blocks import _cross_cache, _self_cache
from ..nn.cache import BlockCache, KVCache
from ..ops.contracts import check_flag, check_float
from . import attention, compiled, layers
from .contracts import check_keep_input
from .packing import Packing


class _Unpacked:
    """The layout of a batch without a packing: (B, T, D) throughout."""

    @staticmethod
    def pack(x: Array) -> Array:
        return x

    unpack = pack


UNPACKED = _Unpacked()


class InputAgain:
    """A sublayer whose input may be a pre-norm residual connection's LN(x) (the block
    names the norm, :func:`recompute_inputs`): then it keeps no copy of it, and its
    backward computes it again from the norm's saved values (one element-wise pass)."""

    _input_norm = None  # underscored: not a child module

    def _keeps(self, keep_input: bool) -> bool:
        return keep_input if self._input_norm is None else False

    def _input_again(self, x: Array | None) -> Array | None:
        return x if x is not None or self._input_norm is None else self._input_norm.output_again()


def recompute_inputs(block: nn.Module, *sublayers: tuple) -> None:
    """Pre-norm: each (sublayer, residual connection)'s sublayer reads the norm's LN(x)."""
    for sublayer, residual in sublayers if block.norm_first else ():
        sublayer._input_norm = residual.norm

# The ops the attention layer calls (``self.ops``, npformer.ops in the textbook tier): this
# tier's blocked attention.
attention_ops = SimpleNamespace(attention_forward=attention.attention_forward,
                                attention_backward=attention.attention_backward,
                                attention_weights=ops.attention_weights)


class MultiHeadAttention(InputAgain, nn.MultiHeadAttention):
    """Multi-head attention (:class:`npformer.nn.MultiHeadAttention`) on blocked attention
    (:mod:`npformer.fast.attention`).  Its own forward and backward, as its input may be
    packed rows (N, D), unpacked around attention alone, and may not be kept."""

    Linear, LayerNorm, ops = layers.Linear, layers.LayerNorm, attention_ops

    def check_inputs(self, x: Array, context: Array | None = None, mask: Array | None = None,
                     need_weights: bool = False, kv_cache: KVCache | None = None,
                     packing: Packing | None = None, keep_input: bool = True) -> None:
        """As the textbook layer's; with a ``packing``, x is its rows (N, D)."""
        check_keep_input(keep_input)
        if packing is None:
            return super().check_inputs(x, context, mask, need_weights, kv_cache)
        check_flag(need_weights, "need_weights")
        check_float(x, "attention input")
        rows = (int(packing.index.shape[0]), self.d_model)
        if tuple(x.shape) != rows:
            raise ValueError(f"attention input must be the packed rows (N, D) = {rows}, got "
                             f"shape {tuple(x.shape)}")
        return self._check_keys(x, packing.batch, packing.length, context, mask, kv_cache)

    def forward(self, x: Array, context: Array | None = None, mask: Array | None = None,
                need_weights: bool = False, kv_cache: KVCache | None = None,
                packing: Packing | None = None, keep_input: bool = True
                ) -> Array | tuple[Array, Array]:
        """As :meth:`npformer.nn.MultiHeadAttention.forward`; with a ``packing``, x and the
        output are its rows (N, D) (a context stays (B, S, D)).  ``keep_input=False``: x is
        not kept (the caller passes it to :meth:`backward` again); a context always is."""
        layout, keep_input = UNPACKED if packing is None else packing, self._keeps(keep_input)
        q = through_norm(self.q_norm, self._heads(self.q_proj, x, layout, keep_input))
        if context is None:  # (B, H, T, E) keys and values of x
            k = through_norm(self.k_norm, self._heads(self.k_proj, x, layout, keep_input))
            k, v = self._through_cache(k, self._heads(self.v_proj, x, layout, keep_input),
                                       kv_cache)
        else:
            k, v = self._keys_and_values(context, kv_cache, is_self=False)  # (B, H, S, E)
        heads, attention_saved = self.ops.attention_forward(q, k, v, mask)  # (B, H, T, E)
        y = self.out_proj(layout.pack(merge_heads(heads)))  # (B, T, D) or rows (N, D)
        self._save((attention_saved, context is None, layout))
        weights = self.ops.attention_weights(q, k, mask) if need_weights or self.keep_attention \
            else None  # (B, H, T, S)
        self.last_attention = weights if self.keep_attention else None
        return (y, weights) if need_weights else y

    def _heads(self, projection: nn.Linear, x: Array, layout=UNPACKED,
               keep_input: bool = True) -> Array:
        """x (B, T, D), or ``layout``'s rows (N, D) -> (B, H, T, E): projected as rows (narrow
        heads: each slice, by the one shared map), then unpacked and cut into heads."""
        h = self.num_heads
        if self.narrow_heads:
            return split_heads(layout.unpack(unslice(projection(slices(x, h), keep_input))), h)
        return split_heads(layout.unpack(projection(x, keep_input)), h)

    def _heads_backward(self, projection: nn.Linear, dheads: Array, layout=UNPACKED,
                        x: Array | None = None) -> Array:
        """dheads (B, H, T, E) -> dx in the form of x: :meth:`_heads` in reverse (narrow
        heads sum over the heads); ``x``: its input, where it was not kept."""
        dy = layout.pack(merge_heads(dheads))  # (B, T, H*E) or rows (N, H*E)
        if not self.narrow_heads:
            return projection.backward(dy, x)
        sliced = None if x is None else slices(x, self.num_heads)
        return unslice(projection.backward(slices(dy, self.num_heads), sliced))

    def backward(self, dy: Array, x: Array | None = None) -> Array | tuple[Array, Array]:
        """As the textbook's, dy and dx in the form of forward's x; ``x``: the forward's
        input, where it was not kept.  ``pack`` and ``unpack`` swap roles: each is the
        other's transpose."""
        attention_saved, is_self, layout = self._pop_saved()
        x = self._input_again(x)
        dheads = split_heads(layout.unpack(self.out_proj.backward(dy)), self.num_heads)
        dq, dk, dv = self.ops.attention_backward(dheads, attention_saved)  # (B, H, T|S, E)
        dk = through_norm_backward(self.k_norm, dk)
        dx = self._heads_backward(self.q_proj, through_norm_backward(self.q_norm, dq), layout, x)
        if not is_self:  # the context fed the keys and the values: (B, S, D)
            return dx, self._heads_backward(self.k_proj, dk) + self._heads_backward(self.v_proj, dv)
        return dx + self._heads_backward(self.k_proj, dk, layout, x) \
            + self._heads_backward(self.v_proj, dv, layout, x)  # x fed q, k, v


class FeedForward(InputAgain, nn.FeedForward):
    """Position-wise FFN (:class:`npformer.nn.FeedForward`), linear2's input not kept.

    The backward computes linear2's input Dropout(Act(h)) again from the activation's and
    the dropout's caches: one element-wise pass (a GELU, or nothing for ReLU without
    dropout) instead of N x D_ff kept numbers.
    """

    Linear, Activation, Dropout = layers.Linear, layers.Activation, layers.Dropout

    def forward(self, x: Array, keep_input: bool = True) -> Array:
        """x (..., D) -> (..., D).  Its own: linear2's input is not kept, and x not with
        ``keep_input=False`` (the caller passes it to :meth:`backward` again)."""
        h = self.activation(self.linear1(x, self._keeps(keep_input)))  # (..., D) -> (..., D_ff)
        return self.linear2(self.dropout(h), keep_input=False)  # (..., D_ff) -> (..., D)

    def backward(self, dy: Array, x: Array | None = None) -> Array:
        """dy (..., D) -> dx (..., D); ``x``: the forward's input, where it was not kept."""
        dh = self.dropout.backward(self.linear2.backward(dy, self._hidden_again()))
        return self.linear1.backward(self.activation.backward(dh), self._input_again(x))

    def _hidden_again(self) -> Array:
        """linear2's input Dropout(Act(linear1(x))) (..., D_ff), computed again from the
        activation's and the dropout's caches (a temporary: linear2's backward reads it)."""
        return self.dropout.mask_again(self.activation.output_again())


class NormAndDropout(nn.NormAndDropout):
    """A residual connection's layer norm and dropout, this tier's."""

    LayerNorm, Dropout = layers.LayerNorm, layers.Dropout


class EncoderBlock(nn.EncoderBlock):
    """The encoder block (:class:`npformer.nn.EncoderBlock`) on packed rows, a pre-norm
    sublayer's input LN(x) recomputed in the backward."""

    MultiHeadAttention, NormAndDropout, FeedForward = \
        MultiHeadAttention, NormAndDropout, FeedForward

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        recompute_inputs(self, (self.self_attn, self.attn_residual), (self.ffn, self.ffn_residual))

    def check_inputs(self, x: Array, mask: Array | None = None,
                     kv_cache: BlockCache | None = None, packing: Packing | None = None) -> None:
        """As the textbook block's; its own as a ``packing`` passes on to attention."""
        self.self_attn.check_inputs(x, mask=mask, kv_cache=_self_cache(kv_cache), packing=packing)

    def forward(self, x: Array, mask: Array | None = None, kv_cache: BlockCache | None = None,
                packing: Packing | None = None) -> Array:
        """x (B, T, D), or the rows (N, D) of ``packing`` -> the same form: the textbook's
        lines, attention told the packing (:meth:`_attention`).  Where nothing is recorded,
        one compiled kernel where it takes the inputs (:mod:`npformer.fast.compiled`)."""
        y = compiled.encoder_block_forward(self, x, mask, kv_cache, packing)
        if y is not None:
            return y
        self._packing = packing
        return super().forward(x, mask, kv_cache)

    def _attention(self, layer: MultiHeadAttention, x: Array, *args, **kwargs) -> Array:
        """The textbook's step, told the packing of this forward's rows."""
        return layer(x, *args, packing=self._packing, **kwargs)


class DecoderBlock(nn.DecoderBlock):
    """The decoder block (:class:`npformer.nn.DecoderBlock`) on packed target rows (the
    memory stays (B, S, D)), a pre-norm sublayer's input LN(x) recomputed in the backward."""

    MultiHeadAttention, NormAndDropout, FeedForward = \
        MultiHeadAttention, NormAndDropout, FeedForward
    _attention = EncoderBlock._attention

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        recompute_inputs(self, (self.self_attn, self.self_attn_residual),
                         (self.cross_attn, self.cross_attn_residual), (self.ffn, self.ffn_residual))

    def check_inputs(self, x: Array, memory: Array, self_mask: Array | None = None,
                     memory_mask: Array | None = None, kv_cache: BlockCache | None = None,
                     packing: Packing | None = None) -> None:
        """As the textbook block's; its own as a ``packing`` passes on to attention."""
        self.self_attn.check_inputs(x, mask=self_mask, kv_cache=_self_cache(kv_cache),
                                    packing=packing)
        self.cross_attn.check_inputs(x, context=memory, mask=memory_mask,
                                     kv_cache=_cross_cache(kv_cache), packing=packing)

    def forward(self, x: Array, memory: Array, self_mask: Array | None = None,
                memory_mask: Array | None = None, kv_cache: BlockCache | None = None,
                packing: Packing | None = None) -> Array:
        """x (B, T, D), or the rows (N, D) of ``packing`` -> the same form: the textbook's
        lines, attention told the packing (:meth:`_attention`)."""
        self._packing = packing
        return super().forward(x, memory, self_mask, memory_mask, kv_cache)
