"""``bench/finetune_llama.py --smoke`` runs end to end (issue 49, item 5): tiny Llama
shapes, full fine-tuning and LoRA each measured in its own process, the CPU model in the
header, a line per measurement with seconds per update, peak memory and the trained
parameters.  (The timings of a smoke run mean nothing.)
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "finetune_llama.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_finetune_llama_benchmark_smoke_runs():
    from bench.report import cpu_model

    proc = run_bench("--smoke", "--cores", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.startswith(f"cpu: {cpu_model()} (")
    line = r"{} +run 1: [\d.]+ s/update \(median of 2; [\d.]+-[\d.]+\), peak memory " \
           r"\(VmHWM\) [\d.]+ GiB, ([\d,]+) of ([\d,]+) parameters trained; load average " \
           r"([\d.]+|unknown) after it$"
    full = re.search(line.format("full"), proc.stdout, re.M)
    lora = re.search(line.format("lora"), proc.stdout, re.M)
    assert full and lora, proc.stdout
    assert full[1] == full[2]  # every weight trains
    # LoRA rank 8 on q_proj (16 -> 16) and v_proj (16 -> 8) of 2 layers: A and B of each
    trained = int(lora[1].replace(",", ""))
    assert trained == 2 * ((16 * 8 + 8 * 16) + (16 * 8 + 8 * 8))
    assert int(lora[2].replace(",", "")) == int(full[2].replace(",", "")) + trained


def test_the_help_names_the_shape_and_bad_options_are_refused():
    help_text = run_bench("--help")
    assert help_text.returncode == 0 and "SmolLM2-135M" in help_text.stdout
    refused = run_bench("--smoke", "--cores", "100000")
    assert refused.returncode != 0 and "--cores 100000" in refused.stderr
    assert "Traceback" not in refused.stderr
