"""Decoder-only causal language model (GPT-2 / nanoGPT shape).

    ids (B, T) -> token + learned position embeddings -> N causal self-attention
               blocks -> final layer norm (pre-norm) -> logits (B, T, V)

With ``tie_weights`` the output projection is the token embedding transposed,
logits = h E^T, so E receives gradient from both ends.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import backend, ops
from ..nn import EncoderBlock, Linear, Module
from .common import TokenEmbedding, check_config, final_norm


@dataclass
class CausalLMConfig:
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
    kind = "causal_lm"
    config_class = CausalLMConfig

    def __init__(self, config: CausalLMConfig):
        self.config = c = config
        self.embed = TokenEmbedding(c.vocab_size, c.d_model, c.block_size, c.positional,
                                    c.dropout, scale_by_sqrt_d=False, init_std=0.02,
                                    limit_name="block_size")
        self.blocks = [EncoderBlock(c.d_model, c.num_heads, c.d_ff, c.dropout, c.activation,
                                    c.norm_first, c.head_dim) for _ in range(c.num_layers)]
        self.norm = final_norm(c)
        self.lm_head = None if c.tie_weights else Linear(c.d_model, c.vocab_size, bias=False)

    def _project(self, h):
        """h (B, T, D) -> logits (B, T, V), cache."""
        if self.lm_head is not None:
            return self.lm_head(h), None
        xp = backend.namespace_of(h)
        table_t = xp.matrix_transpose(self.embed.tokens.weight.data)  # (D, V)
        return ops.linear_forward(h, table_t)  # logits = h E^T

    def forward(self, ids):
        """ids (B, T) with T <= block_size -> logits (B, T, V)."""
        x = self.embed(ids)  # (B, T, D)
        mask = ops.causal_mask(ids.shape[1], like=x)  # (T, T)
        for block in self.blocks:
            x = block(x, mask=mask)
        if self.norm is not None:
            x = self.norm(x)
        logits, tied_cache = self._project(x)
        self._save(("tied", tied_cache))
        return logits

    def backward(self, dlogits):
        _, tied_cache = self._pop_saved()
        if self.lm_head is not None:
            dx = self.lm_head.backward(dlogits)
        else:
            dx, dtable_t, _ = ops.linear_backward(dlogits, tied_cache)  # dtable_t (D, V)
            xp = backend.namespace_of(dtable_t)
            self.embed.tokens.weight.accumulate(xp.matrix_transpose(dtable_t))
        if self.norm is not None:
            dx = self.norm.backward(dx)
        for block in reversed(self.blocks):
            dx = block.backward(dx)
        self.embed.backward(dx)

    # ------------------------------------------------------------------ cached inference
    def start_state(self) -> list[dict]:
        return [{} for _ in self.blocks]

    def step(self, ids, states: list[dict], offset: int):
        """Inference: ids (B, T_new) at positions offset.. -> logits (B, T_new, V),
        extending each block's key/value cache in ``states``."""
        x = self.embed(ids, offset=offset)
        mask = ops.causal_mask(ids.shape[1], offset + ids.shape[1], like=x)  # (T_new, S)
        for block, state in zip(self.blocks, states):
            x = block.step(x, state, mask=mask)
        if self.norm is not None:
            x = self.norm(x)
        return self._project(x)[0]
