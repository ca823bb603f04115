"""npformer: a Transformer written from scratch in NumPy, every backward by hand.

Layers of the package, each importing only those before it:
backend <- ops <- nn <- (models, optim, train) <- demos.
"""
from . import backend, gradcheck, nn, ops
from .backend import set_backend
from .engine import engine_name, set_engine
from .nn import no_grad

__version__ = "0.1.0"
__all__ = ["backend", "gradcheck", "nn", "ops", "set_backend", "set_engine", "engine_name",
           "no_grad"]
