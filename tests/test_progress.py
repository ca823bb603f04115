"""Progress a user can read (npformer.train.progress, issue 37 case 34).

Every test runs on a fake clock (the time function is injected: given to a reporter, or
to an outer one whose clock the reporters opened inside share), so the times are exact:

* elsewhere than on a terminal a line comes at least every 30 s of (fake) time, the first
  within the first 30 s, whether the steps are steady (the default translation run's
  pace: before, its first line came after 2,000 updates) or vary;
* the rate is averaged over a window: steady when fast and slow steps alternate, and the
  time left follows the recent pace, not the pace since the start nor the first step's
  start-up; on a constant rate the time left is exact, and a time budget caps it;
* a phase opened inside another (a validation pass in training) is counted apart: its
  time is not in the outer phase's rate; map_batches counts each batch of a phase;
* the trainer's evaluation lines (and the phases) say which ensemble member they belong
  to, in a demo's ensemble too; nothing is printed on MPI ranks other than 0, nothing of
  progress with TrainConfig.progress=False or after set_enabled(False);
* the tqdm bar is used only when standard error is a terminal.
"""
from __future__ import annotations

import itertools
import re
import sys

import numpy as np
import pytest

from npformer import parallel
from npformer.cli import map_batches
from npformer.models import CausalLMConfig
from npformer.train import TrainConfig, Trainer, progress
from npformer.train.progress import Progress, clock_time
from npformer.train.tasks import LanguageModeling

from .conftest import using_backend
from .helpers import tiered

LINE = re.compile(r"^(?P<name>.+): (?P<unit>\w+) (?P<done>\d+)/(?P<total>\d+), .*?"
                  r"(?P<rate>[\d,.?]+) (?P<per>\w+)/s, (?P<elapsed>[\d:]+) elapsed, "
                  r"(?P<left>[\d:?]+) left$")


@pytest.fixture(autouse=True)
def clean_state():
    """No reporter or context left over, phases shown (a demo run in this process may
    have called set_enabled(False))."""
    assert not progress._open and not progress._labels
    progress.set_enabled(True)
    yield
    progress.set_enabled(True)
    assert not progress._open and not progress._labels


class FakeClock:
    """A clock that moves only when told (``advance``)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def lines_of(text: str) -> list[re.Match]:
    return [m for m in map(LINE.match, text.splitlines()) if m]


def run_steps(clock: FakeClock, shown: Progress, durations, items: int = 100) -> None:
    for duration in durations:
        clock.advance(duration)
        shown.update(items=items, loss=1.0, lr=1e-3)


# =========================================================================== lines in time
@pytest.mark.parametrize("pattern", [[0.36], [1, 7, 3, 11], [29, 1], [40]],
                         ids=["translate-pace", "varying", "nearly-30", "longer-than-30"])
def test_a_line_at_least_every_30_seconds(pattern, capsys):
    """Steps of these durations (seconds), for about an hour: every gap between lines
    (and before the first) is at most 30 s (a step longer than that: its own length),
    and short steps do not each print a line."""
    clock, steps = FakeClock(), int(3600 / np.mean(pattern))
    shown = Progress(20000, "translate", lines_per_run=10, clock=clock)
    durations = list(itertools.islice(itertools.cycle(pattern), steps))
    times = []
    for duration in durations:
        clock.advance(duration)
        shown.update(items=100, loss=1.0, lr=1e-3)
        if capsys.readouterr().out:
            times.append(clock.now)
    shown.close()
    gaps = np.diff([0.0] + times)
    assert times and gaps.max() <= max(30.0, max(pattern)), gaps.max()
    if max(pattern) <= 15:  # steps well under 30 s: a line every few of them, not each
        assert len(times) < steps / 2


def test_the_lines_say_where_the_run_is(capsys):
    """update k/N, loss, lr, items/s, elapsed and left, in that order (the demos' smoke
    tests read "<name>: update k/N, loss ")."""
    clock = FakeClock()
    with Progress(1000, "translate", lines_per_run=10, clock=clock) as shown:
        run_steps(clock, shown, [2.0] * 100)
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == ("translate: update 100/1000, loss 1.0000, lr 1.00e-03, 50 items/s, "
                       "3:20 elapsed, 30:00 left")
    assert all(LINE.match(line) for line in out)


# =========================================================================== rates
def test_the_rate_is_steady_when_fast_and_slow_steps_alternate(capsys):
    """Steps of 0.5 s and 4.5 s of 100 items each: one step's rate swings between 200
    and 22 items/s; the window's stays at 100 items / 2.5 s = 40 items/s."""
    clock = FakeClock()
    with Progress(10_000, "imdb", lines_per_run=100, clock=clock) as shown:
        rates = []
        for step in range(4 * progress.WINDOW):
            run_steps(clock, shown, [0.5 if step % 2 else 4.5])
            if step >= progress.WINDOW:
                rates.append(shown.rate())
    np.testing.assert_allclose(rates, 40.0, rtol=1e-12)
    lines = lines_of(capsys.readouterr().out)
    shown_rates = {m["rate"] for m in lines if int(m["done"]) > progress.WINDOW}
    assert shown_rates == {"40"}, shown_rates


def test_time_left_on_a_constant_rate_and_under_a_budget(capsys):
    clock = FakeClock()
    with Progress(100, "train", clock=clock) as shown:  # 2 s an update
        run_steps(clock, shown, [2.0] * 40)
        assert shown.seconds_left(clock.now) == pytest.approx(60 * 2.0)
        assert shown.status(clock.now).endswith("1:20 elapsed, 2:00 left")
    # resumed at update 20 after 500 s: 40 more updates done, 40 left
    with Progress(100, "train", done=20, elapsed=500.0, clock=clock) as shown:
        run_steps(clock, shown, [2.0] * 40)
        assert shown.status(clock.now).endswith("9:40 elapsed, 1:20 left")
    # a budget of 620 s in all: 40 s of it left, less than the 80 s the pace needs
    with Progress(100, "train", done=20, elapsed=500.0, budget=620.0, clock=clock) as shown:
        run_steps(clock, shown, [2.0] * 40)
        assert shown.seconds_left(clock.now) == pytest.approx(40.0)
    with Progress(100, "train", done=20, elapsed=500.0, budget=1e6, clock=clock) as shown:
        run_steps(clock, shown, [2.0] * 40)
        assert shown.seconds_left(clock.now) == pytest.approx(80.0)


def test_time_left_follows_the_recent_pace_not_the_pace_since_the_start():
    """10 s an update for 100 updates, then 1 s an update: once the window holds only
    the new pace, the time left is (updates left) x 1 s, not x the mean since the start."""
    clock = FakeClock()
    with Progress(1000, "train", clock=clock) as shown:
        run_steps(clock, shown, [10.0] * 100 + [1.0] * progress.WINDOW)
        assert shown.seconds_left(clock.now) == pytest.approx(1000 - 100 - progress.WINDOW)
        assert shown.rate() == pytest.approx(100.0)


def test_the_first_step_start_up_is_left_out_of_the_rate(capsys):
    """A first update of 60 s (compiling, the first checks), then 1 s each: the rate
    and the time left are the steady pace's from the second update on."""
    clock = FakeClock()
    with Progress(1000, "train", lines_per_run=100, clock=clock) as shown:
        run_steps(clock, shown, [60.0])
        assert shown.rate() is None and shown.seconds_left(clock.now) is None
        run_steps(clock, shown, [1.0] * 9)
        assert shown.rate() == pytest.approx(100.0)
        assert shown.seconds_left(clock.now) == pytest.approx(990.0)
    first = capsys.readouterr().out.splitlines()[0]  # due: the next may take 60 s too
    assert first.endswith("? items/s, 1:00 elapsed, ? left"), first


def test_a_phase_inside_is_not_counted_in_the_outer_rate(capsys):
    """A 100-s validation pass between two training steps of 1 s: training's rate stays
    100 items/s, and the time elapsed counts the pass."""
    clock = FakeClock()
    with Progress(1000, "train", clock=clock) as training:
        run_steps(clock, training, [1.0] * 10)
        with progress.phase("validation", 10) as validation:
            run_steps(clock, validation, [10.0] * 10, items=64)
            assert validation.rate() == pytest.approx(6.4)
        run_steps(clock, training, [1.0] * 10)
        assert training.rate() == pytest.approx(100.0)
        assert training.elapsed(clock.now) == pytest.approx(120.0)
    lines = lines_of(capsys.readouterr().out)  # the pass's: 30 s after training began
    assert [m["name"] for m in lines] == ["validation"] * len(lines) and lines


def test_map_batches_counts_each_batch_of_a_phase(capsys):
    """map_batches(..., phase=) on two threads: a step (len(batch) items) per batch."""
    clock = FakeClock()
    batches = [np.arange(i, i + 4) for i in range(0, 40, 4)]

    def score(rows):
        clock.advance(10.0)  # the threads share the clock: each batch ends 10 s later
        return int(rows.sum())

    with Progress(None, "outer", clock=clock):
        results = map_batches(score, batches, 2, phase="validation")
    assert results == [int(b.sum()) for b in batches]
    lines = lines_of(capsys.readouterr().out)
    assert lines and {m["name"] for m in lines} == {"validation"}
    assert {m["total"] for m in lines} == {"10"} and {m["per"] for m in lines} == {"items"}
    assert [int(m["done"]) for m in lines] == sorted(int(m["done"]) for m in lines)


# =========================================================================== whose lines
def tiny_trainer(config: TrainConfig, eval_fn=None) -> Trainer:
    model = tiered.CausalLM(CausalLMConfig(vocab_size=9, block_size=6, d_model=8, num_heads=2,
                                    num_layers=1, d_ff=12, dropout=0.0))

    def batch(rng):
        return rng.integers(0, 9, size=(3, 6)), rng.integers(0, 9, size=(3, 6))

    return Trainer(model, tiered.Adam(model.parameters()), LanguageModeling(), batch, config,
                   eval_fn=eval_fn)


def slow_validation(clock: FakeClock):
    """An eval_fn that runs a 4-batch validation phase of 20 s a batch."""
    def eval_fn(model):
        with progress.phase("validation", 4) as shown:
            for _ in range(4):
                clock.advance(20.0)
                shown.update(items=8)
        return {"val_loss": 1.0}
    return eval_fn


def train_on_fake_clock(config: TrainConfig, clock: FakeClock, trainer_edit=None) -> Trainer:
    """fit() inside an outer reporter holding the fake clock (the trainer's reporter and
    the phases opened inside take it); every update takes 20 s."""
    trainer = tiny_trainer(config, eval_fn=slow_validation(clock))
    if trainer_edit:
        trainer_edit(trainer)
    update = trainer.update

    def slow_update():
        clock.advance(20.0)
        return update()

    trainer.update = slow_update
    with using_backend("numpy", "float64"), Progress(None, "test clock", clock=clock):
        trainer.fit()
    return trainer


def test_evaluation_lines_say_which_member_they_belong_to(capsys):
    clock = FakeClock()
    with progress.context("member 2/3"):
        train_on_fake_clock(TrainConfig(max_iters=4, eval_every=2, desc="imdb-2/3"), clock)
    out = capsys.readouterr().out.splitlines()
    assert "member 2/3, update 2: val_loss 1.0000" in out
    assert "member 2/3, update 4: val_loss 1.0000" in out
    assert any(line.startswith("member 2/3, validation: batch ") for line in out), out
    assert any(line.startswith("imdb-2/3: update ") for line in out), out
    train_on_fake_clock(TrainConfig(max_iters=2, eval_every=2), clock)  # no ensemble
    assert "update 2: val_loss 1.0000" in capsys.readouterr().out.splitlines()


class OtherRank:
    """The trainer's ranks as MPI rank 1 sees them."""

    is_main = False

    def __init__(self, ranks):
        self.ranks = ranks

    def __getattr__(self, name):
        return getattr(self.ranks, name)


def test_nothing_is_printed_on_ranks_other_than_0(capsys, monkeypatch):
    clock = FakeClock()
    with progress.context("member 2/3"):
        train_on_fake_clock(TrainConfig(max_iters=4, eval_every=2), clock)
        assert capsys.readouterr().out  # rank 0: progress and evaluation lines
        train_on_fake_clock(TrainConfig(max_iters=4, eval_every=2), clock,
                            lambda t: setattr(t, "ranks", OtherRank(t.ranks)))
    assert capsys.readouterr() == ("", "")

    class Rank1:
        is_main = False

    monkeypatch.setattr(parallel, "current", lambda: Rank1())
    with progress.phase("test", 10) as shown:  # a pass outside training (test scoring)
        assert not shown.enabled


def test_progress_false_shows_no_progress(capsys):
    """TrainConfig.progress=False: neither training's lines nor the validation phase's;
    the evaluation results are printed as before."""
    clock = FakeClock()
    train_on_fake_clock(TrainConfig(max_iters=4, eval_every=2), clock)
    shown = capsys.readouterr().out.splitlines()
    assert any(line.startswith("train: update") for line in shown)
    assert any(line.startswith("validation: batch") for line in shown)
    train_on_fake_clock(TrainConfig(max_iters=4, eval_every=2, progress=False), clock)
    assert capsys.readouterr().out.splitlines() == ["update 2: val_loss 1.0000",
                                                    "update 4: val_loss 1.0000"]


def test_set_enabled_hides_the_phases_outside_training():
    progress.set_enabled(False)  # a demo's --no-progress
    with progress.phase("beam search", 32) as shown:
        assert not shown.enabled
    progress.set_enabled(True)
    with progress.phase("beam search", 32) as shown:
        assert shown.enabled
    with pytest.raises(TypeError, match="True or False"):
        progress.set_enabled("no")


def test_an_ensemble_demo_names_its_members(tmp_path):
    """imdb.py --smoke (two members): each member's evaluation lines begin with it."""
    from .test_demos import run_demo, synthetic_data

    (tmp_path / "data").mkdir()
    data = synthetic_data(tmp_path / "data")
    result = run_demo("imdb.py", "--smoke", "--replicas", "1", "--no-progress", "--procs", "1",
                      "--data", str(data), "--out", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-2000:]
    for member in ("member 1/2", "member 2/2"):
        assert re.search(rf"^{member}, update \d+: val_accuracy ", result.stdout, re.M), \
            result.stdout


# =========================================================================== terminal
@pytest.mark.parametrize("terminal", [True, False])
def test_the_bar_is_used_on_a_terminal_only(terminal, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal)
    clock = FakeClock()
    with Progress(100, "translate", lines_per_run=10, clock=clock) as shown:
        assert (shown.bar is not None) == terminal
        with progress.phase("validation", 4) as inner:  # a transient bar under it
            assert (inner.bar is not None) == terminal
            run_steps(clock, inner, [20.0] * 4, items=8)
        run_steps(clock, shown, [20.0] * 20)
    out, err = capsys.readouterr()
    if terminal:
        assert not lines_of(out) and "\r" in err
        assert "20/100, loss 1.0000, lr 1.00e-03, 5 items/s, 8:00 elapsed, 26:40 left" in err
    else:
        assert lines_of(out) and not err


def test_clock_time():
    assert [clock_time(s) for s in (0, 7.4, 62, 3599.6, 3723)] == [
        "0:00", "0:07", "1:02", "1:00:00", "1:02:03"]
