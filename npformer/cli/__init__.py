"""What the demo scripts share: their start-up, command line, runs, errors and figures.

The demos stay thin: they declare a :class:`Demo` and a preset dataclass, build their
command line with :func:`demo_parser`, start with :func:`start_demo`, call the package,
and print.  ``main`` runs inside :func:`run_demo`, the error boundary.

One module per job:

* :mod:`.demo`     the :class:`Demo` record, the run's file names, :class:`DemoError`
* :mod:`.options`  the shared options, their types (``positive_int``...) and the presets
* :mod:`.runs`     the start-up, settings and resuming (the data among them), the output
  folder's guard and --overwrite, reading a demo's checkpoints
* :mod:`.lock`     one run at a time in an output folder
* :mod:`.errors`   the error boundary: one ``error: ...`` line for a user's mistake
* :mod:`.ranks`    the processes a run spans: rank 0, shared evaluation, the machine
* :mod:`.output`   what a run prints and writes (rank 0's files, JSON atomically)
* :mod:`.plots`    training curves and attention maps (matplotlib imported when drawn)

*Processes.*  A demo runs on MPI ranks as :data:`.options.MPI_EPILOG` (its ``--help``)
says; evaluation and decoding are shared out across them (:mod:`.ranks`).
"""
from __future__ import annotations

from ..checkpoint import CheckpointError
from .demo import LAST_FILE, MODEL_FILE, Demo, DemoError
from .errors import resume_command, run_demo
from .lock import HOLDER_FILE, _held_outputs, hold_output
from .options import (
    check_divisible,
    demo_parser,
    nonnegative_float,
    nonnegative_int,
    nucleus,
    option,
    positive_float,
    positive_int,
    probability,
    resolve_preset,
    yes_no,
)
from .output import Stopwatch, write_folder, write_json, write_metrics, write_text
from .plots import extra_output, plot_attention, plot_curves
from .ranks import machine_description, map_batches
from .runs import (
    DemoRun,
    guard_output,
    load_demo_model,
    read_demo_checkpoint,
    remove_run_files,
    resume_run,
    run_record,
    start_demo,
)
