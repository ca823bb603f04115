"""Pieces the three models share: the embedding front end and the block stacks."""
from __future__ import annotations

import math
from dataclasses import asdict, fields
from typing import Any

import numpy

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
from ..ops.contracts import check_integers, check_rank, check_token_ids, check_valid_lengths
from .configs import POSITIONALS, check_config  # noqa: F401 (re-exported)


def config_to_dict(config: Any) -> dict:
    return asdict(config)


def config_from_dict(cls: type, values: dict) -> Any:
    """``cls(**values)`` from a saved config; a field ``cls`` does not have is refused by name."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{cls.__name__} has no fields {unknown}")
    return cls(**values)


# --------------------------------------------------------------------------- the size
TEXTBOOK_MODELS: dict[type, type] = {}  # config class -> its model (npformer.models fills it)


def shape_model(config: Any) -> Module:
    """The textbook model of ``config`` (a ClassifierConfig, CausalLMConfig, Seq2SeqConfig
    or LlamaConfig, or a subclass) built within :func:`npformer.backend.shapes_only`: its
    parameters hold their shapes, no weight, and no random number is drawn."""
    for config_class in type(config).__mro__:
        if config_class in TEXTBOOK_MODELS:
            with backend.shapes_only():
                return TEXTBOOK_MODELS[config_class](config)
    raise TypeError(f"parameter_count counts a ClassifierConfig, CausalLMConfig, "
                    f"Seq2SeqConfig or LlamaConfig, got {type(config).__name__}")


def parameter_count(config: Any) -> int:
    """The parameters of the model ``config`` describes: ``num_parameters()`` of that
    model, built with shapes only (:func:`shape_model`)."""
    return shape_model(config).num_parameters()


def check_weights_fit(config: Any, itemsize: int | None = None,
                      available: tuple[int, str] | None = None) -> None:
    """Refuse (ValueError) a model whose weights alone cannot fit in memory, before one
    is allocated, naming the field that sizes its largest table, the parameter count, the
    bytes (``itemsize`` each: default the backend's float) and the memory there is
    (``available``: (bytes, "where"), default the machine's).  Training needs more
    (:func:`npformer.cli.memory.check_training_fits`)."""
    if backend.making_shapes():
        return
    itemsize = itemsize or numpy.dtype(backend.default_float_name()).itemsize
    model = shape_model(config)
    count = model.num_parameters()
    needed = count * itemsize
    memory, where = available or backend.machine_memory()
    if needed <= memory:
        return
    shape = max((p.shape for p in model.parameters()), key=math.prod)  # the largest table
    name = next((f.name for f in fields(config) if type(getattr(config, f.name)) is int
                 and getattr(config, f.name) == max(shape)), None)  # the field sizing it
    table = f" ({name}={getattr(config, name)})" if name else ""
    raise ValueError(f"{type(config).__name__} makes a model of {count:,} parameters, "
                     f"{backend.byte_size(needed)} in {backend.default_float_name()} for its "
                     f"weights alone, and {where} {backend.byte_size(memory)}: its largest "
                     f"table{table} takes {backend.byte_size(math.prod(shape) * itemsize)}; lower "
                     f"{name or 'its sizes'}")


class TokenEmbedding(Module):
    """ids (B, T) -> dropout(positions(embedding(ids) * scale)) (B, T, D).

    scale is sqrt(D) where the paper scales embeddings (section 3.4), else 1.
    """

    Embedding, LearnedPositionalEmbedding, Dropout = \
        Embedding, LearnedPositionalEmbedding, Dropout  # the layers it builds

    def __init__(self, vocab_size: int, d_model: int, block_size: int, positional: str,
                 dropout: float, scale_by_sqrt_d: bool, init_std: float = 1.0):
        self.tokens = self.Embedding(vocab_size, d_model, init_std=init_std)
        if positional == "learned":
            self.positions = self.LearnedPositionalEmbedding(block_size, d_model)
        else:
            self.positions = SinusoidalPositionalEncoding(block_size, d_model)
        self.dropout = self.Dropout(dropout)
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


def decoder_mask(keep: Array | None, length: int, keys: int, like: Array) -> Array | None:
    """The mask of a decoder's self-attention over ``keys`` positions, the last ``length``
    of them queries: causal (T, S), no position sees a later one; with ``keep`` (B, S),
    also no padding: (B, 1, T, S).  None where it would hide nothing: one query, the
    last position, sees every key (a decoding step without padding)."""
    if keep is None and length == 1:
        return None
    mask = ops.causal_mask(length, keys, like=like)  # (T, S)
    if keep is None:
        return mask
    return mask[None, None, :, :] & keep[:, None, None, :]  # (B, 1, T, S)


def inference_only(what: str) -> None:
    """Cached decoding keeps nothing for a backward: it runs under no_grad only."""
    if grad_enabled():
        raise RuntimeError(f"{what} is for inference: call it under npformer.no_grad() (it "
                           "keeps nothing for a backward)")


def final_norm(config: Any, norm_class: type = LayerNorm) -> LayerNorm | None:
    """Pre-norm stacks end with a layer norm (GPT-2); post-norm ones already end normed."""
    return norm_class(config.d_model, config.norm_eps) if config.norm_first else None


def block_options(config: Any) -> dict:
    """The blocks' keyword options a config sets: the attention's kind (narrow heads,
    qk_norm) and the layer norms' epsilon."""
    return {"narrow_heads": config.narrow_heads, "qk_norm": config.qk_norm,
            "norm_eps": config.norm_eps}


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
    check_integers(valid_lens, what)
    if valid_lens.shape[0] != ids.shape[0]:
        raise ValueError(f"{what} holds {valid_lens.shape[0]} lengths for a batch of "
                         f"{ids.shape[0]} rows")
    check_valid_lengths(valid_lens, ids.shape[1], minimum)


# =========================================================================== token batches
# The integer inputs of the models' and the decoders' public entries: ids and lengths
# as arrays, padding only at the end of a row, a Padding that matches its ids, and the
# decoders' source batch.
def model_input(data: Any, what: str, rank: int = 2) -> Array:
    """An integer argument (ids, lengths) of a model's public entry point (forward, predict)
    as a backend array: integer arrays pass as they are; array-likes (nested lists or
    tuples of numbers) are copied onto the backend, an empty one as int64 of the expected
    ``rank`` (``[]`` is a batch of no sequences)."""
    import array_api_compat  # here: validation is imported before the backends settle

    if data is None:
        return data
    if array_api_compat.is_array_api_obj(data):
        if not backend.is_integer_array(data):  # ids and lengths: integers
            raise TypeError(f"{what} must be an integer array, got dtype {data.dtype}")
        return data
    try:
        host = numpy.asarray(data)
    except (ValueError, TypeError) as exc:  # ragged lists
        raise ValueError(f"{what} must be an array or a rectangular nested list of numbers: "
                         f"{exc}") from None
    if host.dtype.kind not in "biuf":
        raise TypeError(f"{what} must hold numbers, got {type(data).__name__} of dtype "
                        f"{host.dtype}")
    if host.size == 0:
        host = host.astype(numpy.int64)
        if host.ndim == 1 and rank == 2:
            host = host.reshape(0, 0)
    if host.dtype.kind not in "iu":
        raise TypeError(f"{what} must be an integer array, got dtype {host.dtype}")
    return backend.asarray(host)


def attention_mask_input(mask: Any, shape: tuple[int, int],
                         what: str = "attention_mask") -> Array:
    """A causal LM's ``attention_mask`` as Hugging Face passes it, (B, S): 1 (or True) at
    every token, 0 (False) at padding, anywhere in a row -> a backend bool array (True at
    the tokens).  An array of any backend, a NumPy array or nested lists; refused naming
    ``what`` if of another shape, or not of 0s and 1s."""
    import array_api_compat  # here: imported before the backends settle

    if array_api_compat.is_array_api_obj(mask):
        given = mask
    else:
        try:
            host = numpy.asarray(mask)
        except (ValueError, TypeError) as exc:  # ragged lists
            raise ValueError(f"{what} must be an array or a rectangular nested list of 0s "
                             f"and 1s: {exc}") from None
        given = backend.asarray(host.astype(numpy.int64) if host.size == 0 else host)
    xp = backend.namespace_of(given)
    if given.dtype != xp.bool and not backend.is_integer_array(given):
        raise TypeError(f"{what} must hold 0 and 1 (integers or booleans), got dtype "
                        f"{given.dtype}")
    if tuple(given.shape) != tuple(shape):
        raise ValueError(f"{what} must have shape {tuple(shape)} (batch, positions), got "
                         f"{tuple(given.shape)}")
    if given.dtype == xp.bool:
        return given
    if math.prod(given.shape):
        low, high = backend.host_range(given)
        if low < 0 or high > 1:
            raise ValueError(f"{what} must hold 0 (padding) and 1 (a token) only, found "
                             f"{low if low < 0 else high}")
    return given != 0


def position_ids_input(position_ids: Any, shape: tuple[int, int], block_size: int,
                       what: str = "position_ids") -> Array:
    """A causal LM's ``position_ids``: integers in [0, block_size), (B, T), or (T,) or
    (1, T) for every row -> a backend integer array (B, T)."""
    ids = model_input(position_ids, what)
    if ids.ndim == 1:
        ids = backend.namespace_of(ids).reshape(ids, (1, ids.shape[0]))
    if ids.ndim != 2 or ids.shape[1] != shape[1] or ids.shape[0] not in (1, shape[0]):
        raise ValueError(f"{what} must have shape {tuple(shape)} (batch, positions), or "
                         f"({shape[1]},) for every row, got {tuple(ids.shape)}")
    check_positions(ids, block_size, what)
    return backend.namespace_of(ids).broadcast_to(ids, tuple(shape))


def check_positions(position_ids: Array, block_size: int, what: str = "position_ids") -> None:
    """Positions must index the positional table: integers in [0, block_size)."""
    if not math.prod(position_ids.shape):
        return
    low, high = backend.host_range(position_ids)
    if low < 0:
        raise ValueError(f"{what} hold position {low}: positions count from 0")
    if high >= block_size:
        raise ValueError(f"{what} reach position {high}, but the positional table has "
                         f"{block_size} rows (block_size {block_size}): a sequence of more "
                         f"than {block_size} tokens is longer than the model's context")


def valid_lengths_from(ids: Array, pad_id: int, what: str = "token ids") -> Array:
    """ids (B, T) -> (B,) number of non-padding tokens per row, padding at the end only:
    the layers read a row's valid positions as its first ``valid_lens[b]``, so padding
    elsewhere (left, or between tokens) is refused, naming the row and the positions."""
    xp = backend.namespace_of(ids)
    real = ids != pad_id  # (B, T)
    lengths = xp.sum(xp.astype(real, xp.int64), axis=1)  # (B,)
    if ids.shape[0] and ids.shape[1]:
        positions = xp.arange(ids.shape[1], dtype=xp.int64, device=backend.device_of(ids))
        if bool(xp.any(real != (positions[None, :] < lengths[:, None]))):
            _refuse_padding_before_a_token(backend.to_numpy(real), pad_id, what)
    return lengths


def _refuse_padding_before_a_token(real: numpy.ndarray, pad_id: int, what: str) -> None:
    """real (B, T) bools with a pad before a real token in some row: raise naming where."""
    for row, tokens in enumerate(real):
        pads = numpy.flatnonzero(~tokens)
        later = numpy.flatnonzero(tokens[pads[0]:]) if pads.size else numpy.empty(0)
        if later.size:
            raise ValueError(
                f"{what} row {row} has padding (pad_id {pad_id}) at position {pads[0]}, "
                f"before a real token at position {pads[0] + later[0]}: padding must come "
                "at the end of a row (right padding), where it is masked; padding elsewhere "
                "would be read as tokens and the row's last tokens dropped. Move the "
                "padding to the end of the row")
