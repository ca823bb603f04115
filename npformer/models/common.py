"""Pieces the three models share: the embedding front end and the block stacks."""
from __future__ import annotations

import math
from dataclasses import MISSING, asdict, fields
from typing import Any

from .. import backend, ops
from ..backend import Array
from ..nn import (
    Dropout,
    Embedding,
    LayerNorm,
    LearnedPositionalEmbedding,
    Module,
    SinusoidalPositionalEncoding,
    grad_enabled,
)
from ..validation import (  # noqa: F401 (POSITIONALS, model_input: re-exported)
    POSITIONALS,
    check_config,
    check_positions,
    check_rank,
    check_token_ids,
    check_valid_lengths,
    model_input,
    new_field_names,
    valid_lengths_from,
)


def config_to_dict(config: Any) -> dict:
    return asdict(config)


def saved_config_values(cls: type, values: dict) -> dict:
    """A config's values as saved (a checkpoint's ``config``), the old name of a renamed
    field read as its new one (``max_len`` -> ``block_size``), and a field added since
    (``layer_norm_eps``, ``narrow_heads``, ``kqnorm``) at its default, the value every
    model had before it existed: the one place a saved config is read, so a checkpoint
    written before a rename or an addition still loads."""
    values = new_field_names(cls, values)
    added = {f.name: f.default for f in fields(cls)
             if f.name not in values and f.default is not MISSING}
    return {**values, **added}


def config_from_dict(cls: type, values: dict) -> Any:
    """``cls(**values)`` from a saved config (old field names read as the new ones); a
    field ``cls`` does not have is refused by name."""
    values = saved_config_values(cls, values)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{cls.__name__} has no fields {unknown}")
    return cls(**values)


class TokenEmbedding(Module):
    """ids (B, T) -> dropout(positions(embedding(ids) * scale)) (B, T, D).

    scale is sqrt(D) where the paper scales embeddings (section 3.4), else 1.
    """

    def __init__(self, vocab_size: int, d_model: int, block_size: int, positional: str,
                 dropout: float, scale_by_sqrt_d: bool, init_std: float = 1.0):
        self.tokens = Embedding(vocab_size, d_model, init_std=init_std)
        if positional == "learned":
            self.positions = LearnedPositionalEmbedding(block_size, d_model)
        else:
            self.positions = SinusoidalPositionalEncoding(block_size, d_model)
        self.dropout = Dropout(dropout)
        self.scale = math.sqrt(d_model) if scale_by_sqrt_d else 1.0
        self.block_size = block_size

    def check_inputs(self, ids: Array, offset: int = 0,
                     position_ids: Array | None = None) -> None:
        """ids (B, T) integers in [0, V), offset + T <= block_size (or position_ids (B, T)
        in [0, block_size)): the door of every model."""
        check_rank(ids, 2, "token ids (batch, positions)")
        if position_ids is not None:
            check_positions(position_ids, self.block_size)
        elif offset + ids.shape[1] > self.block_size:
            raise ValueError(f"sequence of length {offset + ids.shape[1]} is longer than "
                             f"block_size {self.block_size} (the positional table's "
                             "length); raise it in the model's config")
        check_token_ids(ids, self.tokens.num_embeddings)

    def forward(self, ids: Array, offset: int = 0, position_ids: Array | None = None) -> Array:
        """ids (B, T) integers; ``offset``: position of ids[:, 0] (cached decoding);
        ``position_ids`` (B, T): each token's own position instead (a padded batch)."""
        x = self.tokens(ids) * self.scale  # (B, T, D)
        if position_ids is not None:
            x = self.positions(x, position_ids)  # x + P[position_ids]
        elif offset:
            x = self._add_positions_at(x, offset)
        else:
            x = self.positions(x)  # x + P[:T]
        return self.dropout(x)

    def _add_positions_at(self, x, offset: int):
        """Inference only: add the positions offset .. offset+T-1."""
        learned = isinstance(self.positions, LearnedPositionalEmbedding)
        table = self.positions.weight.data if learned else self.positions._table
        xp = backend.namespace_of(x)
        rows = xp.astype(table[offset:offset + x.shape[1], :], x.dtype)
        return x + rows[None, :, :]

    def backward(self, dx: Array) -> None:
        """dx (B, T, D) -> None (token ids are not differentiable)."""
        dx = self.positions.backward(self.dropout.backward(dx))
        return self.tokens.backward(dx * self.scale)


def inference_only(what: str) -> None:
    """Cached decoding keeps nothing for a backward: it runs under no_grad only."""
    if grad_enabled():
        raise RuntimeError(f"{what} is for inference: call it under npformer.no_grad() (it "
                           "keeps nothing for a backward)")


def final_norm(config: Any) -> LayerNorm | None:
    """Pre-norm stacks end with a layer norm (GPT-2); post-norm ones already end normed."""
    eps = getattr(config, "layer_norm_eps", ops.layernorm.EPS)
    return LayerNorm(config.d_model, eps) if config.norm_first else None


def block_options(config: Any) -> dict:
    """The blocks' keyword options a config sets: the attention's kind (narrow heads,
    kqnorm) and the layer norms' epsilon."""
    return {"narrow": config.narrow_heads, "kqnorm": config.kqnorm,
            "norm_eps": getattr(config, "layer_norm_eps", ops.layernorm.EPS)}


def valid_lengths(ids: Array, valid_lens: Array | None, pad_id: int,
                  what: str = "token ids") -> Array:
    """valid_lens (B,) as given, or counted from ids (B, T): the non-pad ids of each row,
    padding at the end only (:func:`valid_lengths_from`)."""
    return valid_lengths_from(ids, pad_id, what) if valid_lens is None else valid_lens


def check_lengths(ids: Array, valid_lens: Array | None, what: str, minimum: int = 0) -> None:
    """valid_lens (B,) integers in [minimum, T] for ids (B, T), when given."""
    if valid_lens is None:
        return
    check_rank(valid_lens, 1, f"{what} (batch,)")
    if not backend.is_integer_array(valid_lens):
        raise TypeError(f"{what} must be integers, got dtype {valid_lens.dtype}")
    if valid_lens.shape[0] != ids.shape[0]:
        raise ValueError(f"{what} holds {valid_lens.shape[0]} lengths for a batch of "
                         f"{ids.shape[0]} rows")
    check_valid_lengths(valid_lens, ids.shape[1], minimum)
