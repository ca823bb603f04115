"""A demo spends every core by itself: it re-launches itself on one MPI rank per core.

On a CPU, N single-threaded MPI ranks (each a whole Python process with its own GIL,
sharing only the one all-reduce of the gradients) train faster than N thread replicas in
one process, which wait for each other on the GIL between NumPy calls (lm on 2 cores:
112 s against 138 s, issue 19).  Ranks give the figures of one process, up to rounding
(tests/test_distributed.py), so the demos make this their default; the user needs to
know nothing of MPI::

    python demos/generate.py             # = mpiexec -n <cores> python demos/generate.py
    python demos/generate.py --procs 1   # one process (thread replicas, as before)

:func:`relaunch` decides, and runs the children when it does.  It re-launches only
when all of these hold: the demo was started from the command line (not called as a
function), it trains, it runs on the CPU (NumPy backend), no launcher started it
already, ``--replicas`` was not given without ``--procs`` (thread replicas asked for),
more than one process is asked for (``--procs``, default: the usable cores; with
``--resume``, the ranks the saved run was on, so every batch is sharded as before and the
figures are those of the uninterrupted run), and mpi4py and an ``mpiexec`` are
installed.  Otherwise the demo runs in this process.

The children get glibc's allocator tunables from their first allocation
(:data:`KEEP_MEMORY_TUNABLES`; ``npformer.distributed`` sets the same with ``mallopt``
once it is imported): two ranks side by side otherwise page-fault their freed
activations back in every step, and those faults do not scale across cores
(../shared/ANCHORS.md, "Where CPU time goes": 49 and 70 ms a step against 35 and 29).
The launcher's exit status is the demo's: 0, 2 for a user error (the failing rank's
message on standard error), 130 for an interruption (Ctrl-C reaches every rank, which
saves its run for --resume; the parent only waits).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from .distributed.launcher import RANK_VARIABLES, SIZE_VARIABLES
from .validation import positive_int

LAUNCHED_MARK = "NPFORMER_LAUNCHED"  # set in the children: they never re-launch
KEEP_BYTES = 4294967296  # 4 GiB: no activation is ever mmap'ed, nor the heap trimmed
KEEP_MEMORY_TUNABLES = (f"glibc.malloc.mmap_threshold={KEEP_BYTES}:"
                        f"glibc.malloc.trim_threshold={KEEP_BYTES}")
# Variables an MPI or batch launcher sets in the processes it starts (npformer.distributed
# reads the same ones), and NPFORMER_MPI, the user's own choice of MPI or not.
LAUNCHER_VARIABLES = (*SIZE_VARIABLES, *RANK_VARIABLES, "SLURM_STEP_ID", "NPFORMER_MPI")


def add_procs_option(parser: argparse.ArgumentParser) -> None:
    """``--procs N`` on a demo's command line."""
    parser.add_argument(
        "--procs", type=positive_int, default=None, metavar="N",
        help="processes to train in: the demo re-launches itself as N MPI ranks (one "
             "process per core by default, when mpi4py and mpiexec are installed; the "
             "results are one process's, up to rounding); --procs 1 runs in this process")


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
    if getattr(args, "resume", False):
        saved = saved_procs(Path(args.out))
        # the saved run's ranks (they and its replicas shard every batch: the same figures);
        # another count given is refused by the demo itself, once, in this process
        return saved if procs in (None, saved) else 1
    if procs is None:
        if getattr(args, "replicas", None) is not None:
            return 1  # thread replicas asked for by name
        procs = usable_cores()
    return procs


def saved_procs(out: Path) -> int:
    """The MPI ranks the run saved in ``out`` was on (1 for a run saved before they were
    recorded, or where nothing readable is saved: the demo then says what is wrong)."""
    from .checkpoint import load_checkpoint

    try:
        settings = load_checkpoint(out / "last.npz").extra["run"]["settings"]
        return int(settings.get("procs") or 1)
    except Exception:  # noqa: BLE001 - no run, or not a demo's: the demo reports it
        return 1


def child_environment(environ: Mapping[str, str] = os.environ) -> dict:
    env = dict(environ, **{LAUNCHED_MARK: "1"})
    env.setdefault("GLIBC_TUNABLES", KEEP_MEMORY_TUNABLES)  # a user's own setting is kept
    return env


def launch_command(mpiexec: str, procs: int, argv: list[str]) -> list[str]:
    return [mpiexec, "-n", str(procs), sys.executable, sys.argv[0], *argv]


def relaunch(args: argparse.Namespace, argv: list[str] | None, training: bool = True) -> int | None:
    """Run the demo as MPI ranks and return their exit status, or None: run it here.

    ``args``: the demo's parsed options; ``argv``: what ``main`` was given (None: the
    command line, the only case that re-launches); ``training``: False for the modes
    that only use a saved model (sampling, prediction, translation)."""
    if argv is not None:
        return None
    procs = planned_procs(args, training)
    if procs == 1:
        return None
    mpiexec = find_mpiexec()
    if mpiexec is None or importlib.util.find_spec("mpi4py") is None:
        if getattr(args, "procs", None) is not None:
            print(f"note: --procs {procs} needs mpi4py and an mpiexec (pip install "
                  "'npformer[mpi]'); running in one process with thread replicas",
                  file=sys.stderr)
        return None
    command = launch_command(mpiexec, procs, sys.argv[1:])
    print(f"running on {procs} MPI ranks, one per core ({Path(mpiexec).name} -n {procs}; "
          "--procs 1 runs in one process)", flush=True)
    return run_children(command, child_environment())


# One-line messages every rank prints alike (cli.run_demo): shown once.
RANK_ALIKE_PREFIXES = ("error: ", "training stopped", "continue it with: ", "interrupted")


def shown_once(lines: Iterable[str], seen: set) -> Iterator[str]:
    """The children's standard-error lines, less repeats of a rank-alike message and, once
    an ``error:`` line was shown, the launcher's ``Abort(N) ... MPI_Abort`` notes (the
    ranks end that way after a user error); anything else (tracebacks) passes."""
    for line in lines:
        if line.startswith(RANK_ALIKE_PREFIXES):
            if line.rstrip("\n") in seen:
                continue
            seen.add(line.rstrip("\n"))
        elif line.startswith("Abort(") and "MPI_Abort" in line and any(
                text.startswith("error: ") for text in seen):
            continue
        yield line


def run_children(command: list[str], env: dict) -> int:
    """Run ``command`` and return its exit status (128 + N for a signal N).  Ctrl-C
    reaches the children from the terminal (one process group); here it only keeps
    waiting for them while they save their run."""
    child = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, bufsize=1)
    seen: set = set()
    lines = shown_once(child.stderr, seen)
    while True:
        try:
            for line in lines:
                sys.stderr.write(line)
                sys.stderr.flush()
            code = child.wait()
            break
        except KeyboardInterrupt:  # the generator ended with it: a new one reads on
            lines = shown_once(child.stderr, seen)
    return 128 - code if code < 0 else code
