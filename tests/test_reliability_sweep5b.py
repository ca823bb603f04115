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
