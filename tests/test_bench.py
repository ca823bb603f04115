"""The benchmark runs end to end: ``python bench/bench.py --smoke`` (tiny sizes, 1 step).

It checks that both sides run for every configuration, that a ratio line is printed
for each, and that the first-step losses agree (PyTorch's initial weights are loaded
into npformer, so the two sides compute the same model on the same batch).
"""
from __future__ import annotations

import os
import re
import shutil
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


# --------------------------------------------------------------------------- process modes
@pytest.fixture(scope="module")
def processes_output():
    """``--processes --smoke`` on one configuration (lm): MPI ranks, thread replicas, PyTorch
    DDP and PyTorch threads, the scaling and Allreduce lines, the sweep and the projection."""
    require_torch()
    if shutil.which("mpiexec", path=str(Path(sys.executable).parent)) is None \
            and shutil.which("mpiexec") is None:
        if os.environ.get("CI"):
            raise RuntimeError("no mpiexec: CI installs mpi4py and mpich (the test extra)")
        pytest.skip("no mpiexec (pip install -e '.[mpi]')")
    return subprocess.run([sys.executable, str(ROOT / "bench" / "bench.py"), "--processes",
                           "--smoke", "--configs", "lm"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_process_modes_run_and_agree_on_the_first_loss(processes_output):
    out = processes_output.stdout
    assert processes_output.returncode == 0, out + processes_output.stderr
    assert "FAILED" not in out
    losses = {}
    for mode in ("PyTorch 2 threads", "npformer 2 threads", "npformer 2 ranks",
                 "PyTorch DDP 2"):
        match = re.search(rf"^  {mode}\s+[\d.]+ \([\d.]+-[\d.]+\)\s+loss ([\d.]+)$", out,
                          re.MULTILINE)
        assert match, f"{mode} missing:\n{out}"
        losses[mode] = float(match.group(1))
    # the same model (PyTorch's initial weights) on the same global batch: the same loss
    # (lm: every shard holds as many tokens, so DDP's mean of the two halves is it too)
    assert max(losses.values()) - min(losses.values()) <= 1e-3 * losses["PyTorch 2 threads"]


def test_process_summary_scaling_allreduce_and_projection(processes_output):
    out = processes_output.stdout
    assert re.search(r"^processes lm\s+2 ranks / PyTorch 2 threads \d+\.\d+x\s+/ PyTorch DDP "
                     r"\d+\.\d+x\s+/ npformer threads \d+\.\d+x\s+\| scaling 1->2 ranks \d+%"
                     r"\s+\| Allreduce [\d.]+ ms = \d+% of the step", out, re.MULTILINE), out
    for ranks in (2, 4):
        assert re.search(rf"^  {ranks} ranks fit: alpha -?[\d.]+ us", out, re.MULTILINE), out
    assert re.search(r"^  lm\s+compute [\d.]+ ms, [\d.]+ KiB: 8 ranks [\d.]+ ms \d+%", out,
                     re.MULTILINE), out


def test_alpha_beta_fit_and_ring_projection():
    from bench import processes

    sizes = [1024, 4096, 65536]
    alpha, beta = processes.fit_alpha_beta(sizes, [3e-6 + n / 2e9 for n in sizes])
    assert abs(alpha - 3e-6) < 1e-12 and abs(1 / beta - 2e9) < 1e-3 * 2e9
    # 2 ranks: one exchange each way of half the message, twice: 2 alpha + n / bandwidth
    assert processes.ring_allreduce_seconds(2, 1e6, 1e-6, 1e9) == 2e-6 + 1e-3
    step, efficiency = processes.projection(0.010, 4e6, 8, alpha=5e-6, bandwidth=12e9)
    assert step == 0.010 + 14 * 5e-6 + 2 * 7 / 8 * 4e6 / 12e9
    assert efficiency == 0.010 / step
