"""The one switch between npformer's two tiers of ops.

* ``"textbook"``: :mod:`npformer.ops`, the mathematics only: each forward/backward
  pair is its derivation, on one screen (dense attention that forms P, the plain
  softmax, cross-entropy, layer norm, linear, embedding).
* ``"fast"`` (default): the same functions, computed for speed (blocked attention
  with a stored log-sum-exp, packing of valid positions, the fused softmax and
  cross-entropy, in-place variants), each tested equal to its textbook op.

Choose with the environment variable ``NPFORMER_ENGINE``, with
:func:`set_engine`, or with a demo's ``--engine`` option, for a whole run (not
between a forward and its backward).  Layers and models reach the chosen tier
through this module only: ``engine.ops().linear_forward(...)`` is the current
tier's op, and :func:`packs_positions` tells :class:`npformer.nn.Padding`
whether the position-wise layers run on packed rows (fast, :class:`Packing`) or on
the padded (B, T, D) arrays (textbook).  Nothing else in the package asks which tier
is active or imports :mod:`npformer.fast`.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from . import fast as _fast
from . import ops as _textbook
from .backend import Array
from .fast import adamw as _adamw
from .fast import compiler as _compiler

if TYPE_CHECKING:  # annotations only: importing these here would be circular
    from .nn import FlatParameters, Parameter

Packing = _fast.Packing  # the packed layout of a padded batch, for npformer.nn.Padding

ENGINES = ("fast", "textbook")


def _checked(name: str, source: str) -> str:
    choice = str(name).strip().lower()
    if choice not in ENGINES:
        raise ValueError(f"unknown engine {name!r} ({source}); choose one of {ENGINES}")
    return choice


_current = _checked(os.environ.get("NPFORMER_ENGINE", "fast"), "from NPFORMER_ENGINE")


def set_engine(name: str) -> None:
    """Run every later forward and backward on tier ``name`` ("fast" or "textbook")."""
    global _current
    _current = _checked(name, "set_engine")


def engine_name() -> str:
    return _current


def ops() -> ModuleType:
    """The current tier's ops: :mod:`npformer.fast` or :mod:`npformer.ops` (same names)."""
    return _fast if _current == "fast" else _textbook


def packs_positions() -> bool:
    """Whether a padded batch's valid positions run as packed rows (the fast tier)."""
    return _current == "fast"


def flat_parameters(params: Sequence[Parameter]) -> FlatParameters | None:
    """The fast tier keeps a model's parameters, and an optimizer's, in one flat buffer
    (:class:`npformer.nn.FlatParameters`, which rebinds their data and gradients to
    views of it): the buffer that already holds exactly ``params`` (the models make
    theirs when built), else a new one; None in the textbook tier, or where they cannot
    share one (not NumPy, or mixed dtypes)."""
    from .nn.module import FlatParameters, flat_buffer_holding

    params = list(params)
    if _current != "fast" or not FlatParameters.supports(params):
        return None
    return flat_buffer_holding(params) or FlatParameters(params)


def fuses_kernels(*arrays: Array) -> bool:
    """Whether the fast tier runs these arrays' element-wise chains as one fused kernel
    (:mod:`npformer.fast.adamw`: CuPy arrays)."""
    return _current == "fast" and _adamw.fuses(*arrays)


def loss_backward_over_logits(dloss: Array, cache: Any) -> Array:
    """The cross-entropy backward for a caller that owns the logits and drops the cache
    after: the fast tier writes the gradient over the (N, V) array its forward kept
    (``overwrite_logits=True``), so no second (N, V) array is allocated; the textbook
    op returns a new array."""
    if _current == "fast":
        return _fast.cross_entropy_backward(dloss, cache, overwrite_logits=True)
    return _textbook.cross_entropy_backward(dloss, cache)


# The fast tier's compiled pieces the optimizer uses (npformer.optim reaches them here).
# (looked up at each call, so the module they live in stays the one place to patch or read)
def fused_adam_update(*args: Any) -> Array:
    """Adam's statements as one CuPy kernel (:func:`npformer.fast.adamw.adam_update_cupy`)."""
    return _adamw.adam_update_cupy(*args)


def adamw_flat(*args: Any) -> None:
    """One AdamW pass over flat NumPy buffers (:func:`npformer.fast.adamw.adamw_flat`)."""
    _adamw.adamw_flat(*args)


def sum_of_squares(flat: Array) -> float:
    """The squared norm of a flat buffer (:func:`npformer.fast.adamw.sum_of_squares`)."""
    return _adamw.sum_of_squares(flat)


def compiled(*arrays: Array) -> bool:
    """Whether the fast tier's compiled CPU kernels take these arrays (numba present,
    C-contiguous NumPy float arrays of one dtype)."""
    return _compiler.usable(*arrays)
