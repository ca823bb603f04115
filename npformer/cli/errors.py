"""A demo's error boundary: :func:`run_demo` runs its ``main`` and turns the failures a user
can cause into one ``error: ...`` line and exit status 2, and a stop into a note on how to
resume (:func:`resume_command`) and status 130.  Any other exception is a bug: it passes
through, traceback and all.

*Signals.*  Every signal that asks a process to end and can be caught
(:data:`npformer.parallel.relaunch.FORWARDED_SIGNALS`: SIGINT, SIGTERM, SIGHUP, SIGQUIT)
stops a demo the same way, in one process and on each MPI rank (whose launcher forwards them):
while training, the :class:`~npformer.train.Trainer` finishes the current update, saves
the run and raises :class:`~npformer.train.TrainingInterrupted` (it handles SIGINT and
SIGTERM itself; SIGHUP and SIGQUIT are handed to its SIGTERM handler); elsewhere the demo
ends at once (``interrupted (SIGNAL)``).  Either way the status is 130; a second signal
in training stops at once.
"""
from __future__ import annotations

import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .. import parallel
from ..checkpoint import CheckpointError
from ..data import DatasetFormatError, DatasetNotFoundError
from ..parallel.relaunch import FORWARDED_SIGNALS, announce_rank, record_last_words
from ..train.loop import TrainingDiverged, TrainingInterrupted
from .demo import DemoError
from .output import say

USER_ERRORS = (DemoError, DatasetNotFoundError, DatasetFormatError, CheckpointError,
               TrainingDiverged, parallel.RanksDiffer)
STOPPED = 130  # the exit status of a demo stopped by a signal or --stop-after


class Stopped(KeyboardInterrupt):
    """A signal ended the demo outside training (nothing to save)."""

    def __init__(self, signum: int):
        self.name = signal.Signals(signum).name
        super().__init__(self.name)


def run_demo(main: Callable[[list[str] | None], Any], argv: list[str] | None = None) -> int:
    """Run a demo's ``main(argv)``; the failures a user can cause become one ``error:``
    line and exit status 2 (among them the file system's: a full disk, a read-only
    folder), a stop (a signal, ``--stop-after``) a note on how to resume and status 130."""
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)  # log lines in order, also in a pipe
    try:
        with stop_signals():
            announce_rank()  # a self-launched rank: its launcher's signals reach it now
            return main(argv)
    except TrainingInterrupted as exc:
        say(str(exc))
        if exc.path is not None:
            say(f"continue it with: {resume_command(sys.argv[1:] if argv is None else argv)}")
        return STOPPED
    except KeyboardInterrupt as exc:
        _say_and_abort(f"interrupted ({exc.name})" if isinstance(exc, Stopped)
                       else "interrupted", STOPPED)
        return STOPPED
    except (*USER_ERRORS, OSError) as exc:  # an OSError: a full disk, a read-only folder
        message = str(exc) if isinstance(exc, USER_ERRORS) else \
            f"{exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else "")
        _say_and_abort(f"error: {message}", 2)
        return 2


def _say_and_abort(line: str, code: int) -> None:
    """Say ``line``, then end every MPI rank (none is left waiting for this one); the
    line is also left for a self-launched run's launcher, which shows it should mpiexec
    drop it in the abort."""
    say(line)
    record_last_words(line)
    parallel.current().abort_others(code)


@contextmanager
def stop_signals() -> Iterator[None]:
    """While a demo runs: each of :data:`~npformer.parallel.relaunch.FORWARDED_SIGNALS`
    stops it (see the module's docstring), but one the demo was started ignoring
    (``nohup``, a shell's background job) stays ignored; the previous handlers come back
    after.  Outside the main thread signals cannot be handled: nothing changes there."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _stop) for s in FORWARDED_SIGNALS
                if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _stop(signum: int, frame) -> None:
    """SIGHUP or SIGQUIT in training: what the Trainer does with SIGTERM (it replaced this
    handler for SIGINT and SIGTERM while it trains); any of them elsewhere: stop now."""
    training = signal.getsignal(signal.SIGTERM)
    if callable(training) and training is not _stop:
        training(signum, frame)
        return
    raise Stopped(signum)


def resume_command(argv: list[str]) -> str:
    """The command line that resumes the run ``argv`` started: --resume, no --stop-after
    or --overwrite (the run it would start over is the one to continue)."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--stop-after="):
            skip = False
        elif arg == "--stop-after":
            skip = True
        elif arg not in ("--resume", "--overwrite"):
            kept.append(arg)
    return shlex.join(["python", sys.argv[0], *kept, "--resume"])
