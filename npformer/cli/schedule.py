"""The demos' learning-rate schedule, legal for a run of any length.

:class:`npformer.optim.warmup_cosine` peaks at update ``warmup`` and reaches ``min_lr``
at update ``total_steps``, so it needs ``warmup < total_steps``.  A demo derives both
from its options (a warmup of at least one update, at most a tenth or a twentieth of
the run), and a run of one update (``--max-iters 1``, ``--epochs 0.01`` on a small
file) would ask for ``warmup_cosine(lr, 1, 1)``: refused.  :func:`cosine_schedule` is
the one place that makes such a run legal.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..ops.contracts import check_size
from ..optim import warmup_cosine

__all__ = ["cosine_schedule", "CosineOfLength"]


def cosine_schedule(peak_lr: float, warmup: int, total_updates: int,
                    min_lr: float = 0.0) -> warmup_cosine:
    """Linear warmup over ``warmup`` updates (at least 1), then cosine decay to
    ``min_lr`` at update ``total_updates`` (at least 1).

    A run that ends before its warmup is over (``total_updates <= warmup``) never
    decays: its schedule is the warmup's line, continued to ``warmup + 1`` updates, so
    a one-update run with a warmup of one takes its update at ``peak_lr``.  Every
    longer run gets exactly ``warmup_cosine(peak_lr, warmup, total_updates, min_lr)``.

    >>> [cosine_schedule(1e-3, 1, 1)(1)]
    [0.001]
    """
    warmup = check_size(warmup, "warmup", 1)
    total_updates = check_size(total_updates, "total_updates", 1)
    return warmup_cosine(peak_lr, warmup, max(total_updates, warmup + 1), min_lr=min_lr)


@dataclass(frozen=True)
class CosineOfLength:
    """updates -> :func:`cosine_schedule` ``(peak_lr, warmup, updates, min_lr)``: the
    schedule of a run of any length, for ``TrainConfig.schedule_for``, which fits the
    length to the time budget.  A dataclass (not a lambda), so that the ranks of an MPI
    run can compare it (their configurations must agree).

    >>> CosineOfLength(1e-3, 10)(100)(100)
    0.0
    """

    peak_lr: float
    warmup: int
    min_lr: float = 0.0

    def __post_init__(self):
        """Bad values refused when made, by cosine_schedule's checks, naming the value."""
        cosine_schedule(self.peak_lr, self.warmup, 1, self.min_lr)

    def __call__(self, updates: int) -> warmup_cosine:
        return cosine_schedule(self.peak_lr, self.warmup, updates, self.min_lr)
