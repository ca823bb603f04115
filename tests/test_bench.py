"""The benchmark runs end to end: ``python bench/bench.py --smoke`` (tiny sizes, 1 step).

It checks that both sides run for every configuration, that a ratio line is printed
for each, and that the first-step losses agree (PyTorch's initial weights are loaded
into npformer, so the two sides compute the same model on the same batch).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import require_torch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("imdb", "lm", "seq2seq")


@pytest.fixture(scope="module")
def smoke_output():
    require_torch()
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench.py"), "--smoke"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    return proc


def test_smoke_exits_cleanly(smoke_output):
    assert smoke_output.returncode == 0, smoke_output.stdout + smoke_output.stderr
    assert "FAILED" not in smoke_output.stdout


@pytest.mark.parametrize("name", CONFIGS)
def test_ratio_line_per_config(smoke_output, name):
    pattern = rf"^ratio {name}\s+train \d+\.\d+x\s+infer \d+\.\d+x\s+memory "
    assert re.search(pattern, smoke_output.stdout, re.MULTILINE), smoke_output.stdout


@pytest.mark.parametrize("name", CONFIGS)
def test_first_step_losses_agree(smoke_output, name):
    line = next(line for line in smoke_output.stdout.splitlines()
                if line.startswith(f"ratio {name} "))
    assert "first-step loss" in line, line
    assert not re.search(rf"^WARNING: {name}:", smoke_output.stdout, re.MULTILINE)


def test_header_names_machine_versions_threads_and_allocator(smoke_output):
    out = smoke_output.stdout
    for label in ("machine:", "libraries:", "threads:", "allocator:", "memory:"):
        assert re.search(rf"^{label}", out, re.MULTILINE), f"{label} missing:\n{out}"
    assert "numpy " in out and "torch " in out
