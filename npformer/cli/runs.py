"""A demo's run: its start-up, its settings, its output folder and the checkpoints in it.

*Start-up.*  Every demo's ``main`` begins with :func:`start_demo`: parse the command
line, settle the settings (a resumed run's saved ones, the preset with the options
given), take the output folder (hold it, refuse to mix two runs in it), then re-launch as
MPI ranks when training on the CPU (:mod:`npformer.parallel.relaunch`), and apply the settings
(backend, dtype, tier, seed, MPI).  Everything a user can get wrong on the command line
is checked before the ranks start, so its error is printed once.

*Resuming.*  Training saves the whole run to ``OUT/last.npz`` (after every evaluation, on a
stop, and at the end) together with its settings (:func:`run_record`), the data it trains
on among them (each file by its path and the sha256 of its content); ``--resume`` continues
it with those settings, an option given again must match them, and other data is refused,
naming both.  A run resumes on any number of MPI ranks: the thread replicas of each are
then set so that every batch is still shared among as many workers (ranks x replicas) as
before, which gives the uninterrupted run's figures (what changed is said in one note).

*The folder.*  A new run refuses a folder holding another demo's checkpoint, a run that
``--resume`` could still continue, or a finished run of other settings
(:func:`guard_output`); ``--overwrite`` removes every file of that run first
(:func:`remove_run_files`).  A folder another run is writing into is refused too
(:func:`npformer.cli.lock.hold_output`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, NamedTuple

from .. import backend, parallel
from ..checkpoint import Checkpoint, CheckpointError, build_model, load_checkpoint
from ..nn import Module
from ..parallel.relaunch import launch_record, relaunch, under_launcher
from ..train import progress
from .demo import (
    DATA_FILES,
    DATA_SETTINGS,
    LAST_FILE,
    MODEL_FOLDERS,
    RUN_FILES,
    RUN_FOLDERS,
    RUN_SETTINGS,
    Demo,
    DemoError,
)
from .lock import hold_output
from .options import default_out, flag, refuse_unread_with_saved_model, resolve_preset
from .output import say
from .ranks import is_main


# --------------------------------------------------------------------------- start-up
class DemoRun(NamedTuple):
    """What a demo's ``main`` works with once its run is set up."""

    args: argparse.Namespace  # every option settled: a resumed run's, the defaults filled in
    preset: Any  # the demo's preset dataclass, with the options given put in its place
    out: Path  # the output folder: created, and held by this run when it trains


def start_demo(demo: Demo, parser: argparse.ArgumentParser, presets: dict,
               argv: list[str] | None, use_saved: str | None = None,
               check_options: Callable[[argparse.ArgumentParser, argparse.Namespace], None]
               | None = None) -> DemoRun:
    """The start-up every demo shares (the module's docstring); returns the run's settled
    options, preset and folder.  ``argv`` (None: the command line) is parsed with ``parser``
    (:func:`demo_parser` and the demo's own options) and ``check_options(parser, args)``
    (the rules between the demo's own options: it calls ``parser.error``).  Where the demo
    re-launches as MPI ranks, this process ends with their exit status (``SystemExit``).

    ``use_saved`` names the option (its destination, e.g. ``"predict"``) with which the
    demo uses a saved model instead of training: given, nothing is trained, so nothing is
    re-launched, held or guarded, and ``--resume`` is refused."""
    args = parser.parse_args(argv)
    if check_options is not None:
        check_options(parser, args)
    given = getattr(args, use_saved) if use_saved else None
    use_only = flag(use_saved) if given is not None and given is not False else None
    preset = resolve_settings(parser, args, demo, presets, use_only)
    started_by_a_launcher = under_launcher()
    if use_only is None and not started_by_a_launcher:  # one process, or the ranks' launcher
        take_output(args, preset, demo)
    with _told(ValueError):  # an environment variable the ranks would refuse
        code = relaunch(args, argv, training=use_only is None)
    if code is not None:
        raise SystemExit(code)  # the run, on one MPI rank per core, has ended
    apply_settings(args)
    if use_only is None and started_by_a_launcher and launch_record() is None:
        take_output(args, preset, demo)  # ranks started by hand: rank 0 holds the folder
    return DemoRun(args, preset, Path(args.out))


def resolve_settings(parser: argparse.ArgumentParser, args: argparse.Namespace, demo: Demo,
           presets: dict, use_only: str | None = None) -> Any:
    """The run's settings, with nothing applied yet; returns the preset.  With ``--resume``
    the saved run's settings are taken (an option given again must match them, the data
    must be the data it was started on); the defaults of --seed, --dtype and --tier
    are filled in, and the content of every data file is hashed (``args.data_sha256``).  An
    --out not given is the preset's default folder (:func:`default_out`)."""
    if args.out is None:
        args.out = default_out(demo, "smoke" if args.smoke else args.preset or "default")
    out = Path(args.out)
    overwrite = getattr(args, "overwrite", False)
    if use_only and args.resume:
        parser.error(f"--resume continues training: it cannot be combined with {use_only}")
    if use_only and overwrite:
        parser.error(f"--overwrite starts a new run: it cannot be combined with {use_only}")
    if args.resume and overwrite:
        parser.error("--resume continues the saved run and --overwrite removes it: give one")
    args.data_sha256 = data_hashes(args)
    if args.resume:
        _adopt_saved_run(parser, args, out / LAST_FILE,
                         read_demo_checkpoint(out / LAST_FILE, demo), presets)
    preset = resolve_preset(parser, args, presets)
    refuse_unread_with_saved_model(parser, args, preset, use_only)
    args.seed = 0 if args.seed is None else args.seed
    args.dtype = args.dtype or "float32"
    args.tier = args.tier or "fast"
    return preset


def take_output(args: argparse.Namespace, preset: Any, demo: Demo) -> None:
    """Hold the output folder for this run (rank 0 under MPI) and, for a new run, guard it
    (:func:`guard_output`) or, with ``--overwrite``, remove the run it holds."""
    out = _folder(args)
    hold_output(out)  # before looking at its files: one run at a time in a folder
    if args.resume:
        return
    if getattr(args, "overwrite", False):
        if is_main():
            remove_run_files(out)
        return
    guard_output(out, demo, run_record(args, preset))


def apply_settings(args: argparse.Namespace) -> Path:
    """Apply the settled --backend, --dtype and --seed (:func:`resolve_settings`), and
    --no-progress; join the MPI ranks when started by mpiexec (before any array is made: a
    rank picks its GPU there); choose the thread replicas; create and return the output
    folder."""
    with _told(RuntimeError, ValueError):
        backend.check_environment()  # NPFORMER_BACKEND and the switches, before any use
        parallel.setup()  # MPI off in a rank, no mpi4py, a foreign mpiexec, NPFORMER_MPI_TIMEOUT
        _check_launched_ranks()
        backend.set_backend(args.backend or backend.backend_name(), seed=args.seed)  # no GPU
    backend.set_default_float(args.dtype)
    if getattr(args, "cuda_graph", False):  # the Trainer reads it (TrainConfig.cuda_graph)
        os.environ["NPFORMER_CUDA_GRAPH"] = "1"
    progress.set_enabled(not args.no_progress)  # evaluation's and decoding's too
    _choose_workers(args)
    return _folder(args)


@contextmanager
def _told(*kinds: type[Exception]) -> Iterator[None]:
    """Within the block, an exception of ``kinds`` is the user's to fix: a DemoError."""
    try:
        yield
    except kinds as exc:
        raise DemoError(str(exc)) from None


def _folder(args: argparse.Namespace) -> Path:
    """--out, created; refused (naming the problem) when it is a file or cannot be made."""
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {out} is a file, not a folder: choose a folder for the run")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DemoError(f"cannot create the --out folder {out}: {exc.strerror or exc}") from None
    return out


def _check_launched_ranks() -> None:
    """A rank the demo's launcher started must be one of as many as it started: copies
    that each run alone come from an mpiexec of another MPI than mpi4py's."""
    started = launch_record()
    ranks = parallel.current().size
    if started is not None and ranks != started["ranks"]:
        raise DemoError(
            f"{started['mpiexec']} was asked for {started['ranks']} MPI ranks, but this "
            f"process runs as one of {ranks}: that mpiexec belongs to another MPI than the "
            "one mpi4py was built with. Put mpi4py's own mpiexec first on PATH (pip "
            "install 'npformer[mpi]' brings both), or run in one process with --procs 1")


def _choose_workers(args: argparse.Namespace) -> None:
    """``args.procs``: the ranks this run is on; ``args.replicas`` (unless given): the
    thread replicas of each, the machine's cores shared among its ranks (the textbook
    tier: one, so that its run is one model in one thread), or for a resumed run as many
    as keep its workers (ranks x replicas).  A resumed run says what changed."""
    ctx = parallel.current()
    args.procs = ctx.size
    saved = getattr(args, "saved_layout", None)  # (procs, replicas) of a resumed run
    if args.replicas is None:
        if saved is not None and (saved[0] * saved[1]) % ctx.size == 0:
            args.replicas = saved[0] * saved[1] // ctx.size
        elif getattr(args, "tier", None) == "textbook":
            args.replicas = 1
        elif backend.backend_name() == "numpy":
            args.replicas = max(1, (os.cpu_count() or 1) // ctx.local_size)
        else:
            args.replicas = 1
    now = (args.procs, args.replicas)
    if saved is not None and now != saved and is_main():
        workers, before = now[0] * now[1], saved[0] * saved[1]
        outcome = (f"the same {workers} workers, so every batch is shared out as before"
                   if workers == before else
                   f"{workers} workers instead of {before}: every batch is shared out "
                   "otherwise, so the figures will differ from the uninterrupted run's (in "
                   "rounding, and in the dropout masks)")
        say(f"note: the run was on {_layout(*saved)}; it continues on {_layout(*now)}: "
            f"{outcome}")


def _layout(procs: int, replicas: int) -> str:
    ranks = f"{procs} MPI ranks" if procs > 1 else "1 process"
    return f"{ranks} x {replicas} replica{'' if replicas == 1 else 's'}"


# --------------------------------------------------------------------------- the data
def data_hashes(args: argparse.Namespace) -> dict[str, str | dict[str, str]]:
    """{option: its content's identity} for the input options naming a file (the sha256
    of its content) or a model folder (:data:`MODEL_FOLDERS`: {file name: sha256} for each
    of its files); a data folder, the default download or a Hub name is known by its path
    or name alone."""
    hashes: dict[str, str | dict[str, str]] = {}
    for name in DATA_FILES:
        path = getattr(args, name, None)
        if path is not None and Path(path).is_file():
            hashes[name] = file_sha256(path)
        elif path is not None and name in MODEL_FOLDERS and Path(path).is_dir():
            hashes[name] = folder_sha256(path)
    return hashes


def folder_sha256(path: str | Path) -> dict[str, str]:
    """{name: sha256 of its content} for each file of the folder ``path`` (its sub-folders'
    files by their relative path), leaving out hidden files."""
    root = Path(path)
    return {p.relative_to(root).as_posix(): file_sha256(p) for p in sorted(root.rglob("*"))
            if p.is_file() and not any(part.startswith(".")
                                       for part in p.relative_to(root).parts)}


def file_sha256(path: str | Path) -> str:
    try:
        with open(path, "rb") as file:
            return hashlib.file_digest(file, "sha256").hexdigest()
    except OSError as exc:
        raise DemoError(f"cannot read {path}: {exc.strerror or exc}") from None


def _absolute(path: str | None, name: str = "data") -> str | None:
    """A data option's path, absolute; a model option that names no folder is a Hub name
    ("gpt2"), kept as given."""
    if path is None or (name in MODEL_FOLDERS and not Path(path).exists()):
        return path
    return str(Path(path).resolve())


def _changes(saved: str | dict[str, str], current: str | dict[str, str]) -> str:
    """How an input's content (:func:`data_hashes`) differs from the saved one's: a file's
    sha256, or a folder's files by name."""
    if isinstance(saved, str) or isinstance(current, str):
        short = current[:16] if isinstance(current, str) else "of a folder"
        return f"sha256 {short}"
    changed = [f"{name} has changed" for name in saved
               if name in current and current[name] != saved[name]]
    changed += [f"{name} is gone" for name in saved if name not in current]
    changed += [f"{name} is new" for name in current if name not in saved]
    return "; ".join(changed)


def _check_same_data(parser: argparse.ArgumentParser, args: argparse.Namespace, name: str,
                     saved_path: str | None, saved_hash: str | None) -> None:
    """--resume: the data option ``name`` must give the data the run was started on (by
    content where it was a file, else by path); not given, it is taken back."""
    given = getattr(args, name)
    option = flag(name)
    started = f"{option} {saved_path}" if saved_path else f"no {option} (the default)"
    if saved_hash is None:
        if given is not None and _absolute(given, name) != saved_path:
            parser.error(f"--resume continues the saved run on the data it was started on: "
                         f"{started}, not {option} {given} (leave {option} out)")
        setattr(args, name, saved_path)
        return
    path = given if given is not None else saved_path
    kind, there = ("file", Path(path).is_file()) if isinstance(saved_hash, str) else \
        ("folder", Path(path).is_dir())
    identity = f"sha256 {saved_hash[:16]}" if kind == "file" else \
        f"{len(saved_hash)} files: {', '.join(saved_hash)}"  # the saved content, short
    started_on = f"--resume continues the saved run on what it was started on, {started} " \
                 f"({identity})"
    if not there:
        gone = (f"{path} is not there any more: give that {kind} with {option}"
                if given is None else
                f"{option} {given} is not a {kind}: give that {kind}, or leave {option} out")
        raise DemoError(f"{started_on}, but {gone}")
    current = args.data_sha256.get(name) if given is not None else \
        data_hashes(argparse.Namespace(**{name: path}))[name]
    if current != saved_hash:
        now = "has changed since" if _absolute(path, name) == saved_path else \
            f"holds other {'data' if kind == 'file' else 'files'}"
        raise DemoError(f"{started_on}, but {path} {now} ({_changes(saved_hash, current)}): "
                        f"resume with what it was started on, or start a new run")
    setattr(args, name, path)
    args.data_sha256[name] = current


# --------------------------------------------------------------------------- resuming
def run_record(args: argparse.Namespace, preset: Any) -> dict:
    """The settings a resumed run takes back (saved in every checkpoint's extra["run"]):
    the preset, :data:`RUN_SETTINGS`, the demo's :data:`DATA_SETTINGS` (files by their
    absolute path) and the sha256 of each data file."""
    settings = {name: getattr(args, name) for name in RUN_SETTINGS}
    for name in DATA_SETTINGS:
        if hasattr(args, name):
            value = getattr(args, name)
            settings[name] = _absolute(value, name) if name in DATA_FILES else value
    return {"preset_name": args.preset, "preset": asdict(preset), "settings": settings,
            "data_sha256": dict(getattr(args, "data_sha256", {}))}


def _adopt_saved_run(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     path: Path, checkpoint: Checkpoint, presets: dict) -> None:
    saved = checkpoint.extra.get("run")
    if saved is None:
        raise DemoError("the saved run records no settings: it cannot be resumed")
    if (args.smoke or args.preset) and ("smoke" if args.smoke else args.preset) != \
            saved["preset_name"]:
        parser.error(f"--resume continues the saved run with its settings: it used --preset "
                     f"{saved['preset_name']} (leave --preset and --smoke out)")
    args.preset, args.smoke = saved["preset_name"], False
    known = {f.name for f in fields(presets["default"])}
    preset = saved["preset"]
    settings = dict(saved["settings"])
    layout = settings.pop("procs", None) or 1, settings.pop("replicas", None) or 1
    args.saved_layout = layout  # the workers it ran on: kept by _choose_workers
    hashes = saved.get("data_sha256", {})
    for name in DATA_FILES:
        if name in settings and hasattr(args, name):
            _check_same_data(parser, args, name, settings.pop(name), hashes.get(name))
    values = {**{k: v for k, v in preset.items() if k in known}, **settings}
    for name, value in values.items():
        if not hasattr(args, name):
            continue
        given = getattr(args, name)
        if given is not None and given != value and not (
                name in DATA_SETTINGS and given == parser.get_default(name)):
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


def load_demo_model(path: str | Path, demo: Demo,
                    tier: str = "fast") -> tuple[Module, Checkpoint]:
    """-> (model of ``tier``, checkpoint) from a checkpoint ``demo`` saved; a checkpoint that
    does not make the model (a missing or misshapen parameter...) is one error naming the
    file."""
    checkpoint = read_demo_checkpoint(path, demo)
    try:
        return build_model(checkpoint, expected_kind=demo.model_kind, tier=tier), checkpoint
    except ValueError as exc:  # CheckpointError among them
        raise CheckpointError(_naming(path, exc)) from None


def resume_run(trainer: Any, path: str | Path) -> None:
    """``trainer.resume(path)``, a checkpoint that cannot continue this run (a missing
    parameter, negative Adam moments, another architecture...) one error naming the file."""
    try:
        trainer.resume(path)
    except (ValueError, KeyError) as exc:  # CheckpointError among them
        raise CheckpointError(_naming(path, exc, "cannot be resumed")) from None


def _naming(path: str | Path, exc: Exception, what: str = "cannot be used") -> str:
    """``exc``'s message, led by the file it is about (unless it names it already)."""
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return text if str(path) in text else f"{path} {what}: {text}"


def checkpoint_files(out: Path) -> list[Path]:
    """The demo checkpoints in ``out``: model.npz and last.npz, and an ensemble's other
    members' model-K.npz and last-K.npz."""
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir()
                  if p.is_file() and p.suffix == ".npz" and RUN_FILES.fullmatch(p.name))


def guard_output(out: Path, demo: Demo, record: dict | None = None) -> None:
    """Before a new run writes its checkpoints into ``out``: refuse to overwrite another
    demo's checkpoint, a run that ``--resume`` could still continue or, given the new
    run's ``record`` (:func:`run_record`), a finished run of other settings."""
    overwrite = "--overwrite (which removes every file of that run)"
    for path in checkpoint_files(out):
        try:
            checkpoint = read_demo_checkpoint(path, demo)
        except CheckpointError as exc:
            raise DemoError(f"{exc}; choose another --out, or start over with "
                            f"{overwrite}") from None
        trainer = checkpoint.extra.get("trainer")
        if path.name.startswith("last") and trainer is not None and not trainer["finished"]:
            raise DemoError(f"{path} holds an unfinished run (stopped after update "
                            f"{checkpoint.step}): continue it with --resume, or start over "
                            f"with {overwrite}")
        differ = _differences(checkpoint.extra.get("run"), record) if record else []
        if differ:
            raise DemoError(f"{out} holds a finished run of other settings ({'; '.join(differ)}"
                            f"): replace it with {overwrite}, continue it with --resume, or "
                            "choose another --out")


def _differences(saved: dict | None, new: dict) -> list[str]:
    """What differs between a saved run's record and a new one's (at most three, by
    option name), leaving out how they run (ranks, replicas)."""
    if saved is None:
        return ["it records no settings"]

    def flat(record: dict) -> dict:
        settings = {k: v for k, v in record["settings"].items() if k not in ("procs", "replicas")}
        return {"preset": record["preset_name"], **record["preset"], **settings,
                **{f"{k} content": v for k, v in record.get("data_sha256", {}).items()}}

    old, now = flat(saved), flat(new)
    names = [k for k in now if old.get(k, now[k]) != now[k]]
    shown = [f"{flag(k) if ' ' not in k else flag(k.split()[0]) + ' content'} "
             f"{_short(old[k])}, not {_short(now[k])}" for k in names[:3]]
    return shown + ([f"{len(names) - 3} more"] if len(names) > 3 else [])


def _short(value: Any) -> str:
    if isinstance(value, dict):  # a folder's files' hashes (a model folder): one digest
        value = hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()
    text = str(value)
    return text[:12] if len(text) == 64 and all(c in "0123456789abcdef" for c in text) else text


def remove_run_files(out: Path) -> list[Path]:
    """--overwrite: delete every file and folder a demo's run wrote into ``out``
    (:data:`RUN_FILES`: checkpoints of every member, figures, sample, metrics, leftover
    temporaries; :data:`RUN_FOLDERS`: the fine-tuned GPT-2 folder); anything else of the
    folder stays.  Returns what was deleted."""
    removed = []
    for path in sorted(out.iterdir()) if out.is_dir() else []:
        if path.is_file() and RUN_FILES.fullmatch(path.name):
            path.unlink()
        elif path.is_dir() and not path.is_symlink() and RUN_FOLDERS.fullmatch(path.name):
            shutil.rmtree(path)
        else:
            continue
        removed.append(path)
    return removed
