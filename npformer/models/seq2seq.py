"""Encoder-decoder Transformer ("Attention is all you need"; d2l's English-French model).

    source ids (B, S) -> embeddings * sqrt(D) + sinusoids -> N encoder blocks -> memory
    target ids (B, T) -> embeddings * sqrt(D) + sinusoids -> N decoder blocks
                         (causal + padding self-attention, cross-attention to memory)
                      -> linear -> logits (B, T, V_tgt)

With ``tie_weights`` the output projection is the target embedding transposed (the
Transformer paper's sharing, Press & Wolf 2017): logits = y E_tgt^T, no bias, so the
target table E_tgt receives gradient from both ends (``Embedding.project``).

Padding is hidden by the masks: source padding keys from the encoder's self-attention
and from cross-attention, target padding keys (and every later position) from the
decoder's self-attention.  Training asks for the logits at the valid target positions
only (``valid_only=True``, :class:`npformer.train.tasks.Translation`): (N, V_tgt), the rows a
loss over real tokens reads.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import backend, ops
from ..backend import Array
from ..nn import DecoderBlock, DecodingCache, EncoderBlock, KVCache, LayerNorm, Linear, Module
from ..nn.cache import check_decoding_cache
from ..ops.contracts import check_flag, check_rank
from .common import (
    TokenEmbedding,
    block_options,
    check_config,
    check_lengths,
    check_weights_fit,
    decoder_mask,
    final_norm,
    inference_only,
    model_input,
    valid_lengths,
)


@dataclass
class Seq2SeqConfig:
    """The shape of a :class:`Seq2SeqTransformer` (saved with its checkpoints).

    src_vocab_size, tgt_vocab_size: the two vocabularies; d_model: width D; num_heads:
    H; num_encoder_layers, num_decoder_layers: blocks on each side; d_ff: feed-forward
    width; block_size: the longest sequence on either side; dropout: probability in
    [0, 1); activation: "relu", "gelu" or "gelu_tanh"; norm_first: pre-norm blocks
    instead of post-norm; head_dim: per-head width E (default D / H); positional:
    "sinusoidal" or "learned"; scale_embeddings: multiply embeddings by sqrt(D);
    tie_weights: the output projection is the target embedding transposed (no bias);
    pad_id, bos_id, eos_id: the special target ids (padding, start, end) decoding uses;
    narrow_heads, qk_norm: the attention's options (:class:`npformer.nn.MultiHeadAttention`);
    norm_eps: every layer norm's epsilon.  Invalid values raise ValueError naming the field.
    """

    src_vocab_size: int
    tgt_vocab_size: int
    d_model: int = 256
    num_heads: int = 4
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    d_ff: int = 1024
    block_size: int = 64
    dropout: float = 0.1
    activation: str = "relu"
    norm_first: bool = False
    head_dim: int | None = None
    positional: str = "sinusoidal"
    scale_embeddings: bool = True
    tie_weights: bool = False
    pad_id: int = 0
    bos_id: int = 2
    eos_id: int = 3
    narrow_heads: bool = False
    qk_norm: bool = False
    norm_eps: float = ops.layernorm.EPS

    def __post_init__(self):
        check_config(self)


class Seq2SeqTransformer(Module):
    """Encoder-decoder Transformer: source ids (B, S), target ids (B, T) -> logits
    (B, T, V_tgt).

    ``model(src, tgt_in)`` with ``tgt_in`` the target shifted right (starting with
    ``bos_id``); train it with :class:`npformer.train.tasks.Translation`; decode with
    :func:`npformer.decoding.greedy_decode` or :func:`npformer.decoding.beam_search`
    (which use :meth:`encode` and the cached decoder).  See the module docstring.
    """

    kind = "seq2seq"
    config_class = Seq2SeqConfig
    # the layers it builds; the fast tier's model names its own
    TokenEmbedding, EncoderBlock, DecoderBlock, LayerNorm, Linear, KVCache = \
        TokenEmbedding, EncoderBlock, DecoderBlock, LayerNorm, Linear, KVCache

    def __init__(self, config: Seq2SeqConfig):
        check_weights_fit(config)  # before any table is allocated
        self.config = c = config
        self.src_embed = self.TokenEmbedding(c.src_vocab_size, c.d_model, c.block_size,
                                             c.positional, c.dropout, c.scale_embeddings,
                                             init_std=c.d_model ** -0.5)
        self.tgt_embed = self.TokenEmbedding(c.tgt_vocab_size, c.d_model, c.block_size,
                                             c.positional, c.dropout, c.scale_embeddings,
                                             init_std=c.d_model ** -0.5)
        self.encoder = [self.EncoderBlock(c.d_model, c.num_heads, c.d_ff, c.dropout, c.activation,
                                          c.norm_first, c.head_dim, **block_options(c))
                        for _ in range(c.num_encoder_layers)]
        self.encoder_norm = final_norm(c, self.LayerNorm)
        self.decoder = [self.DecoderBlock(c.d_model, c.num_heads, c.d_ff, c.dropout, c.activation,
                                          c.norm_first, c.head_dim, **block_options(c))
                        for _ in range(c.num_decoder_layers)]
        self.decoder_norm = final_norm(c, self.LayerNorm)
        self.lm_head = None if c.tie_weights else self.Linear(c.d_model, c.tgt_vocab_size)

    # ------------------------------------------------------------------ training
    def encode(self, src: Array, src_lens: Array | None = None) -> tuple[Array, Array]:
        """src (B, S), src_lens (B,) (default: the non-pad ids of each row) -> memory
        (B, S, D), memory mask (B, 1, 1, S) (True at the source's tokens)."""
        src, src_lens = model_input(src, "source ids"), model_input(src_lens, "src_lens", rank=1)
        check_rank(src, 2, "source ids (batch, positions)")
        src_lens = valid_lengths(src, src_lens, self.config.pad_id, "src")  # (B,)
        mask = ops.padding_mask(src_lens, src.shape[1])  # (B, 1, 1, S): padding keys hidden
        x = self.src_embed(src)  # (B, S, D)
        for block in self.encoder:
            x = block(x, mask)
        if self.encoder_norm is not None:
            x = self.encoder_norm(x)
        return x, mask  # (B, S, D): cross-attention's context

    def check_inputs(self, src: Array, tgt_in: Array, src_lens: Array | None = None,
                     tgt_lens: Array | None = None, *, valid_only: bool = False) -> None:
        src, tgt_in = model_input(src, "source ids"), model_input(tgt_in, "target ids")
        src_lens = model_input(src_lens, "src_lens", rank=1)
        tgt_lens = model_input(tgt_lens, "tgt_lens", rank=1)
        check_rank(src, 2, "source ids (batch, positions)")
        check_rank(tgt_in, 2, "target ids (batch, positions)")
        if tgt_in.shape[0] != src.shape[0]:
            raise ValueError(f"target batch of {tgt_in.shape[0]} sequences does not match "
                             f"the source batch of {src.shape[0]}")
        self.src_embed.check_inputs(src)
        self.tgt_embed.check_inputs(tgt_in)
        check_lengths(src, src_lens, "src_lens")
        check_lengths(tgt_in, tgt_lens, "tgt_lens")
        check_flag(valid_only, "valid_only")

    def forward(self, src: Array, tgt_in: Array, src_lens: Array | None = None,
                tgt_lens: Array | None = None, *, valid_only: bool = False) -> Array:
        """src (B, S), tgt_in (B, T) (target shifted right, starting with <bos>) -> logits
        (B, T, V_tgt).  src_lens (default: the non-pad ids of each row) and tgt_lens
        (default: every target position is a token) give each row's valid positions.

        ``valid_only=True``: the logits at the valid target positions only, (N, V_tgt) with
        N = sum(tgt_lens), in row order (b, then t): what a loss over real tokens reads.

        Ids and lengths may be arrays or nested lists.  Empty axes: B = 0 or T = 0 give
        the empty logits; a source without positions (S = 0) is, like an all-padding
        source, nothing to attend to: cross-attention gives zero, as for masked keys."""
        tgt_in, tgt_lens, memory, memory_mask, self_mask = self._decoder_inputs(
            src, tgt_in, src_lens, tgt_lens)
        y = self.tgt_embed(tgt_in)  # (B, T, D)
        for block in self.decoder:
            y = block(y, memory, self_mask, memory_mask)
        if self.decoder_norm is not None:
            y = self.decoder_norm(y)
        logits = self._logits(y)  # (B, T, V_tgt)
        rows_saved = None
        if valid_only:
            logits, rows_saved = ops.valid_rows_forward(logits, tgt_lens)  # (N, V_tgt)
        self._save((rows_saved,))
        return logits

    def _decoder_inputs(self, src: Array, tgt_in: Array, src_lens: Array | None,
                        tgt_lens: Array | None) -> tuple[Array, Array, Array, Array, Array]:
        """What the decoder blocks read, from forward's arguments: (tgt_in (B, T), tgt_lens
        (B,), memory (B, S, D), memory_mask (B, 1, 1, S), self_mask (B, 1, T, T)): the
        source encoded, and the targets' causal mask with their padding hidden."""
        src, tgt_in = model_input(src, "source ids"), model_input(tgt_in, "target ids")
        tgt_lens = self._target_lengths(tgt_in, model_input(tgt_lens, "tgt_lens", rank=1))
        memory, memory_mask = self.encode(src, src_lens)  # (B, S, D), (B, 1, 1, S)
        length = tgt_in.shape[1]
        self_mask = ops.causal_mask(length, like=memory)[None, None, :, :] \
            & ops.padding_mask(tgt_lens, length)  # (B, 1, T, T)
        return tgt_in, tgt_lens, memory, memory_mask, self_mask

    @staticmethod
    def _target_lengths(tgt_in: Array, tgt_lens: Array | None) -> Array:
        """tgt_lens, or (B,) of T: every target position a token (the decoder may emit
        pad_id itself, and under the causal mask a padding at the end changes no earlier
        position, so none is inferred)."""
        if tgt_lens is not None:
            return tgt_lens
        xp = backend.namespace_of(tgt_in)
        return xp.full((tgt_in.shape[0],), tgt_in.shape[1], dtype=xp.int64,
                       device=backend.device_of(tgt_in))

    def backward(self, dlogits: Array) -> None:
        """dlogits in the form forward returned -> None (ids are not differentiable)."""
        (rows_saved,) = self._pop_saved()
        if rows_saved is not None:
            dlogits = ops.valid_rows_backward(dlogits, rows_saved)  # (N, V) -> (B, T, V)
        dy, dx = self._decoder_backward(self._logits_backward(dlogits))  # (B, T|S, D)
        self.tgt_embed.backward(dy)
        if self.encoder_norm is not None:
            dx = self.encoder_norm.backward(dx)
        self._gradients_final(self.encoder_norm)
        for block in reversed(self.encoder):
            dx = block.backward(dx)
            self._gradients_final(block)
        return self.src_embed.backward(dx)

    def _decoder_backward(self, dy: Array) -> tuple[Array, Array]:
        """dy at the final norm's output -> (dy at the decoder's input, dmemory (B, S, D))."""
        if self.decoder_norm is not None:
            dy = self.decoder_norm.backward(dy)
        self._gradients_final(self.lm_head, self.decoder_norm)  # (a tied one: tgt_embed's)
        dmemory = None
        for block in reversed(self.decoder):
            dy, dmem = block.backward(dy)
            self._gradients_final(block)
            dmemory = dmem if dmemory is None else dmemory + dmem  # memory feeds every block
        return dy, dmemory

    def _logits(self, y: Array) -> Array:
        """y (..., D) -> logits (..., V_tgt): y E_tgt^T when tied, else the projection."""
        if self.lm_head is None:
            return self.tgt_embed.tokens.project(y)
        return self.lm_head(y)

    def _logits_backward(self, dlogits: Array) -> Array:
        """dlogits (..., V_tgt) -> dy (..., D) (tied: E_tgt's second share of gradient)."""
        if self.lm_head is None:
            return self.tgt_embed.tokens.project_backward(dlogits)
        return self.lm_head.backward(dlogits)

    # ------------------------------------------------------------------ cached inference
    def new_cache(self) -> DecodingCache:
        """An empty key/value cache for :meth:`forward_cached`."""
        return DecodingCache(len(self.decoder), cross=True, layer_cache=self.KVCache)

    def forward_cached(self, tgt_ids: Array, memory: Array, memory_mask: Array | None,
                       kv_cache: DecodingCache) -> Array:
        """Inference (under ``no_grad``): tgt_ids (B, T_new) are the target positions after
        the ``kv_cache.length`` already decoded -> logits (B, T_new, V); self-attention keys
        and values are cached, cross-attention ones computed once from ``memory``."""
        inference_only("forward_cached")
        check_decoding_cache(kv_cache, len(self.decoder), type(self).__name__, cross=True)
        offset = kv_cache.length
        y = self.tgt_embed(tgt_ids, offset=offset)  # (B, T_new, D)
        self_mask = decoder_mask(None, tgt_ids.shape[1], offset + tgt_ids.shape[1], like=y)
        for block, block_cache in zip(self.decoder, kv_cache.blocks):
            y = block(y, memory, self_mask, memory_mask, kv_cache=block_cache)
        if self.decoder_norm is not None:
            y = self.decoder_norm(y)
        return self._logits(y)
