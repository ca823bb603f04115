"""A schedule fitted to the time budget (``TrainConfig.schedule_for``): the Trainer
measures how many updates the budget holds and gives the optimizer the schedule of a run
of that many, so the learning rate has decayed when the budget ends, on a slow machine
as on a fast one.  The demos' time-budgeted runs (translation) use it.

Time here is a fake clock that advances a set number of seconds at every batch drawn (the
Trainer reads ``time.perf_counter``), so each case is exact and takes no real time.  The
controls show what the feature changes: the same budget without it ends with the
learning rate near its peak.
"""
from __future__ import annotations

import numpy as np
import pytest

import npformer.train.loop as train_module
from npformer.optim import warmup_cosine
from npformer.parallel import fingerprint
from npformer.train import TrainConfig

from .conftest import using_backend
from .test_resume import assert_same, epoch_batches, make_trainer, outcome

PEAK, WARMUP = 3e-2, 5


class FakeClock:
    """perf_counter() reads ``now``; each batch drawn costs ``seconds_per_batch(n)``
    (n: batches drawn before it)."""

    def __init__(self, seconds_per_batch):
        self.now, self.batches, self.seconds_per_batch = 1000.0, 0, seconds_per_batch

    def perf_counter(self) -> float:
        return self.now

    def timed(self, next_batch):
        def draw(rng):
            self.now += self.seconds_per_batch(self.batches)
            self.batches += 1
            return next_batch(rng)

        for name in ("state_dict", "load_state_dict"):  # the data order resumes too
            setattr(draw, name, getattr(next_batch, name))
        return draw


def fitted_schedule(min_lr: float = 0.0):
    """updates -> the schedule of a run that long, as the demos give it to the Trainer."""
    return warmup_cosine(PEAK, WARMUP, 1, min_lr).of_length


def budgeted_trainer(tmp_path, monkeypatch, clock, fitted=True, **config):
    monkeypatch.setattr(train_module, "time", clock)
    config = {"max_iters": 10_000, "max_seconds": 100.0, "eval_every": 40,
              "schedule_for": fitted_schedule() if fitted else None, **config}
    trainer = make_trainer(tmp_path, next_batch=clock.timed(epoch_batches()), **config)
    if not fitted:  # the control: the schedule of max_iters updates, as a user would give
        trainer.optimizer.schedule = fitted_schedule()(config["max_iters"])
    return trainer


def test_the_schedule_ends_with_the_budget(tmp_path, monkeypatch):
    with using_backend("numpy", "float64"):
        trainer = budgeted_trainer(tmp_path, monkeypatch, FakeClock(lambda n: 1.0))
        trainer.fit()
    assert trainer.finished and trainer.updates == trainer.planned_updates
    assert 95 <= trainer.updates <= 100  # one second each, in a budget of 100
    lrs = trainer.history.lrs
    assert lrs[-1] < 0.01 * PEAK  # decayed at the end of the budget
    assert max(lrs) == pytest.approx(PEAK)
    assert lrs == pytest.approx([warmup_cosine(PEAK, WARMUP, trainer.updates)(t)
                                 for t in range(1, trainer.updates + 1)], rel=0.05, abs=1e-4)


def test_without_it_the_budget_cuts_the_schedule_near_its_peak(tmp_path, monkeypatch):
    with using_backend("numpy", "float64"):
        trainer = budgeted_trainer(tmp_path, monkeypatch, FakeClock(lambda n: 1.0),
                                   fitted=False)
        trainer.fit()
    assert trainer.updates >= 95 and trainer.history.lrs[-1] > 0.9 * PEAK  # the control


def test_a_machine_that_slows_down_gets_a_shorter_schedule(tmp_path, monkeypatch):
    """One second an update, then three from the 40th batch on: 40 + 20 updates fit (the
    budget lets the update under way at 100 s finish, as always)."""
    with using_backend("numpy", "float64"):
        trainer = budgeted_trainer(tmp_path, monkeypatch,
                                   FakeClock(lambda n: 1.0 if n < 40 else 3.0))
        trainer.fit()
    assert 55 <= trainer.updates <= 61 and trainer.train_seconds <= 100.0 + 3.0
    assert trainer.history.lrs[-1] < 0.1 * PEAK


def test_max_iters_still_bounds_the_run(tmp_path, monkeypatch):
    with using_backend("numpy", "float64"):
        trainer = budgeted_trainer(tmp_path, monkeypatch, FakeClock(lambda n: 1.0),
                                   max_iters=30)
        trainer.fit()
    assert trainer.updates == trainer.planned_updates == 30
    assert trainer.history.lrs == pytest.approx(
        [warmup_cosine(PEAK, WARMUP, 30)(t) for t in range(1, 31)])


def test_a_resumed_run_ends_as_the_straight_one(tmp_path, monkeypatch):
    with using_backend("numpy", "float64"):
        straight = budgeted_trainer(tmp_path / "a", monkeypatch, FakeClock(lambda n: 1.0))
        straight.fit()
        first = budgeted_trainer(tmp_path / "b", monkeypatch, FakeClock(lambda n: 1.0),
                                 stop_after=37)
        with pytest.raises(train_module.TrainingInterrupted):
            first.fit()
        second = budgeted_trainer(tmp_path / "b", monkeypatch, FakeClock(lambda n: 1.0))
        second.resume(tmp_path / "b" / "last.npz")
        assert second.planned_updates == first.planned_updates  # the schedule as it was
        second.fit()
    assert second.planned_updates == straight.planned_updates
    assert_same(outcome(second, tmp_path / "b"), outcome(straight, tmp_path / "a"))


@pytest.mark.parametrize("config, error, words", [
    ({"max_seconds": None}, ValueError, "max_seconds is None"),
    ({"schedule_for": 1e-3}, TypeError, "function of the run's length"),
])
def test_a_schedule_for_that_cannot_work_is_refused(config, error, words):
    with pytest.raises(error, match=words):
        TrainConfig(**{"max_iters": 10, "max_seconds": 60.0,
                                    "schedule_for": fitted_schedule(), **config})


@pytest.mark.parametrize("args, error, words", [
    ((-1e-3, 10, 1), ValueError, "peak_lr"), ((1e-3, -1, 1), ValueError, "warmup"),
    ((1e-3, "10", 1), TypeError, "warmup"), ((1e-3, 10, 1, 2e-3), ValueError, "min_lr"),
])
def test_a_schedule_with_bad_values_is_refused_when_made(args, error, words):
    with pytest.raises(error, match=words):
        warmup_cosine(*args)


def test_every_rank_sees_the_same_schedule_for():
    """The ranks compare their configurations by hash: a lambda's repr holds its address,
    which differs from process to process; a schedule's ``of_length`` holds its numbers."""
    assert fingerprint.digest(fitted_schedule()) == fingerprint.digest(fitted_schedule())
    assert fingerprint.digest(fitted_schedule()) != fingerprint.digest(fitted_schedule(1e-5))
    assert fitted_schedule(1e-4)(10) == warmup_cosine(PEAK, WARMUP, 10, 1e-4)
    assert np.isclose(fitted_schedule()(10)(10), 0.0)


@pytest.mark.parametrize("returned", [None, 3e-4, "cosine"])
def test_a_schedule_for_that_returns_no_schedule_is_refused_before_any_update(
        tmp_path, monkeypatch, returned):
    """issue 47 cases 7 and 16: schedule_for returning None was ignored (the run trained
    at the optimizer's constant rate); a number failed at the first update with
    "'float' object is not callable".  Both are refused naming schedule_for, before the
    first update."""
    with using_backend("numpy", "float64"):
        with pytest.raises(TypeError, match=r"TrainConfig.schedule_for\(\d+\) must return a "
                                            "learning-rate schedule"):
            budgeted_trainer(tmp_path, monkeypatch, FakeClock(lambda n: 1.0),
                             schedule_for=lambda n: returned)


def test_a_budgeted_run_of_no_updates_trains_none(tmp_path, monkeypatch):
    """issue 47 case 18: max_iters=0 with a time budget and schedule_for raised "total_updates
    must be at least 1, got 0" (the schedule of a run of 0 updates); it trains 0 updates,
    as max_iters=0 alone does."""
    with using_backend("numpy", "float64"):
        trainer = budgeted_trainer(tmp_path, monkeypatch, FakeClock(lambda n: 1.0),
                                   max_iters=0)
        trainer.fit()
    assert trainer.finished and trainer.updates == 0 and trainer.history.losses == []
