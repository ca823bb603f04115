"""A run's length: ``TrainConfig.max_iters`` updates, or fitted to its time budget
(``TrainConfig.schedule_for``), and the budget's end (``max_seconds``).

With a fitted schedule, the updates still to come are the seconds left over the seconds
an update has taken lately (over the second half of this session at least, evaluations
included), measured again every :data:`TimeBudget.REPLAN_EVERY` updates, so a slower or
faster machine, or one that slows down, gets a shorter or longer schedule that still
decays fully within the budget (:class:`TimeBudget`); :class:`RunLength` is where the
Trainer's run ends, and whether its time is up.
"""
from __future__ import annotations

from typing import Any


class TimeBudget:
    """How many updates fit in ``max_seconds`` (at most ``max_updates``), measured as the
    run goes: :meth:`updates_that_fit` after every update."""

    REPLAN_EVERY = 10  # updates between two measurements of the pace

    def __init__(self, max_seconds: float, max_updates: int):
        self.max_seconds, self.max_updates = max_seconds, max_updates
        self.marks: list[tuple[int, float]] = []  # (updates, seconds) this session

    def new_session(self) -> None:
        """A (resumed) session starts: its first update, compiling and warming up, is not
        counted."""
        self.marks = []

    def updates_that_fit(self, updates: int, seconds: float) -> int | None:
        """After update ``updates``, at ``seconds`` of training: the run's new length, or
        None where it is not measured again at this update."""
        marks = self.marks
        if not marks:  # the session's first update (compiling, warming up) is not counted
            marks.append((updates, seconds))
            return None
        done = updates - marks[0][0]
        if done % self.REPLAN_EVERY and done != 1:  # a first guess from one update
            return None
        middle = (marks[0][0] + updates) / 2
        since_update, since_seconds = max(m for m in marks if m[0] <= middle)
        seconds_each = (seconds - since_seconds) / (updates - since_update)
        left = max(0.0, self.max_seconds - seconds)
        marks.append((updates, seconds))
        return min(self.max_updates, updates + int(left / seconds_each))


class RunLength:
    """Where a run ends (``planned_updates``): ``config.max_iters`` updates, or with
    ``config.schedule_for`` the updates its time budget holds (:class:`TimeBudget`,
    measured as the run goes), the optimizer given the schedule of a run that long.
    Every rank ends where rank 0 does (``ranks``: the run's :mod:`npformer.parallel`
    context)."""

    def __init__(self, config: Any, optimizer: Any, ranks: Any):
        self.config, self.optimizer, self.ranks = config, optimizer, ranks
        self.planned_updates = config.max_iters
        self.budget = TimeBudget(config.max_seconds, config.max_iters) \
            if config.schedule_for is not None else None
        if self.budget is not None:
            self.plan(config.max_iters)

    def new_session(self) -> None:
        """:meth:`TimeBudget.new_session`, for a run with a fitted schedule."""
        if self.budget is not None:
            self.budget.new_session()

    def measure(self, seconds: float) -> None:
        """After an update, at ``seconds`` of training: the run's length measured again,
        where the budget measures it."""
        if self.budget is not None:
            planned = self.budget.updates_that_fit(self.optimizer.updates, seconds)
            if planned is not None:
                self.plan(planned)

    def plan(self, updates: int) -> None:
        """End the run after ``updates`` (rank 0's count, on every rank), with the schedule
        ``schedule_for(updates)`` (none for a run of no updates: there is nothing to
        schedule).  What schedule_for returns must be a schedule, a function of the
        update number: anything else is refused here, before the update it would rule."""
        self.planned_updates = int(self.ranks.from_main(max(updates, self.optimizer.updates)))
        if self.planned_updates == 0:
            return
        schedule = self.config.schedule_for(self.planned_updates)
        if not callable(schedule):
            raise TypeError(f"TrainConfig.schedule_for({self.planned_updates}) must return a "
                            "learning-rate schedule (a function of the update number, e.g. "
                            f"npformer.optim.warmup_cosine(...)), got {schedule!r} "
                            f"({type(schedule).__name__})")
        self.optimizer.schedule = schedule

    def restore(self, planned_updates: int | None) -> None:
        """A resumed run's length and schedule as they were (None: a checkpoint from before
        the length was saved); measured again as the run goes."""
        if self.config.schedule_for is not None and planned_updates is not None:
            self.plan(planned_updates)

    def out_of_time(self, seconds: float) -> bool:
        """Whether ``seconds`` of training have spent the time budget (rank 0 decides for
        all)."""
        max_seconds = self.config.max_seconds
        return max_seconds is not None and bool(self.ranks.from_main(seconds > max_seconds))
