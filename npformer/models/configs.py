"""The rules of the models' configurations.

:func:`check_config` checks the fields the three configs share (each config's
``__post_init__`` calls it), naming the field in every message.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy

from ..ops.contracts import (
    ACTIVATION_NAMES,
    POOLINGS,
    check_flag,
    check_heads_divide,
    check_narrow_heads,
    shown,
)

# Every field with a range, wherever a config has it (the three configs share names).
_POSITIVE_INT_FIELDS = ("vocab_size", "src_vocab_size", "tgt_vocab_size", "num_classes",
                        "d_model", "num_heads", "d_ff", "num_layers", "num_encoder_layers",
                        "num_decoder_layers", "block_size")
# Every integer field with its least value: sizes and counts 1; a feature's count 0 (off).
_INT_FIELD_MINIMUMS = {**dict.fromkeys(_POSITIVE_INT_FIELDS, 1), "bigram_buckets": 0}
_BOOL_FIELDS = ("norm_first", "tie_weights", "scale_embeddings", "narrow_heads",
                "qk_norm")
# token id field -> the vocabulary sizes it must index
_TOKEN_ID_FIELDS = {"pad_id": ("vocab_size", "src_vocab_size", "tgt_vocab_size"),
                    "bos_id": ("tgt_vocab_size",), "eos_id": ("tgt_vocab_size",)}
POSITIONALS = ("learned", "sinusoidal")


def _is_int(value) -> bool:
    """An integer, Python's or NumPy's (``ids.max() + 1``), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, numpy.bool_))


def _set_field(config: Any, field: str, value: Any) -> None:
    """Store a checked value back as Python's own type (a NumPy int64 as int), so the
    config compares, prints and saves to JSON as one built from Python numbers."""
    if type(getattr(config, field)) is not type(value):
        object.__setattr__(config, field, value)  # frozen or not


def check_config(config: Any) -> None:
    """Validate the fields every model config shares, with messages that name the field:
    sizes and counts are positive integers, token ids index every vocabulary they are
    used in, dropout is in [0, 1), and the names are among the known ones.  NumPy
    integers, floats and bools are accepted where Python's are, and stored as Python's."""
    name = type(config).__name__
    for field, least in _INT_FIELD_MINIMUMS.items():
        value = getattr(config, field, least)
        if not _is_int(value) or value < least:
            wanted = "a positive integer" if least == 1 else f"an integer >= {least}"
            raise ValueError(f"{name}.{field} must be {wanted}, got {shown(value)}")
        if hasattr(config, field):
            _set_field(config, field, int(value))
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None:
        if not _is_int(head_dim) or head_dim < 1:
            raise ValueError(f"{name}.head_dim must be None or a positive integer, got "
                             f"{shown(head_dim)}")
        _set_field(config, "head_dim", int(head_dim))
    if head_dim is None:
        check_heads_divide(config.d_model, config.num_heads)
    for field, vocabularies in _TOKEN_ID_FIELDS.items():
        if not hasattr(config, field):
            continue
        value = getattr(config, field)
        limit = min(getattr(config, v) for v in vocabularies if hasattr(config, v))
        if not _is_int(value) or not 0 <= value < limit:
            sizes = ", ".join(f"{v}={getattr(config, v)}" for v in vocabularies
                              if hasattr(config, v))
            raise ValueError(f"{name}.{field} must be a token id in [0, {limit}) ({sizes}), "
                             f"got {shown(value)}")
        _set_field(config, field, int(value))
    for field in (f for f in _BOOL_FIELDS if hasattr(config, f)):
        _set_field(config, field, check_flag(getattr(config, field), f"{name}.{field}"))
    if getattr(config, "narrow_heads", False):
        check_narrow_heads(config.d_model, config.num_heads, head_dim, name)
    eps = config.norm_eps
    if isinstance(eps, (bool, numpy.bool_)) or not isinstance(eps, numbers.Real) \
            or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"{name}.norm_eps must be a finite number > 0, got {shown(eps)}")
    _set_field(config, "norm_eps", float(eps))
    if getattr(config, "positional", "learned") not in POSITIONALS:
        raise ValueError(f"{name}.positional must be one of {POSITIONALS}, got "
                         f"{shown(config.positional)}")
    activation = getattr(config, "activation", "relu")
    if not isinstance(activation, str) or activation not in ACTIVATION_NAMES:
        raise ValueError(f"{name}.activation must be one of {sorted(ACTIVATION_NAMES)}, got "
                         f"{shown(config.activation)}")
    dropout = config.dropout
    if isinstance(dropout, (bool, numpy.bool_)) or not isinstance(dropout, numbers.Real) or not (
            0.0 <= dropout < 1.0):
        raise ValueError(f"{name}.dropout must be in [0, 1), got {shown(dropout)}")
    _set_field(config, "dropout", float(dropout))
    if hasattr(config, "pooling") and config.pooling not in POOLINGS:
        raise ValueError(f"{name}.pooling must be one of {POOLINGS}, got "
                         f"{shown(config.pooling)}")
    if getattr(config, "num_classes", 2) < 2:
        raise ValueError(f"{name}.num_classes must be at least 2, got {config.num_classes}")
