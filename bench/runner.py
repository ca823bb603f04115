"""The one runner of bench/bench.py (CPU) and bench/gpu.py (GPU): the workers' environment,
a worker in a fresh subprocess (one JSON result line), and the sides of one configuration
in order, PyTorch first (it writes the initial weights every other side loads)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench.configs import ROOT
from bench.measure import worker_result
from bench.torch_models import nanogpt_folder

NO_TRIM_TUNABLE = "glibc.malloc.mmap_threshold=4294967296"
ALLOCATORS = ("inherit", "glibc-default", "keep-heap")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def worker_env(threads: int | None = None, allocator: str = "inherit", **extra) -> dict:
    """The environment of every worker: this one, the repository on PYTHONPATH, BLAS /
    OpenMP threads set to ``threads`` (None: as inherited), GLIBC_TUNABLES as
    ``allocator`` says (inherit; glibc-default: unset; keep-heap: NO_TRIM_TUNABLE), and
    ``extra`` variables."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {ALLOCATORS}, got {allocator!r}")
    env = dict(os.environ)
    if threads is not None:
        env.update({name: str(threads) for name in THREAD_VARIABLES})
    if allocator == "glibc-default":
        env.pop("GLIBC_TUNABLES", None)
    elif allocator == "keep-heap":
        env["GLIBC_TUNABLES"] = NO_TRIM_TUNABLE
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return {**env, **extra}


def run_worker(script: Path, spec: dict, env: dict) -> dict:
    """``script --worker SPEC`` in a fresh process: its result, or {"side", "error"}."""
    proc = subprocess.run([sys.executable, str(script), "--worker", json.dumps(spec)],
                          env=env, capture_output=True, text=True)
    return worker_result(proc, spec["side"])


def pooled_rounds(rounds: list[dict]) -> dict:
    """{side: result} of several rounds of :func:`run_sides` as one: each side's step times
    of every round together (their median is the figure), its memory growth the median of
    the rounds', the rest (losses, versions) from the first round.  The sides take turns
    within each round, so a machine whose speed drifts during the run slows every side
    alike instead of the one that happened to run then."""
    import statistics

    pooled = {}
    for side, first in rounds[0].items():
        results = [r[side] for r in rounds if side in r]
        if any("error" in r for r in results):
            pooled[side] = next(r for r in results if "error" in r)
            continue
        pooled[side] = dict(first, rounds=len(results))
        for key in ("train_times", "infer_times"):
            if key in first:
                pooled[side][key] = [t for r in results for t in r[key]]
        if "mem_growth" in first:
            pooled[side]["mem_growth"] = statistics.median(r["mem_growth"] for r in results)
    return pooled


def run_sides(cfg: dict, run_side: Callable[[str, str], dict], npformer_sides,
              nanogpt: bool = True) -> dict:
    """{side: result} of one configuration: ``run_side(side, weights_path)`` for PyTorch
    first, then each of ``npformer_sides``, then (lm, where nanoGPT's model.py is found,
    ``nanogpt`` True) nanoGPT's GPT."""
    with tempfile.TemporaryDirectory(prefix="npformer-bench-") as tmp:
        weights = os.path.join(tmp, "init.npz")
        results = {"pytorch": run_side("pytorch", weights)}
        for side in npformer_sides:
            results[side] = run_side(side, weights)
        if nanogpt and cfg["kind"] == "causal_lm" and nanogpt_folder(ROOT) is not None:
            results["nanogpt"] = run_side("nanogpt", weights)
        return results
