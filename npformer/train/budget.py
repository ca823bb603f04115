"""A run's length fitted to its time budget (``TrainConfig.schedule_for``).

The updates still to come are the seconds left over the seconds an update has taken
lately (over the second half of this session at least, evaluations included), measured
again every :data:`TimeBudget.REPLAN_EVERY` updates, so a slower or faster machine, or
one that slows down, gets a shorter or longer schedule that still decays fully within
the budget.
"""
from __future__ import annotations


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
