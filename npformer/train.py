"""The training loop, and the loss functions of the three tasks.

A :class:`npformer.tasks.Task` runs the forward pass, the loss and the backward
pass for one batch (host NumPy arrays in, gradients accumulated into the
parameters) and says how many items its mean loss covers.  :class:`Trainer`
adds everything around it: gradient
accumulation, clipping, the learning-rate schedule (through the optimizer),
NaN/inf detection, a tqdm progress bar with loss, learning rate and tokens/s,
periodic evaluation, and atomic checkpoints that resume exactly.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from . import backend
from .checkpoint import load_checkpoint, restore, save_checkpoint
from .optim import clip_grad_norm, global_grad_norm
from .distributed import data_parallel
from .tasks import Task


class TrainingDiverged(RuntimeError):
    """The loss or the gradients stopped being finite."""


# --------------------------------------------------------------------------- metrics
def accuracy(logits, labels) -> float:
    """Fraction of rows whose argmax equals the label."""
    predicted = np.argmax(backend.to_numpy(logits), axis=-1)
    return float(np.mean(predicted == np.asarray(labels)))


def perplexity(mean_token_loss: float) -> float:
    return math.exp(mean_token_loss)


# --------------------------------------------------------------------------- the loop
@dataclass
class TrainConfig:
    max_steps: int
    max_seconds: float | None = None  # stop early once training has taken this long
    grad_accum: int = 1
    data_parallel: int = 1  # replicas run in threads on shards of each batch (CPU: 2)
    clip_norm: float | None = None
    eval_every: int | None = None
    checkpoint_path: str | Path | None = None
    select_metric: str | None = None  # e.g. "val_accuracy": keep the best checkpoint
    select_mode: str = "max"
    progress: bool = True
    desc: str = "train"


@dataclass
class History:
    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)


class Trainer:
    """Runs ``task`` on batches from ``next_batch(rng)`` for ``config.max_steps`` updates."""

    def __init__(self, model, optimizer, task: Task, next_batch: Callable,
                 config: TrainConfig, eval_fn: Callable | None = None,
                 checkpoint_extra: dict | None = None, seed: int = 0):
        if config.grad_accum < 1:
            raise ValueError(f"grad_accum must be at least 1, got {config.grad_accum}")
        self.model, self.optimizer, self.task = model, optimizer, task
        self.next_batch, self.config, self.eval_fn = next_batch, config, eval_fn
        self.checkpoint_extra = checkpoint_extra or {}
        self.data_rng = np.random.default_rng(seed)
        self.history = History()
        self.best: float | None = None
        # threads, or MPI ranks (x threads) under mpiexec: npformer.distributed
        self.parallel = data_parallel(model, config.data_parallel, train_config=config)

    @property
    def step(self) -> int:
        return self.optimizer.step_count

    # ----------------------------------------------------------------- one update
    def train_step(self) -> float:
        """One optimizer update over ``grad_accum`` batches; returns the mean loss."""
        self.model.train()
        self.optimizer.zero_grad()
        scale = 1.0 / self.config.grad_accum
        losses, items = [], 0
        for _ in range(self.config.grad_accum):
            batch = self.next_batch(self.data_rng)
            seed = int(self.data_rng.integers(2**31))  # the dropout streams of this batch
            loss, count = self.parallel.loss_and_grad(self.task, batch, scale, seed)
            losses.append(loss)
            items += count
        loss = self.parallel.reduce_step(float(np.mean(losses)))  # MPI: the all-reduce
        params = self.optimizer.params
        norm = (clip_grad_norm(params, self.config.clip_norm) if self.config.clip_norm
                else global_grad_norm(params))
        if not (math.isfinite(loss) and math.isfinite(norm)):
            raise TrainingDiverged(
                f"training diverged at step {self.step + 1}: loss {loss}, gradient norm "
                f"{norm} (learning rate {self.optimizer.lr:.3g}); nothing was updated or "
                "saved. Lower the learning rate, add warmup, or clip gradients (clip_norm).")
        self.optimizer.step()
        self._items = items
        return loss

    # ----------------------------------------------------------------- the loop
    def fit(self) -> History:
        from tqdm.auto import tqdm

        cfg = self.config
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc=cfg.desc,
                   disable=not (cfg.progress and self.parallel.is_main), dynamic_ncols=True)
        smoothed, started_fit = None, time.perf_counter()
        while self.step < cfg.max_steps:
            if cfg.max_seconds is not None and self.parallel.from_main(
                    time.perf_counter() - started_fit > cfg.max_seconds):  # rank 0 decides
                if self.parallel.is_main:
                    bar.write(f"time budget of {cfg.max_seconds:.0f} s reached at step {self.step}")
                if cfg.eval_every and (not self.history.evals
                                       or self.history.evals[-1]["step"] != self.step):
                    self.evaluate(bar)
                break
            started = time.perf_counter()
            loss = self.train_step()
            elapsed = time.perf_counter() - started
            smoothed = loss if smoothed is None else 0.9 * smoothed + 0.1 * loss
            self.history.steps.append(self.step)
            self.history.losses.append(loss)
            self.history.lrs.append(self.optimizer.lr)
            bar.update(1)
            bar.set_postfix(loss=f"{smoothed:.4f}", lr=f"{self.optimizer.lr:.2e}",
                            items_per_s=f"{self._items / elapsed:,.0f}")
            if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.max_steps):
                self.evaluate(bar)
        bar.close()
        if cfg.checkpoint_path and not cfg.select_metric:
            self.save(cfg.checkpoint_path)
        return self.history

    def evaluate(self, bar=None) -> dict:
        if self.eval_fn is None:
            return {}
        metrics = dict(self.eval_fn(self.model), step=self.step)
        self.history.evals.append(metrics)
        if bar is not None and self.parallel.is_main:
            bar.write("step {step}: ".format(**metrics) + ", ".join(
                f"{k} {v:.4f}" for k, v in metrics.items() if k != "step"))
        cfg = self.config
        if cfg.select_metric and cfg.checkpoint_path:
            value = metrics[cfg.select_metric]
            better = (self.best is None or (value > self.best if cfg.select_mode == "max"
                                            else value < self.best))
            if better:
                self.best = value
                self.save(cfg.checkpoint_path, extra={"selected_on": {cfg.select_metric: value}})
        return metrics

    # ----------------------------------------------------------------- checkpoints
    def save(self, path, extra: dict | None = None) -> Path:
        if not self.parallel.is_main:  # MPI: rank 0 writes, the others hold the same state
            return Path(path)
        rng_state = {"backend": backend.get_rng_state(),
                     "data": self.data_rng.bit_generator.state}
        return save_checkpoint(path, self.model, self.optimizer, step=self.step,
                               extra={**self.checkpoint_extra, **(extra or {})},
                               rng_state=rng_state)

    def resume(self, path) -> None:
        """Continue exactly where a checkpoint saved by :meth:`save` left off."""
        checkpoint = load_checkpoint(path)
        restore(self.model, checkpoint, self.optimizer)
        if checkpoint.rng_state:
            backend.set_rng_state(checkpoint.rng_state.get("backend"))
            self.data_rng.bit_generator.state = checkpoint.rng_state["data"]
