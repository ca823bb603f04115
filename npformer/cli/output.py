"""What a run prints and writes: one-line messages on standard error (:func:`say`), the
clock its reports are timed with, and its text and JSON files (written by rank 0 only,
the JSON atomically)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .ranks import is_main


def say(line: str) -> None:
    """One line to standard error in one write: MPI ranks' lines then never interleave
    (``print`` writes the text and the newline apart)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


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
