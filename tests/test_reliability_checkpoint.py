"""Checkpoint files under failure: other formats, poisoned weights, bad destinations,
saves killed mid-write, and the permissions of what is written.

* "gelu" in a checkpoint is the exact GELU; a file of another format version, newer or
  older, is refused, naming the version and the one this release reads (the version-1
  reader, which read "gelu" as the tanh form, went with its test: npformer is
  unreleased, no version-1 file exists);
* a checkpoint whose weights (or optimizer moments) hold NaN or inf is refused, naming
  the tensor;
* saving under a path whose parent is a file, or to a folder, is a clear error;
* a save killed with SIGKILL mid-write leaves ``.<name>.<pid>.tmp``; the next save or
  load removes it, and never a temporary of a process that still runs;
* a checkpoint gets mode 0666 & ~umask (0644 under umask 022), as other files do.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from npformer.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    load_checkpoint,
    remove_stale_temporaries,
    restore,
    save_checkpoint,
)

from .conftest import using_backend
from .helpers import tiered
from .test_checkpoint_train import lm

# A behaviour test: it runs in both tiers (tests.helpers.tiered), which must behave the same.
pytestmark = pytest.mark.usefixtures("tier")

ROOT = Path(__file__).resolve().parents[1]


def _rewrite(path: Path, out: Path, meta_update=None, arrays_update=None) -> Path:
    """A copy of the checkpoint at ``path`` with its meta and/or arrays changed."""
    with np.load(path) as archive:
        contents = {k: archive[k] for k in archive.files}
    meta = json.loads(str(contents["meta"]))
    if meta_update:
        meta_update(meta)
    contents["meta"] = np.array(json.dumps(meta))
    contents.update(arrays_update or {})
    np.savez(out, **contents)
    return out


# =========================================================================== format versions
def test_gelu_is_the_exact_form(tmp_path):
    with using_backend("numpy", "float64", seed=2):
        path = save_checkpoint(tmp_path / "m.npz", lm(activation="gelu"))
        checkpoint = load_checkpoint(path)
    assert json.loads(str(np.load(path)["meta"]))["version"] == FORMAT_VERSION == 6
    assert checkpoint.config["activation"] == "gelu"


@pytest.mark.parametrize("version", [99, 5, 4, 1])
def test_another_format_version_is_refused(tmp_path, version):
    with using_backend("numpy", "float64"):
        path = save_checkpoint(tmp_path / "m.npz", lm())
    other = _rewrite(path, tmp_path / "other.npz", lambda m: m.update(version=version))
    with pytest.raises(CheckpointError, match=f"format version {version}; this release of "
                                              "npformer reads version 6 only"):
        load_checkpoint(other)


# =========================================================================== poisoned weights
def _poisoned(path: Path, out: Path, key: str, index: int, bad: float) -> Path:
    """A copy of the checkpoint at ``path`` with value ``index`` (flat) of the tensor
    ``key`` ("param/<name>" or "optim/<state>.<i>") set to ``bad``."""
    with np.load(path) as archive:
        array = archive[key].copy()
    array.reshape(-1)[index] = bad
    return _rewrite(path, out, arrays_update={key: array})


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, bad, tier):
    with using_backend("numpy", "float64"):
        model = lm()
        path = save_checkpoint(tmp_path / "m.npz", model, tiered.AdamW(model.parameters()))
        assert "flat/param" not in np.load(path).files  # both tiers write tensor by tensor
        poisoned = _poisoned(path, tmp_path / "bad.npz", "param/blocks.1.ffn.linear1.weight",
                             7, bad)
        with pytest.raises(CheckpointError,
                           match=r"param/blocks\.1\.ffn\.linear1\.weight holds 1 NaN or inf"):
            load_checkpoint(poisoned)


def test_non_finite_optimizer_state_is_refused(tmp_path, tier):
    with using_backend("numpy", "float64"):
        model = lm()
        path = save_checkpoint(tmp_path / "m.npz", model, tiered.Adam(model.parameters()))
        assert "flat/optim/v" not in np.load(path).files
        poisoned = _poisoned(path, tmp_path / "bad.npz", "optim/v.3", 0, np.nan)
        with pytest.raises(CheckpointError, match=r"optim/v\.3 holds 1 NaN"):
            load_checkpoint(poisoned)


# =========================================================================== destinations
def test_saving_under_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    with using_backend("numpy", "float64"):
        with pytest.raises(CheckpointError, match=r"a_file is a file, not a folder"):
            save_checkpoint(tmp_path / "a_file" / "sub" / "model.npz", lm())
        with pytest.raises(CheckpointError, match="it is a folder"):
            save_checkpoint(tmp_path, lm())


# =========================================================================== killed saves
_KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from npformer import backend
    from tests.test_checkpoint_train import lm
    from npformer.checkpoint import save_checkpoint

    real_savez = np.savez
    def savez_then_die(handle, **arrays):
        real_savez(handle, **dict(list(arrays.items())[:2]))  # part of the file...
        handle.flush()
        os.kill(os.getpid(), signal.SIGKILL)                  # ...then no clean-up at all
    np.savez = savez_then_die
    backend.set_default_float("float64")
    save_checkpoint(sys.argv[1], lm())
""")


def _killed_save(path: Path) -> int:
    """Run a save in a child process that SIGKILLs itself mid-write; return its pid."""
    child = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(path)], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert child.wait(timeout=120) == -signal.SIGKILL
    return child.pid


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
@pytest.mark.parametrize("next_operation", ["save", "load"])
def test_a_save_killed_mid_write_leaves_a_temporary_the_next_operation_removes(
        tmp_path, next_operation):
    path = tmp_path / "model.npz"
    with using_backend("numpy", "float64"):
        save_checkpoint(path, lm())
        before = path.read_bytes()
        pid = _killed_save(path)
        leftover = tmp_path / f".model.npz.{pid}.tmp"
        assert leftover.is_file() and path.read_bytes() == before  # the old one is intact
        if next_operation == "save":
            save_checkpoint(path, lm())
        else:
            load_checkpoint(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.npz"]


def test_temporaries_of_live_processes_and_other_files_are_kept(tmp_path):
    path = tmp_path / "model.npz"
    live = tmp_path / f".model.npz.{os.getppid()}.tmp"  # our parent runs: a save in progress
    other = tmp_path / ".other.npz.999999999.tmp"        # another checkpoint's
    unrelated = tmp_path / "model.npz.notes"
    for f in (live, other, unrelated):
        f.write_bytes(b"x")
    assert remove_stale_temporaries(path) == []
    assert live.exists() and other.exists() and unrelated.exists()


# =========================================================================== permissions
@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_checkpoint_permissions_follow_the_umask(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        with using_backend("numpy", "float64"):
            path = save_checkpoint(tmp_path / "model.npz", lm())
        plain = tmp_path / "metrics.json"
        plain.write_text("{}")
    finally:
        os.umask(previous)
    assert path.stat().st_mode & 0o777 == mode == plain.stat().st_mode & 0o777


# =========================================================================== malformed meta
@pytest.mark.parametrize("change,match", [
    (lambda m: m.pop("kind"), "'kind' should be a str"),
    (lambda m: m.update(config=[1, 2]), "'config' should be a dict"),
    (lambda m: m.update(step="seven"), "'step' should be a int"),
    (lambda m: m.update(extra=None), "'extra' should be a dict"),
])
def test_malformed_meta_is_refused_naming_the_field(tmp_path, change, match):
    with using_backend("numpy", "float64"):
        path = save_checkpoint(tmp_path / "m.npz", lm())
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(_rewrite(path, tmp_path / "bad.npz", change))


def test_a_bare_npy_file_is_refused(tmp_path):
    np.save(tmp_path / "array.npy", np.zeros(3))
    with pytest.raises(CheckpointError, match="single NumPy array"):
        load_checkpoint(tmp_path / "array.npy")



@pytest.mark.parametrize("version", [True, 1.0, "4", 0, 5, 7])
def test_a_version_that_is_not_a_known_integer_is_refused(tmp_path, version):
    """Issue 37 case 24: "version": true was read as version 1 (and rebuilt gelu as the
    tanh form); a version must be the integer this npformer reads."""
    with using_backend("numpy", "float64"):
        path = save_checkpoint(tmp_path / "m.npz", lm())
    with np.load(path) as saved:
        arrays = {name: saved[name] for name in saved.files}
    meta = json.loads(str(arrays["meta"]))
    meta["version"] = version
    arrays["meta"] = np.array(json.dumps(meta))
    np.savez(tmp_path / "bad.npz", **arrays)
    with pytest.raises(CheckpointError, match=r"format version"):
        load_checkpoint(tmp_path / "bad.npz")


def test_save_and_restore_refuse_an_optimizer_of_another_model(tmp_path):
    """Issue 37 case 25: an optimizer over another model's parameters was saved with the
    model (and restored into it) silently; the Trainer already refused it."""
    with using_backend("numpy", "float64"):
        model, other = lm(), lm()
        foreign = tiered.AdamW(other.parameters())
        with pytest.raises(ValueError, match="save_checkpoint: the optimizer does not update"):
            save_checkpoint(tmp_path / "m.npz", model, foreign)
        path = save_checkpoint(tmp_path / "m.npz", model, tiered.AdamW(model.parameters()))
        with pytest.raises(ValueError, match="restore: the optimizer does not update"):
            restore(model, load_checkpoint(path), foreign)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(step="3"), TypeError, "step must be an integer, got '3'"),
    (dict(step=-1), ValueError, "step must be at least 0, got -1"),
    (dict(step=2.0), TypeError, "step must be an integer"),
    (dict(extra="notes"), TypeError, "extra must be a dict .* got str"),
    (dict(path=""), ValueError, "path must be a path, got the empty name ''"),
])
def test_save_checkpoint_refuses_arguments_of_the_wrong_kind(tmp_path, kwargs, error, match):
    """issue 47 (the count, path and JSON kinds at the checkpoint's door): a str step was
    saved as int("3"), a negative one as it was, a str extra as a JSON string."""
    with using_backend("numpy", "float32"):
        model = lm()
        kwargs = {"path": tmp_path / "m.npz", **kwargs}
        with pytest.raises(error, match=match):
            save_checkpoint(kwargs.pop("path"), model, **kwargs)
        assert not (tmp_path / "m.npz").exists()
        assert load_checkpoint(save_checkpoint(tmp_path / "ok.npz", model, step=np.int64(4))
                               ).step == 4
    with pytest.raises(ValueError, match="path must be a path, got the empty name"):
        load_checkpoint("")


def test_save_and_restore_name_a_model_or_checkpoint_of_the_wrong_kind(tmp_path):
    """sweep 5: restore's arguments swapped, or a path where the Checkpoint goes, failed deep
    inside (asdict() of a Checkpoint, 'str' has no attribute 'kind'), and save_checkpoint of
    something that is not a model with 'no attribute named_modules'."""
    with using_backend("numpy", "float64"):
        model = lm()
        path = save_checkpoint(tmp_path / "m.npz", model)
        checkpoint = load_checkpoint(path)
        with pytest.raises(TypeError, match=r"restore\(model, checkpoint\): model must be an "
                           r"npformer model \(a Module\), got Checkpoint"):
            restore(checkpoint, model)
        with pytest.raises(TypeError, match=r"checkpoint must be a Checkpoint \(read the file "
                           r"with load_checkpoint\(path\) first\), got PosixPath"):
            restore(model, path)
        with pytest.raises(TypeError, match=r"save_checkpoint\(path, model\): model must be "
                           r"an npformer model \(a Module\), got Checkpoint"):
            save_checkpoint(tmp_path / "other.npz", checkpoint)
        assert not (tmp_path / "other.npz").exists()
        restore(model, checkpoint)  # the right order still works
