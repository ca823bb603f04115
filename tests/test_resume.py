"""A run the Trainer stops part-way (``stop_after``, Ctrl-C, SIGTERM) and resumes ends
exactly where an uninterrupted run ends: weights, optimizer, history, best metric, the
selected checkpoint, with the data order continued mid-epoch (:class:`EpochBatches`).

The controls show the equalities are earned: resuming without the data order's state
gives other weights.  (The demos' own interrupted-and-resumed smoke runs are in
tests/test_demos.py.)
"""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from npformer import backend, ops, optim
from npformer.checkpoint import load_checkpoint
from npformer.data import length_bucketed_batches, pad_batch
from npformer.models import ClassifierConfig
from npformer.nn import evaluating
from npformer.train import EpochBatches, TrainConfig, Trainer, TrainingInterrupted
from npformer.train.tasks import Classification
from tests.helpers import tiered

from .conftest import using_backend

TOTAL, EVERY = 12, 4  # updates of the whole run; evaluation interval
ROWS = 40  # examples: 10 batches of 4 an epoch, so update 6 is in the middle of epoch 1


def dataset():
    rng = np.random.default_rng(3)
    ids = [list(rng.integers(1, 9, size=int(n))) for n in rng.integers(1, 7, size=ROWS)]
    return ids, rng.integers(0, 3, size=ROWS)


def epoch_batches() -> EpochBatches:
    ids, labels = dataset()

    def make(rows):
        padded, lens = pad_batch([ids[i] for i in rows], 0)
        return padded, lens, labels[rows]

    return EpochBatches(lambda rng: length_bucketed_batches([len(x) for x in ids], 4, rng=rng,
                                                            pool_batches=2), make)


def make_trainer(tmp_path, init_seed=0, next_batch=None, **config) -> Trainer:
    """Dropout, AdamW on a warmup-cosine schedule, clipping, two replicas, evaluation with
    best-model selection: every piece of state matters for resuming."""
    backend.seed(init_seed)
    model = tiered.TransformerClassifier(ClassifierConfig(
        vocab_size=9, num_classes=3, d_model=8, num_heads=2, num_layers=1, d_ff=12,
        block_size=6, dropout=0.3, pad_id=0))
    opt = tiered.AdamW(model.parameters(), weight_decay=0.1,
                      lr=optim.warmup_cosine(peak_lr=3e-2, warmup=2, total_updates=TOTAL))
    x, lens, y = epoch_batches().make(np.arange(ROWS))

    def eval_fn(m):  # minus the loss on every example, a score to maximise
        with evaluating(m):
            loss, _ = ops.cross_entropy_forward(m(backend.asarray(x), backend.asarray(lens)),
                                                backend.asarray(y))
        return {"val_score": -backend.to_float(loss)}

    cfg = dict(max_iters=TOTAL, replicas=2, clip_norm=0.5, eval_every=EVERY,
               checkpoint_path=tmp_path / "best.npz", select_metric="val_score",
               last_path=tmp_path / "last.npz", progress=False)
    return Trainer(model, opt, Classification(), next_batch or epoch_batches(),
                   TrainConfig(**{**cfg, **config}), eval_fn=eval_fn, seed=5)


def outcome(trainer: Trainer, folder) -> dict:
    return {"weights": [backend.to_numpy(p.data).copy() for p in trainer.model.parameters()],
            "history": trainer.history, "best": trainer.best, "updates": trainer.updates,
            "selected": load_checkpoint(folder / "best.npz").params}


def assert_same(a: dict, b: dict) -> None:
    for x, y in zip(a["weights"], b["weights"]):
        np.testing.assert_array_equal(x, y)
    assert a["history"] == b["history"]
    assert (a["best"], a["updates"]) == (b["best"], b["updates"])
    for name, value in a["selected"].items():
        np.testing.assert_array_equal(value, b["selected"][name], err_msg=name)


def straight_run(tmp_path) -> dict:
    folder = tmp_path / "straight"
    trainer = make_trainer(folder)
    trainer.fit()
    return outcome(trainer, folder)


def resumed_run(folder, stop_after=None, next_batch=None) -> tuple[dict, TrainingInterrupted]:
    first = make_trainer(folder, stop_after=stop_after, next_batch=next_batch)
    with pytest.raises(TrainingInterrupted) as stopped:
        first.fit()
    second = make_trainer(folder, init_seed=123)  # other weights, other generator position
    second.resume(folder / "last.npz")
    second.fit()
    return outcome(second, folder), stopped.value


@pytest.mark.parametrize("stop_after", [1, 4, 6, 11])
def test_stop_after_and_resume_ends_like_the_uninterrupted_run(tmp_path, stop_after):
    with using_backend("numpy", "float64"):
        straight = straight_run(tmp_path)
        resumed, stopped = resumed_run(tmp_path / "resumed", stop_after=stop_after)
        assert stopped.updates == stop_after and stopped.path == tmp_path / "resumed" / "last.npz"
        assert_same(resumed, straight)


def test_resume_without_the_data_order_gives_other_weights(tmp_path, monkeypatch):
    """Control: the resumed run plans a new epoch instead of finishing the saved one."""
    with using_backend("numpy", "float64"):
        straight = straight_run(tmp_path)
        monkeypatch.setattr(EpochBatches, "load_state_dict", lambda self, state: None)
        resumed, _ = resumed_run(tmp_path / "resumed", stop_after=6)
        assert any(not np.array_equal(x, y)
                   for x, y in zip(resumed["weights"], straight["weights"]))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_after_the_current_update_saves_and_resumes_exactly(tmp_path, signum):
    with using_backend("numpy", "float64"):
        straight = straight_run(tmp_path)
        batches, calls = epoch_batches(), []

        def next_batch(rng):  # the signal arrives in the middle of update 7
            calls.append(1)
            if len(calls) == 7:
                os.kill(os.getpid(), signum)
            return batches(rng)

        next_batch.state_dict, next_batch.load_state_dict = (batches.state_dict,
                                                             batches.load_state_dict)
        before = signal.getsignal(signum)
        resumed, stopped = resumed_run(tmp_path / "resumed", next_batch=next_batch)
        assert stopped.updates == 7 and stopped.reason == signal.Signals(signum).name
        assert signal.getsignal(signum) is before  # the handler is put back
        assert_same(resumed, straight)


def test_time_already_spent_counts_after_resuming(tmp_path):
    with using_backend("numpy", "float64"):
        trainer = make_trainer(tmp_path, stop_after=3)
        with pytest.raises(TrainingInterrupted):
            trainer.fit()
        spent = load_checkpoint(tmp_path / "last.npz").extra["trainer"]["train_seconds"]
        assert spent > 0
        resumed = make_trainer(tmp_path, max_seconds=spent / 2)  # budget already used up
        resumed.resume(tmp_path / "last.npz")
        resumed.fit()
        assert resumed.updates == 3 and resumed.finished


def test_interrupted_without_last_path_says_nothing_was_saved(tmp_path):
    with using_backend("numpy", "float64"):
        trainer = make_trainer(tmp_path, stop_after=2, last_path=None)
        with pytest.raises(TrainingInterrupted, match="nothing was saved") as stopped:
            trainer.fit()
        assert stopped.value.path is None and not (tmp_path / "last.npz").exists()
