"""Llama-shaped causal language model: Llama 3, SmolLM2, TinyLlama, Qwen2, Qwen3.

    ids (B, T) -> token embeddings -> N pre-norm blocks (RMS norms, grouped-query
               attention with rotary positions, SwiGLU feed-forward) -> final RMS norm
               -> logits (B, T, V)

The layers are :class:`npformer.nn.LlamaBlock` s (see :mod:`npformer.nn.llama` for the
math); the rotary tables of the batch's positions are computed once per forward and shared
by every block.  With ``tie_weights`` the output projection is the token embedding
transposed (SmolLM2, Llama 3.2 1B, small Qwen models), else its own ``lm_head``.

The interface is :class:`npformer.models.CausalLM`'s (``forward(ids, attention_mask,
position_ids)``, ``backward``, ``new_cache``, ``forward_cached``), so the same Trainer
task, :func:`npformer.decoding.generate` and checkpoints (its ``kind``, ``"llama"``) work.
Padding as Hugging Face passes it: ``attention_mask`` (B, T) holds 1 at tokens and 0 at
padding, the positions count each row's tokens from 0, and the rotation makes every
row's scores those of the row alone (rotary scores depend on distances only).  Hugging
Face folders: :meth:`LlamaCausalLM.from_pretrained`, :meth:`LlamaCausalLM.save_pretrained`
(:mod:`npformer.hf.llama`).
"""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass

from .. import backend, ops
from ..backend import Array
from ..hf import llama as hf_llama
from ..nn import DecodingCache, Embedding, KVCache, Linear, LlamaBlock, Module, RMSNorm
from ..nn.cache import check_decoding_cache, check_layer_cache
from ..nn.llama import check_kv_heads
from ..ops.contracts import (
    check_flag,
    check_rank,
    check_rope_scaling,
    check_rotary_width,
    check_token_ids,
    shown,
    trusting,
)
from .common import decoder_mask, inference_only, model_input
from .configs import _is_int, _set_field
from .lm import keys_and_positions, logits_backward, logits_of

_SIZE_FIELDS = ("vocab_size", "d_model", "d_ff", "num_layers", "num_heads", "block_size")
_FLAG_FIELDS = ("tie_weights", "attention_bias", "qkv_bias", "qk_norm")


@dataclass
class LlamaConfig:
    """The shape of a :class:`LlamaCausalLM`, in npformer's names (the table in
    docs/guide.md; :data:`npformer.hf.llama.FIELDS` maps config.json's to them).

    vocab_size: V; d_model: D; d_ff: the feed-forward width; num_layers: blocks;
    num_heads: H; num_kv_heads: Hkv, dividing H (None: H; 1: multi-query); head_dim: E,
    even (None: D / H); block_size: the longest context; norm_eps: every RMS norm's epsilon;
    rope_theta: the rotary base; rope_scaling: None or a ``llama3`` rope_scaling dict;
    tie_weights: the output projection is the token embedding transposed;
    attention_bias: biases on the q, k, v and output projections (Llama's and Qwen3's
    field); qkv_bias: biases on q, k and v only (Qwen2's); qk_norm: an RMS norm over each
    head's queries and keys (Qwen3).  Invalid values raise ValueError naming the field.
    """

    vocab_size: int
    d_model: int = 128
    d_ff: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    head_dim: int | None = None
    block_size: int = 256
    norm_eps: float = ops.rmsnorm.EPS
    rope_theta: float = ops.rotary.THETA
    rope_scaling: dict | None = None
    tie_weights: bool = True
    attention_bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self):
        check_llama_config(self)


def check_llama_config(config: LlamaConfig) -> None:
    """Validate a :class:`LlamaConfig`, naming the field in every message, as
    :func:`npformer.models.configs.check_config` does for the other configs; None for
    num_kv_heads and head_dim is resolved (H and D / H, as Hugging Face does)."""
    name = type(config).__name__
    for field in _SIZE_FIELDS:
        value = getattr(config, field)
        if not _is_int(value) or value < 1:
            raise ValueError(f"{name}.{field} must be a positive integer, got {shown(value)}")
        _set_field(config, field, int(value))
    heads = config.num_heads
    for field, default in (("num_kv_heads", heads),
                           ("head_dim", config.d_model // heads)):
        value = getattr(config, field)
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"{name}.{field} must be None or a positive integer, got "
                             f"{shown(value)}")
        if value is None and field == "head_dim" and config.d_model % heads:
            raise ValueError(f"{name}.d_model {config.d_model} is not divisible by "
                             f"{name}.num_heads {heads}: set head_dim explicitly")
        object.__setattr__(config, field, default if value is None else int(value))
    check_kv_heads(heads, config.num_kv_heads, f"{name}.num_heads",
                   f"{name}.num_kv_heads")
    check_rotary_width(config.head_dim, f"{name}.head_dim")
    for field in ("norm_eps", "rope_theta"):
        value = getattr(config, field)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}.{field} must be a finite number > 0, got {shown(value)}")
        _set_field(config, field, float(value))
    try:
        check_rope_scaling(config.rope_scaling)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}.rope_scaling: {exc}") from None
    for field in _FLAG_FIELDS:
        _set_field(config, field, check_flag(getattr(config, field), f"{name}.{field}"))


class LlamaCausalLM(Module):
    """Llama-shaped language model: ids (B, T) -> next-token logits (B, T, V) (see the
    module docstring).  Its parts are ``embed``, ``blocks``, ``norm`` and ``lm_head``
    (:func:`npformer.hf.llama.npformer_name` maps Hugging Face's names to them)."""

    kind = "llama"  # as checkpoints name it
    config_class = LlamaConfig
    Embedding, LlamaBlock, RMSNorm, Linear, KVCache = \
        Embedding, LlamaBlock, RMSNorm, Linear, KVCache

    def __init__(self, config: LlamaConfig):
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"LlamaCausalLM takes a LlamaConfig, got {type(config).__name__}")
        self.config = c = config
        self.embed = self.Embedding(c.vocab_size, c.d_model, init_std=0.02)
        self.blocks = [self.LlamaBlock(c.d_model, c.num_heads,
                                       c.d_ff, c.num_kv_heads, c.head_dim,
                                       qkv_bias=c.attention_bias or c.qkv_bias,
                                       output_bias=c.attention_bias, qk_norm=c.qk_norm,
                                       norm_eps=c.norm_eps)
                       for _ in range(c.num_layers)]
        self.norm = self.RMSNorm(c.d_model, c.norm_eps)
        self.lm_head = None if c.tie_weights else \
            self.Linear(c.d_model, c.vocab_size, bias=False)

    def check_inputs(self, ids: Array, attention_mask: Array | None = None,
                     position_ids: Array | None = None) -> None:
        ids = model_input(ids, "token ids")
        check_rank(ids, 2, "token ids (batch, positions)")
        keys_and_positions(ids, attention_mask, position_ids, self.config.block_size)
        self._check_context(ids.shape[1], position_ids)
        check_token_ids(ids, self.config.vocab_size)

    def _check_context(self, length: int, position_ids: Array | None, cached: int = 0) -> None:
        """``cached`` positions and ``length`` new ones fit the model's context (positions
        counted from 0 reach cached + length - 1); given position_ids are checked apart."""
        if position_ids is None and cached + length > self.config.block_size:
            held = f" ({cached} cached and {length} new)" if cached else ""
            raise ValueError(f"sequence of length {cached + length}{held} is longer than "
                             f"block_size {self.config.block_size} (the model's "
                             "context); raise it in the model's config")

    def forward(self, ids: Array, attention_mask: Array | None = None,
                position_ids: Array | None = None) -> Array:
        """ids (B, T) -> logits (B, T, V); ``attention_mask`` (B, T) 1 at tokens, 0 at
        padding; ``position_ids`` (B, T) or (T,), by default counted over each row's
        tokens (see the module docstring)."""
        ids = model_input(ids, "token ids")
        x, cos, sin, mask = self._inputs(ids, attention_mask, position_ids)  # (B, T, D)
        for block in self.blocks:
            x = block(x, cos, sin, mask)
        return self._logits(self.norm(x))  # (B, T, V)

    def _inputs(self, ids: Array, attention_mask: Array | None, position_ids: Array | None,
                offset: int = 0) -> tuple[Array, Array, Array, Array]:
        """ids (B, T) after ``offset`` positions -> their embeddings (B, T, D), the rotary
        tables (T, E) or (B, T, E) of their positions, and the blocks' mask: causal (T, S)
        without an attention mask, else causal and the keys' padding (B, 1, T, S)."""
        c = self.config
        keep, positions = keys_and_positions(ids, attention_mask, position_ids,
                                             c.block_size, offset)
        x = self.embed(ids)  # (B, T, D)
        xp = backend.namespace_of(x)
        length, keys = ids.shape[1], offset + ids.shape[1]
        if positions is None:
            positions = xp.arange(offset, keys, dtype=xp.int64, device=backend.device_of(x))
        cos, sin = ops.rotary_table(positions, c.head_dim, c.rope_theta, c.rope_scaling,
                                    dtype=x.dtype)  # (T, E) or (B, T, E)
        return x, cos, sin, decoder_mask(keep, length, keys, like=x)

    def backward(self, dlogits: Array) -> None:
        """dlogits (B, T, V) -> None (token ids are not differentiable)."""
        dx = self.norm.backward(self._logits_backward(dlogits))  # (B, T, D)
        self._gradients_final(self.lm_head, self.norm)  # (a tied head is the embedding's)
        for block in reversed(self.blocks):
            dx = block.backward(dx)
            self._gradients_final(block)
        return self.embed.backward(dx)

    def _logits(self, h: Array) -> Array:
        return logits_of(h, self.embed, self.lm_head)

    def _logits_backward(self, dlogits: Array) -> Array:
        return logits_backward(dlogits, self.embed, self.lm_head)

    # ------------------------------------------------------------------ cached inference
    def new_cache(self) -> DecodingCache:
        """An empty key/value cache for :meth:`forward_cached` (each layer's Hkv heads)."""
        return DecodingCache(len(self.blocks), layer_cache=self.KVCache)

    def forward_cached(self, ids: Array, kv_cache: DecodingCache,
                       attention_mask: Array | None = None,
                       position_ids: Array | None = None) -> Array:
        """Inference (under ``no_grad``): ids (B, T_new) are the positions after the
        ``kv_cache.length`` already decoded -> logits (B, T_new, V); the cache grows by T_new.
        ``attention_mask`` (B, kv_cache.length + T_new) covers the cached positions and the
        new ones; ``position_ids`` (B, T_new) the new ones."""
        inference_only("forward_cached")
        check_decoding_cache(kv_cache, len(self.blocks), type(self).__name__)
        ids = model_input(ids, "token ids")
        check_rank(ids, 2, "token ids (batch, positions)")
        self._check_context(ids.shape[1], position_ids, kv_cache.length)
        for block, block_cache in zip(self.blocks, kv_cache.blocks):  # this batch's caches
            attn = block.self_attn
            check_layer_cache(block_cache.self_attn, ids.shape[0], attn.num_kv_heads,
                              attn.head_dim)
        x, cos, sin, mask = self._inputs(ids, attention_mask, position_ids,
                                         kv_cache.length)  # ids, mask, positions checked
        with trusting():  # the layers' inputs are this model's own: no layer checks them again
            for block, block_cache in zip(self.blocks, kv_cache.blocks):
                x = block(x, cos, sin, mask, kv_cache=block_cache.self_attn)
            return self._logits(self.norm(x))

    # ------------------------------------------------------------------ Hugging Face
    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike,
                        dtype: str | None = None) -> LlamaCausalLM:
        """A ``cls`` (the fast tier's from ``npformer.fast.LlamaCausalLM``) of a Llama, Qwen2
        or Qwen3 Hugging Face folder or Hub name (:func:`npformer.hf.llama.load_folder`)."""
        return hf_llama.load_folder(cls, name_or_path, dtype=dtype)

    def save_pretrained(self, path: str | os.PathLike) -> os.PathLike:
        """Write this model as a Hugging Face folder of its family, which transformers'
        ``AutoModelForCausalLM`` loads; -> the folder (:func:`npformer.hf.llama.save_folder`)."""
        return hf_llama.save_folder(self, path)
