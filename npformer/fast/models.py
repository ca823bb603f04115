"""The three models of the fast tier.

Each is a subclass of its textbook model (:mod:`npformer.models`): the same
configuration, parameters, names and initial weights (its layers are the fast tier's,
built by the textbook constructor), the same outputs and gradients.  What each adds:

* its weights in one flat buffer as soon as it is built (:mod:`npformer.nn.flat`), which
  the optimizer adopts (so training never holds them twice) and the all-reduce sends;
* :class:`TransformerClassifier`, :class:`Seq2SeqTransformer`: the valid positions of a
  padded batch packed as rows once (:class:`npformer.fast.Packing`), the blocks run on
  them, unpacked where positions are read (pooling, cross-attention's memory); with
  ``valid_only`` the seq2seq model computes logits at the valid target positions only;
* :class:`CausalLM`: the final norm's output, the head's input, computed again in the
  backward rather than kept; under ``no_grad``, its blocks and final norm as one compiled
  call (:func:`npformer.fast.compiled.encoder_stack_forward`).

One difference is visible, and nothing of the models reads it: :meth:`encode`'s memory
holds zeros at the source's padding positions, where the textbook encoder computes
values that every mask then hides.

Tested equal to the textbook models in ``tests/test_fast_layers.py``.
"""
from __future__ import annotations

from collections.abc import Callable

from .. import models, ops
from ..backend import Array, keep_freed_memory
from ..gpu.gemm import capturing
from ..models.common import TokenEmbedding as _TokenEmbedding
from ..models.common import model_input, valid_lengths
from ..nn import LayerNorm
from ..nn.flat import flat_buffer, flat_buffer_of
from . import blocks, cache, compiled, layers, losses
from .packing import Packing


def packed_blocks(x: Array, blocks: list, norm: LayerNorm | None, mask: Array,
                  packing: Packing) -> Array:
    """x (B, T, D) -> the blocks, then the final norm (if any), on its valid positions:
    rows (N, D)."""
    x = packing.pack(x)  # (B, T, D) -> rows (N, D)
    for block in blocks:
        x = block(x, mask, packing=packing)
    return x if norm is None else norm(x)


def packed_blocks_backward(dx: Array, blocks: list, norm: LayerNorm | None,
                           packing: Packing, gradients_final: Callable) -> Array:
    """The backward of :func:`packed_blocks`: rows (N, D) -> dx (B, T, D), zeros at padding.
    ``gradients_final``: the model's :meth:`~npformer.nn.Module._gradients_final`."""
    if norm is not None:
        dx = norm.backward(dx)
    gradients_final(norm)
    for block in reversed(blocks):
        dx = block.backward(dx)
        gradients_final(block)
    return packing.unpack(dx)  # the backward of pack


def _textbook_forward(model, forward, *args, **kwargs) -> Array:
    """The textbook model's forward (its blocks this tier's, on padded rows), marked for
    the backward: what a step captured as a CUDA graph runs (:func:`.gemm.capturing`), as the
    packing of valid positions counts them on the host."""
    model._save(True, slot="_textbook_cache")
    return forward(*args, **kwargs)


def _ran_textbook_forward(model) -> bool:
    """Whether the last forward was :func:`_textbook_forward` (its mark taken)."""
    if getattr(model, "_textbook_cache", None) is None:
        return False
    model._pop_saved("_textbook_cache")
    return True


class TokenEmbedding(_TokenEmbedding):
    """The token embedding, positions and dropout (:mod:`npformer.models.common`) on this
    tier's layers."""

    Embedding, LearnedPositionalEmbedding, Dropout = \
        layers.Embedding, layers.LearnedPositionalEmbedding, layers.Dropout


class _FastModel:
    """What every fast model adds: this tier's layers and loss, its weights in one flat
    buffer from the start (:mod:`npformer.nn.flat`), and freed memory kept in the process
    (:func:`npformer.backend.keep_freed_memory`): each forward allocates the
    arrays the last one freed, so they are reused instead of page-faulted in again (the
    Trainer does the same for training with either tier)."""

    TokenEmbedding, Embedding, EncoderBlock, DecoderBlock, LayerNorm, Linear, KVCache = (
        TokenEmbedding, layers.Embedding, blocks.EncoderBlock, blocks.DecoderBlock,
        layers.LayerNorm, layers.Linear, cache.KVCache)
    # the loss the tasks compute on this model's logits: the gradient written over them
    cross_entropy_with_gradient = staticmethod(losses.cross_entropy_with_gradient)

    def __init__(self, config):
        super().__init__(config)
        self._flat = flat_buffer(self.parameters())
        keep_freed_memory()

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if self._flat is not None:
            self._flat.sync()  # the loaded arrays copied into the buffer at once

    def zero_grad(self) -> None:
        """Every gradient zero through the flat buffer (one fill), which keeps the record of
        the rows written, empty (:mod:`npformer.nn.flat`); the textbook's zeroing binds
        fresh zeros, whose rows are not known, so a data-parallel sum would then read the
        lookup tables whole.  Per parameter where no buffer holds exactly this model's."""
        flat = flat_buffer_of(self.parameters())
        if flat is None:
            return super().zero_grad()
        flat.zero_grad()

    def freeze(self):
        """Freeze every parameter (:meth:`npformer.nn.Module.freeze`) and let the flat
        gradient buffer of all of them go: the flat buffer is the trainable ones' (none)."""
        super().freeze()
        self._flat = None
        return self


class TransformerClassifier(_FastModel, models.TransformerClassifier):
    __doc__ = models.TransformerClassifier.__doc__

    def forward(self, ids: Array, valid_lens: Array | None = None) -> Array:
        if capturing():  # a step captured as a CUDA graph: the padded rows, as the textbook's
            return _textbook_forward(self, super().forward, ids, valid_lens)
        ids, valid_lens = self._ids_and_lengths(ids, valid_lens)  # (B, T), (B,)
        packing = Packing.from_lengths(valid_lens, ids.shape[1])
        mask = ops.padding_mask(valid_lens, ids.shape[1])  # (B, 1, 1, T)
        x = packed_blocks(self._embedded(ids), self.blocks, self.norm, mask, packing)  # (N, D)
        x = packing.unpack(x)  # (B, T, D): pooling reads the valid positions only
        pooled, pool_saved = ops.pool_forward(x, valid_lens, self.config.pooling)  # (B, D)
        self._save((pool_saved, packing))
        return self.head(pooled)  # (B, C)

    forward.__doc__ = models.TransformerClassifier.forward.__doc__

    def backward(self, dlogits: Array) -> None:
        if _ran_textbook_forward(self):
            return super().backward(dlogits)
        pool_saved, packing = self._pop_saved()
        dx = ops.pool_backward(self.head.backward(dlogits), pool_saved)  # (B, T, D)
        self._gradients_final(self.head)
        dx = packing.pack(dx)  # the backward of unpack
        return self._embedded_backward(packed_blocks_backward(dx, self.blocks, self.norm,
                                                              packing, self._gradients_final))


class CausalLM(_FastModel, models.CausalLM):
    __doc__ = models.CausalLM.__doc__

    def _stack(self, x: Array, mask: Array | None, kv_cache=None) -> Array:
        """As the textbook's; where nothing is recorded, one compiled call where it takes
        the inputs (no Python between the blocks), a decoding step's too."""
        y = compiled.encoder_stack_forward(self.blocks, self.norm, x, mask, kv_cache)
        return super()._stack(x, mask, kv_cache) if y is None else y

    def _logits(self, h: Array) -> Array:
        """h (B, T, D) -> logits (B, T, V).  Its own: h, the final norm's output, is not kept
        (the backward computes it again); without a final norm it is."""
        keep_input = self.norm is None
        if self.lm_head is None:
            return self.embed.tokens.project(h, keep_input)
        return self.lm_head(h, keep_input)

    def _logits_backward(self, dlogits: Array) -> Array:
        """dlogits (B, T, V) -> dh (B, T, D).  With a final norm, the head's input h was not
        kept: the norm computes it again (a temporary, for the head's backward only)."""
        h = None if self.norm is None else self.norm.output_again()  # (B, T, D)
        if self.lm_head is None:
            return self.embed.tokens.project_backward(dlogits, h)
        return self.lm_head.backward(dlogits, h)


class Seq2SeqTransformer(_FastModel, models.Seq2SeqTransformer):
    __doc__ = models.Seq2SeqTransformer.__doc__

    def encode(self, src: Array, src_lens: Array | None = None) -> tuple[Array, Array]:
        """As :meth:`npformer.models.Seq2SeqTransformer.encode`, the encoder on the source's
        valid positions packed as rows; the memory holds zeros at padding positions."""
        if capturing():  # a step captured as a CUDA graph: the textbook's, on padded rows
            return super().encode(src, src_lens)
        src, src_lens = model_input(src, "source ids"), model_input(src_lens, "src_lens", rank=1)
        src_lens = valid_lengths(src, src_lens, self.config.pad_id, "src")  # (B,)
        packing = Packing.from_lengths(src_lens, src.shape[1])
        mask = ops.padding_mask(src_lens, src.shape[1])  # (B, 1, 1, S)
        x = packed_blocks(self.src_embed(src), self.encoder, self.encoder_norm, mask,
                          packing)  # rows (N_src, D)
        self._save(packing, slot="_encode_saved")
        return packing.unpack(x), mask  # (B, S, D): cross-attention's context

    def forward(self, src: Array, tgt_in: Array, src_lens: Array | None = None,
                tgt_lens: Array | None = None, *, valid_only: bool = False) -> Array:
        if capturing():  # a step captured as a CUDA graph: the padded rows, as the textbook's
            return _textbook_forward(self, super().forward, src, tgt_in, src_lens, tgt_lens,
                                     valid_only=valid_only)
        tgt_in, tgt_lens, memory, memory_mask, self_mask = self._decoder_inputs(
            src, tgt_in, src_lens, tgt_lens)
        packing = Packing.from_lengths(tgt_lens, tgt_in.shape[1]) if valid_only else None
        y = self.tgt_embed(tgt_in)  # (B, T, D)
        if packing is not None:
            y = packing.pack(y)  # rows (N, D): only the valid targets get logits
        for block in self.decoder:
            y = block(y, memory, self_mask, memory_mask, packing=packing)
        if self.decoder_norm is not None:
            y = self.decoder_norm(y)
        self._save((packing,))
        return self._logits(y)  # (B, T, V_tgt), or rows (N, V_tgt) with valid_only

    forward.__doc__ = models.Seq2SeqTransformer.forward.__doc__

    def backward(self, dlogits: Array) -> None:
        if _ran_textbook_forward(self):
            return super().backward(dlogits)
        (packing,) = self._pop_saved()
        dy, dmemory = self._decoder_backward(self._logits_backward(dlogits))
        self.tgt_embed.backward(dy if packing is None else packing.unpack(dy))
        src_packing = self._pop_saved("_encode_saved")
        dx = src_packing.pack(dmemory)  # the backward of unpack
        return self.src_embed.backward(packed_blocks_backward(
            dx, self.encoder, self.encoder_norm, src_packing, self._gradients_final))
