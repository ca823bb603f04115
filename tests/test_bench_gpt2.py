"""``bench/gpt2.py --smoke`` runs end to end (issue 34, item 7): a tiny GPT-2 folder written
with transformers, both sides loaded and timed in turn, the first-step losses agreeing,
the greedy tokens compared, the table printed; ``bench/llama.py --smoke`` the same for a
tiny Llama.  (The timings of a smoke run mean nothing.)
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .test_gpt2 import required

ROOT = Path(__file__).resolve().parents[1]
required("transformers")
required("tokenizers")


def test_the_gpt2_benchmark_smoke_runs():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpt2.py"), "--smoke"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for row in ("forward (2, 16)", "train step"):  # issue 48: GFLOP and shares of the peak
        assert re.search(rf"^\| {re.escape(row)}.*\| [\d.]+x \| [\d.]+ \| [\d.]+% \| [\d.]+% \|$",
                         proc.stdout, re.M), row
    assert re.search(r"^\| generate 8 tokens.*\| [\d.]+x \| n/a \| n/a \| n/a \|$", proc.stdout,
                     re.M)
    assert re.search(r"^peak: +float32 matrix products [\d.]+ GFLOP/s", proc.stdout, re.M)
    assert re.search(r"^bandwidth: [\d.]+ GB/s", proc.stdout, re.M)
    assert "greedy tokens equal: 8 of 8" in proc.stdout
    losses = re.search(r"first-step loss: npformer ([\d.]+), PyTorch ([\d.]+)", proc.stdout)
    assert losses and abs(float(losses[1]) - float(losses[2])) < 1e-4


def test_the_llama_benchmark_smoke_runs():
    """``bench/llama.py --smoke`` (issue 49): a tiny Llama folder, both sides loaded and
    timed in turn (forward, training step, LoRA step, generation), their first steps'
    losses agreeing, the greedy tokens equal, the table printed."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "llama.py"), "--smoke"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for row in ("forward (2, 16)", "train step", "LoRA step", "generate 8 tokens"):
        assert re.search(rf"^\| {re.escape(row)}.*\| [\d.]+ \| [\d.]+ \| [\d.]+x \|$",
                         proc.stdout, re.M), row
    assert "greedy tokens equal: 8 of 8" in proc.stdout
    assert re.search(r"^CPU: .+, \d+ cores", proc.stdout, re.M)


def test_a_benchmark_script_does_not_shadow_installed_packages():
    """Run as ``python bench/NAME.py``, the script's folder is first on sys.path; once the
    bench package is imported it is gone, so ``import kernels`` (which transformers tries,
    for Hugging Face's kernel hub) cannot find bench/kernels.py, whose import sets the BLAS
    thread counts to 1 for every worker the benchmark starts.  (The path as a script has it
    once it puts the repository first: the repository, then the script's folder.)"""
    probe = ("import importlib.util, sys; sys.path[:0] = [sys.argv[2], sys.argv[1]]; "
             "import bench; spec = importlib.util.find_spec('kernels'); "
             "print('shadowed' if spec and spec.origin.startswith(sys.argv[1]) else 'clear')")
    proc = subprocess.run([sys.executable, "-c", probe, str(ROOT / "bench"), str(ROOT)],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.stdout.strip() == "clear", proc.stdout + proc.stderr


def test_the_npformer_side_uses_every_core_as_the_torch_side_does():
    from bench.gpt2 import blas_threads

    assert blas_threads() == len(os.sched_getaffinity(0))


def test_the_model_benchmarks_stop_when_the_sides_first_losses_differ():
    from bench.gpt2 import check_losses_agree

    seen = {"npformer": {"first_loss": 2.0, "first_lora_loss": 3.0},
            "torch": {"first_loss": 2.001, "first_lora_loss": 3.0}}
    check_losses_agree(seen, ("first_lora_loss",))  # equal: no stop
    with pytest.raises(SystemExit, match=r"losses differ \(first_loss\): npformer 2.0"):
        check_losses_agree(seen)
