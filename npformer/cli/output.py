"""What a run prints and writes: one-line messages on standard error (:func:`say`), the
clock its reports are timed with, and its text and JSON files (written by rank 0 only,
the JSON atomically)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..parallel.relaunch import one_line
from .ranks import is_main, machine_description


def say(line: str) -> None:
    """One message to standard error in one write: MPI ranks' lines then never interleave
    (``print`` writes the text and the newline apart); in a self-launched rank a message
    of several lines goes as one (:func:`npformer.parallel.relaunch.one_line`), for its
    launcher to show once.  A terminal that is gone (the hang-up that stopped the run)
    loses the line, not the exit status."""
    try:
        sys.stderr.write(one_line(line) + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


class Stopwatch:
    """Seconds since it was made (a monotonic clock)."""

    def __init__(self):
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start


def write_text(path: Path, text: str) -> None:
    if is_main():
        path.write_text(text)


def write_json(path: Path, values: dict) -> None:
    if not is_main():
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(values, indent=2))
    os.replace(tmp, path)


def write_folder(path: Path, write: Callable[[Path], None]) -> None:
    """``write(folder)`` into a temporary folder beside ``path``, then renamed to ``path``
    (replacing the folder there): ``path`` is never half-written, whatever stops the run
    (rank 0 only)."""
    if not is_main():
        return
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    previous = path.with_name(f".{path.name}.{os.getpid()}.old")
    for leftover in (temporary, previous):
        shutil.rmtree(leftover, ignore_errors=True)
    write(temporary)
    if path.exists():
        os.replace(path, previous)
    os.replace(temporary, path)
    shutil.rmtree(previous, ignore_errors=True)


def write_metrics(out: Path, args: argparse.Namespace, parameters: int, results: dict) -> None:
    """``out/metrics.json``: the run's results, then what every demo records of how it was
    made (preset, seed, tier, the machine and how the run spread over it, the model's
    parameter count)."""
    write_json(out / "metrics.json", {
        **results, "preset": args.preset, "seed": args.seed, "tier": args.tier,
        "machine": machine_description(args.replicas), "parameters": parameters})
