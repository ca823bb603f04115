"""npformer: a Transformer written from scratch in NumPy, every backward by hand.

Its parts, each a folder (or a module) importing only the parts before it (the order
``tests/test_imports.py`` checks):

    backend                        the array namespace (NumPy, CuPy), dtypes, random streams
    ops/                           the textbook's mathematics: forward/backward pairs
    nn/                            the textbook's layers
    hf/                            Hugging Face folders, read and written for the models
    models/, optim                 the textbook's models; update rules and schedules
    fast/                          the fast CPU tier: whole implementations, tested equal
    data/, decoding, checkpoint, gradcheck, interop/
    parallel/, gpu/                thread replicas and MPI ranks; CUDA graphs and cuBLAS
    train/                         the loop, the tasks, progress
    cli/                           what the demos share

The class you name is the class that runs: ``npformer.models.CausalLM`` is the textbook's,
``npformer.fast.CausalLM`` the fast tier's.  The textbook's parts are imported with the
package; the others are attributes too (``npformer.models``, ``npformer.train`` ...),
imported on first use, so that ``import npformer`` stays light and never imports torch,
mpi4py or matplotlib.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from . import backend, gradcheck, nn, ops
from .backend import set_backend
from .nn import no_grad

__version__ = "0.1.0"

# Subpackages and modules imported on first attribute access (PEP 562).
_LAZY_SUBMODULES = ("checkpoint", "cli", "data", "decoding", "fast", "gpu", "hf", "interop",
                    "models", "optim", "parallel", "train")

__all__ = ["backend", "gradcheck", "nn", "ops", *_LAZY_SUBMODULES, "set_backend", "no_grad"]


def __getattr__(name: str) -> ModuleType:
    """``npformer.<submodule>`` imports it on first use; anything else is an AttributeError."""
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
