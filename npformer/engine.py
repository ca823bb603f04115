"""The one seam between npformer's two tiers.

* ``"textbook"``: the mathematics, written once: :mod:`npformer.ops` (each op's forward
  and backward, its derivation in the docstring), the layers of :mod:`npformer.nn`, the
  models of :mod:`npformer.models` and the optimizers of :mod:`npformer.optim`, each a
  reading of its equations.
* ``"fast"`` (default): :mod:`npformer.fast`, whole implementations of the same classes
  and functions, computed for speed (blocked attention, packed rows, recomputed
  activations, compiled kernels, one flat parameter buffer), each tested equal to its
  textbook one and behaving the same.

Choose with the environment variable ``NPFORMER_ENGINE``, with :func:`set_engine`, or
with a demo's ``--engine`` option.  The tier is chosen when an object is made:
``CausalLM(config)``, ``EncoderBlock(...)`` or ``AdamW(params)`` give the current tier's
implementation of that class (:func:`implementation`; in the fast tier a subclass of the
textbook class, with the same parameters and state), and keep it for their life.  Code
above the layers reaches the tier's functions here (:func:`ops`, :func:`implementation`).
With ``NPFORMER_ENGINE=textbook`` nothing of :mod:`npformer.fast` ever runs.

:mod:`npformer.fast` registers its implementations with :func:`register` as it is
imported (``import npformer`` imports it).
"""
from __future__ import annotations

import os
from types import ModuleType
from typing import Any, TypeVar

from . import ops as _textbook_ops

ENGINES = ("fast", "textbook")
T = TypeVar("T")


def _checked(name: Any, source: str) -> str:
    choice = name.strip().lower() if isinstance(name, str) else name
    if choice not in ENGINES:
        raise ValueError(f"unknown engine {name!r} ({source}); choose one of {ENGINES}")
    return choice


_current = _checked(os.environ.get("NPFORMER_ENGINE", "fast"), "from NPFORMER_ENGINE")
_fast: dict[Any, Any] = {}  # textbook class, function or module -> its fast implementation


def set_engine(name: str) -> None:
    """Make every later model, layer and optimizer in tier ``name`` ("fast" or
    "textbook"); objects already made keep theirs."""
    global _current
    _current = _checked(name, "set_engine")


def engine_name() -> str:
    return _current


def register(textbook: Any, fast: Any) -> None:
    """``fast`` implements ``textbook`` (a class, a function or a module of functions) in
    the fast tier (called by :mod:`npformer.fast`)."""
    _fast[textbook] = fast


def implementation(textbook: T) -> T:
    """The current tier's implementation of ``textbook``: itself in the textbook tier, or
    where the fast tier has none."""
    return _fast.get(textbook, textbook) if _current == "fast" else textbook


def ops() -> ModuleType:
    """The current tier's ops: :mod:`npformer.ops` or :mod:`npformer.fast` (same names)."""
    return implementation(_textbook_ops)
