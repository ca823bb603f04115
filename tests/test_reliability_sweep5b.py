"""Issue 57, cases 6 to 11: LoRA checkpoints keep their adapters' settings, PEFT folders
with lm_head / embedding adapters, whole-or-nothing writers, options given without the
option they need, environment settings read where they are used, and errors that name
the argument instead of a library's."""
from __future__ import annotations

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import npformer

ROOT = Path(npformer.__file__).resolve().parents[1]  # the checkout whose package runs
GARBAGE = "maybe-not"


# --------------------------------------------------------------------------- case 10
def _environment_variables() -> list[str]:
    """Every NPFORMER_* variable the package's source names."""
    import re

    names = set()
    for path in Path(npformer.__file__).parent.rglob("*.py"):
        names.update(re.findall(r"\bNPFORMER_[A-Z_]*[A-Z]\b", path.read_text()))
    return sorted(names)


def _all_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(npformer.__path__, "npformer.")
                  if ".__main__" not in m.name)


def test_the_settings_variables_are_found():
    names = _environment_variables()
    for name in ("NPFORMER_BACKEND", "NPFORMER_GPU_FUSED", "NPFORMER_NO_NUMBA",
                 "NPFORMER_CUDA_GRAPH"):
        assert name in names


def test_no_module_refuses_the_environment_on_import():
    """Every module imports with every NPFORMER_* variable set to garbage: the settings
    are read where they are used, and reported there (case 10)."""
    code = ("import importlib, sys\n"
            "for name in sys.argv[1:]:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except ImportError as exc:\n"
            "        if 'npformer' in str(exc): raise\n")  # an optional library: cupy
    env = {**os.environ, **{name: GARBAGE for name in _environment_variables()}}
    env.pop("NPFORMER_LAUNCHED", None)  # names a folder the launcher made
    proc = subprocess.run([sys.executable, "-c", code, *_all_modules()], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("name", ["NPFORMER_GPU_FUSED", "NPFORMER_NO_NUMBA",
                                  "NPFORMER_BACKEND", "NPFORMER_CUDA_GRAPH"])
def test_a_demo_says_a_bad_setting_in_one_error_line(name, tmp_path):
    env = {**os.environ, name: GARBAGE}
    proc = subprocess.run([sys.executable, "demos/generate.py", "--smoke", "--procs", "1",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[-1].startswith("error: ") and name in lines[-1], lines


def test_the_backend_is_made_on_first_use(monkeypatch):
    from npformer import backend

    monkeypatch.setenv("NPFORMER_BACKEND", GARBAGE)
    monkeypatch.setattr(backend, "_current", None)
    with pytest.raises(ValueError, match="NPFORMER_BACKEND='maybe-not' is not a backend"):
        backend.backend_name()
    monkeypatch.setenv("NPFORMER_BACKEND", "")
    assert backend.backend_name() == "numpy"


# --------------------------------------------------------------------------- case 9
def _demo(script: str, *args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "demos" / script), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


@pytest.mark.parametrize("script,args,typed,needed", [
    ("finetune.py", ("--lora-alpha", "16"), "--lora-alpha 16", "--lora R"),  # the default
    ("finetune.py", ("--lora", "0", "--lora-dropout", "0"), "--lora-dropout 0", "--lora R"),
    ("finetune.py", ("--lora-targets", ""), "--lora-targets ''", "--lora R"),
    ("generate.py", ("--kv-heads", "2"), "--kv-heads 2", "--arch llama"),  # the default
    ("generate.py", ("--kv_heads=2",), "--kv_heads 2", "--arch llama"),
    ("imdb.py", ("--checkpoint", "x.npz"), "--checkpoint x.npz", "--predict TEXT"),
    ("imdb.py", ("--text-column", "text"), "--text-column text", "--data FILE.csv"),
])
def test_an_option_typed_without_the_one_it_needs_is_refused(script, args, typed, needed,
                                                             tmp_path):
    """Refused whatever its value, the default's too (case 9): the run would not read it."""
    result = _demo(script, "--smoke", "--procs", "1", *args, "--out", str(tmp_path / "run"))
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert f"error: {typed}" in last and needed in last, last
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_a_resumed_run_is_not_refused_for_its_saved_settings(tmp_path):
    """A resumed run reads --arch llama --kv-heads 1 back from its checkpoint: only what
    is typed on the resuming command line counts as given."""
    from .test_demos import SHARED_DATA, synthetic_data

    (tmp_path / "data").mkdir()
    data = SHARED_DATA if SHARED_DATA.is_dir() else synthetic_data(tmp_path / "data")
    out = str(tmp_path / "run")
    first = _demo("generate.py", "--smoke", "--procs", "1", "--replicas", "1", "--arch",
                  "llama", "--kv-heads", "1", "--max-iters", "3", "--stop-after", "1",
                  "--data", str(data), "--out", out, "--no-progress")
    assert first.returncode == 130, first.stderr[-3000:]
    resumed = _demo("generate.py", "--resume", "--procs", "1", "--out", out, "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = _demo("generate.py", "--resume", "--procs", "1", "--kv-heads", "1", "--out", out,
                  "--no-progress")  # finished: nothing to refuse but what a finished run is
    assert "is read only with" not in again.stderr
