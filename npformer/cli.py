"""What the demo scripts share: options, presets, set-up, checkpoints, plots and errors.

The demos stay thin: they declare a :class:`Demo` and a preset dataclass, parse their
command line with :func:`demo_parser`, call the package, and print.

*Presets.*  Each demo's settings are one dataclass whose fields are declared with
:func:`option` (default, help text, validator).  ``PRESETS`` names instances of it
(always ``"default"`` and ``"smoke"``; ``--smoke`` is short for ``--preset smoke``).
Every field is also a command-line option (``d_model`` -> ``--d-model``); an option the
user gives wins over the preset's value (:func:`resolve_preset`).

*Resuming.*  Training saves the whole run to ``OUT/last.npz`` (after every evaluation,
on Ctrl-C / SIGTERM, and at the end) together with its settings; ``--resume``
continues it with those settings (:func:`prepare`).

*Processes.*  ``mpiexec -n N python demos/...`` runs a demo on N MPI ranks with no
other flag (:mod:`npformer.distributed`): the ranks split every batch's rows, so the
global batch, the learning rate and the results are those of one process; evaluation
and decoding are shared out across the ranks; only rank 0 prints and writes files.

*Errors.*  Invalid option values are refused by the parser (exit status 2) naming the
option; errors a user can cause at run time become one ``error: ...`` line
(:func:`run_demo`).  matplotlib is imported only when a plot is drawn
(``pip install -e .[demos]``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import Field, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import backend, distributed
from .checkpoint import Checkpoint, CheckpointError, build_model, load_checkpoint
from .data import DatasetFormatError, DatasetNotFoundError
from .engine import ENGINES, engine_name, set_engine
from .launch import add_procs_option
from .nn import Module
from .train import History, TrainingDiverged, TrainingInterrupted
from .validation import check_heads_divide

if TYPE_CHECKING:  # annotations only: filelock is imported when a run holds its folder
    from filelock import FileLock

MODEL_FILE = "model.npz"  # the selected (or final) model: what --predict and friends read
LAST_FILE = "last.npz"  # the whole run, resumable with --resume
# saved with a run, beside its preset; procs (the MPI ranks) and replicas (the threads of
# each) fix how every batch is sharded, so a resumed run takes them back too
RUN_SETTINGS = ("seed", "dtype", "engine", "replicas", "procs")


MPI_EPILOG = """
Across processes: where mpi4py and mpiexec are installed (pip install -e ".[mpi]"), the
demo re-launches itself as one MPI rank per core (--procs N sets the count, --procs 1
runs one process); `mpiexec -n N python {script}` starts N ranks by hand.  The global
batch is --batch-size whatever N is: the ranks split its rows and sum their gradients,
so the learning rate (and its schedule) and the results stay those of one process, and a
run resumes on any number of ranks.  Only rank 0 prints and writes files."""


class DemoError(Exception):
    """A problem the user can fix (a missing checkpoint, a too-short corpus, no GPU...):
    :func:`run_demo` prints it as one ``error: ...`` line."""


@dataclass(frozen=True)
class Demo:
    """What identifies a demo: the tag its checkpoints carry, its title for messages,
    the model kind it saves, its script and its default output folder."""

    tag: str  # written into every checkpoint's extra["demo"]
    title: str  # for messages: "the IMDB demo"
    model_kind: str  # the model kind its checkpoints hold
    script: str  # how to run it: "demos/imdb.py"
    out: str  # default output folder


# --------------------------------------------------------------------------- option values
def _checked_number(text: str, convert, ok, expected: str):
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return _checked_number(text, int, lambda v: v > 0, "a positive integer")


def nonnegative_int(text: str) -> int:
    return _checked_number(text, int, lambda v: v >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    return _checked_number(text, float, lambda v: v > 0, "a positive number")


def nonnegative_float(text: str) -> float:
    return _checked_number(text, float, lambda v: v >= 0, "a number >= 0")


def probability(text: str) -> float:
    return _checked_number(text, float, lambda v: 0 <= v < 1, "a probability in [0, 1)")


def flag(name: str) -> str:
    """A preset field's command-line option: ``d_model`` -> ``--d-model``."""
    return "--" + name.replace("_", "-")


# --------------------------------------------------------------------------- presets
def option(default: Any, help: str, type: Callable[[str], Any] = positive_int,
           choices: Collection | None = None) -> Field:
    """A preset field that is also a command-line option (validated by ``type``)."""
    return field(default=default, metadata={"help": help, "type": type, "choices": choices})


def check_divisible(preset: Any, width: str, heads: str) -> None:
    """Refuse a model width the number of heads does not divide, naming both options."""
    check_heads_divide(getattr(preset, width), getattr(preset, heads), flag(width), flag(heads),
                       hint="")


def _add_preset_options(parser: argparse.ArgumentParser, presets: dict) -> None:
    group = parser.add_argument_group(
        "settings", "each has a value in every preset; an option given here overrides it")
    group.add_argument("--preset", choices=sorted(presets), default=None,
                       help="named settings (default: default)")
    group.add_argument("--smoke", action="store_true",
                       help="short for --preset smoke: a few seconds on a tiny subset, "
                            "checks the whole pipeline runs (CI)")
    base = presets["default"]
    for f in fields(base):
        values = "; ".join([f"default: {getattr(base, f.name)}"] + [
            f"{name}: {getattr(p, f.name)}" for name, p in presets.items()
            if name != "default" and getattr(p, f.name) != getattr(base, f.name)])
        group.add_argument(flag(f.name), type=f.metadata["type"], default=None,
                           choices=f.metadata["choices"],
                           metavar=None if f.metadata["choices"] else f.name.upper(),
                           help=f"{f.metadata['help']} ({values})".replace("%", "%%"))


def resolve_preset(parser: argparse.ArgumentParser, args: argparse.Namespace, presets: dict) -> Any:
    """The chosen preset with every option the user gave put in its place."""
    if args.smoke and args.preset not in (None, "smoke"):
        parser.error(f"--smoke is short for --preset smoke: it cannot be combined with "
                     f"--preset {args.preset}")
    args.preset = "smoke" if args.smoke else (args.preset or "default")
    given = {f.name: getattr(args, f.name) for f in fields(presets["default"])
             if getattr(args, f.name) is not None}
    try:
        return replace(presets[args.preset], **given)  # the preset's __post_init__ checks
    except ValueError as exc:
        parser.error(str(exc))


# --------------------------------------------------------------------------- the parser
def demo_parser(demo: Demo, doc: str, presets: dict) -> argparse.ArgumentParser:
    """The command line every demo shares: data, output, run settings, resuming, and one
    option per preset field.  The demo adds its own options to it."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=doc.split("\n\n", 1)[1]
                                     + MPI_EPILOG.format(script=demo.script))
    parser.add_argument("--data", default=None,
                        help="dataset file or folder (default: $NPFORMER_DATA, then the user "
                             "cache, downloading there if needed)")
    parser.add_argument("--out", default=demo.out,
                        help="folder for the checkpoints, plots and metrics "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=nonnegative_int, default=None,
                        help="random seed (default: 0)")
    parser.add_argument("--backend", choices=["numpy", "cupy"], default=None,
                        help="array backend: numpy (CPU) or cupy (GPU) "
                             "(default: $NPFORMER_BACKEND, else numpy)")
    parser.add_argument("--dtype", choices=["float32", "float64"], default=None,
                        help="float dtype of parameters and activations (default: float32)")
    parser.add_argument("--engine", choices=ENGINES, default=None,
                        help="tier of ops: fast (the default, or $NPFORMER_ENGINE) or textbook "
                             "(the plain derivations); both give the same numbers up to "
                             "rounding")
    parser.add_argument("--replicas", type=positive_int, default=None,
                        help="data-parallel replicas, one thread each with single-threaded "
                             "BLAS, for training and evaluation (default: one per CPU core "
                             "with numpy, shared among the MPI ranks on the machine; 1 with "
                             "cupy)")
    add_procs_option(parser)
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (on a terminal) or progress lines (elsewhere)")
    parser.add_argument("--resume", action="store_true",
                        help=f"continue the run saved in OUT/{LAST_FILE} (after an interruption) "
                             "exactly, with its saved settings; options given again must "
                             "match them")
    parser.add_argument("--stop-after", type=positive_int, default=None, metavar="UPDATES",
                        help=f"stop after this many updates as if interrupted (the run is saved "
                             f"in OUT/{LAST_FILE}: continue it with --resume)")
    _add_preset_options(parser, presets)
    return parser


def prepare(parser: argparse.ArgumentParser, args: argparse.Namespace, demo: Demo, presets: dict,
            use_only: str | None = None) -> Any:
    """Settle the run's settings and set it up; returns the preset.

    ``use_only`` names the option (e.g. ``"--predict"``) when the demo only uses a saved
    model.  Training: with ``--resume`` the saved run's settings are taken (an option given
    again must match them); without it, a folder holding another demo's checkpoint or a
    run that can still be resumed is refused."""
    out = Path(args.out)
    if use_only and args.resume:
        parser.error(f"--resume continues training: it cannot be combined with {use_only}")
    if args.resume:
        _adopt_saved_run(parser, args, read_demo_checkpoint(out / LAST_FILE, demo), presets)
    preset = resolve_preset(parser, args, presets)
    setup(args)
    if not use_only:
        hold_output(out)  # before looking at its files: one run at a time in a folder
        if not args.resume:
            guard_output(out, demo)
    return preset


def setup(args: argparse.Namespace) -> Path:
    """Apply --backend, --dtype, --engine and --seed (filling in the defaults of those not
    given); join the MPI ranks when started by mpiexec (before any array is made: a rank
    picks its GPU there); create and return the output folder."""
    try:
        distributed.setup()
    except RuntimeError as exc:  # MPI turned off in one rank of several, no mpi4py
        raise DemoError(str(exc)) from None
    args.seed = 0 if args.seed is None else args.seed
    try:
        backend.set_backend(args.backend or backend.backend_name(), seed=args.seed)
    except (RuntimeError, ValueError) as exc:  # no CuPy, no GPU
        raise DemoError(str(exc)) from None
    args.dtype = args.dtype or "float32"
    backend.set_default_float(args.dtype)
    args.engine = args.engine or engine_name()
    set_engine(args.engine)
    args.procs = distributed.current().size  # the ranks this run is on
    if args.replicas is None:  # the cores, shared among the MPI ranks on this machine
        cores = (os.cpu_count() or 1) // distributed.current().local_size
        args.replicas = max(1, cores) if backend.backend_name() == "numpy" else 1
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {out} is a file, not a folder: choose a folder for the run")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DemoError(f"cannot create the --out folder {out}: {exc.strerror or exc}") from None
    return out


def run_record(args: argparse.Namespace, preset: Any) -> dict:
    """The settings a resumed run takes back (saved in every checkpoint's extra["run"])."""
    return {"preset_name": args.preset, "preset": asdict(preset),
            "settings": {name: getattr(args, name) for name in RUN_SETTINGS}}


def _adopt_saved_run(parser, args, checkpoint, presets: dict) -> None:
    saved = checkpoint.extra.get("run")
    if saved is None:
        raise DemoError("the saved run records no settings: it cannot be resumed")
    if (args.smoke or args.preset) and ("smoke" if args.smoke else args.preset) != \
            saved["preset_name"]:
        parser.error(f"--resume continues the saved run with its settings: it used --preset "
                     f"{saved['preset_name']} (leave --preset and --smoke out)")
    args.preset, args.smoke = saved["preset_name"], False
    known = {f.name for f in fields(presets["default"])}
    values = {**{k: v for k, v in saved["preset"].items() if k in known}, **saved["settings"]}
    for name, value in values.items():
        given = getattr(args, name)
        if given is not None and given != value:
            parser.error(f"--resume continues the saved run with its settings: it used "
                         f"{flag(name)} {value}, not {given} (leave {flag(name)} out)")
        setattr(args, name, value)


# --------------------------------------------------------------------------- checkpoints
def read_demo_checkpoint(path: str | Path, demo: Demo) -> Checkpoint:
    """The checkpoint at ``path``, refused unless ``demo`` saved it."""
    path = Path(path)
    try:
        checkpoint = load_checkpoint(path)
    except FileNotFoundError:
        raise DemoError(f"no checkpoint at {path}: train one first with "
                        f"`python {demo.script} --out {path.parent}`") from None
    owner = checkpoint.extra.get("demo")
    if owner != demo.tag:
        raise CheckpointError(f"{path} was not saved by the {demo.title} demo (it comes "
                              f"from {'the ' + repr(owner) + ' demo' if owner else 'elsewhere'})")
    return checkpoint


def load_demo_model(path: str | Path, demo: Demo) -> tuple[Module, Checkpoint]:
    """-> (model, checkpoint) from a checkpoint ``demo`` saved."""
    checkpoint = read_demo_checkpoint(path, demo)
    return build_model(checkpoint, expected_kind=demo.model_kind), checkpoint


def checkpoint_files(out: Path) -> list[Path]:
    """The demo checkpoints in ``out``: model.npz and last.npz, and an ensemble's other
    members' model-K.npz and last-K.npz."""
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir()
                  if p.is_file() and re.fullmatch(r"(model|last)(-\d+)?\.npz", p.name))


def guard_output(out: Path, demo: Demo) -> None:
    """Before a new run writes its checkpoints into ``out``: refuse to overwrite another
    demo's checkpoint, or a run that ``--resume`` could still continue."""
    for path in checkpoint_files(out):
        try:
            checkpoint = read_demo_checkpoint(path, demo)
        except CheckpointError as exc:
            raise DemoError(f"{exc}; choose another --out, or delete it to reuse the "
                            "folder") from None
        trainer = checkpoint.extra.get("trainer")
        if path.name.startswith("last") and trainer is not None and not trainer["finished"]:
            raise DemoError(f"{path} holds an unfinished run (stopped after update "
                            f"{checkpoint.step}): continue it with --resume, or delete that "
                            "file to start over")


LOCK_FILE = ".npformer.lock"  # held (fcntl) by the run writing into a folder
HOLDER_FILE = ".npformer.lock.holder"  # who holds it: pid, host, command, start time
_held_outputs: dict = {}  # folder -> its FileLock, held until the process ends


def hold_output(out: Path) -> FileLock | None:
    """Hold ``out`` for this run (rank 0 under MPI) until the process ends: a second run
    into the same folder is refused, naming the holder (pid, host, command).

    The lock is an ``fcntl`` lock on OUT/.npformer.lock (the ``filelock`` library): the
    operating system releases it when the process ends, however it ends (a run killed
    with SIGKILL leaves no stale lock).  Returns the lock (None on other ranks)."""
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
        raise DemoError(f"{out} is in use by another run ({_holder(out)}): wait for it to "
                        "end, or choose another --out") from None
    except OSError as exc:  # a read-only folder
        lock.release()
        raise DemoError(f"cannot write into the --out folder {out}: "
                        f"{exc.strerror or exc}") from None
    _held_outputs[key] = lock
    return lock


def _holder(out: Path) -> str:
    try:
        return (out / HOLDER_FILE).read_text().strip() or "holder unknown"
    except OSError:
        return "holder unknown"


# --------------------------------------------------------------------------- errors
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


def say(line: str) -> None:
    """One line to standard error in one write: MPI ranks' lines then never interleave
    (``print`` writes the text and the newline apart)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


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


# --------------------------------------------------------------------------- reports
def machine_description(replicas: int | None = None) -> str:
    """The machine and how a run spread over it, for metrics.json: e.g. "x86_64, 2 CPU
    cores, backend numpy, 2 MPI ranks, 1 replica each" (processes started by mpiexec,
    and ``replicas`` data-parallel threads in each)."""
    ranks = distributed.current().size
    text = (f"{platform.machine()}, {os.cpu_count()} CPU cores, backend "
            f"{backend.backend_name()}, " + (f"{ranks} MPI ranks" if ranks > 1 else "1 process"))
    if replicas is not None:
        text += f", {replicas} replica{'' if replicas == 1 else 's'}"
        text += " each" if ranks > 1 else ""
    return text


class Stopwatch:
    """Seconds since it was made (a monotonic clock)."""

    def __init__(self):
        self.start = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.start


def is_main() -> bool:
    """False on MPI ranks other than 0: they compute, rank 0 writes the files."""
    return distributed.current().is_main


def map_batches(fn: Callable, items: Sequence, replicas: int) -> list:
    """[fn(item) for item in items] for evaluation and decoding: across ``replicas``
    threads, and across the MPI ranks when there are several (every rank gets all)."""
    return distributed.current().shard_map(fn, items, replicas)


def write_text(path: Path, text: str) -> None:
    if is_main():
        path.write_text(text)


def write_json(path: Path, values: dict) -> None:
    if not is_main():
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(values, indent=2))
    os.replace(tmp, path)


def extra_output(name: str, draw: Callable, *args: Any, **kwargs: Any) -> bool:
    """Draw an extra (a plot, a sample) after the run's results are saved: a failure is
    one ``warning:`` line, never the end of a run whose checkpoints and metrics.json are
    already written.  Returns whether it was written."""
    try:
        draw(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure of an extra: reported, not fatal
        print(f"warning: {name} not written: {type(exc).__name__}: {exc}", file=sys.stderr)
        return False
    return True


def plot_curves(path: Path, history: History, eval_keys: list[str], title: str) -> None:
    """Training loss per update (left) and evaluation metrics (right) to a PNG."""
    if not is_main():
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    losses = np.asarray(history.losses)
    left.plot(history.updates, losses, alpha=0.3, label="loss per update")
    if len(losses) >= 20:
        window = max(len(losses) // 50, 5)
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        left.plot(history.updates[window - 1:], smooth, label=f"mean of {window}")
    left.set_xlabel("update")
    left.set_ylabel("training loss")
    left.legend()
    for key in eval_keys:
        points = [(e["update"], e[key]) for e in history.evals if key in e]
        if points:
            xs, ys = zip(*points)
            right.plot(xs, ys, marker="o", label=key)
    right.set_xlabel("update")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
def plot_attention(path: Path, weights: np.ndarray, query_tokens: list[str],
                   key_tokens: list[str], title: str) -> None:
    """A (T, S) attention matrix as a heat-map with token labels."""
    if not is_main():
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    height = max(3.0, 0.25 * len(query_tokens) + 1.5)
    width = max(4.0, 0.25 * len(key_tokens) + 2.0)
    fig, ax = plt.subplots(figsize=(min(width, 30), min(height, 30)))
    image = ax.imshow(weights, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(key_tokens)), key_tokens, rotation=90, fontsize=7)
    ax.set_yticks(range(len(query_tokens)), query_tokens, fontsize=7)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    fig.colorbar(image, ax=ax)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
