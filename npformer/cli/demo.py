"""What names a demo and its run: the :class:`Demo` record, the files a run writes, the
settings a run saves beside its preset, and :class:`DemoError`, a problem the user can fix."""
from __future__ import annotations

from dataclasses import dataclass

MODEL_FILE = "model.npz"  # the selected (or final) model: what --predict and friends read
LAST_FILE = "last.npz"  # the whole run, resumable with --resume
# saved with a run, beside its preset; procs (the MPI ranks) and replicas (the threads of
# each) fix how every batch is sharded, so a resumed run takes them back too
RUN_SETTINGS = ("seed", "dtype", "engine", "replicas", "procs")


class DemoError(Exception):
    """A problem the user can fix (a missing checkpoint, a too-short corpus, no GPU...):
    :func:`npformer.cli.run_demo` prints it as one ``error: ...`` line."""


@dataclass(frozen=True)
class Demo:
    """What identifies a demo: the tag its checkpoints carry, its title for messages,
    the model kind it saves, its script and its default output folder."""

    tag: str  # written into every checkpoint's extra["demo"]
    title: str  # for messages: "the IMDB demo"
    model_kind: str  # the model kind its checkpoints hold
    script: str  # how to run it: "demos/imdb.py"
    out: str  # default output folder
