"""Failure handling: no rank is ever left waiting for ever.

* Joining: a rank whose peers have not all joined within ``NPFORMER_MPI_TIMEOUT``
  seconds (default 300) says so and stops (:class:`stop_unless_joined_within`); the
  launcher then ends the others.
* Failing: an exception that ends a rank prints its traceback with the rank's number
  and aborts every rank (:func:`abort_all_on_uncaught_exception`), after waiting until
  the launcher has read the message (:func:`wait_until_read`), so it is not lost.
* Refusing to join (``NPFORMER_MPI=0`` in one rank of several): the process says why and
  ends every rank of the launch at once (:func:`end_the_launch`); its peers, waiting for
  it in ``MPI_Init``, would otherwise wait out their join timeout.
"""
from __future__ import annotations

import os
import select
import signal
import stat
import sys
import time
import traceback
from typing import Any

from .launcher import launcher_rank

ABORTED = 2  # the exit status of every rank of a launch one rank refused to join

JOIN_TIMEOUT = 300.0  # seconds the ranks wait for each other to start (NPFORMER_MPI_TIMEOUT)


def join_timeout() -> float:
    """Seconds a rank waits for the others to join (``NPFORMER_MPI_TIMEOUT``, else 300)."""
    text = os.environ.get("NPFORMER_MPI_TIMEOUT", "").strip()
    if not text:
        return JOIN_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"NPFORMER_MPI_TIMEOUT must be a positive number of seconds, "
                         f"got {text!r}")
    return seconds


class stop_unless_joined_within:
    """Joining the ranks, in a ``with`` block: if it has not ended after ``seconds``,
    print why and kill this process (the launcher then ends the others).

    ``MPI_Init`` and the first barrier wait in C, holding the GIL, for ranks that may
    never come (one started with MPI off, or another program): no Python thread or
    signal handler runs there.  The watchdog is a forked child waiting on a pipe; the
    parent closes the pipe when it has joined (or dies, which closes it too)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        if not hasattr(os, "fork"):
            self.pipe = None
            return self
        read_end, self.pipe = os.pipe()
        parent, rank = os.getpid(), launcher_rank()
        self.watchdog = os.fork()
        if self.watchdog == 0:  # the watchdog
            os.close(self.pipe)
            joined, _, _ = select.select([read_end], [], [], self.seconds)
            if not joined:
                message = (f"npformer: rank {rank} waited "
                           f"{self.seconds:g} s for the other MPI ranks to join, and they did "
                           "not (one started with NPFORMER_MPI=0, or not running npformer?); "
                           "stopping it (NPFORMER_MPI_TIMEOUT sets the wait)\n")
                os.write(2, message.encode())
                os.kill(parent, signal.SIGKILL)
            os._exit(0)
        os.close(read_end)
        return self

    def __exit__(self, *exc_info):
        if self.pipe is not None:
            os.close(self.pipe)  # the watchdog wakes up and ends
            os.waitpid(self.watchdog, 0)
        return False


def abort_all_on_uncaught_exception(rank: int, size: int, abort: Any) -> None:
    """From now on an exception that ends this process prints its traceback, naming
    ``rank`` of ``size``, to standard error, then calls ``abort(1)`` (``MPI_Abort``:
    every rank ends, none is left waiting in a collective call)."""
    previous = sys.excepthook

    def hook(kind, error, tb):
        text = "".join(traceback.format_exception(kind, error, tb))
        sys.stderr.write(f"npformer rank {rank} of {size} failed, aborting all "
                         f"ranks:\n{text}")
        sys.stderr.flush()
        if kind is KeyboardInterrupt:
            previous(kind, error, tb)
        wait_until_read(sys.stderr)
        abort(1)

    sys.excepthook = hook


def wait_until_read(stream: Any, timeout: float = 5.0) -> None:
    """Where ``stream`` is a pipe (an MPI launcher's, forwarding a rank's output), wait
    until the reader has taken everything written to it, at most ``timeout`` seconds.

    ``MPI_Abort`` makes the launcher kill every rank and its own forwarding processes;
    text still in the pipe then is lost (seen in CI: the failing rank's message missing
    from the output).  Elsewhere (a terminal, a file) it returns at once."""
    try:
        import fcntl
        import termios

        fd = stream.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return
        unread = bytearray(4)  # an int, filled by the ioctl
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fcntl.ioctl(fd, termios.FIONREAD, unread)  # bytes still in the pipe (Linux)
            if int.from_bytes(unread, sys.byteorder) == 0:
                return
            time.sleep(0.01)
    except (ImportError, OSError, ValueError, AttributeError):  # not POSIX, no descriptor
        return


def end_the_launch(message: str) -> None:
    """A process an MPI launcher started as one of several ranks, which will not train
    among them: print ``message`` (``error: ...``) and end every rank of the launch now.

    Its peers wait for it in ``MPI_Init``, and a launcher (MPICH's Hydra) ends them when a
    rank aborts or dies of a signal, not when one exits before joining.  So this process
    joins only to call ``MPI_Abort`` (within the join timeout).  Without mpi4py it
    returns: the peers then stop after their join timeout."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    wait_until_read(sys.stderr)
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        return
    try:
        seconds = join_timeout()
    except ValueError:  # said by its peers
        seconds = JOIN_TIMEOUT
    with stop_unless_joined_within(seconds):
        from mpi4py import MPI
    MPI.COMM_WORLD.Abort(ABORTED)
