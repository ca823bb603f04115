"""A demo's error boundary: :func:`run_demo` runs its ``main`` and turns the failures a user
can cause into one ``error: ...`` line and exit status 2, and an interruption into a note
on how to resume (:func:`resume_command`) and status 130.  Any other exception is a bug:
it passes through, traceback and all."""
from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from typing import Any

from .. import distributed
from ..checkpoint import CheckpointError
from ..data import DatasetFormatError, DatasetNotFoundError
from ..train import TrainingDiverged, TrainingInterrupted
from .demo import DemoError
from .output import say

USER_ERRORS = (DemoError, DatasetNotFoundError, DatasetFormatError, CheckpointError,
               TrainingDiverged, distributed.RanksDiffer)


def _file_system_error(exc: OSError) -> str:
    """An OSError from the user's file system (full disk, read-only folder) in one line."""
    where = f" ({exc.filename})" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


def run_demo(main: Callable[[list[str] | None], Any], argv: list[str] | None = None) -> int:
    """Run a demo's ``main(argv)``; the failures a user can cause become one ``error:``
    line and exit status 2 (among them the file system's: a full disk, a read-only
    folder), an interruption a note on how to resume and status 130."""
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # log lines in order, also in a pipe
    try:
        return main(argv)
    except TrainingInterrupted as exc:
        say(str(exc))
        if exc.path is not None:
            say(f"continue it with: {resume_command(sys.argv[1:] if argv is None else argv)}")
        return 130
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except (*USER_ERRORS, OSError) as exc:
        message = str(exc) if isinstance(exc, USER_ERRORS) else _file_system_error(exc)
        say(f"error: {message}")
        distributed.current().abort_others(2)  # MPI: no rank is left waiting for this one
        return 2


def resume_command(argv: list[str]) -> str:
    """The command line that resumes the run ``argv`` started: --resume, no --stop-after."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--stop-after="):
            skip = False
        elif arg == "--stop-after":
            skip = True
        elif arg != "--resume":
            kept.append(arg)
    return shlex.join(["python", sys.argv[0], *kept, "--resume"])
