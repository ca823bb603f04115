"""The attention layer, the feed-forward network and the blocks of the fast tier.

Each is a subclass of its textbook class (:mod:`npformer.nn.attention`,
:mod:`npformer.nn.blocks`): the same parameters and residual equations, computed with
two memory savings and one saving of work.

* **Packed rows.**  Given a :class:`npformer.fast.Packing` (the fast models make one per
  padded batch), the position-wise layers (projections, layer norms, feed-forward,
  residual sums) run on the N valid positions as rows (N, D), skipping the padding.
  Attention, the one layer that mixes positions, unpacks its queries, keys and values
  to (B, H, T, E) and packs its output again.  Every valid position gets the textbook's
  value: padding keys are masked either way.
* **Recomputed hidden layer.**  :class:`FeedForward` keeps no copy of linear2's input
  Dropout(Act(h)) (N, D_ff), the widest activation of a block: its backward computes it
  again from what the activation and the dropout keep anyway.
* **Recomputed sublayer inputs.**  A pre-norm block keeps no copy of LN(x), its
  sublayers' input: their backward is handed it again, computed from the norm's cache.

Tested equal to the textbook classes (outputs at every valid position, every gradient)
in ``tests/test_fast_layers.py``.
"""
from __future__ import annotations

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
from ..nn.cache import BlockCache, KVCache
from ..ops.contracts import (
    check_float,
    check_keep_input,
    check_mask,
    check_same_dtype,
    check_sequence_input,
)
from . import attention, layers
from .packing import Packing


class _Unpacked:
    """The layout of a batch without a packing: (B, T, D) throughout."""

    @staticmethod
    def pack(x: Array) -> Array:
        return x

    unpack = pack


UNPACKED = _Unpacked()


class MultiHeadAttention(nn.MultiHeadAttention):
    """Multi-head attention (:class:`npformer.nn.MultiHeadAttention`) on blocked attention
    (:mod:`npformer.fast.attention`), its input optionally packed rows."""

    Linear, LayerNorm = layers.Linear, layers.LayerNorm

    def check_inputs(self, x: Array, context: Array | None = None, mask: Array | None = None,
                     need_weights: bool = False, kv_cache: KVCache | None = None,
                     packing: Packing | None = None, keep_input: bool = True) -> None:
        """As the textbook layer's; with a ``packing``, x is its rows (N, D)."""
        check_keep_input(keep_input)
        if packing is None:
            super().check_inputs(x, context, mask, need_weights, kv_cache)
            return
        check_float(x, "attention input")
        rows = (int(packing.index.shape[0]), self.d_model)
        if tuple(x.shape) != rows:
            raise ValueError(f"attention input must be the packed rows (N, D) = {rows}, got "
                             f"shape {tuple(x.shape)}")
        keys = packing.length
        if context is not None:
            check_float(context, "attention context")
            check_sequence_input(context, self.d_model, "attention context")
            if context.shape[0] != packing.batch:
                raise ValueError(f"attention context has batch {context.shape[0]} but the "
                                 f"queries have batch {packing.batch}")
            keys = context.shape[1]
        check_same_dtype("attention", input=x, context=context, weight=self.q_proj.weight.data)
        if mask is not None:
            check_mask(mask, (packing.batch, self.num_heads, packing.length, keys),
                       "attention mask")

    def forward(self, x: Array, context: Array | None = None, mask: Array | None = None,
                need_weights: bool = False, kv_cache: KVCache | None = None,
                packing: Packing | None = None, keep_input: bool = True
                ) -> Array | tuple[Array, Array]:
        """As :meth:`npformer.nn.MultiHeadAttention.forward`; with a ``packing``, x and the
        output are its rows (N, D) (a context stays (B, S, D)).  ``keep_input=False``: x is
        not kept (the caller passes it to :meth:`backward` again); a context always is."""
        layout = UNPACKED if packing is None else packing
        h = self.num_heads
        q = split_heads(layout.unpack(self._project(self.q_proj, x, keep_input)), h)
        q = through_norm(self.q_norm, q)  # (B, H, T, E)
        if context is None:
            k = layout.unpack(self._project(self.k_proj, x, keep_input))  # (B, T, H*E)
            v = layout.unpack(self._project(self.v_proj, x, keep_input))
        elif kv_cache is not None and kv_cache.length > 0:
            k = v = None  # the memory's keys and values, cached on the first call
        else:
            k = self._project(self.k_proj, context)  # (B, S, H*E)
            v = self._project(self.v_proj, context)
        k, v = self._cached(k, v, kv_cache)  # (B, H, S, E) each
        heads, attention_saved = attention.attention_forward(q, k, v, mask)  # (B, H, T, E)
        y = self.out_proj(layout.pack(merge_heads(heads)))  # (B, T, D) or rows (N, D)
        self._save((attention_saved, context is None, layout))
        weights = ops.attention_weights(q, k, mask) if need_weights or self.keep_attention \
            else None  # (B, H, T, S)
        self.last_attention = weights if self.keep_attention else None
        return (y, weights) if need_weights else y

    def _project(self, projection: nn.Linear, x: Array, keep_input: bool = True) -> Array:
        """x (..., D) -> (..., H*E), column block h head h's: the standard heads project
        the whole width; narrow heads cut it into the heads' slices and project each with
        the one shared map (the textbook's :meth:`_heads`, before the split)."""
        if not self.narrow_heads:
            return projection(x, keep_input)
        return unslice(projection(slices(x, self.num_heads), keep_input))  # (..., H, E) ->

    def _project_backward(self, projection: nn.Linear, dy: Array,
                          x: Array | None = None) -> Array:
        """dy (..., H*E) -> dx (..., D): :meth:`_project` in reverse; ``x``: its input,
        where it was not kept."""
        if not self.narrow_heads:
            return projection.backward(dy, x)
        sliced = None if x is None else slices(x, self.num_heads)
        return unslice(projection.backward(slices(dy, self.num_heads), sliced))  # sums heads

    def _cached(self, k: Array | None, v: Array | None, kv_cache: KVCache | None):
        """(B, S, H*E) keys and values -> (B, H, S, E), through the cache where there is one
        (None, None: the cache's); the keys normed with kqnorm."""
        h = self.num_heads
        if k is not None:
            k, v = through_norm(self.k_norm, split_heads(k, h)), split_heads(v, h)
            if kv_cache is None:
                return k, v
            kv_cache.append(k, v)
        return kv_cache.keys, kv_cache.values

    def backward(self, dy: Array, x: Array | None = None) -> Array | tuple[Array, Array]:
        """dy -> dx for self-attention, (dx, dcontext) for cross-attention (dcontext
        (B, S, D)); dy and dx in the form of forward's x; ``x``: the forward's input, where
        it was not kept.  ``pack`` and ``unpack`` swap roles: each is the other's transpose."""
        attention_saved, is_self, layout = self._pop_saved()
        h = self.num_heads
        dmerged = layout.unpack(self.out_proj.backward(dy))  # (B, T, H*E)
        dq, dk, dv = attention.attention_backward(split_heads(dmerged, h), attention_saved)
        dq, dk = through_norm_backward(self.q_norm, dq), through_norm_backward(self.k_norm, dk)
        dx = self._project_backward(self.q_proj, layout.pack(merge_heads(dq)), x)
        if not is_self:
            return dx, (self._project_backward(self.k_proj, merge_heads(dk))
                        + self._project_backward(self.v_proj, merge_heads(dv)))  # (B, S, D)
        dk_x = self._project_backward(self.k_proj, layout.pack(merge_heads(dk)), x)
        dv_x = self._project_backward(self.v_proj, layout.pack(merge_heads(dv)), x)
        return dx + dk_x + dv_x  # x fed q, k, v


class FeedForward(nn.FeedForward):
    """Position-wise FFN (:class:`npformer.nn.FeedForward`), linear2's input not kept.

    The backward computes linear2's input Dropout(Act(h)) again from the activation's and
    the dropout's caches: one element-wise pass (a GELU, or nothing for ReLU without
    dropout) instead of N x D_ff kept numbers.
    """

    Linear, Activation, Dropout = layers.Linear, layers.Activation, layers.Dropout

    def forward(self, x: Array, keep_input: bool = True) -> Array:
        """x (..., D) -> (..., D); ``keep_input=False``: x is not kept (the caller passes
        it to :meth:`backward` again)."""
        h = self.activation(self.linear1(x, keep_input))  # (..., D) -> (..., D_ff)
        return self.linear2(self.dropout(h), keep_input=False)  # (..., D_ff) -> (..., D)

    def backward(self, dy: Array, x: Array | None = None) -> Array:
        """dy (..., D) -> dx (..., D); ``x``: the forward's input, where it was not kept."""
        dh = self.dropout.backward(self.linear2.backward(dy, self._hidden_again()))
        return self.linear1.backward(self.activation.backward(dh), x)  # (..., D)

    def _hidden_again(self) -> Array:
        """linear2's input Dropout(Act(linear1(x))) (..., D_ff), computed again from the
        activation's and the dropout's caches (a temporary: linear2's backward reads it)."""
        return self.dropout.mask_again(self.activation.output_again())


class NormAndDropout(nn.NormAndDropout):
    """A residual connection's layer norm and dropout, this tier's."""

    LayerNorm, Dropout = layers.LayerNorm, layers.Dropout


def _self_cache(kv_cache: BlockCache | None):
    return None if kv_cache is None else kv_cache.self_attn


def _cross_cache(kv_cache: BlockCache | None):
    return None if kv_cache is None else kv_cache.cross_attn


class EncoderBlock(nn.EncoderBlock):
    """The encoder block (:class:`npformer.nn.EncoderBlock`) on packed rows, a pre-norm
    sublayer's input LN(x) recomputed in the backward."""

    MultiHeadAttention, NormAndDropout, FeedForward = \
        MultiHeadAttention, NormAndDropout, FeedForward

    def check_inputs(self, x: Array, mask: Array | None = None,
                     kv_cache: BlockCache | None = None, packing: Packing | None = None) -> None:
        self.self_attn.check_inputs(x, mask=mask, kv_cache=_self_cache(kv_cache), packing=packing)

    def forward(self, x: Array, mask: Array | None = None, kv_cache: BlockCache | None = None,
                packing: Packing | None = None) -> Array:
        """x (B, T, D), or the rows (N, D) of ``packing`` -> the same form."""
        a, f, kv = self.attn_residual, self.ffn_residual, _self_cache(kv_cache)
        if self.norm_first:  # pre-norm: x + Dropout(F(LN(x))), LN(x) not kept by F
            x = x + a.dropout(self.self_attn(a.norm(x), mask=mask, kv_cache=kv, packing=packing,
                                             keep_input=False))
            return x + f.dropout(self.ffn(f.norm(x), keep_input=False))
        x = a.norm(x + a.dropout(self.self_attn(x, mask=mask, kv_cache=kv, packing=packing)))
        return f.norm(x + f.dropout(self.ffn(x)))  # post-norm: LN(x + Dropout(F(x)))

    def backward(self, dy: Array) -> Array:
        """dy -> dx, in the form of forward's x.  Pre-norm: each sublayer's input LN(x) is
        computed again from the norm's cache (one element-wise pass)."""
        if not self.norm_first:  # post-norm: the textbook block's lines
            return super().backward(dy)
        a, f = self.attn_residual, self.ffn_residual
        dh = self.ffn.backward(f.dropout.backward(dy), f.norm.output_again())
        dx = dy + f.norm.backward(dh)
        dh = self.self_attn.backward(a.dropout.backward(dx), a.norm.output_again())
        return dx + a.norm.backward(dh)


class DecoderBlock(nn.DecoderBlock):
    """The decoder block (:class:`npformer.nn.DecoderBlock`) on packed target rows (the
    memory stays (B, S, D)), a pre-norm sublayer's input LN(x) recomputed in the backward."""

    MultiHeadAttention, NormAndDropout, FeedForward = \
        MultiHeadAttention, NormAndDropout, FeedForward

    def check_inputs(self, x: Array, memory: Array, self_mask: Array | None = None,
                     memory_mask: Array | None = None, kv_cache: BlockCache | None = None,
                     packing: Packing | None = None) -> None:
        self.self_attn.check_inputs(x, mask=self_mask, kv_cache=_self_cache(kv_cache),
                                    packing=packing)
        self.cross_attn.check_inputs(x, context=memory, mask=memory_mask,
                                     kv_cache=_cross_cache(kv_cache), packing=packing)

    def forward(self, x: Array, memory: Array, self_mask: Array | None = None,
                memory_mask: Array | None = None, kv_cache: BlockCache | None = None,
                packing: Packing | None = None) -> Array:
        """x (B, T, D), or the rows (N, D) of ``packing`` -> the same form."""
        a, c, f = self.self_attn_residual, self.cross_attn_residual, self.ffn_residual
        kv, memory_kv = _self_cache(kv_cache), _cross_cache(kv_cache)
        if self.norm_first:  # pre-norm: x + Dropout(F(LN(x))), LN(x) not kept by F
            x = x + a.dropout(self.self_attn(a.norm(x), mask=self_mask, kv_cache=kv,
                                             packing=packing, keep_input=False))
            x = x + c.dropout(self.cross_attn(c.norm(x), memory, memory_mask, kv_cache=memory_kv,
                                              packing=packing, keep_input=False))
            return x + f.dropout(self.ffn(f.norm(x), keep_input=False))
        x = a.norm(x + a.dropout(self.self_attn(x, mask=self_mask, kv_cache=kv, packing=packing)))
        x = c.norm(x + c.dropout(self.cross_attn(x, memory, memory_mask, kv_cache=memory_kv,
                                                 packing=packing)))
        return f.norm(x + f.dropout(self.ffn(x)))  # post-norm: LN(x + Dropout(F(x)))

    def backward(self, dy: Array) -> tuple[Array, Array]:
        """dy -> (dx, dmemory (B, S, D)); dx in the form of forward's x.  Pre-norm: each
        sublayer's input LN(x) is computed again from the norm's cache."""
        if not self.norm_first:  # post-norm: the textbook block's lines
            return super().backward(dy)
        a, c, f = self.self_attn_residual, self.cross_attn_residual, self.ffn_residual
        dh = self.ffn.backward(f.dropout.backward(dy), f.norm.output_again())
        dx = dy + f.norm.backward(dh)
        dh, dmemory = self.cross_attn.backward(c.dropout.backward(dx), c.norm.output_again())
        dx = dx + c.norm.backward(dh)
        dh = self.self_attn.backward(a.dropout.backward(dx), a.norm.output_again())
        return dx + a.norm.backward(dh), dmemory
