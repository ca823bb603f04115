"""What names a demo and its run: the :class:`Demo` record, the files a run writes, the
settings a run saves beside its preset, and :class:`DemoError`, a problem the user can fix."""
from __future__ import annotations

import re
from dataclasses import dataclass

MODEL_FILE = "model.npz"  # the selected (or final) model: what --predict and friends read
LAST_FILE = "last.npz"  # the whole run, resumable with --resume
# saved with a run, beside its preset; --resume takes them back (an option given again
# must match) but for procs (the MPI ranks) and replicas (the threads of each): a resumed
# run keeps their product, the workers every batch is shared among
RUN_SETTINGS = ("seed", "dtype", "tier", "replicas", "procs")
# the data a run trains on, saved with its settings where the demo has the option: the
# files (DATA_FILES) by their absolute path and their content's sha256
DATA_SETTINGS = ("data", "validation_data", "test_data", "text_column", "label_column")
DATA_FILES = ("data", "validation_data", "test_data")
# every file a demo's run writes into its folder (the checkpoints, an ensemble's members',
# figures, sample, metrics) and the temporaries of its atomic writes: what --overwrite
# removes, and nothing else of the folder
RUN_FILES = re.compile(r"(model|last)(-\d+)?\.npz|curves(-\d+)?\.png|(cross_)?attention\.png"
                       r"|sample\.txt|metrics\.json(\.tmp)?|\.(model|last)(-\d+)?\.npz\.\d+\.tmp")


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
