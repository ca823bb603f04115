"""Checkpoints: one backend-neutral ``.npz`` file, no pickle.

Layout of the archive:

* ``meta``: a 0-d unicode array holding JSON: format version, the model kind
  and config, the step, the random generators' states, and ``extra`` (vocabularies,
  metrics: anything JSON-able the caller adds);
* ``param/<name>``: every parameter, as NumPy arrays on the host;
* ``optim/<key>``: the optimizer's :meth:`state_dict` (arrays and scalars).

Files are written atomically: into a temporary file beside the target, flushed
to disk, then renamed over it, so an interrupted save never leaves a
half-written checkpoint where a good one was.  Loading works on any backend.
"""
from __future__ import annotations

import json
import os
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import backend

FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or does not fit the model it is loaded into."""


@dataclass
class Checkpoint:
    kind: str
    config: dict
    params: dict[str, np.ndarray]
    optimizer: dict[str, Any] = field(default_factory=dict)
    step: int = 0
    rng_state: dict | None = None
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- saving
def save_checkpoint(path, model, optimizer=None, step: int = 0, extra: dict | None = None,
                    rng_state: dict | None = None) -> Path:
    """Write ``model`` (and optionally ``optimizer``) to ``path`` atomically."""
    from .models.common import config_to_dict

    path = Path(path)
    meta = {
        "format": "npformer-checkpoint",
        "version": FORMAT_VERSION,
        "kind": model.kind,
        "config": config_to_dict(model.config),
        "step": int(step),
        "rng_state": rng_state,
        "extra": extra or {},
    }
    arrays = {"meta": np.array(json.dumps(meta))}
    for name, p in model.named_parameters():
        arrays[f"param/{name}"] = backend.to_numpy(p.data)
    if optimizer is not None:
        for key, value in optimizer.state_dict().items():
            arrays[f"optim/{key}"] = (np.array(value) if isinstance(value, (str, int, float))
                                      else backend.to_numpy(value))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            np.savez(handle, **arrays)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
    return path


# --------------------------------------------------------------------------- loading
def load_checkpoint(path) -> Checkpoint:
    """Read a checkpoint into host memory, with a clear error for anything unreadable."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    try:
        with np.load(path, allow_pickle=False) as archive:
            contents = {key: archive[key] for key in archive.files}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as exc:
        raise CheckpointError(f"{path} is not a readable npformer checkpoint (truncated or "
                              f"corrupt?): {exc}") from exc
    if "meta" not in contents:
        raise CheckpointError(f"{path} is not an npformer checkpoint (no 'meta' entry)")
    try:
        meta = json.loads(str(contents["meta"]))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} has an unreadable 'meta' entry: {exc}") from exc
    if meta.get("format") != "npformer-checkpoint":
        raise CheckpointError(f"{path} is not an npformer checkpoint")
    params = {k[len("param/"):]: v for k, v in contents.items() if k.startswith("param/")}
    optim = {k[len("optim/"):]: _unwrap(v) for k, v in contents.items() if k.startswith("optim/")}
    return Checkpoint(kind=meta["kind"], config=meta["config"], params=params, optimizer=optim,
                      step=meta["step"], rng_state=meta.get("rng_state"), extra=meta["extra"])


def _unwrap(value: np.ndarray):
    """0-d arrays back to Python scalars/strings; arrays stay arrays."""
    if value.ndim == 0:
        return value.item()
    return value


def build_model(checkpoint: Checkpoint, expected_kind: str | None = None):
    """A new model of the checkpoint's kind and config, with its weights loaded."""
    from .models import MODELS
    from .models.common import config_from_dict

    if expected_kind is not None and checkpoint.kind != expected_kind:
        raise CheckpointError(f"the checkpoint holds a {checkpoint.kind!r} model, not a "
                              f"{expected_kind!r} model (is it from another demo?)")
    if checkpoint.kind not in MODELS:
        raise CheckpointError(f"unknown model kind {checkpoint.kind!r} in checkpoint")
    cls = MODELS[checkpoint.kind]
    model = cls(config_from_dict(cls.config_class, checkpoint.config))
    model.load_state_dict(checkpoint.params)
    return model


def restore(model, checkpoint: Checkpoint, optimizer=None) -> None:
    """Load a checkpoint into an existing model (and optimizer), checking that it was
    saved from the same architecture: kind, then every config field, then shapes."""
    from .models.common import config_to_dict

    if checkpoint.kind != model.kind:
        raise CheckpointError(f"the checkpoint holds a {checkpoint.kind!r} model, but this is "
                              f"a {model.kind!r} model")
    own = config_to_dict(model.config)
    differing = {k: (checkpoint.config.get(k), v) for k, v in own.items()
                 if checkpoint.config.get(k) != v}
    if differing:
        details = "; ".join(f"{k}: checkpoint {a!r}, model {b!r}" for k, (a, b) in differing.items())
        raise CheckpointError(f"the checkpoint was saved from a different architecture: {details}")
    model.load_state_dict(checkpoint.params)
    if optimizer is not None:
        if not checkpoint.optimizer:
            raise CheckpointError("the checkpoint holds no optimizer state to resume from")
        optimizer.load_state_dict(checkpoint.optimizer)
