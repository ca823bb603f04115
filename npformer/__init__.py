"""npformer: a Transformer written from scratch in NumPy, every backward by hand.

Layers of the package, each importing only those before it:
backend <- ops (textbook tier) <- fast (fast tier) <- engine (the switch between them)
<- nn <- (models, tasks, optim, train) <- demos.

The core layers are imported with the package; the others are attributes too
(``npformer.models``, ``npformer.train`` ...), imported on first use, so that
``import npformer`` stays light and never imports torch, mpi4py or matplotlib.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from . import backend, engine, fast, gradcheck, nn, ops
from .backend import set_backend
from .engine import engine_name, set_engine
from .nn import no_grad

__version__ = "0.1.0"

# Subpackages and modules imported on first attribute access (PEP 562).
_LAZY_SUBMODULES = ("checkpoint", "cli", "data", "decoding", "gpu", "interop", "models",
                    "optim", "parallel", "train")

__all__ = ["backend", "engine", "fast", "gradcheck", "nn", "ops", *_LAZY_SUBMODULES,
           "set_backend", "set_engine", "engine_name", "no_grad"]


def __getattr__(name: str) -> ModuleType:
    """``npformer.<submodule>`` imports it on first use; anything else is an AttributeError."""
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
