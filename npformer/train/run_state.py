"""A run saved and resumed exactly (:meth:`Trainer.save`, :meth:`Trainer.resume`).

Besides the model and the optimizer (so its schedule), a run's checkpoint holds its
random streams, the backend's (dropout masks) and the batches', and the trainer's
state in ``extra["trainer"]`` (:meth:`Trainer.state_dict`: the history, the best metric
so far, the time spent, the planned length and the position in the data order).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .. import backend
from ..checkpoint import load_checkpoint, restore


def random_streams(data_rng: np.random.Generator) -> dict:
    """The random streams a resumed run continues: the backend's and the batches'."""
    return {"backend": backend.get_rng_state(), "data": data_rng.bit_generator.state}


def restore_run(path: str | Path, model: Any, optimizer: Any,
                data_rng: np.random.Generator) -> dict | None:
    """Load the checkpoint at ``path`` into ``model``, ``optimizer`` and the random
    streams; returns the trainer's state it holds (None: a checkpoint without one)."""
    checkpoint = load_checkpoint(path)
    restore(model, checkpoint, optimizer)
    if checkpoint.rng_state:
        backend.set_rng_state(checkpoint.rng_state.get("backend"))
        data_rng.bit_generator.state = checkpoint.rng_state["data"]
    return checkpoint.extra.get("trainer")


def batches_state(next_batch: Any) -> dict | None:
    """The position in the data order, where ``next_batch`` keeps one (``state_dict()``,
    as :class:`npformer.data.EpochBatches` does); else None."""
    state_dict = getattr(next_batch, "state_dict", None)
    return state_dict() if state_dict else None


def restore_batches(next_batch: Any, state: dict | None) -> None:
    """Put ``next_batch`` back at :func:`batches_state`'s position (None: nothing kept)."""
    if state is not None:
        next_batch.load_state_dict(state)
