"""Decoder-only causal language model (GPT-2 / nanoGPT shape).

    ids (B, T) -> token + learned position embeddings -> N causal self-attention
               blocks -> final layer norm (pre-norm) -> logits (B, T, V)

With ``tie_weights`` the output projection is the token embedding transposed,
logits = h E^T (``Embedding.project``), so E receives gradient from both ends.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import ops
from ..backend import Array
from ..nn import DecodingCache, EncoderBlock, Linear, Module
from .common import TokenEmbedding, check_config, final_norm, inference_only, model_input


@dataclass
class CausalLMConfig:
    """The shape of a :class:`CausalLM` (saved with its checkpoints).

    vocab_size: V; block_size: the longest context T; d_model: width D; num_heads: H;
    num_layers: blocks; d_ff: feed-forward width; dropout: probability in [0, 1);
    activation: "relu", "gelu" or "gelu_tanh"; norm_first: pre-norm blocks and a final
    layer norm (GPT-2) instead of post-norm; head_dim: per-head width E (default
    D / H); positional: "learned" or "sinusoidal"; tie_weights: the output projection
    is the token embedding transposed.  Invalid values raise ValueError naming the field.
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

    def __post_init__(self):
        check_config(self)


class CausalLM(Module):
    """Decoder-only language model: ids (B, T) -> next-token logits (B, T, V).

    Causal self-attention blocks (GPT-2 / nanoGPT shape; see the module docstring).
    Train it with :class:`npformer.tasks.LanguageModeling`; sample with
    :func:`npformer.decoding.generate`, which uses :meth:`forward_cached` and a
    key/value cache (:meth:`new_cache`).
    """

    kind = "causal_lm"
    config_class = CausalLMConfig

    def __init__(self, config: CausalLMConfig):
        self.config = c = config
        self.embed = TokenEmbedding(c.vocab_size, c.d_model, c.block_size, c.positional,
                                    c.dropout, scale_by_sqrt_d=False, init_std=0.02)
        self.blocks = [EncoderBlock(c.d_model, c.num_heads, c.d_ff, c.dropout, c.activation,
                                    c.norm_first, c.head_dim) for _ in range(c.num_layers)]
        self.norm = final_norm(c)
        self.lm_head = None if c.tie_weights else Linear(c.d_model, c.vocab_size, bias=False)

    def check_inputs(self, ids: Array) -> None:
        self.embed.check_inputs(model_input(ids, "token ids"))

    def forward(self, ids: Array) -> Array:
        """ids (B, T) with T <= block_size -> logits (B, T, V); ids an array or a nested
        list.  An empty batch or T = 0 gives the empty logits (0, T, V) or (B, 0, V)."""
        ids = model_input(ids, "token ids")
        x = self.embed(ids)  # (B, T, D)
        mask = ops.causal_mask(ids.shape[1], like=x)  # (T, T): no position sees a later one
        for block in self.blocks:
            x = block(x, mask)
        if self.norm is not None:
            x = self.norm(x)
        return self._logits(x)  # (B, T, V)

    def backward(self, dlogits: Array) -> None:
        """dlogits (B, T, V) -> None (token ids are not differentiable)."""
        dx = self._logits_backward(dlogits)  # (B, T, D)
        if self.norm is not None:
            dx = self.norm.backward(dx)
        for block in reversed(self.blocks):
            dx = block.backward(dx)
        return self.embed.backward(dx)

    def _logits(self, h: Array) -> Array:
        """h (B, T, D) -> logits (B, T, V): h E^T when tied, else the head."""
        return self.embed.tokens.project(h) if self.lm_head is None else self.lm_head(h)

    def _logits_backward(self, dlogits: Array) -> Array:
        """dlogits (B, T, V) -> dh (B, T, D) (tied: E's second share of gradient)."""
        if self.lm_head is None:
            return self.embed.tokens.project_backward(dlogits)
        return self.lm_head.backward(dlogits)

    # ------------------------------------------------------------------ cached inference
    def new_cache(self) -> DecodingCache:
        """An empty key/value cache for :meth:`forward_cached`."""
        return DecodingCache(len(self.blocks))

    def forward_cached(self, ids: Array, cache: DecodingCache) -> Array:
        """Inference (under ``no_grad``): ids (B, T_new) are the positions after the
        ``cache.length`` already decoded -> logits (B, T_new, V); the cache grows by T_new."""
        inference_only("forward_cached")
        offset = cache.length
        x = self.embed(ids, offset=offset)  # (B, T_new, D)
        mask = ops.causal_mask(ids.shape[1], offset + ids.shape[1], like=x)  # (T_new, S)
        for block, block_cache in zip(self.blocks, cache.blocks):
            x = block(x, mask, cache=block_cache)
        if self.norm is not None:
            x = self.norm(x)
        return self._logits(x)
