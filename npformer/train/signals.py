"""Ctrl-C and SIGTERM while training: stop after the current update, never inside one."""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


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
