"""Pieces the three models share: the embedding front end and the block stacks."""
from __future__ import annotations

import math
from dataclasses import asdict, fields

from .. import backend
from ..nn import (Dropout, Embedding, LayerNorm, LearnedPositionalEmbedding, Module, Padding,
                  SinusoidalPositionalEncoding)
from ..ops._checks import check_rank

POSITIONALS = ("learned", "sinusoidal")


def check_config(config) -> None:
    """Validate the fields every config shares, with messages that name the field."""
    if config.d_model < 1 or config.num_heads < 1 or config.d_ff < 1:
        raise ValueError("d_model, num_heads and d_ff must be positive")
    if config.head_dim is None and config.d_model % config.num_heads != 0:
        raise ValueError(f"d_model {config.d_model} is not divisible by num_heads "
                         f"{config.num_heads}; choose a head count that divides the width "
                         "or set head_dim")
    if getattr(config, "positional", "learned") not in POSITIONALS:
        raise ValueError(f"positional must be one of {POSITIONALS}, got {config.positional!r}")
    if not 0.0 <= config.dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {config.dropout}")


def config_to_dict(config) -> dict:
    return asdict(config)


def config_from_dict(cls, values: dict):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{cls.__name__} has no fields {unknown}")
    return cls(**values)


class TokenEmbedding(Module):
    """ids (B, T) -> dropout(positions(embedding(ids) * scale)) (B, T, D).

    scale is sqrt(D) where the paper scales embeddings (section 3.4), else 1.
    """

    def __init__(self, vocab_size: int, d_model: int, max_len: int, positional: str,
                 dropout: float, scale_by_sqrt_d: bool, init_std: float = 1.0,
                 limit_name: str = "max_len"):
        self.tokens = Embedding(vocab_size, d_model, init_std=init_std)
        if positional == "learned":
            self.positions = LearnedPositionalEmbedding(max_len, d_model)
        else:
            self.positions = SinusoidalPositionalEncoding(max_len, d_model)
        self.dropout = Dropout(dropout)
        self.scale = math.sqrt(d_model) if scale_by_sqrt_d else 1.0
        self.max_len = max_len
        self.limit_name = limit_name  # the config field that sets max_len, for errors

    def forward(self, ids, offset: int = 0):
        """ids (B, T) integers; ``offset``: position of ids[:, 0] (cached decoding)."""
        check_rank(ids, 2, "token ids (batch, positions)")
        if offset + ids.shape[1] > self.max_len:
            raise ValueError(f"sequence of length {offset + ids.shape[1]} is longer than "
                             f"{self.limit_name} {self.max_len} (the positional table's "
                             "length); raise it in the model's config")
        x = self.tokens(ids) * self.scale  # (B, T, D)
        if offset:
            x = self._add_positions_at(x, offset)
        else:
            x = self.positions(x)
        return self.dropout(x)

    def _add_positions_at(self, x, offset: int):
        """Inference only: add the positions offset .. offset+T-1."""
        table = (self.positions.weight.data if isinstance(self.positions, LearnedPositionalEmbedding)
                 else self.positions._table)
        xp = backend.namespace_of(x)
        rows = xp.astype(table[offset:offset + x.shape[1], :], x.dtype)
        return x + rows[None, :, :]

    def backward(self, dx):
        """dx (B, T, D) -> None (token ids are not differentiable)."""
        dx = self.positions.backward(self.dropout.backward(dx))
        return self.tokens.backward(dx * self.scale)


def final_norm(config):
    """Pre-norm stacks end with a layer norm (GPT-2); post-norm ones already end normed."""
    return LayerNorm(config.d_model) if config.norm_first else None


def valid_lengths_from(ids, pad_id: int):
    """(B,) number of non-padding tokens per row (padding assumed at the end)."""
    xp = backend.namespace_of(ids)
    return xp.sum(xp.astype(ids != pad_id, xp.int64), axis=1)


def padding_of(ids, valid_lens, pad_id: int, padding: Padding | None,
               pack: bool | None = None) -> Padding:
    """The batch's :class:`Padding`: ``padding`` if given (checked against ids), else built
    from ``valid_lens`` (default: the count of non-pad ids per row)."""
    if padding is None:
        if valid_lens is None:
            valid_lens = valid_lengths_from(ids, pad_id)
        return Padding(valid_lens, ids.shape[1], pack)
    if valid_lens is not None:
        raise ValueError("pass the valid lengths or a padding, not both (the padding "
                         "holds the valid lengths)")
    if (padding.batch, padding.length) != tuple(ids.shape):
        raise ValueError(f"padding describes a ({padding.batch}, {padding.length}) batch, "
                         f"but the ids have shape {tuple(ids.shape)}")
    return padding
