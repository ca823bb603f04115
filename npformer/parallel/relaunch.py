"""A demo spends every core by itself: it re-launches itself on one MPI rank per core.

On a CPU, N single-threaded MPI ranks (each a whole Python process with its own GIL,
sharing only the one all-reduce of the gradients) train faster than N thread replicas in
one process, which wait for each other on the GIL between NumPy calls (the figures:
``bench/README.md``, "Process modes").  Ranks give the figures of one process, up to rounding
(tests/test_distributed.py), so the demos make this their default; the user needs to
know nothing of MPI::

    python demos/generate.py             # = mpiexec -n <cores> python demos/generate.py
    python demos/generate.py --procs 1   # one process (thread replicas, as before)

:func:`relaunch` decides, and runs the children when it does.  It re-launches only
when all of these hold: the demo was started from the command line (not called as a
function), it trains, it runs on the CPU (NumPy backend), no launcher started it
already, ``--replicas`` was not given without ``--procs`` (thread replicas asked for),
more than one process is asked for (``--procs``, default: the usable cores; with
``--resume``, the ranks the saved run was on), and mpi4py and an ``mpiexec`` are
installed.  Otherwise the demo runs in this process (saying so where ranks were asked
for, or where the resumed run was on ranks).

*The launcher owns its ranks.*  The process the user started (the launcher) starts
``mpiexec`` in a session of its own, so a terminal's Ctrl-C, ``timeout`` or ``kill``
reach the launcher alone, whether they signal it or its process group.  It forwards each
signal it can catch (:data:`FORWARDED_SIGNALS`: SIGINT, SIGTERM, SIGHUP, SIGQUIT) once
to every rank, which stops as one process stops (:mod:`npformer.cli.errors`: in
training, after the current update, the run saved).  A rank names itself to the
launcher as it starts (:func:`announce_rank`: its pid, a file in the launch's folder),
so a signal that came before it had started reaches it then.  The launcher returns only
once ``mpiexec`` and every rank have ended, with their exit status: 0, 2 for a user error
(the failing rank's message, once), 130 for a stop (the "training stopped ... continue
it with" lines, once).

The children get glibc's allocator tunables from their first allocation
(:data:`KEEP_MEMORY_TUNABLES`; ``npformer.parallel`` sets the same with ``mallopt``
once it is imported): two ranks side by side otherwise page-fault their freed
activations back in every step, and those faults do not scale across cores
(``bench/README.md``, "The allocator").
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from .failure import join_timeout
from .launcher import RANK_VARIABLES, SIZE_VARIABLES

# Set in the children (they never re-launch) to the launch's folder, where each names
# itself (announce_rank) and reads what its launcher started (LAUNCH_FILE).
LAUNCHED_MARK = "NPFORMER_LAUNCHED"
LAUNCH_FILE = "launch.json"  # {"ranks": N, "mpiexec": path}
KEEP_BYTES = 4294967296  # 4 GiB: no activation is ever mmap'ed, nor the heap trimmed
KEEP_MEMORY_TUNABLES = (f"glibc.malloc.mmap_threshold={KEEP_BYTES}:"
                        f"glibc.malloc.trim_threshold={KEEP_BYTES}")
# Variables an MPI or batch launcher sets in the processes it starts (npformer.parallel
# reads the same ones), and NPFORMER_MPI, the user's own choice of MPI or not.
LAUNCHER_VARIABLES = (*SIZE_VARIABLES, *RANK_VARIABLES, "SLURM_STEP_ID", "NPFORMER_MPI")
# The signals that ask a process to end and can be caught: the launcher forwards them.
FORWARDED_SIGNALS = tuple(getattr(signal, name) for name in
                          ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name))
POLL_SECONDS = 0.05  # how often the launcher forwards what it received, and looks at its ranks


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def under_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """True when a launcher (ours, mpiexec, srun) started this process."""
    return any(name in environ for name in (LAUNCHED_MARK, *LAUNCHER_VARIABLES))


def find_mpiexec() -> str | None:
    """The mpiexec beside this Python (a pip-installed MPICH), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpiexec")


def planned_procs(args: argparse.Namespace, training: bool,
                  environ: Mapping[str, str] = os.environ) -> int:
    """How many processes the run should have (1: stay in this one)."""
    if not training or under_launcher(environ):
        return 1
    backend = getattr(args, "backend", None) or environ.get("NPFORMER_BACKEND", "numpy")
    if backend != "numpy":
        return 1  # one GPU: one process (several GPUs: start the ranks with mpiexec)
    procs = getattr(args, "procs", None)
    if procs is not None:
        return procs  # a resumed run too: its thread replicas keep its workers (cli.runs)
    if getattr(args, "resume", False):
        return saved_procs(Path(args.out))  # the saved run's ranks
    if getattr(args, "replicas", None) is not None:
        return 1  # thread replicas asked for by name
    if getattr(args, "tier", None) == "textbook":
        return 1  # the textbook's run is one process (--procs asks for ranks)
    return usable_cores()


def saved_procs(out: Path) -> int:
    """The MPI ranks the run saved in ``out`` was on (1 for a run saved before they were
    recorded, or where nothing readable is saved: the demo then says what is wrong)."""
    from ..checkpoint import load_checkpoint

    try:
        settings = load_checkpoint(out / "last.npz").extra["run"]["settings"]
        return int(settings.get("procs") or 1)
    except Exception:  # noqa: BLE001 - no run, or not a demo's: the demo reports it
        return 1


def check_environment() -> None:
    """What the ranks will read from the environment, checked before they are started
    (a ValueError naming the variable), so that its error is printed once."""
    from .. import backend

    backend.check_environment()
    join_timeout()


def child_environment(folder: str | Path, environ: Mapping[str, str] = os.environ) -> dict:
    env = dict(environ, **{LAUNCHED_MARK: str(folder)})
    env.setdefault("GLIBC_TUNABLES", KEEP_MEMORY_TUNABLES)  # a user's own setting is kept
    return env


def launch_command(mpiexec: str, procs: int, argv: list[str]) -> list[str]:
    return [mpiexec, "-n", str(procs), sys.executable, sys.argv[0], *argv]


def relaunch(args: argparse.Namespace, argv: list[str] | None, training: bool = True) -> int | None:
    """Run the demo as MPI ranks and return their exit status, or None: run it here.

    ``args``: the demo's parsed options; ``argv``: what ``main`` was given (None: the
    command line, the only case that re-launches); ``training``: False for the modes
    that only use a saved model (sampling, prediction, translation).  Raises ValueError
    for an environment variable the ranks would refuse (before starting them)."""
    if argv is not None:
        return None
    procs = planned_procs(args, training)
    if procs == 1:
        return None
    mpiexec = find_mpiexec()
    if mpiexec is None or importlib.util.find_spec("mpi4py") is None:
        asked = (f"--procs {procs}" if getattr(args, "procs", None) is not None else
                 f"the saved run's {procs} MPI ranks" if getattr(args, "resume", False)
                 else f"the default {procs} MPI ranks (one per core)")
        print(f"note: {asked} need mpi4py and an mpiexec (pip install -e '.[demos]' or "
              "'npformer[mpi]'); running in one process with thread replicas",
              file=sys.stderr)
        return None
    check_environment()
    print(f"running on {procs} MPI ranks, one per core ({Path(mpiexec).name} -n {procs}; "
          "--procs 1 runs in one process)", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="npformer-launch-"))
    try:
        (folder / LAUNCH_FILE).write_text(json.dumps({"ranks": procs, "mpiexec": mpiexec}))
        return run_children(launch_command(mpiexec, procs, sys.argv[1:]),
                            child_environment(folder), folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# --------------------------------------------------------------------------- in a rank
def launch_record(environ: Mapping[str, str] = os.environ) -> dict | None:
    """In a rank this module's launcher started: what it started (``{"ranks": N,
    "mpiexec": path}``); None elsewhere."""
    folder = environ.get(LAUNCHED_MARK)
    try:
        return json.loads((Path(folder) / LAUNCH_FILE).read_text()) if folder else None
    except (OSError, ValueError):  # a mark without a launch (set by hand)
        return None


def announce_rank(environ: Mapping[str, str] = os.environ) -> None:
    """In a rank this module's launcher started: name this process to the launcher, which
    from then on forwards to it the signals it receives.  Call it once the process
    handles them (:func:`npformer.cli.errors.run_demo`)."""
    pid = os.getpid()
    _leave_in_launch_folder(str(pid), _started(pid) or "", environ)


def one_line(text: str, environ: Mapping[str, str] = os.environ) -> str:
    """In a rank this module's launcher started: ``text`` as one line, its line breaks
    written as :data:`LINE_BREAK` (the launcher shows a rank-alike message once by
    comparing whole lines, then puts the breaks back: :func:`shown_once`); elsewhere
    ``text`` itself."""
    return text.replace("\n", LINE_BREAK) if launch_record(environ) is not None else text


def record_last_words(line: str, environ: Mapping[str, str] = os.environ) -> None:
    """In a rank this module's launcher started, about to end every rank (``MPI_Abort``)
    after printing ``line``: leave the line in the launch's folder too, for the launcher
    to show should ``mpiexec`` not have forwarded it before the abort (it may drop a
    rank's pending output then, and the user would see an exit status and no reason)."""
    try:
        _leave_in_launch_folder(f"{os.getpid()}.said", one_line(line, environ) + "\n",
                                environ)
    except OSError:  # the line was printed already; nothing more to do
        pass


def _leave_in_launch_folder(name: str, text: str, environ: Mapping[str, str]) -> None:
    """In a rank this module's launcher started: write ``text`` to the file ``name`` of
    the launch's folder, whole or not at all (the launcher reads it meanwhile)."""
    if launch_record(environ) is None:
        return
    folder = Path(environ[LAUNCHED_MARK])
    partial = folder / f".{name}"
    partial.write_text(text)
    os.replace(partial, folder / name)


# --------------------------------------------------------------------------- the launcher
# Messages every rank prints alike (cli.run_demo): shown once.  A message of several
# lines travels as one (:func:`one_line`), so it is compared whole, however long.
RANK_ALIKE_PREFIXES = ("error: ", "training stopped", "continue it with: ", "interrupted")
LINE_BREAK = "\x1f"  # a message's line breaks on their way from a rank to the launcher
# (the unit separator: neither a file's readline nor str.splitlines breaks at it)


def shown_once(lines: Iterable[str], seen: set) -> Iterator[str]:
    """The children's standard-error lines, less repeats of a rank-alike message and, once
    an ``error:`` or ``interrupted`` line was shown, the launcher's ``Abort(N) ...
    MPI_Abort`` notes (the ranks end that way then); anything else (tracebacks) passes.
    A message's line breaks (:data:`LINE_BREAK`) are put back."""
    for line in lines:
        if line.startswith(RANK_ALIKE_PREFIXES):
            if line.rstrip("\n") in seen:
                continue
            seen.add(line.rstrip("\n"))
        elif line.startswith("Abort(") and "MPI_Abort" in line and any(
                text.startswith(("error: ", "interrupted")) for text in seen):
            continue
        yield line.replace(LINE_BREAK, "\n")


def run_children(command: list[str], env: dict, folder: Path) -> int:
    """Run ``command`` (mpiexec) in a session of its own and return its exit status (128
    + N for a signal N), once it and every rank named in ``folder`` have ended; the
    signals this process receives meanwhile are forwarded to the ranks
    (:class:`LaunchedRanks`), the children's standard error copied (:func:`shown_once`)."""
    ranks, seen = LaunchedRanks(folder), set()
    previous = {s: signal.signal(s, ranks.receive) for s in FORWARDED_SIGNALS
                if signal.getsignal(s) is not signal.SIG_IGN}  # nohup's stays ignored
    try:
        child = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True, errors="replace",
                                 bufsize=1, start_new_session=True)
        copying = threading.Thread(target=_copy_lines, args=(child.stderr, seen), daemon=True)
        copying.start()
        while child.poll() is None or ranks.alive():
            ranks.forward()
            time.sleep(POLL_SECONDS)
        copying.join(timeout=10.0)
        _write_lines(shown_once(_last_words(folder), seen))  # those mpiexec did not forward
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    code = child.returncode
    return 128 - code if code < 0 else code


class LaunchedRanks:
    """The ranks of one launch, as each names itself in the launch's folder (a file named
    by its pid, holding its start time), and the signals the launcher received: each
    signal goes once to every rank, to one that names itself later too.  The handler
    only records; :meth:`forward`, called from the launcher's loop, sends."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.received: list[int] = []
        self.forwarded: dict[int, int] = {}  # pid -> how many of `received` it was sent

    def receive(self, signum: int, frame: object) -> None:
        self.received.append(signum)

    def forward(self) -> None:
        count = len(self.received)  # a signal received while this runs goes next time
        for pid, started in self.ranks().items():
            for signum in self.received[self.forwarded.get(pid, 0):count]:
                if _is_running(pid, started):
                    os.kill(pid, signum)
            self.forwarded[pid] = count

    def ranks(self) -> dict[int, str]:
        """{pid: start time} of the ranks that have named themselves."""
        try:
            entries = [p for p in self.folder.iterdir() if p.name.isdigit()]
            return {int(p.name): p.read_text() for p in entries}
        except OSError:
            return {}

    def alive(self) -> bool:
        return any(_is_running(pid, started) for pid, started in self.ranks().items())


def _copy_lines(stream, seen: set) -> None:
    """The children's standard error onto this process's, each rank-alike line once (in
    ``seen``); a failed write (a closed terminal) does not stop the reading."""
    _write_lines(shown_once(stream, seen))


def _write_lines(lines: Iterable[str]) -> None:
    for line in lines:
        try:
            sys.stderr.write(line)
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


def _last_words(folder: Path) -> list[str]:
    """The lines the ranks left with :func:`record_last_words`, in rank-file order."""
    try:
        return [line for path in sorted(folder.glob("*.said"))
                for line in path.read_text().splitlines(keepends=True)]
    except OSError:
        return []


def _started(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, Linux's /proc; None
    elsewhere): with the pid, it names one process, never a later one given its pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _is_running(pid: int, started: str) -> bool:
    """Whether the rank ``pid`` that started at ``started`` still runs (not a zombie, not
    another process given its pid since)."""
    try:
        os.kill(pid, 0)
    except OSError:  # gone, or another user's process has its pid now
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (not Linux): it exists
    return state != "Z" and (not started or _started(pid) == started)
