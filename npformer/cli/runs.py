"""A demo's run: its start-up, its settings, its output folder and the checkpoints in it.

*Start-up.*  Every demo's ``main`` begins with :func:`start_demo`: parse the command
line, re-launch as MPI ranks when training on the CPU (:mod:`npformer.launch`), settle
the settings (a resumed run's saved ones, the preset with the options given), apply
them (backend, dtype, engine, seed, MPI), and create and hold the output folder.

*Resuming.*  Training saves the whole run to ``OUT/last.npz`` (after every evaluation,
on Ctrl-C / SIGTERM, and at the end) together with its settings (:func:`run_record`);
``--resume`` continues it with those settings, and an option given again must match them.

*Guards.*  A new run refuses a folder holding another demo's checkpoint or a run that
``--resume`` could still continue (:func:`guard_output`), and a folder another run is
writing into (:func:`npformer.cli.lock.hold_output`).
"""
from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, NamedTuple

from .. import backend, distributed
from ..checkpoint import Checkpoint, CheckpointError, build_model, load_checkpoint
from ..engine import engine_name, set_engine
from ..launch import relaunch
from ..nn import Module
from ..validation import new_field_names
from .demo import LAST_FILE, RUN_SETTINGS, Demo, DemoError
from .lock import hold_output
from .options import flag, resolve_preset


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
    """The start-up every demo shares; returns the run's settled options, preset and folder.

    Parses ``argv`` (None: the command line) with ``parser`` (:func:`demo_parser` and the
    demo's own options), checks the rules between the demo's own options
    (``check_options(parser, args)``, which calls ``parser.error``), and re-launches the
    demo as MPI ranks when it trains on the CPU (:func:`npformer.launch.relaunch`): this
    process then ends with their exit status (``SystemExit``, as argparse ends on a bad
    option).  Otherwise the run is set up here (:func:`prepare`).

    ``use_saved`` names the option (its destination, e.g. ``"predict"``) with which the
    demo uses a saved model instead of training: given, nothing is trained, so nothing is
    re-launched, held or guarded, and ``--resume`` is refused."""
    args = parser.parse_args(argv)
    if check_options is not None:
        check_options(parser, args)
    given = getattr(args, use_saved) if use_saved else None
    use_only = flag(use_saved) if given is not None and given is not False else None
    if (code := relaunch(args, argv, training=use_only is None)) is not None:
        raise SystemExit(code)  # the run, on one MPI rank per core, has ended
    preset = prepare(parser, args, demo, presets, use_only)
    return DemoRun(args, preset, Path(args.out))


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


# --------------------------------------------------------------------------- resuming
def run_record(args: argparse.Namespace, preset: Any) -> dict:
    """The settings a resumed run takes back (saved in every checkpoint's extra["run"])."""
    return {"preset_name": args.preset, "preset": asdict(preset),
            "settings": {name: getattr(args, name) for name in RUN_SETTINGS}}


def _adopt_saved_run(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     checkpoint: Checkpoint, presets: dict) -> None:
    saved = checkpoint.extra.get("run")
    if saved is None:
        raise DemoError("the saved run records no settings: it cannot be resumed")
    if (args.smoke or args.preset) and ("smoke" if args.smoke else args.preset) != \
            saved["preset_name"]:
        parser.error(f"--resume continues the saved run with its settings: it used --preset "
                     f"{saved['preset_name']} (leave --preset and --smoke out)")
    args.preset, args.smoke = saved["preset_name"], False
    known = {f.name for f in fields(presets["default"])}
    preset = new_field_names(type(presets["default"]), saved["preset"])  # old names: new
    values = {**{k: v for k, v in preset.items() if k in known}, **saved["settings"]}
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
