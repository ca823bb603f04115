"""The training loop: :class:`Trainer`, one update (:meth:`Trainer.update`, as
nanoGPT writes it) and the loop that makes them (:meth:`Trainer.fit`).

A :class:`npformer.train.tasks.Task` runs the forward pass, the loss
and the backward pass for one batch (host NumPy arrays in, gradients accumulated into
the parameters) and says how many items its mean loss covers.  The step adds gradient
accumulation, NaN/inf detection, clipping and the optimizer's step (its learning-rate
schedule with it); data parallelism (:mod:`npformer.parallel`) shards each batch over the
workers and sums their gradients.  The loop calls the pieces around it, each in its own
module: progress (:mod:`.progress`: a tqdm bar on a terminal, elsewhere a line every
30 s or less), periodic evaluation and best-model selection (:mod:`.evaluation`), the
run's length and time budget (:mod:`.budget`), atomic checkpoints that resume exactly
(:mod:`.run_state`: the model, the optimizer, the random streams, the position in the data
order, the history, the best metric so far and the time already spent), stop requests
(:mod:`.signals`: Ctrl-C or SIGTERM stops after the current update, saves the run and
raises :class:`TrainingInterrupted`) and CUDA graphs (:mod:`npformer.gpu.cuda_graph`).
:class:`~npformer.train.config.TrainConfig` and :class:`~npformer.train.config.History`
are in :mod:`.config`.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .. import backend
from ..backend import keep_freed_memory
from ..checkpoint import save_checkpoint
from ..gpu.cuda_graph import GraphedSteps
from ..nn import Module
from ..optim import NonFiniteGradientError, Optimizer, _nonfinite_report, check_optimizer_of
from ..parallel.context import SINGLE
from ..parallel.workers import DataParallel, data_parallel
from .budget import RunLength, TimeBudget
from .config import History, TrainConfig
from .evaluation import Evaluation, describe
from .progress import Progress, write_line
from .run_state import batches_state, random_streams, restore_batches, restore_run
from .signals import TrainingInterrupted, stop_after_reached, stop_requests
from .tasks import Task


class TrainingDiverged(RuntimeError):
    """The loss or the gradients stopped being finite."""


class Trainer:
    """Runs ``task`` on batches from ``next_batch(rng)`` for ``config.max_iters`` updates.

    Args:
        model: the :class:`npformer.nn.Module` to train.
        optimizer: e.g. :class:`npformer.optim.AdamW` over ``model.parameters()`` (its
            learning rate, or schedule, is the run's).
        task: what a batch means (:mod:`npformer.train.tasks`): ``Classification``,
            ``LanguageModeling``, ``Translation`` or your own :class:`Task`.
        next_batch: ``next_batch(rng) -> batch``, called once per batch with the
            trainer's ``numpy.random.Generator`` (draw rows with it, and a resumed run
            repeats the same batches); the batch is the tuple of host NumPy arrays the
            task expects.  It may carry ``state_dict()`` / ``load_state_dict()`` (as
            :class:`EpochBatches` does): its state is then saved and resumed with the run.
        config: the :class:`TrainConfig`.
        eval_fn: ``eval_fn(model) -> dict`` of metrics, ``{name: number}`` (e.g.
            ``{"val_loss": 0.41, "val_accuracy": 0.87}``).  It is called with the model
            being trained, in training mode (wrap it in ``npformer.nn.evaluating(model)``
            to turn dropout off; nothing it computes is backpropagated, so
            ``npformer.no_grad()`` saves memory), every ``config.eval_every`` updates,
            after the last update and when the time budget ends the run; under MPI on
            every rank.  The trainer adds the key ``"update"``, logs the values
            (``{value:.4f}``), keeps them in ``history.evals`` (saved in checkpoints, so
            plain floats), and with ``config.select_metric`` keeps the checkpoint whose
            value of that key is best (``select_mode`` "max" or "min"), so the dict must
            then hold that key.  None (the default): no evaluation.
        checkpoint_extra: JSON-able values saved in every checkpoint's ``extra`` (a
            vocabulary as ``vocab.to_json()``, label names...).
        seed: seeds the batch generator ``rng`` and the dropout streams.
    """

    def __init__(self, model: Module, optimizer: Optimizer, task: Task, next_batch: Callable,
                 config: TrainConfig, eval_fn: Callable | None = None,
                 checkpoint_extra: dict | None = None, seed: int = 0):
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
        check_optimizer_of(optimizer, model, "Trainer")
        self.evaluation = Evaluation(eval_fn, config.select_metric, config.select_mode)
        keep_freed_memory()  # every step's arrays reused, not page-faulted in again
        self.model, self.optimizer, self.task = model, optimizer, task
        self.next_batch, self.config = next_batch, config
        self.checkpoint_extra = checkpoint_extra or {}
        self.data_rng = np.random.default_rng(seed)
        self.history = History()
        self.train_seconds = 0.0  # spent in fit(), over every session of a resumed run
        self.finished = False  # fit() ended by max_iters or the time budget
        # Data parallelism (npformer.parallel): thread replicas, MPI ranks, or None for one
        # process of one replica, whose step runs the task itself.
        self.workers: DataParallel | None = data_parallel(model, config.replicas,
                                                          train_config=config)
        self.ranks = self.workers.ranks if self.workers is not None else SINGLE
        names = {id(p): name for name, p in model.named_parameters()}
        self._named_parameters = [(names.get(id(p), f"params[{i}]"), p)
                                  for i, p in enumerate(optimizer.params)]
        self._progress: Progress | None = None  # the run's, while fit() runs
        self.cuda_graphs = GraphedSteps(model, optimizer, task, config, self.ranks.size, self._log)
        self.length = RunLength(config, optimizer, self.ranks)  # planned_updates, the budget

    # ----------------------------------------------------------------- one update
    def update(self) -> float:
        """One optimizer update; returns its mean loss.  With ``cuda_graph`` on CuPy the
        update is replayed as a CUDA graph (:class:`npformer.gpu.cuda_graph.GraphedSteps`)."""
        self.model.train()
        if not self.cuda_graphs.on():
            return self._eager_update()
        batch, seed = self._draw_batch()
        replayed = self.cuda_graphs.update(batch)  # None: not captured, eager from now on
        if replayed is None:
            return self._eager_update(first=(batch, seed))
        self._items = self.task.count(batch)
        loss, norm, finite = (float(x) for x in replayed)
        self._check_loss(loss)
        if finite != 1.0:  # the gradient: named as the eager check names it
            raise TrainingDiverged(self._diverged(_nonfinite_report(self._named_parameters,
                                                                    norm)))
        return loss

    def _eager_update(self, first: tuple | None = None) -> float:
        """One update as nanoGPT writes it: forward, loss and backward of ``grad_accum``
        batches, clipping, the optimizer's step.  Returns the update's mean loss
        (``first``: its first (batch, seed), already drawn)."""
        self.optimizer.zero_grad()
        losses, self._items = [], 0
        for i in range(self.config.grad_accum):
            batch, seed = first if i == 0 and first is not None else self._draw_batch()
            scale = 1.0 / self.config.grad_accum  # the forward, loss and backward of the batch
            if self.workers is None:  # one process of one replica: the task itself, here
                self._items += self.task.count(batch)
                with backend.thread_generator(seed):  # its dropout masks drawn from seed
                    losses.append(self.task.loss_and_grad(self.model, batch, scale))
            else:  # data parallelism: the batch sharded over the workers, gradients summed
                loss, count = self.workers.loss_and_grad(  # the last batch's backward
                    self.task, batch, scale, seed,  # starts the gradients' sum (MPI ranks)
                    ends_step=i == self.config.grad_accum - 1)
                self._items += count
                losses.append(loss)
        loss = float(np.mean(losses))
        if self.workers is not None:
            loss = self.workers.reduce_step(loss)  # the gradients' all-reduce (MPI ranks)
        self._check_loss(loss)
        self._clip_gradients()  # a NaN or inf gradient stops the run here
        self.optimizer.step()
        return loss

    def _draw_batch(self) -> tuple[tuple, int]:
        """The next batch, and the seed of its dropout masks."""
        batch = self.next_batch(self.data_rng)
        return batch, int(self.data_rng.integers(2**31))

    def _check_loss(self, loss: float) -> None:
        if not math.isfinite(loss):
            raise TrainingDiverged(self._diverged(f"loss {loss}"))

    def _clip_gradients(self) -> None:
        """Clip to ``clip_norm`` (or only check that every gradient is finite), with the
        optimizer's gradient norm; a non-finite gradient is TrainingDiverged, naming it."""
        named = self._named_parameters
        try:
            if self.config.clip_norm:
                self.optimizer.clip_grad_norm(named, self.config.clip_norm)
            else:
                self.optimizer.grad_norm(named)
        except NonFiniteGradientError as exc:
            raise TrainingDiverged(self._diverged(str(exc))) from exc

    def _diverged(self, what: str) -> str:
        return (f"training diverged at update {self.updates + 1}: {what} (learning rate "
                f"{self.optimizer.lr:.3g}); nothing was updated or saved. Lower the learning "
                "rate, add warmup, or clip gradients (clip_norm).")

    # ----------------------------------------------------------------- the loop
    def fit(self) -> History:
        """Train until ``max_iters`` updates or the time budget; returns the history.

        Raises :class:`TrainingInterrupted` (after saving to ``last_path``) on Ctrl-C,
        SIGTERM or ``stop_after``; a second Ctrl-C interrupts at once."""
        cfg = self.config
        self._progress = Progress(cfg.max_iters, cfg.desc, done=self.updates,
                                  elapsed=self.train_seconds, budget=cfg.max_seconds,
                                  lines_per_run=10, enabled=cfg.progress and self.ranks.is_main)
        self._seconds_before, self._started = self.train_seconds, time.perf_counter()
        self.finished = False
        self.length.new_session()
        try:
            with stop_requests() as requests:
                while not self.finished:
                    self.train_seconds = self._train_seconds_now()
                    self.finished = self.updates >= self.planned_updates or self._out_of_time()
                    if not self.finished:
                        self._record_update(cfg, self.update())
                        reason = self.ranks.from_main(  # every rank stops at the same update
                            requests[0] if requests else stop_after_reached(
                                cfg.stop_after, self.updates, self.planned_updates))
                        if reason:
                            self._interrupt(reason)
        finally:
            self._progress.close()
        self.save_last()
        if cfg.checkpoint_path and not cfg.select_metric:
            self.save(cfg.checkpoint_path)
        self.ranks.from_main(None)  # MPI: no rank returns before rank 0's files are written
        return self.history

    def _record_update(self, cfg: TrainConfig, loss: float) -> None:
        """After an update: its loss in the history and the progress, then the evaluation
        and the run's save when due."""
        self.history.updates.append(self.updates)
        self.history.losses.append(loss)
        self.history.lrs.append(self.optimizer.lr)
        self._progress.update(items=self._items, loss=loss, lr=self.optimizer.lr)
        self.length.measure(self._train_seconds_now())
        if cfg.eval_every and (self.updates % cfg.eval_every == 0
                               or self.updates == self.planned_updates):
            self.evaluate()
            if self.updates < self.planned_updates:
                self.save_last()

    def _out_of_time(self) -> bool:
        """Whether the time budget is spent (:meth:`RunLength.out_of_time`); evaluates once
        more then, if the run evaluates and has not at this update."""
        if not self.length.out_of_time(self.train_seconds):
            return False
        self._log(f"time budget of {self.config.max_seconds:.0f} s reached at update "
                  f"{self.updates}")
        if self.config.eval_every and not self._evaluated_at_this_update():
            self.evaluate()
        return True

    def _interrupt(self, reason: str) -> None:
        """Save the run with this update and raise TrainingInterrupted."""
        self.train_seconds = self._train_seconds_now()
        self.save_last()
        last = self.config.last_path
        raise TrainingInterrupted(self.updates, reason, Path(last) if last else None)

    def _train_seconds_now(self) -> float:
        """Seconds spent in training so far, this instant (``train_seconds`` is updated
        once per update, before it)."""
        return self._seconds_before + time.perf_counter() - self._started

    def _evaluated_at_this_update(self) -> bool:
        return bool(self.history.evals) and self.history.evals[-1]["update"] == self.updates

    def _log(self, line: str) -> None:
        if self.ranks.is_main:  # MPI: rank 0 speaks for all
            write_line(line)

    def evaluate(self) -> dict:
        """Run ``eval_fn``, record its metrics (:mod:`.evaluation`), and save the model if
        it is the best yet."""
        if self.evaluation.eval_fn is None:
            return {}
        metrics = self.evaluation.metrics(self.model, self.updates)
        self.history.evals.append(metrics)
        self._log(describe(metrics))
        cfg = self.config
        if cfg.checkpoint_path and self.evaluation.is_best(metrics):
            self.save(cfg.checkpoint_path, extra={"selected_on": {cfg.select_metric: self.best}})
        return metrics

    # ----------------------------------------------------------------- the run's state
    @property
    def updates(self) -> int:
        """Optimizer updates done so far."""
        return self.optimizer.updates

    @property
    def best(self) -> float | None:
        """The best value of ``select_metric`` so far (None: none yet, or none selected)."""
        return self.evaluation.best

    @property
    def planned_updates(self) -> int:
        """Where the run ends (with ``schedule_for``: measured as it goes)."""
        return self.length.planned_updates

    @property
    def budget(self) -> TimeBudget | None:
        """The time budget that fits the schedule (None: no ``schedule_for``)."""
        return self.length.budget

    def state_dict(self) -> dict:
        """What a resumed run needs besides the model, the optimizer and the random
        streams (JSON-able)."""
        return {"history": asdict(self.history), "best": self.best,
                "train_seconds": self.train_seconds, "finished": self.finished,
                "planned_updates": self.planned_updates,
                "batches": batches_state(self.next_batch)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`.  ``finished`` is not restored: :meth:`fit` decides
        again from the counters (so a run may also be resumed with more updates)."""
        self.history = History(**state["history"])
        self.evaluation.best, self.train_seconds = state["best"], state["train_seconds"]
        self.length.restore(state.get("planned_updates"))  # the schedule as it was
        restore_batches(self.next_batch, state["batches"])

    def save(self, path: str | Path, extra: dict | None = None) -> Path:
        """The model, the optimizer, the random streams and :meth:`state_dict`: a run
        that :meth:`resume` continues exactly (:mod:`.run_state`).  Under MPI only rank 0
        writes (every rank holds the same state)."""
        if not self.ranks.is_main:
            return Path(path)
        return save_checkpoint(path, self.model, self.optimizer, step=self.updates,
                               extra={**self.checkpoint_extra, **(extra or {}),
                                      "trainer": self.state_dict()},
                               rng_state=random_streams(self.data_rng))

    def save_last(self) -> Path | None:
        """Save the run to ``config.last_path`` (if set)."""
        return self.save(self.config.last_path) if self.config.last_path else None

    def resume(self, path: str | Path) -> None:
        """Continue exactly where a checkpoint saved by :meth:`save` left off."""
        state = restore_run(path, self.model, self.optimizer, self.data_rng)
        if state is not None:
            self.load_state_dict(state)
