"""One run at a time in an output folder: :func:`hold_output` locks it for this process.

A second run into a held folder is refused, naming the holder (pid, host, command).  The
lock is an ``fcntl`` lock on OUT/.npformer.lock (the ``filelock`` library, imported when
a run holds its folder): the operating system releases it when the process ends, however
it ends, so a run killed with SIGKILL leaves no stale lock.
"""
from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .demo import DemoError
from .ranks import is_main

if TYPE_CHECKING:  # annotations only: filelock is imported when a run holds its folder
    from filelock import FileLock

LOCK_FILE = ".npformer.lock"  # held (fcntl) by the run writing into a folder
HOLDER_FILE = ".npformer.lock.holder"  # who holds it: pid, host, command, start time
_held_outputs: dict = {}  # folder -> its FileLock, held until the process ends


def hold_output(out: Path) -> FileLock | None:
    """Hold ``out`` for this run (rank 0 under MPI) until the process ends: a second run
    into the same folder is refused, naming the holder.  Returns the lock (None on other
    ranks)."""
    from filelock import FileLock, Timeout

    if not is_main():
        return None
    out = Path(out)
    key = str(out.resolve())
    if key in _held_outputs:
        return _held_outputs[key]
    out.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(out / LOCK_FILE), timeout=0)
    try:
        lock.acquire()
        (out / HOLDER_FILE).write_text(
            f"pid {os.getpid()} on host {platform.node()}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {shlex.join(sys.argv)}\n")
    except Timeout:
        try:
            holder = (out / HOLDER_FILE).read_text().strip() or "holder unknown"
        except OSError:
            holder = "holder unknown"
        raise DemoError(f"{out} is in use by another run ({holder}): wait for it to "
                        "end, or choose another --out") from None
    except OSError as exc:  # a read-only folder
        lock.release()
        raise DemoError(f"cannot write into the --out folder {out}: "
                        f"{exc.strerror or exc}") from None
    _held_outputs[key] = lock
    return lock
