"""Will the model fit?  Its size from its config, before a single array is made.

``--d-model 1000000000000`` or ``--block-size 100000000000`` ended deep inside NumPy
(``_ArrayMemoryError``) when the model's first weight was allocated.  A demo calls
:func:`check_training_fits` before it builds its model: the parameter count follows
from the config alone (:func:`parameter_count`), and with it a lower bound of what
training needs (:func:`training_memory`): the weights, their gradients, Adam's two
moments, a sinusoidal table, and the activations a batch keeps at the least (each
block's input and the logits).  A run whose lower bound exceeds the machine's memory
(:func:`machine_memory`) is refused, naming the options that made the model large and
the sizes.  Being a lower bound, the check never refuses a run that would fit.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .demo import DemoError
from .options import flag

__all__ = ["TrainingMemory", "parameter_count", "training_memory", "machine_memory",
           "processes_sharing_memory", "check_training_fits", "SIZE_OPTIONS"]

# The preset fields that make a model (or its batch) large, wherever a demo has them.
SIZE_OPTIONS = ("d_model", "block_size", "max_tokens", "layers", "d_ff", "vocab_size",
                "bigram_buckets", "batch_size")


@dataclass(frozen=True)
class TrainingMemory:
    """At least what training a model takes: ``parameters``, its parameter count;
    ``model_bytes``, what every process holding it keeps (weights, gradients, Adam's
    moments, tables); ``batch_bytes``, the activations of one batch (shared out among
    the processes that split it)."""

    parameters: int
    model_bytes: int
    batch_bytes: int

    def total(self, copies: int = 1) -> int:
        """Bytes for ``copies`` processes holding the model and splitting one batch."""
        return copies * self.model_bytes + self.batch_bytes


# --------------------------------------------------------------------------- the count
def _attention(d: int, inner: int, config: Any) -> int:
    """MultiHeadAttention: q, k, v projections D -> H*E (one shared E -> E map each with
    narrow heads) and the output H*E -> D, biased; kqnorm's two layer norms over E."""
    width = inner // config.num_heads  # E
    projection = width * width + width if config.narrow_heads else d * inner + inner
    norms = 2 * (2 * width) if config.kqnorm else 0
    return 3 * projection + inner * d + d + norms


def _feed_forward(d: int, d_ff: int) -> int:
    return d * d_ff + d_ff + d_ff * d + d


def _encoder_block(d: int, inner: int, d_ff: int, config: Any) -> int:
    return _attention(d, inner, config) + _feed_forward(d, d_ff) + 2 * (2 * d)  # + 2 norms


def _decoder_block(d: int, inner: int, d_ff: int, config: Any) -> int:
    return (2 * _attention(d, inner, config) + _feed_forward(d, d_ff)
            + 3 * (2 * d))  # + 3 layer norms


def _embedding(config: Any, vocab_size: int) -> int:
    """Token table, and the positions' when they are learned."""
    learned = config.positional == "learned"
    return (vocab_size + (config.block_size if learned else 0)) * config.d_model


def parameter_count(config: Any) -> int:
    """The parameters of the model ``config`` describes (a ClassifierConfig,
    CausalLMConfig or Seq2SeqConfig), counted from its fields: what ``num_parameters()``
    of the built model returns."""
    from ..models import CausalLMConfig, ClassifierConfig, Seq2SeqConfig

    d = config.d_model
    inner = config.num_heads * (config.head_dim or d // config.num_heads)
    final_norm = 2 * d if config.norm_first else 0
    if isinstance(config, ClassifierConfig):
        return (_embedding(config, config.vocab_size) + config.bigram_buckets * d
                + config.num_layers * _encoder_block(d, inner, config.d_ff, config) + final_norm
                + d * config.num_classes + config.num_classes)
    if isinstance(config, CausalLMConfig):
        return (_embedding(config, config.vocab_size)
                + config.num_layers * _encoder_block(d, inner, config.d_ff, config) + final_norm
                + (0 if config.tie_weights else d * config.vocab_size))
    if isinstance(config, Seq2SeqConfig):
        return (_embedding(config, config.src_vocab_size)
                + _embedding(config, config.tgt_vocab_size)
                + config.num_encoder_layers * _encoder_block(d, inner, config.d_ff, config)
                + config.num_decoder_layers * _decoder_block(d, inner, config.d_ff, config)
                + 2 * final_norm
                + (0 if config.tie_weights else (d + 1) * config.tgt_vocab_size))
    raise TypeError(f"parameter_count counts a ClassifierConfig, CausalLMConfig or "
                    f"Seq2SeqConfig, got {type(config).__name__}")


# --------------------------------------------------------------------------- the memory
def training_memory(config: Any, batch_size: int, sequence_length: int,
                    itemsize: int = 4) -> TrainingMemory:
    """At least what training the model of ``config`` with Adam on batches of
    ``batch_size`` sequences of ``sequence_length`` tokens takes, in floats of
    ``itemsize`` bytes: 4 floats a parameter (weight, gradient, two moments), the
    sinusoidal tables, and the activations every step keeps at the least: each block's
    input (B, T, D) and the logits (B, T, V), (B, C) for a classifier."""
    from ..models import ClassifierConfig, Seq2SeqConfig

    parameters = parameter_count(config)
    tables = 0 if config.positional == "learned" else config.block_size * config.d_model
    tokens = batch_size * sequence_length
    if isinstance(config, Seq2SeqConfig):
        tables *= 2  # one per side
        blocks = config.num_encoder_layers + config.num_decoder_layers
        activations = tokens * (config.d_model * blocks + config.tgt_vocab_size)
    elif isinstance(config, ClassifierConfig):
        activations = tokens * config.d_model * config.num_layers + \
            batch_size * config.num_classes
    else:
        activations = tokens * (config.d_model * config.num_layers + config.vocab_size)
    return TrainingMemory(parameters, itemsize * (4 * parameters + tables),
                          itemsize * activations)


def machine_memory() -> tuple[int, str]:
    """(bytes, where) of the memory a run can use: the GPU's on the cupy backend; else
    the machine's physical memory, or the container's limit (cgroup) when lower."""
    from .. import backend

    if backend.backend_name() == "cupy":
        import cupy

        return int(cupy.cuda.runtime.memGetInfo()[1]), "this GPU has"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        limit = "max"
    if limit.isdigit() and int(limit) < total:
        return int(limit), "this container may use"
    return total, "this machine has"


def _size(count: int) -> str:
    """Bytes in binary units: ``125.7 GiB``; past YiB, a power of ten."""
    value = float(count)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "ZiB", "YiB"):
        if value < 1024 or unit == "YiB":
            break
        value /= 1024
    if value >= 1024:
        return f"{count:.2g} bytes"
    return f"{value:.0f} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"


# --------------------------------------------------------------------------- the check
def _raised_options(preset: Any, defaults: Any) -> list[str]:
    """The size fields of ``preset`` set above the default preset's values, the furthest
    above (by ratio) first."""
    ratios = {}
    for f in fields(preset):
        value, default = getattr(preset, f.name), getattr(defaults, f.name, None)
        if (f.name in SIZE_OPTIONS and isinstance(value, int) and isinstance(default, int)
                and 0 < default < value):
            ratios[f.name] = value / default
    return sorted(ratios, key=ratios.get, reverse=True)


def processes_sharing_memory() -> int:
    """The processes of this run that share the memory :func:`machine_memory` reports,
    each holding the model: the MPI ranks on this machine (on the CPU), else one."""
    from .. import backend, parallel

    return 1 if backend.backend_name() == "cupy" else parallel.current().local_size


def check_training_fits(config: Any, batch_size: int, sequence_length: int, preset: Any,
                        defaults: Any, dtype: str = "float32", copies: int | None = None,
                        available: tuple[int, str] | None = None) -> TrainingMemory:
    """Refuse (:class:`DemoError`) a model whose training cannot fit in memory, before
    it is built: the message names the options that made it large (the size options
    set above the demo's ``defaults`` preset, the furthest above first), the parameter
    count, the memory needed at the least and the memory there is.

    ``copies``: the processes on this machine that each hold the model (default:
    :func:`processes_sharing_memory`); ``available``: (bytes, "where") instead of
    :func:`machine_memory`'s.  Returns the estimate when it fits."""
    itemsize = 8 if dtype == "float64" else 4
    estimate = training_memory(config, batch_size, sequence_length, itemsize)
    copies = processes_sharing_memory() if copies is None else copies
    needed = estimate.total(copies)
    memory, where = available or machine_memory()
    if needed <= memory:
        return estimate
    raised = _raised_options(preset, defaults)
    given = " and ".join(f"{flag(name)} {getattr(preset, name)}" for name in raised)
    what = (f"{given} make{'s' if len(raised) == 1 else ''} the model too large" if raised
            else "the model is too large")
    ranks = f"; the model held by each of {copies} processes" if copies > 1 else ""
    raise DemoError(
        f"{what} for this machine: {estimate.parameters:,} parameters, and training them "
        f"needs at least {_size(needed)} (weights, gradients and Adam's two moments in "
        f"{dtype}, and the activations of {batch_size} sequences of {sequence_length} "
        f"tokens{ranks}); {where} {_size(memory)}. "
        + (f"Lower {' or '.join(map(flag, raised))}." if raised else "Choose smaller settings."))
