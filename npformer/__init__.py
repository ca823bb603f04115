"""npformer: a Transformer written from scratch in NumPy, every backward by hand.

Layers of the package, each importing only those before it:
backend <- ops (textbook tier) <- fast (fast tier) <- engine (the switch between them)
<- nn <- (models, tasks, optim, train) <- demos.
"""
from . import backend, engine, fast, gradcheck, nn, ops
from .backend import set_backend
from .engine import engine_name, set_engine
from .nn import no_grad

__version__ = "0.1.0"
__all__ = ["backend", "engine", "fast", "gradcheck", "nn", "ops", "set_backend", "set_engine", "engine_name",
           "no_grad"]
