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
