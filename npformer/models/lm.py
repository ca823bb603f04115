"""Decoder-only causal language model (GPT-2 / nanoGPT shape).

    ids (B, T) -> token + learned position embeddings -> N causal self-attention
               blocks -> final layer norm (pre-norm) -> logits (B, T, V)

With ``tie_weights`` the output projection is the token embedding transposed,
logits = h E^T (``Embedding.project``), so E receives gradient from both ends.

Padding, as Hugging Face passes it: ``attention_mask`` (B, T) holds 1 at the tokens
and 0 at padding, anywhere in a row (a batch of prompts is left-padded for
generation).  Position t of row b may attend to position s when s <= t (causal) and
s is a token; positions count each row's tokens from 0 (``position_ids``, by default
the tokens before each one, as Hugging Face's ``generate`` derives them), so a row's
tokens get the logits they get alone.  A padding position's logits are computed and
mean nothing; a row of padding only gives finite ones (a query with no key to attend
to gets a zero attention output).

Hugging Face GPT-2 folders: :meth:`CausalLM.from_pretrained` and
:meth:`CausalLM.save_pretrained` (:mod:`npformer.hf.gpt2`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .. import backend, ops
from ..backend import Array
from ..hf import gpt2
from ..nn import DecodingCache, EncoderBlock, KVCache, LayerNorm, Linear, Module
from ..nn.cache import check_decoding_cache, check_layer_cache
from ..ops.contracts import check_rank, trusting
from .common import (
    TokenEmbedding,
    attention_mask_input,
    block_options,
    check_config,
    check_weights_fit,
    decoder_mask,
    final_norm,
    inference_only,
    model_input,
    position_ids_input,
)


@dataclass
class CausalLMConfig:
    """The shape of a :class:`CausalLM` (saved with its checkpoints).

    vocab_size: V; block_size: the longest context T; d_model: width D; num_heads: H;
    num_layers: blocks; d_ff: feed-forward width; dropout: probability in [0, 1);
    activation: "relu", "gelu" or "gelu_tanh"; norm_first: pre-norm blocks and a final
    layer norm (GPT-2) instead of post-norm; head_dim: per-head width E (default D / H);
    positional: "learned" or "sinusoidal"; tie_weights: the output projection is the token
    embedding transposed; norm_eps: every layer norm's epsilon (GPT-2's 1e-5);
    narrow_heads, qk_norm: the attention's options (:class:`npformer.nn.MultiHeadAttention`:
    Bloem's narrow heads, a layer norm over each head's queries and keys).  Invalid values
    raise ValueError naming the field.
    """

    vocab_size: int
    block_size: int = 64
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 4
    d_ff: int = 512
    dropout: float = 0.0
    activation: str = "gelu"
    norm_first: bool = True
    head_dim: int | None = None
    positional: str = "learned"
    tie_weights: bool = True
    norm_eps: float = ops.layernorm.EPS
    narrow_heads: bool = False
    qk_norm: bool = False

    def __post_init__(self):
        check_config(self)


class CausalLM(Module):
    """Decoder-only language model: ids (B, T) -> next-token logits (B, T, V).

    Causal self-attention blocks (GPT-2 / nanoGPT shape; see the module docstring).
    Train it with :class:`npformer.train.tasks.LanguageModeling`; sample with
    :func:`npformer.decoding.generate`, which uses :meth:`forward_cached` and a
    key/value cache (:meth:`new_cache`).
    """

    kind = "causal_lm"
    config_class = CausalLMConfig
    # the layers it builds; the fast tier's model names its own
    TokenEmbedding, EncoderBlock, LayerNorm, Linear, KVCache = \
        TokenEmbedding, EncoderBlock, LayerNorm, Linear, KVCache

    def __init__(self, config: CausalLMConfig):
        check_weights_fit(config)  # before any table is allocated
        self.config = c = config
        self.embed = self.TokenEmbedding(c.vocab_size, c.d_model, c.block_size, c.positional,
                                    c.dropout, scale_by_sqrt_d=False, init_std=0.02)
        self.blocks = [self.EncoderBlock(c.d_model, c.num_heads, c.d_ff, c.dropout, c.activation,
                                         c.norm_first, c.head_dim, **block_options(c))
                       for _ in range(c.num_layers)]
        self.norm = final_norm(c, self.LayerNorm)
        self.lm_head = None if c.tie_weights else self.Linear(c.d_model, c.vocab_size,
                                                                 bias=False)

    def check_inputs(self, ids: Array, attention_mask: Array | None = None,
                     position_ids: Array | None = None) -> None:
        ids = model_input(ids, "token ids")
        _, positions = keys_and_positions(ids, attention_mask, position_ids,
                                          self.config.block_size)
        self.embed.check_inputs(ids, position_ids=positions)

    def forward(self, ids: Array, attention_mask: Array | None = None,
                position_ids: Array | None = None) -> Array:
        """ids (B, T) with T <= block_size -> logits (B, T, V); ids an array or a nested
        list.  An empty batch or T = 0 gives the empty logits (0, T, V) or (B, 0, V).

        ``attention_mask`` (B, T): 1 at tokens, 0 at padding (anywhere); ``position_ids``
        (B, T), or (T,) for every row: each token's position, by default counted over the
        row's tokens (see the module docstring)."""
        ids = model_input(ids, "token ids")
        x, mask = self._embedded(ids, attention_mask, position_ids)  # (B, T, D), mask
        return self._logits(self._stack(x, mask))  # (B, T, V)

    def _stack(self, x: Array, mask: Array | None,
               kv_cache: DecodingCache | None = None) -> Array:
        """x (B, T, D) -> the blocks, each with its cache in ``kv_cache`` if given, then the
        final norm (pre-norm) -> (B, T, D) (a step of its own: the fast tier's model runs
        it compiled where nothing is recorded)."""
        caches = [None] * len(self.blocks) if kv_cache is None else kv_cache.blocks
        for block, block_cache in zip(self.blocks, caches):
            x = block(x, mask, kv_cache=block_cache)
        return x if self.norm is None else self.norm(x)

    def _embedded(self, ids: Array, attention_mask: Array | None, position_ids: Array | None,
                  offset: int = 0) -> tuple[Array, Array]:
        """ids (B, T) after ``offset`` positions -> their embeddings (B, T, D) and the
        blocks' mask: causal (T, S) without an attention mask, else causal and the keys'
        padding, (B, 1, T, S); S = offset + T."""
        keep, positions = keys_and_positions(ids, attention_mask, position_ids,
                                             self.config.block_size, offset)
        x = self.embed(ids, offset=offset, position_ids=positions)  # (B, T, D)
        return x, decoder_mask(keep, ids.shape[1], offset + ids.shape[1], like=x)

    def backward(self, dlogits: Array) -> None:
        """dlogits (B, T, V) -> None (token ids are not differentiable)."""
        dx = self._logits_backward(dlogits)  # (B, T, D)
        if self.norm is not None:
            dx = self.norm.backward(dx)
        self._gradients_final(self.lm_head, self.norm)  # (a tied head is the embedding's)
        for block in reversed(self.blocks):
            dx = block.backward(dx)
            self._gradients_final(block)
        return self.embed.backward(dx)

    def _logits(self, h: Array) -> Array:
        return logits_of(h, self.embed.tokens, self.lm_head)

    def _logits_backward(self, dlogits: Array) -> Array:
        return logits_backward(dlogits, self.embed.tokens, self.lm_head)

    # ------------------------------------------------------------------ cached inference
    def new_cache(self) -> DecodingCache:
        """An empty key/value cache for :meth:`forward_cached`."""
        return DecodingCache(len(self.blocks), layer_cache=self.KVCache)

    def forward_cached(self, ids: Array, kv_cache: DecodingCache,
                       attention_mask: Array | None = None,
                       position_ids: Array | None = None) -> Array:
        """Inference (under ``no_grad``): ids (B, T_new) are the positions after the
        ``kv_cache.length`` already decoded -> logits (B, T_new, V); the cache grows by T_new.

        ``attention_mask`` (B, kv_cache.length + T_new) covers the cached positions and the
        new ones (as Hugging Face passes it); ``position_ids`` (B, T_new) the new ones."""
        inference_only("forward_cached")
        check_decoding_cache(kv_cache, len(self.blocks), type(self).__name__)
        ids = model_input(ids, "token ids")
        check_rank(ids, 2, "token ids (batch, positions)")
        for block, block_cache in zip(self.blocks, kv_cache.blocks):  # this batch's caches
            attn = block.self_attn
            check_layer_cache(block_cache.self_attn, ids.shape[0], attn.num_heads, attn.head_dim)
        x, mask = self._embedded(ids, attention_mask, position_ids,
                                 kv_cache.length)  # (B, T_new, D): ids, mask, positions checked
        with trusting():  # the layers' inputs are this model's own: no layer checks them again
            return self._logits(self._stack(x, mask, kv_cache))

    # ------------------------------------------------------------------ Hugging Face
    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, dtype: str | None = None,
                        dropout: float = 0.0, **kwargs: Any) -> CausalLM:
        """A GPT-2 folder in Hugging Face's format, or a Hub name (``"gpt2"``) downloaded into
        the user's cache, as a ``cls`` (the fast tier's from ``npformer.fast.CausalLM``).
        See :func:`npformer.hf.gpt2.load_folder`."""
        return gpt2.load_folder(cls, name_or_path, dtype=dtype, dropout=dropout, **kwargs)

    def save_pretrained(self, path: str | os.PathLike, tokenizer: Any = None) -> os.PathLike:
        """Write this model as the GPT-2 folder ``transformers.GPT2LMHeadModel`` loads (with
        ``tokenizer.json`` given a tokenizer); -> the folder.  See
        :func:`npformer.hf.gpt2.save_folder`."""
        return gpt2.save_folder(self, path, tokenizer=tokenizer)


def keys_and_positions(ids: Array, attention_mask: Array | None, position_ids: Array | None,
                       block_size: int, offset: int = 0) -> tuple[Array | None, Array | None]:
    """A decoder's inputs beside ids (B, T) after ``offset`` positions, checked -> the
    attention mask as booleans (B, S) (None: no padding) and the positions of ids (B, T)
    (None: offset, offset + 1, ...).  With a mask and no position_ids, the positions count
    each row's tokens (:func:`positions_of`)."""
    batch, length = ids.shape
    keep = None if attention_mask is None else \
        attention_mask_input(attention_mask, (batch, offset + length))
    if position_ids is not None:
        return keep, position_ids_input(position_ids, (batch, length), block_size)
    if keep is None:
        return None, None
    return keep, positions_of(keep)[:, offset:]


def logits_of(h: Array, table: Module, head: Module | None) -> Array:
    """h (B, T, D) -> logits (B, T, V): h E^T with the token table when tied (no head),
    else the head."""
    return table.project(h) if head is None else head(h)


def logits_backward(dlogits: Array, table: Module, head: Module | None) -> Array:
    """dlogits (B, T, V) -> dh (B, T, D) (tied: the table's second share of gradient)."""
    return table.project_backward(dlogits) if head is None else head.backward(dlogits)


def positions_of(keep: Array) -> Array:
    """keep (B, S) booleans, True at tokens -> (B, S) positions: the number of tokens
    before each one (cumulative sum minus 1), 0 where none is (left padding) — the
    positions Hugging Face's ``generate`` gives a padded batch."""
    xp = backend.namespace_of(keep)
    counts = xp.cumulative_sum(xp.astype(keep, xp.int64), axis=1)  # (B, S)
    return xp.maximum(counts - 1, xp.zeros_like(counts))
