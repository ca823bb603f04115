"""Will the model fit?  Its size from its definition, before a single weight is made.

A demo calls :func:`check_training_fits` before it builds its model (a huge ``--d-model``
would otherwise end deep inside NumPy): the parameter count of the model built with
shapes only (:func:`parameter_count`) gives a lower bound of what training needs
(:func:`training_memory`); a run whose bound exceeds the machine's memory
(:func:`machine_memory`) is refused, naming the options that made the model large and
the sizes.  Being a lower bound, the check never refuses a run that would fit.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..backend import byte_size as _size
from ..backend import machine_memory
from ..models.common import parameter_count
from .demo import DemoError
from .options import flag

__all__ = ["TrainingMemory", "parameter_count", "training_memory", "machine_memory",
           "processes_sharing_memory", "check_training_fits", "SIZE_OPTIONS"]

# The preset fields that make a model (or its batch) large, wherever a demo has them.
SIZE_OPTIONS = ("d_model", "block_size", "max_tokens", "num_layers", "d_ff", "vocab_size",
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


# --------------------------------------------------------------------------- the memory
def training_memory(config: Any, batch_size: int, sequence_length: int,
                    itemsize: int = 4) -> TrainingMemory:
    """At least what training the model of ``config`` with Adam on batches of
    ``batch_size`` sequences of ``sequence_length`` tokens takes, in floats of
    ``itemsize`` bytes: 4 floats a parameter (weight, gradient, two moments), the
    sinusoidal tables, and the activations every step keeps at the least: each block's
    input (B, T, D) and the logits (B, T, V), (B, C) for a classifier."""
    from ..models import ClassifierConfig, LlamaConfig, Seq2SeqConfig

    parameters = parameter_count(config)
    tokens = batch_size * sequence_length
    tables = 0 if isinstance(config, LlamaConfig) or config.positional == "learned" else \
        config.block_size * config.d_model  # Llama's rotary positions are computed
    if isinstance(config, Seq2SeqConfig):
        tables *= 2  # one per side
        blocks = config.num_encoder_layers + config.num_decoder_layers
        activations = tokens * (config.d_model * blocks + config.tgt_vocab_size)
    elif isinstance(config, ClassifierConfig):
        activations = tokens * config.d_model * config.num_layers + \
            batch_size * config.num_classes
    else:  # a causal LM: GPT-2's or Llama's
        activations = tokens * (config.d_model * config.num_layers + config.vocab_size)
    return TrainingMemory(parameters, itemsize * (4 * parameters + tables),
                          itemsize * activations)


# --------------------------------------------------------------------------- the check
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
    ratios = {}  # the size fields set above the default preset's, the furthest above first
    for f in fields(preset):
        value, default = getattr(preset, f.name), getattr(defaults, f.name, None)
        if (f.name in SIZE_OPTIONS and isinstance(value, int) and isinstance(default, int)
                and 0 < default < value):
            ratios[f.name] = value / default
    raised = sorted(ratios, key=ratios.get, reverse=True)
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
