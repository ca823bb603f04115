"""Stopping a run early: Ctrl-C and SIGTERM while training stop it after the current
update, never inside one, as ``TrainConfig.stop_after`` does; the Trainer then saves the
run and raises :class:`TrainingInterrupted`."""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class TrainingInterrupted(Exception):
    """Training stopped early on request (Ctrl-C, SIGTERM or ``stop_after``).

    ``path`` is where the run was saved for :meth:`Trainer.resume` (None: nowhere)."""

    def __init__(self, updates: int, reason: str, path: Path | None):
        self.updates, self.reason, self.path = updates, reason, path
        saved = f"the run is saved in {path}" if path else "nothing was saved"
        super().__init__(f"training stopped ({reason}) after update {updates}; {saved}")


@contextmanager
def stop_requests() -> Iterator[list[str]]:
    """While training, SIGINT (Ctrl-C) and SIGTERM ask the loop to stop after the current
    update (the yielded list receives the signal's name); a second one interrupts at once.
    Outside the main thread signals cannot be caught: nothing changes there."""
    requests: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield requests
        return

    def request_stop(signum, frame):
        if requests:
            raise KeyboardInterrupt
        requests.append(signal.Signals(signum).name)

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield requests
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def stop_after_reached(stop_after: int | None, updates: int, planned_updates: int) -> str | None:
    """The reason to stop after update ``updates`` that ``TrainConfig.stop_after`` gives
    (None: none; nor at the run's planned end, where it ends anyway)."""
    if stop_after is not None and stop_after <= updates < planned_updates:
        return f"stop_after={stop_after}"
    return None
