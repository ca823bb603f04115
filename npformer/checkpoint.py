"""Checkpoints: one backend-neutral ``.npz`` file, no pickle.

Layout of the archive:

* ``meta``: a 0-d unicode array holding JSON: format version, the model kind
  and config, the step, the random generators' states, and ``extra`` (vocabularies,
  metrics: anything JSON-able the caller adds);
* ``param/<name>``: every parameter, a NumPy array on the host, under its
  :meth:`~npformer.nn.Module.state_dict` name;
* ``optim/<key>``: the optimizer's :meth:`~npformer.optim.Optimizer.state_dict` (arrays
  and scalars), under its keys (``optim/m.3``, ``optim/lr``).

Both tiers write the same file: what a model and an optimizer mean (their state dicts)
does not depend on how the fast tier lays them out in memory.

The format's version is :data:`FORMAT_VERSION` (6: configs and parameters in the one
vocabulary of docs/guide.md; ``meta["lora"]`` holds a LoRA model's adapters' settings,
below), the only one this release reads: a file of another version,
older or newer, is refused by its version, not by a field it does not know.

Files are written atomically: into ``.<name>.<pid>.tmp`` beside the target, flushed to
disk, then renamed over it, so an interrupted save never leaves a half-written checkpoint
where a good one was; the temporary of a process killed mid-save is removed by the next
save or load of that checkpoint.  The file's mode is 0666 less the umask, as for any file.

A LoRA model's adapters are saved apart from its weights (merged ones are refused:
restored, the update would count twice), with what they compute in ``meta["lora"]``
(:func:`npformer.nn.lora.adapter_settings`): :func:`build_model` puts the same adapters on
the model it builds, and :func:`restore` refuses a model whose adapters differ, naming the
layer and the setting.

Loading works on any backend, and refuses (:class:`CheckpointError`, naming the problem) a
file that is not a readable checkpoint: truncated or corrupt, of another format version,
with a malformed ``meta``, or whose weights or optimizer state hold NaN or inf.
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
from .nn.state import weight_array
from .ops.contracts import check_path, check_size, read_json_object

if TYPE_CHECKING:  # annotations only: nn and optim are not imported here
    from .nn import Module
    from .optim import Optimizer

FORMAT_VERSION = 6


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written, or does not fit the model it is
    loaded into."""


class CheckpointWriteError(CheckpointError, OSError):
    """A checkpoint the file system would not take (a full disk, a read-only folder): an
    OSError still, with the file and the previous file's fate said in its message."""


@dataclass
class Checkpoint:
    """A loaded checkpoint, what :func:`build_model` and :func:`restore` read: ``params`` by
    dotted name, ``optimizer`` by its state dict's keys, ``extra`` the caller's values."""

    kind: str
    config: dict
    params: dict[str, np.ndarray]
    optimizer: dict[str, Any] = field(default_factory=dict)
    step: int = 0
    rng_state: dict | None = None
    extra: dict = field(default_factory=dict)
    lora: dict | None = None  # the adapters' settings (nn.lora.adapter_settings), or None


# --------------------------------------------------------------------------- temporaries
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


def _check_model(model: Any, door: str) -> None:
    """``model`` is an npformer model (a Module); ``door`` names the call, for the message."""
    from .nn import Module

    if not isinstance(model, Module):
        raise TypeError(f"{door}: model must be an npformer model (a Module), got "
                        f"{type(model).__name__}")


def _refuse_merged_adapters(model: Module) -> None:
    """A checkpoint holds a LoRA model's weights and its adapters apart: with the adapters
    merged, the weights would hold the update too, and a model restored from it (its
    adapters unmerged) would add it twice, silently."""
    from .nn.lora import lora_layers

    merged = [name for name, layer in lora_layers(model).items() if layer.merged]
    if merged:
        shown = ", ".join(merged[:3]) + (", ..." if len(merged) > 3 else "")
        raise CheckpointError(f"cannot save a checkpoint of {type(model).__name__} with its "
                              f"LoRA adapters merged into the weights ({shown}): restored, "
                              "the update would count twice; unmerge_lora(model) first")


_JSON_SCALARS = (str, int, float, bool, type(None))


def check_json(value: Any, what: str) -> None:
    """``value`` is what JSON holds: dicts (keys str, or numbers, bools, None, which JSON
    writes as strings), lists or tuples, str, int, float, bool, None.  The first part that
    is not is a TypeError naming where it is (``extra['x'][2]``), its type and what would
    do (a NumPy array's ``.tolist()``): not JSON's own error, after a file was begun."""
    def walk(item: Any, where: str) -> None:
        if isinstance(item, _JSON_SCALARS):
            return
        if isinstance(item, dict):
            for key, inner in item.items():
                if not isinstance(key, _JSON_SCALARS):
                    raise TypeError(f"{where} has the key {key!r} ({type(key).__name__}): "
                                    "JSON's keys are strings")
                walk(inner, f"{where}[{key!r}]")
            return
        if isinstance(item, (list, tuple)):
            for i, inner in enumerate(item):
                walk(inner, f"{where}[{i}]")
            return
        hint = " (.tolist() makes one of an array, float() or int() of a number)" \
            if hasattr(item, "tolist") else ""
        kind = f"{type(item).__module__}.{type(item).__qualname__}".replace("builtins.", "")
        raise TypeError(f"{where} is a {kind}, not a JSON value (a dict, list, str, number, "
                        f"bool or None){hint}")

    walk(value, what)


def save_checkpoint(path: str | os.PathLike, model: Module, optimizer: Optimizer | None = None,
                    step: int = 0, extra: dict | None = None,
                    rng_state: dict | None = None) -> Path:
    """Write ``model`` (and optionally ``optimizer``, whose parameters must be the model's)
    to ``path`` atomically, every array under its state-dict name."""
    from .models.common import config_to_dict
    from .nn.lora import adapter_settings
    from .optim import check_optimizer_of

    path = Path(check_path(path, "path"))
    step = check_size(step, "step", 0)
    for name, value, holding in (("extra", extra, "JSON values by name"),
                                 ("rng_state", rng_state, "the random generators' states")):
        if value is not None and not isinstance(value, dict):
            raise TypeError(f"{name} must be a dict ({holding}) or None, got "
                            f"{type(value).__name__}")
        check_json(value, name)
    _check_destination(path)
    _check_model(model, "save_checkpoint(path, model)")
    _refuse_merged_adapters(model)
    if optimizer is not None:
        check_optimizer_of(optimizer, model, "save_checkpoint")
    meta = {"format": "npformer-checkpoint", "version": FORMAT_VERSION, "kind": model.kind,
            "config": config_to_dict(model.config), "step": int(step),
            "rng_state": rng_state, "extra": extra or {}}
    lora = adapter_settings(model)
    if lora is not None:  # what the adapters compute: build_model and restore read it
        meta["lora"] = lora
    arrays = {f"param/{name}": backend.to_numpy(p.data) for name, p in model.named_parameters()}
    if optimizer is not None:
        arrays.update({f"optim/{key}": (np.array(value) if isinstance(value, (str, int, float))
                                        else backend.to_numpy(value))
                       for key, value in optimizer.state_dict().items()})
    arrays["meta"] = np.array(json.dumps(meta))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
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
    path = Path(check_path(path, "path"))
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
    optim = {k[len("optim/"):]: v.item() if v.ndim == 0 else v  # scalars back to Python's
             for k, v in contents.items() if k.startswith("optim/")}
    for key, value in contents.items():  # the rules every weight loader applies
        if key.startswith("param/") or (key.startswith("optim/") and value.ndim > 0):
            try:
                weight_array(value, key)
            except (TypeError, ValueError) as exc:
                raise CheckpointError(f"{path}: {exc}") from None
    return Checkpoint(kind=meta["kind"], config=meta["config"], params=params, optimizer=optim,
                      step=meta["step"], rng_state=meta.get("rng_state"), extra=meta["extra"],
                      lora=meta.get("lora"))


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
        text = head.decode("utf-8", errors="replace")
        is_text = all(c.isprintable() or c.isspace() for c in text) and "\ufffd" not in text
        looks = ("an empty file" if not head else "a text file" if is_text
                 else f"a file starting with {head!r}")
        raise CheckpointError(f"{path} is not an npformer .npz checkpoint (not a zip archive: "
                              f"{looks})")


_META_FIELDS = {"kind": str, "config": dict, "step": int, "extra": dict}


def _read_meta(path: Path, contents: dict) -> dict:
    """The checked ``meta`` entry."""
    if "meta" not in contents:
        raise CheckpointError(f"{path} is not an npformer checkpoint (no 'meta' entry)")
    raw = contents["meta"]
    if raw.dtype.kind != "U" or raw.ndim != 0:
        raise CheckpointError(f"{path} has an unreadable 'meta' entry (not a JSON string)")
    try:
        meta = read_json_object(raw, f"{path}'s 'meta' entry", (), "an npformer checkpoint's "
                                "record")
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if meta.get("format") != "npformer-checkpoint":
        raise CheckpointError(f"{path} is not an npformer checkpoint")
    version = meta.get("version")
    if isinstance(version, bool) or version != FORMAT_VERSION:
        raise CheckpointError(f"{path} has checkpoint format version {version!r}; this "
                              f"release of npformer reads version {FORMAT_VERSION} only")
    for name, kind in _META_FIELDS.items():
        if not isinstance(meta.get(name), kind) or isinstance(meta.get(name), bool):
            raise CheckpointError(f"{path} has a malformed 'meta' entry: {name!r} should be "
                                  f"a {kind.__name__}, got {meta.get(name)!r:.80}")
    if meta.get("lora") is not None:
        from .nn.lora import check_saved_adapter_settings

        try:
            check_saved_adapter_settings(meta["lora"], f"{path}'s 'lora' entry in its 'meta'")
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
    return meta


TIERS = ("fast", "textbook")  # npformer.fast's implementations, or the textbook's


def build_model(checkpoint: Checkpoint, expected_kind: str | tuple[str, ...] | None = None,
                tier: str = "fast") -> Module:
    """A new model of the checkpoint's kind and config, with its weights loaded: the fast
    tier's class (:data:`npformer.fast.MODELS`) or, with ``tier="textbook"``, the
    textbook's (:data:`npformer.models.MODELS`).  ``expected_kind``: the kind, or the
    kinds, the caller can use (a checkpoint of another is refused, naming both)."""
    from . import models
    from .models.common import config_from_dict
    from .ops.contracts import check_choice

    check_choice(tier, TIERS, "tier")
    if tier == "fast":  # imported only when asked for: a textbook run never loads it
        from . import fast

        MODELS = fast.MODELS
    else:
        MODELS = models.MODELS

    kinds = (expected_kind,) if isinstance(expected_kind, str) else expected_kind
    if kinds is not None and checkpoint.kind not in kinds:
        wanted = " or ".join(repr(kind) for kind in kinds)
        raise CheckpointError(f"the checkpoint holds a {checkpoint.kind!r} model, not a "
                              f"{wanted} model (is it from another demo?)")
    if checkpoint.kind not in MODELS:
        raise CheckpointError(f"unknown model kind {checkpoint.kind!r} in checkpoint")
    cls = MODELS[checkpoint.kind]
    try:
        config = config_from_dict(cls.config_class, checkpoint.config)
        model = cls(config)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"the checkpoint's config does not make a {checkpoint.kind!r} "
                              f"model: {exc}") from exc
    from .nn.lora import apply_adapter_settings, merge_saved_adapters

    if checkpoint.lora is not None:  # the adapters it was saved with, then their weights
        try:
            apply_adapter_settings(model, checkpoint.lora)
        except ValueError as exc:
            raise CheckpointError(f"the checkpoint's LoRA adapters do not fit its "
                                  f"{checkpoint.kind!r} model: {exc}") from None
    model.load_state_dict(checkpoint.params)
    if checkpoint.lora is not None:
        merge_saved_adapters(model, checkpoint.lora)
    return model


def _check_same_adapters(model: Module, checkpoint: Checkpoint) -> None:
    """A checkpoint restores only into a model whose adapters compute the same as its own:
    each difference is named (the layer and the setting: r, alpha, dropout, merged, or the
    targets)."""
    from .nn.lora import adapter_differences, adapter_settings

    differences = adapter_differences(checkpoint.lora, adapter_settings(model))
    if differences:
        shown = "; ".join(differences[:6]) + ("; ..." if len(differences) > 6 else "")
        raise CheckpointError(f"the checkpoint's LoRA adapters differ from the model's: "
                              f"{shown} (build the model with build_model(checkpoint), or "
                              "apply_lora with the checkpoint's settings)")


def restore(model: Module, checkpoint: Checkpoint,
            optimizer: Optimizer | None = None) -> None:
    """Load a checkpoint into an existing model (and optimizer), checking that it was
    saved from the same architecture: kind, then every config field, then shapes."""
    from .models.common import config_to_dict
    from .optim import check_optimizer_of

    _check_model(model, "restore(model, checkpoint)")
    if not isinstance(checkpoint, Checkpoint):
        read_first = " (read the file with load_checkpoint(path) first)" \
            if isinstance(checkpoint, (str, os.PathLike)) else ""
        raise TypeError(f"restore(model, checkpoint): checkpoint must be a Checkpoint"
                        f"{read_first}, got {type(checkpoint).__name__}")
    if optimizer is not None:
        check_optimizer_of(optimizer, model, "restore")
    if checkpoint.kind != model.kind:
        raise CheckpointError(f"the checkpoint holds a {checkpoint.kind!r} model, but this is "
                              f"a {model.kind!r} model")
    own = config_to_dict(model.config)
    saved = checkpoint.config
    differing = {k: (saved.get(k), v) for k, v in own.items() if saved.get(k) != v}
    if differing:
        details = "; ".join(f"{k}: checkpoint {a!r}, model {b!r}"
                            for k, (a, b) in differing.items())
        raise CheckpointError(f"the checkpoint was saved from a different architecture: {details}")
    _check_same_adapters(model, checkpoint)
    model.load_state_dict(checkpoint.params)
    if optimizer is not None:
        if not checkpoint.optimizer:
            raise CheckpointError("the checkpoint holds no optimizer state to resume from")
        optimizer.load_state_dict(checkpoint.optimizer)
