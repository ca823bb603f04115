"""What names a demo and its run: the :class:`Demo` record, the files a run writes, the
settings a run saves beside its preset, and :class:`DemoError`, a problem the user can fix."""
from __future__ import annotations

import re
from dataclasses import dataclass

MODEL_FILE = "model.npz"  # the selected (or final) model: what --predict and friends read
LAST_FILE = "last.npz"  # the whole run, resumable with --resume
# saved with a run, beside its preset; --resume takes them back (an option given again
# must match), procs and replicas only as their product (runs._choose_workers)
RUN_SETTINGS = ("seed", "dtype", "tier", "replicas", "procs")
# what a run starts from, saved with its settings where the demo has the option: the data
# it trains on and the model it fine-tunes; the inputs (DATA_FILES) are known by their
# absolute path and content (runs.data_hashes)
DATA_SETTINGS = ("data", "validation_data", "test_data", "text_column", "label_column",
                 "model")
DATA_FILES = ("data", "validation_data", "test_data", "model")
MODEL_FOLDERS = ("model",)
# every file a demo's run writes into its folder (the checkpoints, an ensemble's members',
# figures, sample, metrics) and the temporaries of its atomic writes: what --overwrite
# removes, and nothing else of the folder
RUN_FILES = re.compile(r"(model|last)(-\d+)?\.npz|curves(-\d+)?\.png|(cross_)?attention\.png"
                       r"|sample\.txt|metrics\.json(\.tmp)?|\.(model|last)(-\d+)?\.npz\.\d+\.tmp")
# the folders a run writes (the fine-tuned model as a GPT-2 or Llama folder, the LoRA
# adapters), and the temporaries of their whole-or-nothing writes
# (npformer.cli.output.write_folder): --overwrite removes them
RUN_FOLDERS = re.compile(r"(gpt2|llama|adapter)|\.(gpt2|llama|adapter)\.\d+\.(tmp|old)")


class DemoError(Exception):
    """A problem the user can fix (a missing checkpoint, a too-short corpus, no GPU...):
    :func:`npformer.cli.run_demo` prints it as one ``error: ...`` line."""


@dataclass(frozen=True)
class Demo:
    """What identifies a demo: the tag its checkpoints carry, its title for messages,
    the model kind it saves, its script and its default output folder."""

    tag: str  # written into every checkpoint's extra["demo"]
    title: str  # for messages: "the IMDB demo"
    model_kind: str | tuple[str, ...]  # the model kind (or kinds) its checkpoints hold
    script: str  # how to run it: "demos/imdb.py"
    out: str  # default output folder
