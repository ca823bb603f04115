"""Where a long phase is: :class:`Progress`, the one reporter that training, evaluation
and decoding share.

On a terminal (standard error a TTY) a phase is a tqdm bar; elsewhere (a log file, CI)
it is a plain line on standard output at least every :data:`LINE_SECONDS` seconds
(training: also every tenth of the run).  Either way it says how far the phase is
(``update 400/20000``), the time taken and left, and its rate in items per second, from
the last :data:`WINDOW` steps but the first (which carries the start-up): batches of
varying lengths give a steady rate, and a change of pace shows soon.

Phases nest: one opened while another is open (the validation pass inside training) is
shown under it (a transient bar, or lines), shares its clock and its lines' rhythm (a line
of either counts as the line due), is silent when the outer one is, and its time is not
counted in the outer one's rate.  :func:`context` says what the lines inside it belong to
(``member 2/3``): every line :func:`write_line` prints and every :func:`phase` opened
inside begins with it.  Rank 0 alone shows anything (:func:`phase` asks
:mod:`npformer.parallel`; the trainer passes its own rank).
"""
from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sized
from contextlib import contextmanager
from types import SimpleNamespace

from .. import parallel
from ..ops.contracts import check_flag

LINE_SECONDS = 30.0  # elsewhere than on a terminal, a line at least this often
WINDOW = 50  # the steps the rate and the time left are measured over
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}{postfix}"

_open: list[Progress] = []  # the phases open now, innermost last
_labels: list[str] = []  # the contexts entered now, innermost last
_lock = threading.RLock()  # steps may be counted from worker threads (map_batches)
_shown = True  # set_enabled(): whether a phase opened outside any other is shown


class Progress:
    """One long phase: :meth:`update` after each step, :meth:`close` at its end (or use it
    as a ``with`` block).

    Args:
        total: the steps of the whole phase (a run's ``max_iters``, a pass's batches).
        name: what the phase is; its lines and its bar begin with it ("translate").
        done: steps done before this one was opened (a resumed run's updates).
        elapsed: seconds spent before (a resumed run's earlier sessions).
        budget: the seconds the whole phase may take (a time budget, ``elapsed``
            included): the time left shown is the budget's when that is the smaller.
        unit: what a step is ("update", "batch").
        lines_per_run: elsewhere than on a terminal, a line at least every
            ``total // lines_per_run`` steps besides every :data:`LINE_SECONDS` (None: by
            time alone).
        enabled: False shows nothing (``TrainConfig.progress=False``, MPI ranks but 0);
            a phase opened inside a silent one is silent.
        transient: on a terminal, the bar disappears when the phase ends.
        clock: seconds, monotonic (None: ``time.monotonic``, or the outer phase's clock;
            tests give a fake one).
    """

    def __init__(self, total: int | None, name: str, *, done: int = 0, elapsed: float = 0.0,
                 budget: float | None = None, unit: str = "update",
                 lines_per_run: int | None = None, enabled: bool = True,
                 transient: bool = False, clock: Callable[[], float] | None = None):
        enabled, transient = check_flag(enabled, "enabled"), check_flag(transient, "transient")
        self.outer = _open[-1] if _open else None
        self.clock = clock or (self.outer.clock if self.outer else time.monotonic)
        self.total, self.name, self.unit, self.done = total, name, unit, done
        self.budget, self.elapsed_before = budget, elapsed
        self.enabled = enabled and (self.outer is None or self.outer.enabled)
        self.every = max(1, (total or 0) // lines_per_run) if lines_per_run else None
        self.started = self._last_step = self.clock()
        # .last: when the last line was printed, shared by an outer phase and those inside
        self.rhythm = self.outer.rhythm if self.outer else SimpleNamespace(last=self.started)
        self.steps: deque[tuple[int, int | None, float]] = deque(maxlen=WINDOW)  # (steps,
        #                       items, seconds) of the last ones, but the phase's first step:
        self.first_step_done = False  # it carries the start-up (compiling, first checks)
        self.loss: float | None = None  # smoothed
        self.lr: float | None = None
        self.bar = None
        self.on_terminal = self.outer.on_terminal if self.outer else _stderr_is_a_terminal()
        if self.enabled and self.on_terminal:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=done, desc=name, leave=not transient,
                            dynamic_ncols=True, bar_format=BAR_FORMAT)
        with _lock:
            _open.append(self)

    # ----------------------------------------------------------------- steps
    def update(self, steps: int = 1, items: int | None = None, loss: float | None = None,
               lr: float | None = None) -> None:
        """``steps`` more steps done, covering ``items`` items (examples, tokens,
        sentences: the rate's unit); in training the last step's ``loss`` (shown
        smoothed) and learning rate ``lr``."""
        if not self.enabled:
            return
        with _lock:
            now = self.clock()
            self.done += steps
            seconds, self._last_step = now - self._last_step, now
            if self.first_step_done:
                self.steps.append((steps, items, seconds))
            self.first_step_done = True
            if loss is not None:
                self.loss = loss if self.loss is None else 0.9 * self.loss + 0.1 * loss
            self.lr = lr if lr is not None else self.lr
            if self.bar is not None:
                self.bar.set_postfix_str(self.status(now), refresh=False)
                self.bar.update(steps)
            elif self._line_due(now, seconds):
                self._print(f"{self.name}: {self.unit} {self.done}/{self.total}, "
                            f"{self.status(now)}", now)

    def _line_due(self, now: float, last_step: float) -> bool:
        """Every ``every`` steps and at the end; and now if waiting for the next step
        (as long as the longest recent one) would leave more than LINE_SECONDS
        without a line."""
        if self.every and (self.done % self.every == 0 or self.done == self.total):
            return True
        longest = max((seconds for _, _, seconds in self.steps), default=last_step)
        return now + longest - self.rhythm.last >= LINE_SECONDS

    def _print(self, line: str, now: float) -> None:
        self.rhythm.last = now
        _print(line)

    # ----------------------------------------------------------------- what is shown
    def rate(self) -> float | None:
        """Items (or, where none were given, steps) per second over the last WINDOW
        steps; None before a step has taken any time."""
        seconds = sum(s for _, _, s in self.steps)
        by_items = all(items is not None for _, items, _ in self.steps)
        done = sum(items if by_items else steps for steps, items, _ in self.steps)
        return done / seconds if seconds > 0 else None

    def seconds_left(self, now: float) -> float | None:
        """The steps left at the last WINDOW steps' pace; with a budget, at most the
        budget's seconds left.  None while unknown."""
        steps, seconds = sum(s for s, _, _ in self.steps), sum(s for _, _, s in self.steps)
        estimate = (None if self.total is None or steps == 0
                    else (self.total - self.done) * seconds / steps)
        if self.budget is None:
            return estimate
        budget_left = max(0.0, self.budget - self.elapsed(now))
        return budget_left if estimate is None else min(estimate, budget_left)

    def elapsed(self, now: float) -> float:
        return self.elapsed_before + now - self.started

    def status(self, now: float) -> str:
        """The loss and lr (training), the rate, the time taken and the time left:
        "loss 4.1234, lr 1.00e-03, 3,120 items/s, 2:24 elapsed, 1:57:36 left"."""
        parts = []
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.lr is not None:
            parts.append(f"lr {self.lr:.2e}")
        rate = self.rate()
        per = "items" if all(items is not None for _, items, _ in self.steps) else self.unit
        shown = f"{rate:,.0f}" if rate and rate >= 100 else f"{rate:.3g}" if rate else "?"
        parts.append(f"{shown} {per}/s")
        left = self.seconds_left(now)
        parts.append(f"{clock_time(self.elapsed(now))} elapsed")
        parts.append(f"{clock_time(left)} left" if left is not None else "? left")
        return ", ".join(parts)

    # ----------------------------------------------------------------- the end
    def close(self) -> None:
        """End the phase: its bar closes (a transient one disappears), and its time is
        taken out of the step of the outer phase it ran in (that step's rate is the
        outer phase's own)."""
        with _lock:
            if self not in _open:
                return
            _open.remove(self)
            if self.bar is not None:
                self.bar.close()
            if self.outer is not None:
                self.outer._last_step += self.clock() - self.started

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- phases, lines
def phase(name: str, total: int, unit: str = "batch") -> Progress:
    """A reporter for one pass of evaluation or decoding (``with phase("validation",
    len(batches)) as shown: ... shown.update(items=len(batch))``): named after the
    contexts it is opened in ("member 2/3, validation"), a transient bar on a terminal,
    and shown on rank 0 alone, after :func:`set_enabled` ``(True)``, and only if the
    phase it is opened in (training) is shown."""
    return Progress(total, labelled(name), unit=unit, transient=True,
                    enabled=_shown and parallel.current().is_main)


def counted(shown: Progress, fn: Callable) -> Callable:
    """``fn``, counting a step of ``shown`` after each call (``len(item)`` items where
    the item has a length: a batch's rows): for ``map(fn, items)`` on any thread."""
    def step(item):
        result = fn(item)
        shown.update(items=len(item) if isinstance(item, Sized) else None)
        return result
    return step


@contextmanager
def context(label: str | None) -> Iterator[None]:
    """Inside, every line :func:`write_line` prints and every :func:`phase` opened begins
    with ``label`` (``"member 2/3"``; contexts nest).  None: no label."""
    if label is None:
        yield
        return
    _labels.append(label)
    try:
        yield
    finally:
        _labels.pop()


def labelled(text: str) -> str:
    """``text`` after the labels of the contexts entered: "member 2/3, validation"."""
    return ", ".join([*_labels, text])


def write_line(line: str) -> None:
    """Print ``line`` (an evaluation's results), labelled (:func:`labelled`), on standard
    output without cutting a bar; it is the line due for the open phases."""
    line = labelled(line)
    with _lock:
        if _open:
            _open[-1].rhythm.last = _open[-1].clock()
        if any(shown.bar is not None for shown in _open):
            from tqdm.auto import tqdm

            tqdm.write(line)
        else:
            _print(line)


def set_enabled(enabled: bool) -> None:
    """Show (True, the default) or hide the phases opened outside any other (a demo's
    ``--no-progress``); a reporter made with ``enabled`` is not affected."""
    global _shown
    _shown = check_flag(enabled, "set_enabled's enabled")


def clock_time(seconds: float) -> str:
    """Seconds as a clock shows them: "0:07", "12:58", "1:57:36"."""
    minutes, second = divmod(int(round(seconds)), 60)
    hours, minute = divmod(minutes, 60)
    return f"{hours}:{minute:02d}:{second:02d}" if hours else f"{minute}:{second:02d}"


def _stderr_is_a_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, OSError, ValueError):  # none, or closed (the terminal is gone)
        return False


def _print(line: str) -> None:
    """One line to standard output; a terminal that is gone (the hang-up that stops the
    run) loses the line, not the run."""
    try:
        print(line, flush=True)
    except (OSError, ValueError):
        pass
