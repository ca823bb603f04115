"""Checkpoints: one backend-neutral ``.npz`` file, no pickle.

Layout of the archive:

* ``meta``: a 0-d unicode array holding JSON: format version, the model kind
  and config, the step, the random generators' states, and ``extra`` (vocabularies,
  metrics: anything JSON-able the caller adds);
* ``param/<name>``: every parameter, as NumPy arrays on the host;
* ``optim/<key>``: the optimizer's :meth:`state_dict` (arrays and scalars).

Format versions: 3 (this one) calls every config's context length ``block_size``;
versions 1 and 2 called the classifier's and the seq2seq model's ``max_len``, and
reading one maps it (``models.common.saved_config_values``, the one place a saved config
is read).  Version 2 named the exact GELU "gelu" and the tanh form "gelu_tanh";
version 1 files called the tanh form "gelu", so reading one renames its config's
``activation`` "gelu" to "gelu_tanh": the model is rebuilt with the activation it was
trained with.  An npformer that reads only older versions refuses a newer file by its
version, not by a field it does not know.

Files are written atomically: into a temporary file ``.<name>.<pid>.tmp`` beside the
target, flushed to disk, then renamed over it, so an interrupted save never leaves a
half-written checkpoint where a good one was.  A process killed mid-save (SIGKILL: no
clean-up runs) leaves its temporary behind; the next save or load of that checkpoint
removes the temporaries whose process is gone.  The file is created with mode 0666
less the umask, like any file a program writes (0644 under the usual umask 022).

Loading works on any backend, and refuses (:class:`CheckpointError`, naming the
problem) a file that is not a readable checkpoint: truncated or corrupt, from a newer
format, with a malformed ``meta``, or whose weights or optimizer state hold NaN or inf.
"""
from __future__ import annotations

import json
import os
import re
import struct
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import backend
from .validation import weight_array

if TYPE_CHECKING:  # annotations only: nn and optim are not imported here
    from .nn import Module
    from .optim import Optimizer

FORMAT_VERSION = 3
_RENAMED_IN_V2 = {"gelu": "gelu_tanh"}  # activation names of version 1 -> version 2


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written, or does not fit the model it is
    loaded into."""


class CheckpointWriteError(CheckpointError, OSError):
    """A checkpoint the file system would not take (a full disk, a read-only folder): an
    OSError still, with the file and the previous file's fate said in its message."""


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model ``kind`` and ``config`` (to rebuild it), its
    parameter arrays ``params`` by dotted name, the ``optimizer`` state, the update
    ``step``, the random generators' ``rng_state`` and the caller's ``extra`` values
    (vocabularies, label names, the trainer's state)."""

    kind: str
    config: dict
    params: dict[str, np.ndarray]
    optimizer: dict[str, Any] = field(default_factory=dict)
    step: int = 0
    rng_state: dict | None = None
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- temporaries
def _temporary_name(path: Path, pid: int) -> Path:
    return path.with_name(f".{path.name}.{pid}.tmp")


def _process_is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's), or we cannot tell: keep its file
    return True


def remove_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Delete the temporaries ``.<name>.<pid>.tmp`` of saves of ``path`` whose process
    no longer runs (killed mid-save); return what was deleted.  Those of live processes
    (a save in progress elsewhere) are left alone."""
    path = Path(path)
    pattern = re.compile(re.escape(f".{path.name}.") + r"(\d+)\.tmp")
    removed = []
    try:
        candidates = list(path.parent.iterdir())
    except OSError:
        return removed
    for candidate in candidates:
        match = pattern.fullmatch(candidate.name)
        if match and int(match[1]) != os.getpid() and not _process_is_alive(int(match[1])):
            try:
                candidate.unlink()
                removed.append(candidate)
            except OSError:
                pass
    return removed


# --------------------------------------------------------------------------- saving
def _check_destination(path: Path) -> None:
    """A clear error for a destination that cannot hold a file."""
    if path.is_dir():
        raise CheckpointError(f"cannot save a checkpoint to {path}: it is a folder; "
                              "give a file name such as model.npz")
    for ancestor in path.parents:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise CheckpointError(f"cannot save a checkpoint to {path}: {ancestor} is a "
                                      "file, not a folder")
            return


def save_checkpoint(path: str | os.PathLike, model: Module, optimizer: Optimizer | None = None,
                    step: int = 0, extra: dict | None = None,
                    rng_state: dict | None = None) -> Path:
    """Write ``model`` (and optionally ``optimizer``) to ``path`` atomically."""
    from .models.common import config_to_dict

    path = Path(path)
    _check_destination(path)
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
    tmp = _temporary_name(path, os.getpid())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path)
        # 0o666 & ~umask, as open() gives any other file (mkstemp would give 0600)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        with os.fdopen(fd, "wb") as handle:
            np.savez(handle, **arrays)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):  # a full disk, a read-only folder: the user's to fix
            previous = "the previous file there is unchanged" if path.exists() else \
                "nothing was written"
            raise CheckpointWriteError(f"could not save the checkpoint {path}: "
                                  f"{exc.strerror or exc} ({previous})") from None
        raise
    return path


# --------------------------------------------------------------------------- loading
# What a damaged .npz can raise from zipfile / zlib / np.load: all mean "unreadable".
_UNREADABLE = (zipfile.BadZipFile, zlib.error, struct.error, ValueError, OSError, EOFError,
               KeyError, NotImplementedError, RuntimeError, MemoryError, OverflowError,
               UnicodeDecodeError)


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint into host memory, with a clear error for anything unreadable."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    remove_stale_temporaries(path)
    _check_is_an_archive(path)
    try:
        archive = np.load(path, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):  # a bare .npy gives an array
            raise CheckpointError(f"{path} is a single NumPy array, not an npformer checkpoint")
        with archive:
            contents = {key: archive[key] for key in archive.files}
    except (FileNotFoundError, CheckpointError):
        raise
    except _UNREADABLE as exc:
        raise CheckpointError(f"{path} is not a readable npformer checkpoint (truncated or "
                              f"corrupt?): {type(exc).__name__}: {exc}") from exc
    meta = _read_meta(path, contents)
    params = {k[len("param/"):]: v for k, v in contents.items() if k.startswith("param/")}
    optim = {k[len("optim/"):]: _unwrap(v) for k, v in contents.items() if k.startswith("optim/")}
    for name, value in params.items():  # the rules every weight loader applies
        try:
            weight_array(value, f"param/{name}")
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: {exc}") from None
    _check_arrays(path, "optim/", {k: v for k, v in optim.items() if isinstance(v, np.ndarray)})
    return Checkpoint(kind=meta["kind"], config=meta["config"], params=params, optimizer=optim,
                      step=meta["step"], rng_state=meta.get("rng_state"), extra=meta["extra"])


_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a .npz is a zip archive (or an empty one)
_NPY_MAGIC = b"\x93NUMPY"


def _check_is_an_archive(path: Path) -> None:
    """Refuse, saying what it is not, a file that is neither a zip (.npz) nor a .npy: NumPy
    would try it as a pickle and speak of allow_pickle, which misleads."""
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc}") from exc
    if not head.startswith(_ZIP_MAGIC) and head != _NPY_MAGIC:
        looks = ("an empty file" if not head else "a text file" if _is_text(head)
                 else f"a file starting with {head!r}")
        raise CheckpointError(f"{path} is not an npformer .npz checkpoint (not a zip archive: "
                              f"{looks})")


def _is_text(head: bytes) -> bool:
    text = head.decode("utf-8", errors="replace")
    return all(c.isprintable() or c.isspace() for c in text) and "\ufffd" not in text


_META_FIELDS = {"kind": str, "config": dict, "step": int, "extra": dict}


def _read_meta(path: Path, contents: dict) -> dict:
    """The checked, upgraded ``meta`` entry."""
    if "meta" not in contents:
        raise CheckpointError(f"{path} is not an npformer checkpoint (no 'meta' entry)")
    raw = contents["meta"]
    if raw.dtype.kind != "U" or raw.ndim != 0:
        raise CheckpointError(f"{path} has an unreadable 'meta' entry (not a JSON string)")
    try:
        meta = json.loads(str(raw))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} has an unreadable 'meta' entry: {exc}") from exc
    if not isinstance(meta, dict) or meta.get("format") != "npformer-checkpoint":
        raise CheckpointError(f"{path} is not an npformer checkpoint")
    version = meta.get("version", 1)
    if not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {version!r}; this "
                              f"npformer reads versions 1 to {FORMAT_VERSION} (is it from a "
                              "newer npformer?)")
    for name, kind in _META_FIELDS.items():
        if not isinstance(meta.get(name), kind) or isinstance(meta.get(name), bool):
            raise CheckpointError(f"{path} has a malformed 'meta' entry: {name!r} should be "
                                  f"a {kind.__name__}, got {meta.get(name)!r:.80}")
    if version == 1:
        activation = meta["config"].get("activation")
        if activation in _RENAMED_IN_V2:  # "gelu" meant the tanh form before version 2
            meta["config"]["activation"] = _RENAMED_IN_V2[activation]
    return meta


def _check_arrays(path: Path, prefix: str, arrays: dict) -> None:
    """Every saved array is numeric and finite; the first that is not is named."""
    for name, value in arrays.items():
        if value.dtype.kind not in "fiub":
            raise CheckpointError(f"{path}: {prefix}{name} has dtype {value.dtype}, not a "
                                  "number type (corrupt or not an npformer checkpoint)")
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            bad = int(np.size(value) - np.count_nonzero(np.isfinite(value)))
            raise CheckpointError(f"{path}: {prefix}{name} holds {bad} NaN or infinite "
                                  "values; refusing to load weights that would predict NaN "
                                  "(was it saved after training diverged?)")


def _unwrap(value: np.ndarray):
    """0-d arrays back to Python scalars/strings; arrays stay arrays."""
    if value.ndim == 0:
        return value.item()
    return value


def build_model(checkpoint: Checkpoint, expected_kind: str | None = None) -> Module:
    """A new model of the checkpoint's kind and config, with its weights loaded."""
    from .models import MODELS
    from .models.common import config_from_dict

    if expected_kind is not None and checkpoint.kind != expected_kind:
        raise CheckpointError(f"the checkpoint holds a {checkpoint.kind!r} model, not a "
                              f"{expected_kind!r} model (is it from another demo?)")
    if checkpoint.kind not in MODELS:
        raise CheckpointError(f"unknown model kind {checkpoint.kind!r} in checkpoint")
    cls = MODELS[checkpoint.kind]
    try:
        config = config_from_dict(cls.config_class, checkpoint.config)
        model = cls(config)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"the checkpoint's config does not make a {checkpoint.kind!r} "
                              f"model: {exc}") from exc
    model.load_state_dict(checkpoint.params)
    return model


def restore(model: Module, checkpoint: Checkpoint,
            optimizer: Optimizer | None = None) -> None:
    """Load a checkpoint into an existing model (and optimizer), checking that it was
    saved from the same architecture: kind, then every config field, then shapes."""
    from .models.common import config_to_dict, saved_config_values

    if checkpoint.kind != model.kind:
        raise CheckpointError(f"the checkpoint holds a {checkpoint.kind!r} model, but this is "
                              f"a {model.kind!r} model")
    own = config_to_dict(model.config)
    saved = saved_config_values(type(model.config), checkpoint.config)
    differing = {k: (saved.get(k), v) for k, v in own.items() if saved.get(k) != v}
    if differing:
        details = "; ".join(f"{k}: checkpoint {a!r}, model {b!r}"
                            for k, (a, b) in differing.items())
        raise CheckpointError(f"the checkpoint was saved from a different architecture: {details}")
    model.load_state_dict(checkpoint.params)
    if optimizer is not None:
        if not checkpoint.optimizer:
            raise CheckpointError("the checkpoint holds no optimizer state to resume from")
        optimizer.load_state_dict(checkpoint.optimizer)
