"""What a training run does (:class:`TrainConfig`) and what it recorded (:class:`History`).

Words: an *update* (an iteration, a step) is one ``optimizer.step()``;
``TrainConfig.max_iters`` (nanoGPT's name) is how many a run makes, ``Trainer.updates``
how many it has made.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..ops.contracts import check_choice, check_flag, check_path, check_real, check_size


@dataclass
class TrainConfig:
    """What :class:`Trainer` does: how long, how, when it evaluates and where it saves.

    Only ``max_iters`` is required; the comment beside each field says what it holds.  With
    ``select_metric`` (a key of ``eval_fn``'s dict) the checkpoint at ``checkpoint_path``
    is the best evaluation's (``select_mode`` "max" or "min"), otherwise the final model's.
    """

    max_iters: int  # optimizer updates in the whole run (the schedule's length)
    max_seconds: float | None = None  # stop early once training has taken this long in all
    schedule_for: Callable | None = None  # with max_seconds: schedule_for(n) is the learning-
    #   rate schedule of a run of n updates, n being the updates the budget holds, measured
    #   as the run goes (Trainer.planned_updates); the run ends there
    grad_accum: int = 1
    replicas: int = 1  # data-parallel replicas in threads, each on a shard of every batch
    clip_norm: float | None = None
    eval_every: int | None = None  # evaluate every this many updates, and after the last
    checkpoint_path: str | Path | None = None  # the selected model (or the final one)
    select_metric: str | None = None  # e.g. "val_accuracy": keep the best checkpoint
    select_mode: str = "max"
    last_path: str | Path | None = None  # the resumable run: after every evaluation, on
    #                                      Ctrl-C / SIGTERM, and at the end
    stop_after: int | None = None  # stop as if interrupted after this many updates
    cuda_graph: bool | None = None  # CuPy: each update replayed as a CUDA graph
    #   (npformer.gpu.cuda_graph); None: the environment variable NPFORMER_CUDA_GRAPH (1 = on)
    progress: bool = True
    desc: str = "train"

    def __post_init__(self):
        """Every field checked when the config is built, naming it: a value that would
        do nothing, or the opposite of what it says, is refused."""
        # stored as Python's numbers (a NumPy int64 as int), as the model configs store them
        self.max_iters = check_size(self.max_iters, "TrainConfig.max_iters", 0)
        self.max_seconds = check_real(self.max_seconds, "TrainConfig.max_seconds", 0.0,
                                      optional=True)
        self.grad_accum = check_size(self.grad_accum, "TrainConfig.grad_accum", 1)
        self.replicas = check_size(self.replicas, "TrainConfig.replicas", 1)
        self.clip_norm = check_real(self.clip_norm, "TrainConfig.clip_norm", 0.0,
                                    inclusive=False, optional=True, hint=" (None: no clipping)")
        self.eval_every = check_size(self.eval_every, "TrainConfig.eval_every", 1, optional=True)
        self.stop_after = check_size(self.stop_after, "TrainConfig.stop_after", 1, optional=True)
        for name in ("checkpoint_path", "last_path"):
            check_path(getattr(self, name), f"TrainConfig.{name}", optional=True)
        if self.schedule_for is not None:
            if not callable(self.schedule_for):
                raise TypeError("TrainConfig.schedule_for must be a function of the run's "
                                f"length in updates, got {self.schedule_for!r}")
            if self.max_seconds is None:
                raise ValueError("TrainConfig.schedule_for fits the schedule to the time "
                                 "budget, but max_seconds is None: give the budget, or pass "
                                 "the schedule to the optimizer yourself")
        check_choice(self.select_mode, ("max", "min"), "TrainConfig.select_mode")
        if self.select_metric is not None:
            if not isinstance(self.select_metric, str) or not self.select_metric:
                raise ValueError(f"TrainConfig.select_metric must be a metric's name (a "
                                 f"non-empty string) or None, got {self.select_metric!r}")
            missing = [name for name in ("eval_every", "checkpoint_path")
                       if getattr(self, name) is None]
            if missing:
                raise ValueError(f"TrainConfig.select_metric={self.select_metric!r} keeps the "
                                 f"best model by evaluation, but {' and '.join(missing)} "
                                 f"{'is' if len(missing) == 1 else 'are'} None: nothing would "
                                 "be evaluated or kept. Set them, or leave select_metric out")
        self.progress = check_flag(self.progress, "TrainConfig.progress")
        self.cuda_graph = check_flag(self.cuda_graph, "TrainConfig.cuda_graph", optional=True,
                                     hint=" (None: the environment's NPFORMER_CUDA_GRAPH)")


@dataclass
class History:
    """What a run recorded: the loss and learning rate of every update, and every
    evaluation's metrics (``eval_fn``'s dict, with the ``"update"`` it was made at)."""

    updates: list[int] = field(default_factory=list)  # the update each loss belongs to
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)  # metrics, each with its "update"
